"""The ``torch.optim`` front-ends: parameter groups, state, backend choice (``lopt.registry`` lists them)."""

from lopt.optimizers.small_fc_lopt import SmallFCLOpt
from lopt.optimizers.velo import VeLO

__all__ = ["SmallFCLOpt", "VeLO"]
