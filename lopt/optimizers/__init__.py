"""The ``torch.optim`` front-ends: parameter groups, state, backend choice (``lopt.registry`` lists them)."""

from lopt.optimizers.small_fc_lopt import SmallFCLOpt
from lopt.optimizers.velo import VeLO
from lopt.optimizers.celo2 import CELO2, ELO_CELO2, param_groups_for

__all__ = ["SmallFCLOpt", "VeLO", "CELO2", "ELO_CELO2", "param_groups_for"]

from lopt.optimizers.elo import ELO  # noqa: E402
from lopt.optimizers.mulo import MuLO  # noqa: E402

__all__ += ["ELO", "MuLO"]
