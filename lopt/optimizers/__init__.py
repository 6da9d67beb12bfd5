"""The ``torch.optim`` front-ends: parameter groups, state, backend choice."""

from lopt.optimizers.small_fc_lopt import SmallFCLOpt

__all__ = ["SmallFCLOpt"]
