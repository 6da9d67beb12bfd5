"""What lopt raises and warns with, in one place (each class is also exported from ``lopt``).

Errors name the problem and the fix, and are raised before anything changes; warnings are specific
classes so that a user can silence exactly one of them.
"""

from __future__ import annotations


class NonFiniteGradientError(FloatingPointError):
    """A step saw a non-finite (or overflowing) gradient or loss, or a tensor ``lr``/``weight_decay`` that is
    not a finite number >= 0, under ``nonfinite="raise"``; nothing changed."""


class WeightsError(ValueError):
    """Meta-weights could not be found, downloaded or validated (the message says why and what to do)."""


class UntrainedWeightsWarning(UserWarning):
    """An optimizer was built with untrained meta-weights (``lopt.random_weights``): its steps can be timed,
    but it does not train a model. Where that is intended (timing, tests), silence it with
    ``warnings.filterwarnings("ignore", category=lopt.UntrainedWeightsWarning)``."""


class AdamHabitWarning(UserWarning):
    """A hyper-parameter that is almost certainly a habit from Adam (e.g. ``lr=1e-3``), where a learned
    optimizer's ``lr`` multiplies the meta-trained step (1.0). Silence it with
    ``warnings.filterwarnings("ignore", category=lopt.AdamHabitWarning)``."""
