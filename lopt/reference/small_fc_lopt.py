"""small_fc_lopt (AdafacMLPLOpt), the reference math in plain PyTorch.

One step for one parameter tensor ``p`` with gradient ``g`` and step count ``t`` (1 on the first
step), all in float32 (the semantics are specified in ``docs/small_fc_lopt.md``; section numbers
below refer to it):

1. accumulators (§3.2): momentum ``m_k``, ``v`` (EMA of g²), Adafactor ``R_k, C_k`` or ``V_k``
2. 28 per-element features from the updated accumulators and the pre-update ``p`` (§3.4, §3.5)
3. per-feature second-moment normalisation over the tensor's elements (§3.6)
4. 11 time features ``tanh((t - 1) / T_i - 1)`` appended (§3.7)
5. MLP 39 → 32 → 32 → 2 (ReLU) gives ``direction, magnitude`` (§3.8)
6. ``u = direction · exp(exp_mult · magnitude) · step_mult``;
   ``p ← p − lr · u``; then, if ``weight_decay > 0``, ``p ← p − weight_decay · lr · p`` (§3.9)

The fused backend (``lopt/fused/small_fc_lopt.py`` + ``cuda_src/small_fc_lopt.cu``) mirrors these
functions and names.
"""

from __future__ import annotations

import torch

from lopt.network import forward as network_forward
from lopt.reference import accumulators
from lopt.reference.accumulators import (  # the shared steps (update_accumulators, apply_update, ...)
    adafactor_features,
    apply_update,
    factored_gradient,
    feature_square_sums,
    normalise_by_square_sums,
    second_moment_normalizer,
    stable_factored_dims,
    update_accumulators,
)

NUM_ELEMENT_FEATURES = 28
TIMESCALES = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000, 30000, 100000)
NUM_TIME_FEATURES = len(TIMESCALES)

# Meta-learned decay offsets of the published weights (PyLO's constructor defaults).
MOMENTUM_DECAY_OFFSETS = (0.15216392, 0.14245212, 0.06812963)
RMS_DECAY_OFFSETS = (0.01079706,)
ADAFACTOR_DECAY_OFFSETS = (0.18621896, -0.10864615, -0.06185547)

# Names of the 28 per-element features, in input order (for documentation and debugging).
FEATURE_NAMES = (
    ["grad", "param"] + accumulators.MOMENTUM_RMS_FEATURE_NAMES + accumulators.FACTORED_GRAD_FEATURE_NAMES
    + accumulators.ADAFACTOR_FEATURE_NAMES
)


class Decays(accumulators.Decays):
    """small_fc_lopt's decays: the shared mapping with the published weights' meta-learned offsets."""

    DEFAULT_OFFSETS = (MOMENTUM_DECAY_OFFSETS, RMS_DECAY_OFFSETS, ADAFACTOR_DECAY_OFFSETS)


def factored_dims(shape) -> tuple[int, int] | None:
    """small_fc_lopt's (d1, d0): the plain stable rule (lowest axis first among equal sizes)."""
    return stable_factored_dims(shape)


def time_features(step) -> torch.Tensor:
    """tanh(τ / T_i − 1) for the 11 timescales, τ = step − 1 (steps taken before this one). ``step``: an int,
    or a 0-d integer tensor (a compiled step's counter; τ on its device)."""
    tau = (step - 1).to(torch.float32) if torch.is_tensor(step) else torch.tensor(step - 1, dtype=torch.float32)
    return torch.tanh(tau / torch.tensor(TIMESCALES, dtype=torch.float32) - 1.0)



def per_element_features(grad: torch.Tensor, param: torch.Tensor, state: dict, dims,
                         row_col_mean: torch.Tensor | None = None) -> torch.Tensor:
    """§3.5: the 28 features, ``S + (28,)``, from the updated accumulators and the pre-update param.

    ``grad`` and ``param`` carry a trailing axis of size 1. ``row_col_mean`` (the mean of R over
    axis d1) is computed from R unless given (see ``accumulators.adafactor_factors``).
    """
    mom, rms = state["mom"], state["rms"]
    rsqrt_rms = torch.rsqrt(rms + 1e-6)
    features = [grad, param, mom, rms, mom * rsqrt_rms, rsqrt_rms, factored_gradient(grad, state, dims, row_col_mean)]
    features += adafactor_features(state, dims, full_momentum_epsilon=1e-6, row_col_mean=row_col_mean)
    return torch.cat(features, dim=-1)


def normalise_features(features: torch.Tensor) -> torch.Tensor:
    """§3.6: every feature column divided by the root mean square over the tensor's elements."""
    return second_moment_normalizer(features)


def mlp(inputs: torch.Tensor, network: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """§3.8: the MLP (39 → 32 → 32 → 2 for the published weights; any geometry their config gives, lopt.network)
    with ReLU; returns (direction, magnitude), each shaped like the param."""
    output = network_forward(inputs, network)
    return output[..., 0], output[..., 1]


def gradient_square_sum(grad: torch.Tensor) -> torch.Tensor:
    """Σ g² over the tensor, in float64 (so that large finite gradients do not overflow it)."""
    return accumulators.float64_square_sum(grad)


def clip_gradient_norm(grad: torch.Tensor, max_norm: float, square_sum: torch.Tensor | None = None) -> torch.Tensor:
    """PyLO's per-tensor clipping (``max_grad_norm``): ``g · min(1, max_norm / (‖g‖₂ + 1e-6))`` in float32.

    ``‖g‖₂ = sqrt(Σ g²)``, with the float64 sum computed here unless given (the reduce phase gives
    it for a tensor split among processes), rounded to float32.
    """
    grad = grad.to(torch.float32)
    if square_sum is None:
        square_sum = gradient_square_sum(grad)
    norm = torch.sqrt(square_sum).to(torch.float32)
    return grad * torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def update_from_mlp(direction: torch.Tensor, magnitude: torch.Tensor, exp_mult: float, step_mult: float) -> torch.Tensor:
    """§3.9: u = direction · exp(exp_mult · magnitude) · step_mult."""
    return direction * torch.exp(magnitude * exp_mult) * step_mult



def update_from_features(features: torch.Tensor, square_sums: torch.Tensor, count: int, step: int, network: dict,
                         *, exp_mult: float, step_mult: float) -> torch.Tensor:
    """§3.6–§3.9 for one tensor: normalise the 28 features (``S + (28,)``) by the tensor's float64
    ``square_sums`` over its ``count`` elements, append the time features, run the MLP; returns u (``S``)."""
    features = normalise_by_square_sums(features, square_sums, count)
    time = time_features(step).to(features.device).expand(features.shape[:-1] + (NUM_TIME_FEATURES,))
    direction, magnitude = mlp(torch.cat([features, time], dim=-1), network)
    return update_from_mlp(direction, magnitude, exp_mult, step_mult)


def small_fc_lopt_step(param: torch.Tensor, grad: torch.Tensor, state: dict, step: int, network: dict,
                       decays: Decays, *, lr: float, weight_decay: float, exp_mult: float, step_mult: float,
                       apply=None) -> None:
    """One small_fc_lopt step for one tensor: updates ``state`` and ``param`` in place.

    ``param`` may be float32, bfloat16 or float16; the math is float32 and the result is written
    back in the parameter's dtype. ``step`` is the group's step count including this step.
    (``lopt.SmallFCLOpt`` runs the same functions phase by phase over all its tensors, with the
    sums over the elements of a tensor split among processes completed in between.)
    ``apply`` (default :func:`apply_update`) forms the new value from ``(param, u, lr, weight_decay)``:
    ELO's step is this one with its own decays, ``step_mult=1`` and its own rule (``lopt.reference.elo``).
    """
    shape = tuple(param.shape)
    dims = factored_dims(shape)
    work_shape = shape if shape else (1,)  # a 0-d parameter is the 1-element vector of the JAX definition
    batch_grad = grad.detach().to(torch.float32).reshape(work_shape + (1,))
    batch_param = param.detach().to(torch.float32).reshape(work_shape + (1,))
    work_state = {name: (buf.view(work_shape + buf.shape[-1:]) if buf.numel() and not shape else buf) for name, buf in state.items()}

    update_accumulators(work_state, batch_grad, decays, dims)
    features = per_element_features(batch_grad, batch_param, work_state, dims)
    update = update_from_features(features, feature_square_sums(features), batch_param.numel(), step, network,
                                  exp_mult=exp_mult, step_mult=step_mult)
    new_param = (apply or apply_update)(batch_param.squeeze(-1), update, lr, weight_decay)
    param.copy_(new_param.reshape(shape))
