"""The ``torch.optim`` front-ends: parameter groups, state, backend choice."""

from lopt.optimizers.small_fc_lopt import SmallFCLOpt

# Optimizers by the name the CLI and the benchmarks use.
OPTIMIZERS = {"small_fc_lopt": SmallFCLOpt}

__all__ = ["SmallFCLOpt", "OPTIMIZERS"]
