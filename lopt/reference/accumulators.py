"""Per-element accumulators shared by small_fc_lopt and VeLO (plain PyTorch, float32).

State layout (PyLO's, so state dicts interchange with PyLO and between lopt's backends): for a
parameter of shape ``S`` the decay axis is **last**:

* ``mom``          ``S + (3,)``  momentum EMAs of g, one per momentum decay
* ``rms``          ``S + (1,)``  EMA of g² (no epsilon)
* ``fac_vec_row``  factored: ``S`` without axis d0, ``+ (3,)``; else ``(0,)``   EMA of mean_{d0}(g² + 1e-30)
* ``fac_vec_col``  factored: ``S`` without axis d1, ``+ (3,)``; else ``(0,)``   EMA of mean_{d1}(g² + 1e-30)
* ``fac_vec_v``    non-factored: ``S + (3,)``; else ``(0,)``                    EMA of g² + 1e-30

A tensor is *factored* iff its rank is at least 2; ``(d1, d0)`` are its two largest axes.
A 0-d parameter is handled as shape ``(1,)`` (the JAX definition); its state keeps the shapes above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Names of the per-element features both optimizers build from these accumulators (in their order).
MOMENTUM_RMS_FEATURE_NAMES = (
    [f"momentum_{k}" for k in range(3)] + ["rms"] + [f"momentum_times_rsqrt_rms_{k}" for k in range(3)] + ["rsqrt_rms"]
)
FACTORED_GRAD_FEATURE_NAMES = [f"factored_grad_{k}" for k in range(3)]
ADAFACTOR_FEATURE_NAMES = (
    [f"row_accumulator_{k}" for k in range(3)] + [f"col_accumulator_{k}" for k in range(3)]
    + [f"rsqrt_row_accumulator_{k}" for k in range(3)] + [f"rsqrt_col_accumulator_{k}" for k in range(3)]
    + [f"factored_momentum_{k}" for k in range(3)]
)

ADAFACTOR_EPSILON = 1e-30  # added to g² before the Adafactor means
SAFE_RSQRT_FLOOR = 1e-9
MOMENTUM_DECAYS = (0.9, 0.99, 0.999)
RMS_DECAYS = (0.999,)
ADAFACTOR_DECAYS = (0.9, 0.99, 0.999)


def decay_to_param(decay: torch.Tensor) -> torch.Tensor:
    return torch.log(1 - decay) / 10.0


def param_to_decay(param: torch.Tensor) -> torch.Tensor:
    return 1 - torch.exp(param * 10.0)


def effective_decays(initial_decays, offsets) -> torch.Tensor:
    """clip(param_to_decay(decay_to_param(initial) + offset), 0, 1), evaluated in float32 on the CPU.

    The float32 chain (not float64 rounded once) is what the meta-weights were used with.
    """
    initial = torch.tensor(initial_decays, dtype=torch.float32)
    offsets = torch.tensor(offsets, dtype=torch.float32)
    return torch.clip(param_to_decay(decay_to_param(initial) + offsets), 0.0, 1.0)


@dataclass(frozen=True)
class Decays:
    """Effective float32 decays (each a 1-d tensor): momentum (3), rms (1), Adafactor (3).

    Each optimizer subclasses this with its own meta-learned offsets as ``DEFAULT_OFFSETS``.
    """

    momentum: torch.Tensor
    rms: torch.Tensor
    adafactor: torch.Tensor

    DEFAULT_OFFSETS = ((0.0, 0.0, 0.0), (0.0,), (0.0, 0.0, 0.0))

    @classmethod
    def from_offsets(cls, momentum_offsets=None, rms_offsets=None, adafactor_offsets=None):
        defaults = cls.DEFAULT_OFFSETS
        return cls(
            momentum=effective_decays(MOMENTUM_DECAYS, defaults[0] if momentum_offsets is None else momentum_offsets),
            rms=effective_decays(RMS_DECAYS, defaults[1] if rms_offsets is None else rms_offsets),
            adafactor=effective_decays(ADAFACTOR_DECAYS, defaults[2] if adafactor_offsets is None else adafactor_offsets),
        )

    def to(self, device):
        return type(self)(self.momentum.to(device), self.rms.to(device), self.adafactor.to(device))


def stable_factored_dims(shape) -> tuple[int, int] | None:
    """(d1, d0): the second-largest and largest axes, ties broken by a stable sort (lowest axis first).

    ``None`` for rank < 2. Sizes of 1 still count, so every rank >= 2 tensor is factored.
    """
    if len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda axis: (shape[axis], axis))
    return order[-2], order[-1]


def init_state(shape, factored_dims) -> dict:
    """Zero accumulators for a parameter of ``shape`` (float32, on the CPU; move them with ``.to``)."""
    shape = tuple(shape)
    empty = torch.zeros(0, dtype=torch.float32)
    state = {
        "mom": torch.zeros(shape + (3,), dtype=torch.float32),
        "rms": torch.zeros(shape + (1,), dtype=torch.float32),
        "fac_vec_row": empty,
        "fac_vec_col": empty.clone(),
        "fac_vec_v": empty.clone(),
    }
    if factored_dims is None:
        state["fac_vec_v"] = torch.zeros(shape + (3,), dtype=torch.float32)
    else:
        d1, d0 = factored_dims
        state["fac_vec_row"] = torch.zeros(tuple(s for i, s in enumerate(shape) if i != d0) + (3,), dtype=torch.float32)
        state["fac_vec_col"] = torch.zeros(tuple(s for i, s in enumerate(shape) if i != d1) + (3,), dtype=torch.float32)
    return state


def safe_rsqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(torch.clamp_min(x, SAFE_RSQRT_FLOOR))


# Means over a tensor's elements or along an axis are sums in float64 divided by the count. Gradients
# up to 2^64 are stepped (beyond, g² overflows float32 and the step is skipped:
# lopt.optimizers.naive.GRADIENT_LIMIT), so accumulators and features reach float32's largest value:
# their float64 sums, and sums of their squares, cannot overflow. A sum is also what one process
# can compute for its part of a tensor: the reduce phase (lopt/distributed.py) adds the parts of
# all processes before the division.


def finite_part(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its non-finite elements (NaN, ±inf) replaced by 0: what every sum over a tensor's elements
    adds up. Such an element (of a parameter, or of state loaded or edited from outside: gradients are
    checked before any step) then leaves the other elements' statistics alone, so that it stays in its own
    element, as it does in AdamW, instead of reaching every element of its tensor through the normaliser
    (and, in VeLO, every tensor through the controller). Finite values are unchanged, bit for bit."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def float64_sum(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """Σ of float32 values, accumulated in float64 (over ``dim``, or over everything)."""
    if dim is None:
        return torch.sum(x, dtype=torch.float64)
    return torch.sum(x, dim=dim, keepdim=keepdim, dtype=torch.float64)


def mean_from_sum(total: torch.Tensor, count: int) -> torch.Tensor:
    """The float32 mean of ``count`` values whose float64 sum is ``total``."""
    return (total / count).to(torch.float32)


def float64_mean(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """``torch.mean(x, dim)`` of float32 values, accumulated in float64 and rounded once to float32."""
    return mean_from_sum(float64_sum(x, dim, keepdim), x.shape[dim])


def update_momentum(mom: torch.Tensor, grad: torch.Tensor, decays: torch.Tensor) -> None:
    """mom_k <- β_k·mom_k + (1 − β_k)·g   (in place; grad has a trailing axis of size 1)."""
    mom.mul_(decays).add_((1 - decays) * grad)


def update_rms(rms: torch.Tensor, grad: torch.Tensor, decays: torch.Tensor) -> None:
    """rms <- β·rms + (1 − β)·g²   (in place, no epsilon)."""
    rms.mul_(decays).add_((1 - decays) * (grad * grad))


def ema_(accumulator: torch.Tensor, decays: torch.Tensor, value: torch.Tensor) -> None:
    """accumulator <- β·accumulator + (1 − β)·value   (in place, written as PyLO writes it)."""
    accumulator.copy_(decays * accumulator + (1 - decays) * value)


def adafactor_square(grad: torch.Tensor) -> torch.Tensor:
    """G = g² + 1e-30, what the Adafactor accumulators average."""
    return grad * grad + ADAFACTOR_EPSILON


def adafactor_axis_sums(grad: torch.Tensor, factored_dims) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over axis d0 of G, Σ over axis d1 of G), float64: the sums behind R's and C's means.

    ``grad`` has a trailing axis of size 1. For one process's part of a tensor split along an
    axis, the sum over that axis is partial (completed by the reduce phase).
    """
    d1, d0 = factored_dims
    grad_squared = adafactor_square(grad)
    return float64_sum(grad_squared, d0), float64_sum(grad_squared, d1)


def update_adafactor(state: dict, grad: torch.Tensor, decays: torch.Tensor, factored_dims) -> None:
    """Adafactor accumulators of G = g² + 1e-30 (in place).

    Factored: ``fac_vec_row`` tracks the mean of G over axis d0, ``fac_vec_col`` over axis d1.
    Non-factored: ``fac_vec_v`` tracks G itself. ``grad`` has a trailing axis of size 1.
    """
    if factored_dims is None:
        ema_(state["fac_vec_v"], decays, adafactor_square(grad))
        return
    d1, d0 = factored_dims
    row_sum, col_sum = adafactor_axis_sums(grad, factored_dims)
    ema_(state["fac_vec_row"], decays, mean_from_sum(row_sum, grad.shape[d0]))
    ema_(state["fac_vec_col"], decays, mean_from_sum(col_sum, grad.shape[d1]))


def row_axis_of_d1(factored_dims) -> int:
    """The index, inside R (which lacks axis d0), of the parameter's axis d1."""
    d1, d0 = factored_dims
    return d1 - 1 if d1 > d0 else d1


def row_col_sum(row: torch.Tensor, factored_dims) -> torch.Tensor:
    """Σ of R over the parameter's axis d1 (keeping it), float64: the sum behind ``row_col_mean``
    (non-finite entries of R, only ever from state loaded or edited from outside, left out: :func:`finite_part`)."""
    return float64_sum(finite_part(row), row_axis_of_d1(factored_dims), keepdim=True)


def adafactor_factors(state: dict, factored_dims, row_col_mean: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_factor, col_factor) of a factored tensor, broadcastable against ``S + (3,)``.

    row_factor = safe_rsqrt(R / (row_col_mean + 1e-9)), col_factor = safe_rsqrt(C), with
    ``row_col_mean`` the mean of R over the d1 axis: computed here from R unless given (the reduce
    phase gives it when R's d1 axis is split among processes).
    """
    d1, d0 = factored_dims
    row, col = state["fac_vec_row"], state["fac_vec_col"]
    if row_col_mean is None:
        row_col_mean = mean_from_sum(row_col_sum(row, factored_dims), row.shape[row_axis_of_d1(factored_dims)])
    row_factor = safe_rsqrt(row / (row_col_mean + 1e-9)).unsqueeze(d0)
    col_factor = safe_rsqrt(col).unsqueeze(d1)
    return row_factor, col_factor


def factored_gradient(grad: torch.Tensor, state: dict, factored_dims, row_col_mean=None) -> torch.Tensor:
    """fac_g_k: the gradient preconditioned by the updated Adafactor accumulators (``S + (3,)``)."""
    if factored_dims is None:
        return grad * safe_rsqrt(state["fac_vec_v"] + 1e-9)
    row_factor, col_factor = adafactor_factors(state, factored_dims, row_col_mean)
    return grad * row_factor * col_factor


def adafactor_features(state: dict, factored_dims, full_momentum_epsilon: float, row_col_mean=None) -> list:
    """The 15 Adafactor features both optimizers end their feature list with (each ``S + (3,)``).

    Factored: row ``R_k``, col ``C_k`` (broadcast back), ``rsqrt(R_k + 1e-8)``, ``rsqrt(C_k + 1e-8)``,
    ``m_k · row_factor_k · col_factor_k``. Non-factored: ``V_k`` twice, ``rsqrt(V_k + 1e-8)`` twice,
    ``m_k · (V_k + full_momentum_epsilon)^(-1/2)`` (small_fc_lopt: 1e-6; VeLO: none).
    """
    mom = state["mom"]
    if factored_dims is not None:
        d1, d0 = factored_dims
        row = state["fac_vec_row"].unsqueeze(d0).expand_as(mom)
        col = state["fac_vec_col"].unsqueeze(d1).expand_as(mom)
        row_factor, col_factor = adafactor_factors(state, factored_dims, row_col_mean)
        return [row, col, torch.rsqrt(row + 1e-8), torch.rsqrt(col + 1e-8), mom * row_factor * col_factor]
    full = state["fac_vec_v"]
    full_momentum = mom * torch.pow(full + full_momentum_epsilon if full_momentum_epsilon else full, -0.5)
    return [full, full, torch.rsqrt(full + 1e-8), torch.rsqrt(full + 1e-8), full_momentum]


def float64_square_sum(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """Σ x² in float64 (over ``dim``, or over everything), formed as the square of the float64 2-norm:
    torch upcasts element by element inside the reduction, without a float64 copy of ``x``."""
    return torch.linalg.vector_norm(x, dim=dim, keepdim=keepdim, dtype=torch.float64) ** 2


def feature_square_sums(features: torch.Tensor, axes=None) -> torch.Tensor:
    """Σ x_j² over all elements, for every feature column j (the last axis), in float64; a non-finite
    value (of a non-finite parameter or state element) is left out of its column's sum (:func:`finite_part`).

    ``axes`` (element axes, e.g. CELO2's last two): the sums over those axes only, kept as size-1 axes, so
    that they broadcast against ``features`` (one set of sums per index of the other axes).
    """
    if axes is None:
        return float64_square_sum(finite_part(features), dim=list(range(features.dim() - 1)))
    return float64_square_sum(finite_part(features), dim=list(axes), keepdim=True)


def normalise_by_square_sums(features: torch.Tensor, square_sums: torch.Tensor, count: int,
                             eps: float = 1e-5) -> torch.Tensor:
    """x_j · rsqrt(eps + Σx_j²/count) for every feature column j, in float32 (``square_sums`` float64).

    The scale is formed in float64 and rounded to float32. Columns whose values reach ~2^63 have a
    scale below float32's normal range: it is applied as (x·(s·2^64))·2^-64, exact powers of two,
    so every ordinary column gets plain x·s.
    """
    scales = torch.rsqrt(eps + square_sums / count)
    shift = torch.where(scales < 2.0**-60, 2.0**64, 1.0).to(torch.float64)
    return features * (scales * shift).to(torch.float32) * (1 / shift).to(torch.float32)


def second_moment_normalizer(features: torch.Tensor, axes=None, eps: float = 1e-5) -> torch.Tensor:
    """x_j · rsqrt(eps + mean over the tensor's elements of x_j²), separately for every feature column j.

    ``features`` is ``S + (F,)``; the mean runs over all axes of ``S`` (``axes``, if given, must be
    those). The sums are float64 (:func:`feature_square_sums`), so huge values cannot overflow them.
    """
    element_axes = list(range(features.dim() - 1))
    if axes is not None and sorted(axes) != element_axes:
        raise ValueError(f"second_moment_normalizer normalises over all element axes {element_axes}, got {axes}")
    count = math.prod(features.shape[:-1])
    return normalise_by_square_sums(features, feature_square_sums(features), count, eps)


def update_accumulators(state: dict, grad: torch.Tensor, decays: Decays, factored_dims) -> None:
    """Momentum, rms and Adafactor accumulators, in place. ``grad`` is ``S + (1,)``."""
    update_momentum(state["mom"], grad, decays.momentum)
    update_rms(state["rms"], grad, decays.rms)
    update_adafactor(state, grad, decays.adafactor, factored_dims)


def apply_update(param: torch.Tensor, update: torch.Tensor, lr, weight_decay) -> torch.Tensor:
    """p ← p − lr·u, then p ← p − (weight_decay·lr)·p on the updated p (decoupled; skipped when 0).

    ``lr`` and ``weight_decay`` are numbers or 0-d tensors (schedulers update tensors in place, so a
    compiled step or a captured graph follows them). Each product is rounded before the
    subtraction, as the fused kernels do.
    """
    new_param = param - lr * update
    if torch.is_tensor(weight_decay) or weight_decay > 0:
        new_param = new_param - (weight_decay * lr) * new_param
    return new_param
