"""lopt.meta: meta-training learned optimizers in PyTorch (docs/meta_training.md).

* :class:`MetaTrainer` with :func:`preset` / :class:`MetaTrainConfig`: truncated PES or full ES on θ,
  AdamW outer steps, exact checkpoint/resume (``lopt meta-train``);
* :class:`BatchedSmallFCLOpt`: small_fc_lopt (or ELO) over a population of members, each exactly
  ``SmallFCLOpt``'s step; :class:`BatchedCELO2` (CELO2, ELO-CELO2); :class:`BatchedAdamW`;
* :mod:`lopt.meta.tasks`, :mod:`lopt.meta.data`: offline task families and data sets;
* :func:`run_suite`: the frozen held-out evaluation against AdamW (``lopt meta-eval``).

The names are imported on first use, so that ``python -m lopt.meta.data`` and the CLI's parser stay light.
"""

import importlib

_EXPORTS = {
    "BatchedAdamW": "batched", "BatchedSmallFCLOpt": "batched", "BatchedCELO2": "batched_celo2", "FullES": "estimators", "TruncatedPES": "estimators",
    "SUITES": "evaluate", "EvalSettings": "evaluate", "run_suite": "evaluate", "MetaParamSpace": "metaparams",
    "PRESETS": "presets", "MetaTrainConfig": "presets", "preset": "presets", "MetaTrainer": "trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"lopt.meta.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'lopt.meta' has no attribute {name!r}")
