"""What every framework's glue shares: finding the VeLO behind a framework's wrapper, and handing
it one micro-batch's loss."""

from __future__ import annotations

import torch

from lopt.optimizers.velo import VeLO

# Attributes under which frameworks keep the optimizer they wrap: Lightning's LightningOptimizer
# (``_optimizer``), accelerate's AcceleratedOptimizer (``optimizer``).
_WRAPPED_OPTIMIZER_ATTRIBUTES = ("_optimizer", "optimizer")
_MAX_WRAPPING_DEPTH = 8


def find_velo(optimizer) -> VeLO | None:
    """The :class:`lopt.VeLO` that ``optimizer`` is or wraps (accelerate, Lightning), else None.

    Wrappers are unwrapped first: Lightning's ``LightningOptimizer`` pretends to be an instance of
    the class it wraps, but its own attributes are not the optimizer's.
    """
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
    return optimizer if isinstance(optimizer, VeLO) else None


def feed_loss(velo: VeLO, loss: torch.Tensor, *, multiplier: float = 1) -> None:
    """Hand one micro-batch's loss to ``velo.accumulate_loss``.

    ``multiplier`` undoes a framework's division of the loss by the number of micro-batches, so
    that the mean VeLO forms is the mean of the micro-batch losses. In a multi-process run the loss
    is first averaged over the processes (one scalar all-reduce), because VeLO's state depends on
    the loss: processes that fed different losses would drift apart.
    """
    loss = loss.detach().reshape(()).to(torch.float32)
    if multiplier != 1:
        loss = loss * multiplier
    world = _world_size()
    if world > 1:
        loss = loss.clone()
        torch.distributed.all_reduce(loss)  # SUM (gloo has no AVG)
        loss = loss / world
    velo.accumulate_loss(loss)


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1
