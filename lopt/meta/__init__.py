"""lopt.meta: meta-training learned optimizers in PyTorch (docs/meta_training.md).

* :class:`MetaTrainer` with :func:`preset` / :class:`MetaTrainConfig`: truncated PES or full ES on θ,
  AdamW outer steps, exact checkpoint/resume (``lopt meta-train``);
* :class:`BatchedSmallFCLOpt`: small_fc_lopt over a population of members, each exactly
  ``SmallFCLOpt``'s step; :class:`BatchedAdamW`;
* :mod:`lopt.meta.tasks`, :mod:`lopt.meta.data`: offline task families and data sets;
* :func:`run_suite`: the frozen held-out evaluation against AdamW (``lopt meta-eval``).
"""

from lopt.meta.batched import BatchedAdamW, BatchedSmallFCLOpt
from lopt.meta.estimators import FullES, TruncatedPES
from lopt.meta.evaluate import SUITES, EvalSettings, run_suite
from lopt.meta.metaparams import MetaParamSpace
from lopt.meta.presets import PRESETS, MetaTrainConfig, preset
from lopt.meta.trainer import MetaTrainer

__all__ = ["BatchedAdamW", "BatchedSmallFCLOpt", "FullES", "TruncatedPES", "SUITES", "EvalSettings", "run_suite",
           "MetaParamSpace", "PRESETS", "MetaTrainConfig", "preset", "MetaTrainer"]
