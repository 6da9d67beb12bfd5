"""What every framework's glue shares: finding the VeLO behind a framework's wrapper, and handing
it one micro-batch's loss."""

from __future__ import annotations

import torch

from lopt.optimizers.velo import VeLO

# Attributes under which frameworks keep the optimizer they wrap: Lightning's LightningOptimizer
# (``_optimizer``), accelerate's AcceleratedOptimizer (``optimizer``).
_WRAPPED_OPTIMIZER_ATTRIBUTES = ("_optimizer", "optimizer")
_MAX_WRAPPING_DEPTH = 8


def find_learned_optimizer(optimizer):
    """The lopt optimizer (:class:`lopt.SmallFCLOpt`, :class:`lopt.VeLO`) that ``optimizer`` is or wraps, else None."""
    from lopt.optimizers.base import LearnedOptimizer

    for _ in range(_MAX_WRAPPING_DEPTH):
        inner = None
        for name in _WRAPPED_OPTIMIZER_ATTRIBUTES:
            candidate = getattr(optimizer, name, None)
            if isinstance(candidate, torch.optim.Optimizer) and candidate is not optimizer:
                inner = candidate
                break
        if inner is None:
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, LearnedOptimizer) else None


def discard_pending_losses(velo: VeLO) -> None:
    """Forget the losses handed to ``velo.accumulate_loss`` since its last step.

    For a step that a framework skipped without calling ``step()`` (GradScaler's standard path on an
    overflow): VeLO's own skip consumes them, so the next step averages its own micro-batches only.
    """
    velo._losses["accumulated"] = 0


def find_velo(optimizer) -> VeLO | None:
    """The :class:`lopt.VeLO` that ``optimizer`` is or wraps (accelerate, Lightning), else None
    (:func:`find_learned_optimizer`, which unwraps first: Lightning's ``LightningOptimizer`` pretends to be
    an instance of the class it wraps, but its own attributes are not the optimizer's)."""
    found = find_learned_optimizer(optimizer)
    return found if isinstance(found, VeLO) else None


def feed_loss(velo: VeLO, loss: torch.Tensor, *, multiplier: float = 1) -> None:
    """Hand one micro-batch's loss to ``velo.accumulate_loss``.

    ``multiplier`` undoes a framework's division of the loss by the number of micro-batches, so
    that the mean VeLO forms is the mean of the micro-batch losses. Nothing is communicated here:
    in a multi-process run VeLO itself averages the step's loss over the processes, once per step
    (its ``average_loss``, on by default).
    """
    loss = loss.detach().reshape(()).to(torch.float32)
    velo.accumulate_loss(loss * multiplier if multiplier != 1 else loss)
