"""ELO, the reference math in plain PyTorch: only what differs from small_fc_lopt.

ELO (PyLO's ``ELO_naive``, ported from the ELO Adafactor-MLP optimizer at inference time) runs
small_fc_lopt's per-element network on small_fc_lopt's 39 inputs: the same accumulators, 28
features, per-feature normalisation, 11 time features and MLP, all of them the functions of
``lopt.reference.small_fc_lopt`` (re-exported below). It differs in three places
(``docs/elo.md``; section numbers below refer to it):

1. the decays are used as given, with no reparameterisation (§2): :class:`Decays`;
2. ``max_grad_norm`` clips by the global norm of every gradient of the optimizer, as
   ``optax.clip_by_global_norm`` (§3.1): :func:`global_clip_factor`;
3. the update has no ``step_mult`` (``lr`` is ELO's step multiplier, 1e-3) and decays the parameter
   inside the step, ``p ← p − lr·(direction·exp(exp_mult·magnitude) + weight_decay·p)`` (§3.9):
   :func:`update_from_features` with ``step_mult=1``, then :func:`apply_update`.
"""

from __future__ import annotations

import torch

from lopt.reference import accumulators
from lopt.reference import small_fc_lopt
from lopt.reference.small_fc_lopt import (  # noqa: F401  (ELO's features, network and statistics are small_fc_lopt's)
    FEATURE_NAMES,
    NUM_ELEMENT_FEATURES,
    NUM_TIME_FEATURES,
    TIMESCALES,
    factored_dims,
    gradient_square_sum,
    mlp,
    normalise_features,
    per_element_features,
    time_features,
    update_from_features,
)

# ELO's decays (PyLO's ELO_naive defaults, used as given): the initial decays of the shared accumulators.
MOMENTUM_DECAYS = accumulators.MOMENTUM_DECAYS  # (0.9, 0.99, 0.999)
RMS_DECAYS = accumulators.RMS_DECAYS  # (0.999,)
ADAFACTOR_DECAYS = accumulators.ADAFACTOR_DECAYS  # (0.9, 0.99, 0.999)
# ELO's direction·exp(exp_mult·magnitude) is small_fc_lopt's update with step_mult 1 (a multiplication by 1 is exact).
STEP_MULT = 1.0


class Decays(accumulators.Decays):
    """ELO's decays: the values given, as float32 (no ``1 − exp(10·(ln(1 − β⁰)/10 + θ))`` mapping).

    The shared interface calls them "offsets" (``from_offsets``); for ELO they are the decays themselves.
    The front-end refuses values outside [0, 1]; the clip here (PyLO's CUDA class clamps, its naive
    class does not) only matters for values written into a param group after validation.
    """

    DEFAULT_OFFSETS = (MOMENTUM_DECAYS, RMS_DECAYS, ADAFACTOR_DECAYS)

    @classmethod
    def from_offsets(cls, momentum_decays=None, rms_decays=None, adafactor_decays=None):
        given = (momentum_decays, rms_decays, adafactor_decays)
        values = [default if value is None else value for value, default in zip(given, cls.DEFAULT_OFFSETS)]
        return cls(*(torch.clip(torch.tensor(value, dtype=torch.float32), 0.0, 1.0) for value in values))


def global_clip_factor(square_sum: torch.Tensor, max_norm: float) -> torch.Tensor:
    """§3.1: the factor every gradient of a clipping group is multiplied by, float32 (0-d).

    ``square_sum`` is Σ g² over every gradient of the optimizer (float64; all groups, clipping or not);
    the norm is its square root rounded to float32. Where the norm exceeds ``max_norm`` the factor is
    ``max_norm / norm``, evaluated as PyLO evaluates ``clip_norm / denom`` (``(1 / norm) · max_norm``
    in float32); otherwise it is exactly 1, as in ``optax.clip_by_global_norm`` (PyLO's
    ``clip_norm / max(norm, clip_norm)`` is 1 − 2⁻²⁴ there for some limits, e.g. 5.05).
    """
    norm = torch.sqrt(square_sum).to(torch.float32)
    factor = torch.reciprocal(norm) * max_norm
    return torch.where(norm > max_norm, factor, torch.ones_like(factor))


def apply_update(param: torch.Tensor, update: torch.Tensor, lr, weight_decay) -> torch.Tensor:
    """§3.9: ``p ← p − lr·(u + weight_decay·p)``, the decay of the pre-update ``p`` inside the step (PyLO's
    ``p.add_(step + weight_decay * p, alpha=-lr)``). The decay term is left out when ``weight_decay`` is
    the number 0 (a non-finite element of ``p`` then stays as it is instead of becoming NaN)."""
    if torch.is_tensor(weight_decay) or weight_decay > 0:
        update = update + weight_decay * param
    return param - lr * update


def elo_step(param: torch.Tensor, grad: torch.Tensor, state: dict, step: int, network: dict, decays: Decays, *,
             lr: float, weight_decay: float, exp_mult: float) -> None:
    """One ELO step for one tensor, in place (``grad`` already clipped: the factor of
    :func:`global_clip_factor` spans every tensor, so it is the caller's). small_fc_lopt's step with
    ELO's decays, ``step_mult = 1`` and :func:`apply_update`."""
    small_fc_lopt.small_fc_lopt_step(param, grad, state, step, network, decays, lr=lr, weight_decay=weight_decay,
                                     exp_mult=exp_mult, step_mult=STEP_MULT, apply=apply_update)
