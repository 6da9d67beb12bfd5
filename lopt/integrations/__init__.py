"""Glue between lopt's optimizers and the training loops that call ``step()`` for you.

Each submodule imports its framework only when it is imported itself, so ``import lopt`` never
needs any of them (``pip install -e ".[integrations]"`` in the lopt checkout brings the tested versions):

- :mod:`lopt.integrations.transformers` — ``LoptTrainer`` / ``VeLOLossMixin`` for the Hugging Face
  ``Trainer``: every micro-batch's loss reaches :class:`lopt.VeLO`.
- :mod:`lopt.integrations.lightning` — ``VeLOLossCallback`` for Lightning's automatic optimisation
  (gradient accumulation, ``16-mixed`` with its GradScaler, ``bf16-mixed``), and
  ``GradientClippingCallback``, which lets Lightning clip (``gradient_clip_val``) under mixed precision.
- :mod:`lopt.integrations.timm` — ``register_timm_optimizers()``: ``timm.optim.create_optimizer_v2(model,
  "small_fc_lopt")`` and ``"velo"``.

``SmallFCLOpt`` needs no glue in any of them; plain loops, ``accelerate`` and ``torch.amp.GradScaler``
need none for either optimizer. ``docs/integrations.md`` has a tested recipe for each.
"""

from lopt.integrations._common import find_velo

__all__ = ["find_velo"]
