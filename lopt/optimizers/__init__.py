"""The ``torch.optim`` front-ends: parameter groups, state, backend choice."""

from lopt.optimizers.small_fc_lopt import SmallFCLOpt
from lopt.optimizers.velo import VeLO

# Optimizers by the name the CLI and the benchmarks use.
OPTIMIZERS = {"small_fc_lopt": SmallFCLOpt, "velo": VeLO}

__all__ = ["SmallFCLOpt", "VeLO", "OPTIMIZERS"]
