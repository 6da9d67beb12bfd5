"""lopt: learned optimizers as exact, fast, drop-in ``torch.optim`` optimizers (``lopt.registry`` lists them)."""

__version__ = "0.1.0"

from lopt.errors import AdamHabitWarning, NonFiniteGradientError, UntrainedWeightsWarning, WeightsError  # noqa: E402
from lopt.optimizers import CELO2, ELO, ELO_CELO2, MuLO, SmallFCLOpt, VeLO, param_groups_for  # noqa: E402
from lopt.weights import MetaWeights, load_weights, random_weights  # noqa: E402

__all__ = ["SmallFCLOpt", "VeLO", "ELO", "MuLO", "CELO2", "ELO_CELO2", "param_groups_for", "NonFiniteGradientError",
           "WeightsError", "UntrainedWeightsWarning", "AdamHabitWarning", "MetaWeights", "load_weights",
           "random_weights", "__version__"]
