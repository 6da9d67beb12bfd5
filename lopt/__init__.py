"""lopt: learned optimizers (small_fc_lopt, VeLO) as exact, fast, drop-in ``torch.optim`` optimizers."""

__version__ = "0.1.0"

from lopt.optimizers import SmallFCLOpt, VeLO  # noqa: E402
from lopt.optimizers import CELO2, ELO_CELO2, param_groups_for  # noqa: E402
from lopt.optimizers.base import AdamHabitWarning, NonFiniteGradientError  # noqa: E402
from lopt.weights import (MetaWeights, UntrainedWeightsWarning, WeightsError, load_weights,  # noqa: E402
                          random_weights)

__all__ = ["SmallFCLOpt", "VeLO", "NonFiniteGradientError", "MetaWeights", "WeightsError", "load_weights",
           "random_weights", "UntrainedWeightsWarning", "AdamHabitWarning", "__version__", "CELO2", "ELO_CELO2",
           "param_groups_for"]

from lopt.optimizers import ELO, MuLO  # noqa: E402  (docs/elo.md, docs/mulo.md)

__all__ += ["ELO", "MuLO"]
