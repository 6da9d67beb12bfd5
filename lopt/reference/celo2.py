"""CELO2 and ELO-CELO2, the reference math in plain PyTorch (float32).

``docs/celo2.md`` defines what one step computes; section numbers below refer to it. Both optimizers
share everything here; they differ only in the AdamW branch (§5) and in their defaults.

The learned branch, for one parameter ``p`` (rank >= 2, or any rank when ``use_adamw_for_1d=False``):

1. the gradient: optional global-norm clipping over every gradient of the optimizer, then an element
   clamp to ``±grad_clip_value`` (§3.1);
2. accumulators (§3.2): momentum ``m_k`` (3 decays), ``v`` (EMA of g², 1 decay), Adafactor ``R_k, C_k`` or
   ``V_k`` (3 decays) — the functions small_fc_lopt and VeLO use (``lopt/reference/accumulators.py``);
3. 14 feature groups, 30 inputs (rank <= 1: the first 9 groups, 15 inputs) (§3.3);
4. every input divided by its root mean square over the parameter's last two axes (§3.4);
5. the split-input MLP 30 → 8 → 8 → 3 (ReLU) gives ``direction, magnitude`` (§3.5);
6. ``u = direction · exp(exp_mult · magnitude)``, Newton–Schulz orthogonalisation over the last two
   axes (rank >= 2), normalisation over the last two axes, ``· rms_mult`` (§3.6, §3.7);
7. ``p ← p − lr · (u + weight_decay · p)`` (§3.8).

The AdamW branch (rank <= 1 parameters and groups with ``is_embedding=True``): CELO2 keeps its own
``exp_avg``/``exp_avg_sq`` (§5.1), ELO-CELO2 reads the shared ``mom[..., 0]`` and ``rms[..., -1]`` (§5.2).

A fused backend is to mirror these functions and names; :func:`newton_schulz` works on a stack of
matrices ``(..., m, n)`` as it does on one, so a batched version is the same function applied to
``torch.stack`` of same-shaped updates.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lopt.reference import accumulators
from lopt.reference.accumulators import (  # the steps CELO2 shares with small_fc_lopt and VeLO
    adafactor_features,
    factored_gradient,
    feature_square_sums,
    finite_part,
    float64_sum,
    mean_from_sum,
    normalise_by_square_sums,
    stable_factored_dims,
    update_accumulators,
)

# §3.3: the feature groups in the MLP's input order, as (name, width). A tensor of rank <= 1 has the first
# UNFACTORED_GROUPS of them; the Adafactor row/col groups exist only for factored (rank >= 2) tensors.
FEATURE_GROUPS = (
    ("grad", 1), ("clipped_grad", 1), ("param", 1), ("momentum", 3), ("rms", 1), ("momentum_times_rsqrt_rms", 3),
    ("rsqrt_rms", 1), ("factored_grad", 3), ("grad_times_rsqrt_rms", 1), ("row_accumulator", 3),
    ("col_accumulator", 3), ("rsqrt_row_accumulator", 3), ("rsqrt_col_accumulator", 3), ("factored_momentum", 3),
)
GROUP_WIDTHS = tuple(width for _, width in FEATURE_GROUPS)
NUM_INPUTS = sum(GROUP_WIDTHS)  # 30
UNFACTORED_GROUPS = 9
UNFACTORED_INPUTS = sum(GROUP_WIDTHS[:UNFACTORED_GROUPS])  # 15
NUM_OUTPUTS = 3  # direction, magnitude, and a third output no update reads

# §3.3, §3.4, §3.7 constants
GRAD_FEATURE_CLIP = 0.1  # the clipped-gradient feature: clamp(g, -0.1, 0.1)
RSQRT_RMS_EPSILON = 1e-8  # rsqrt(v + 1e-8)
NORMALISER_EPSILON = 1e-9  # x · rsqrt(1e-9 + mean x²), for the inputs and for the step
PARAM_SCALE_EPSILON = 1e-9  # sqrt(mean p² + 1e-9) (param_scale_mult)

# The defaults of both optimizers (§2, §3.1, §3.6, §3.7).
MOMENTUM_DECAYS = (0.9, 0.99, 0.999)
RMS_DECAYS = (0.95,)
ADAFACTOR_DECAYS = (0.9, 0.99, 0.999)
GRAD_CLIP_VALUE = 1000.0
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPSILON = 1e-8

# A learned-branch parameter's state (accumulators.init_state), PyLO's names and layout (decay axis last).
ACCUMULATOR_KEYS = ("mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v")
# CELO2's AdamW-branch state (PyLO's names): the moments (float32, the parameter's shape) and a step count
# (a 0-d int64 tensor on the CPU).
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
ADAM_STEP_KEY = "adam_step"

# The meta-weights' tensors (PyLO's CELO2MLP state dict; weights in ``x @ w`` layout, in × out), §6.
FIRST_LAYER = "w0.{}"  # one (width, hidden) weight per feature group
FIRST_BIAS = "b0"
DENSE_WEIGHT = "dense_w.{}"
DENSE_BIAS = "dense_b.{}"


class Decays(accumulators.Decays):
    """CELO2's float32 decays. CELO2 has no offset parametrisation: the group's ``momentum_decays``,
    ``rms_decays`` and ``adafactor_decays`` are the decays themselves (§2). ``from_offsets`` (the name
    the shared front-end calls) takes them as they are; the RMS and Adafactor decays are clipped to
    [0, 1] as both sources do (the front-end only accepts values in [0, 1], so the clip changes nothing)."""

    DEFAULT_OFFSETS = (MOMENTUM_DECAYS, RMS_DECAYS, ADAFACTOR_DECAYS)

    @classmethod
    def from_offsets(cls, momentum_offsets=None, rms_offsets=None, adafactor_offsets=None):
        defaults = cls.DEFAULT_OFFSETS
        as_tensor = lambda values, default: torch.tensor(default if values is None else values,  # noqa: E731
                                                         dtype=torch.float32)
        return cls(momentum=as_tensor(momentum_offsets, defaults[0]),
                   rms=torch.clip(as_tensor(rms_offsets, defaults[1]), 0.0, 1.0),
                   adafactor=torch.clip(as_tensor(adafactor_offsets, defaults[2]), 0.0, 1.0))


def factored_dims(shape) -> tuple[int, int] | None:
    """(d1, d0), the two largest axes, ties broken by a stable sort (lopt's rule, docs/small_fc_lopt.md §3.3)."""
    return stable_factored_dims(shape)


# ------------------------------------------------------------------------------------------ §3.1 gradient


def global_norm(square_sum: torch.Tensor) -> torch.Tensor:
    """‖g‖₂ over every gradient of the optimizer: the square root of their float64 Σ g², rounded to float32."""
    return torch.sqrt(square_sum).to(torch.float32)


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """optax.clip_by_global_norm's factor as PyLO forms it: ``max_norm / max(‖g‖₂, max_norm)`` in float32
    (exactly 1 where the norm is at most ``max_norm``)."""
    limit = torch.tensor(max_norm, dtype=torch.float32, device=norm.device)
    return limit / torch.maximum(norm, limit)


def clip_gradient(grad: torch.Tensor, scale: torch.Tensor | None, clip_value: float) -> torch.Tensor:
    """The gradient both branches use: ``clamp(g · scale, −clip_value, clip_value)`` (no scale: no global clip)."""
    if scale is not None:
        grad = grad * scale
    return torch.clamp(grad, -clip_value, clip_value)


# ------------------------------------------------------------------------------------------ §3.3 features


def per_element_features(grad: torch.Tensor, param: torch.Tensor, state: dict, dims,
                         row_col_mean: torch.Tensor | None = None) -> torch.Tensor:
    """§3.3: the inputs of the MLP, ``S + (30,)`` (``S + (15,)`` for rank <= 1), from the updated accumulators
    and the pre-update parameter. ``grad`` and ``param`` carry a trailing axis of size 1."""
    mom, rms = state["mom"], state["rms"]
    rsqrt_rms = torch.rsqrt(rms + RSQRT_RMS_EPSILON)
    groups = [grad, torch.clamp(grad, -GRAD_FEATURE_CLIP, GRAD_FEATURE_CLIP), param, mom, rms, mom * rsqrt_rms,
              rsqrt_rms, factored_gradient(grad, state, dims, row_col_mean), grad * rsqrt_rms]
    if dims is not None:
        # row R_k, col C_k (broadcast back), rsqrt(R_k + 1e-8), rsqrt(C_k + 1e-8), m_k · row_factor · col_factor
        groups += adafactor_features(state, dims, full_momentum_epsilon=0.0, row_col_mean=row_col_mean)
    return torch.cat(groups, dim=-1)


# ------------------------------------------------------------------------------------------ §3.4 normalisation


def normalisation_axes(rank: int) -> tuple:
    """The element axes every normalisation runs over: the last two of the parameter's (work) shape
    (the one axis of a vector; a 0-d parameter is the 1-element vector of JAX's definition)."""
    return tuple(range(rank))[-2:]


def last_axes_count(shape) -> int:
    """How many elements each normalisation averages: the product of the last two sizes of ``shape``
    (the parameter's work shape; a DTensor's global one)."""
    return math.prod([shape[axis] for axis in normalisation_axes(len(shape))])  # (a list: torch.compile traces it)


def last_axes_square_sums(features: torch.Tensor) -> torch.Tensor:
    """Σ x_j² over the parameter's last two axes (kept as size-1 axes), for every feature column j and every
    index of the other axes, in float64 (non-finite values left out: ``accumulators.finite_part``). For one
    process's rows of a tensor split along axis 0 these sums are partial where axis 0 is one of the two
    (vectors and matrices), complete otherwise."""
    return feature_square_sums(features, normalisation_axes(features.dim() - 1))


def normalise_over_last_axes(features: torch.Tensor, square_sums: torch.Tensor | None = None,
                             count: int | None = None) -> torch.Tensor:
    """``x_j · rsqrt(1e-9 + mean x_j²)`` for every feature column j (the last axis of ``features``), the mean
    running over the parameter's last two axes, separately for every index of the others.

    The sums are float64 (:func:`last_axes_square_sums`, computed here unless given: the reduce phase
    completes them for a tensor split among processes), the scale formed in float64 and rounded once
    (``accumulators.normalise_by_square_sums``)."""
    if square_sums is None:
        square_sums = last_axes_square_sums(features)
        count = last_axes_count(features.shape[:-1])
    return normalise_by_square_sums(features, square_sums, count, NORMALISER_EPSILON)


# ------------------------------------------------------------------------------------------ §3.5 the MLP


def first_layer_weight(network: dict, inputs: int = NUM_INPUTS) -> torch.Tensor:
    """The split first layer as one ``(inputs, hidden)`` matrix: the groups' weights stacked in input order
    (the first 9 groups' 15 rows for a rank <= 1 tensor)."""
    pieces, rows = [], 0
    index = 0
    while rows < inputs:
        piece = network[FIRST_LAYER.format(index)]
        pieces.append(piece)
        rows += piece.shape[0]
        index += 1
    return torch.cat(pieces, dim=0)


def dense_layer_count(network: dict) -> int:
    count = 0
    while DENSE_WEIGHT.format(count) in network:
        count += 1
    return count


def mlp(inputs: torch.Tensor, network: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP on ``inputs`` (``... × 30`` or ``... × 15``): ``relu(x W0 + b0)``, then the dense layers
    ``h W_j + b_j`` with ReLU after every one but the last (``x @ w`` layout, as PyLO and JAX multiply).
    Returns (direction, magnitude): outputs 0 and 1."""
    hidden = F.relu(inputs @ first_layer_weight(network, inputs.shape[-1]) + network[FIRST_BIAS])
    layers = dense_layer_count(network)
    for j in range(layers):
        hidden = hidden @ network[DENSE_WEIGHT.format(j)] + network[DENSE_BIAS.format(j)]
        if j != layers - 1:
            hidden = F.relu(hidden)
    return hidden[..., 0], hidden[..., 1]


# ------------------------------------------------------------------------------------------ §3.6 Newton–Schulz


def newton_schulz(x: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS,
                  eps: float = NS_EPSILON) -> torch.Tensor:
    """Newton–Schulz orthogonalisation of every matrix of ``x`` (``(..., m, n)``, float32), all at once.

    A matrix with more rows than columns is transposed first (so that the Gram matrix is the smaller
    one) and back at the end; each matrix is divided by its Frobenius norm plus ``eps`` (the norm from
    a float64 sum of squares, rounded to float32); then ``steps`` times, with ``(a, b, c) = coefficients``:
    ``A = X Xᵀ``, ``B = b·A + c·A A``, ``X ← a·X + B X``. Leading axes are a batch: the result for a
    stack of matrices is the stack of the results, so the same function batches same-shaped updates.
    """
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    norm = torch.sqrt(accumulators.float64_square_sum(x, dim=(-2, -1), keepdim=True)).to(torch.float32)
    x = x / (norm + eps)
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.mT
        polynomial = b * gram + c * (gram @ gram)
        x = a * x + polynomial @ x
    return x.mT if transposed else x


def orthogonalise(step: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS,
                  eps: float = NS_EPSILON) -> torch.Tensor:
    """:func:`newton_schulz` of a learned step over its last two axes, with lopt's rule for non-finite
    elements: they (only ever from a non-finite parameter or state element) enter the iteration as 0,
    so that the rest of their matrix is orthogonalised as if they were absent, and keep their own
    non-finite value. For finite steps this is :func:`newton_schulz` itself, bit for bit."""
    finite = torch.isfinite(step)
    return torch.where(finite, newton_schulz(finite_part(step), coefficients, steps, eps), step)


# ------------------------------------------------------------------------------------------ §3.6–§3.8 the step


def param_scale(param: torch.Tensor, square_sum: torch.Tensor | None = None, count: int | None = None) -> torch.Tensor:
    """``sqrt(mean p² + 1e-9)`` over all of the parameter's elements (``param_scale_mult``): the float64 Σ p²
    (non-finite elements left out) computed here unless given (completed across processes)."""
    if square_sum is None:
        square_sum, count = float64_sum(finite_part(param) ** 2), param.numel()
    return torch.sqrt(mean_from_sum(square_sum, count) + PARAM_SCALE_EPSILON)


def proposed_step(normalised: torch.Tensor, network: dict, *, exp_mult: float,
                  scale: torch.Tensor | None = None, network_fn=None) -> torch.Tensor:
    """§3.6 before Newton–Schulz: ``direction · exp(exp_mult · magnitude)`` from the normalised features,
    times ``scale`` (:func:`param_scale`) where given (``param_scale_mult``). ``network_fn`` runs the MLP
    (default :func:`mlp`; ``lopt.meta`` passes one that gives every population member its own weights)."""
    direction, magnitude = (network_fn or mlp)(normalised, network)
    factor = torch.exp(magnitude * exp_mult)
    if scale is not None:
        factor = scale * factor
    return direction * factor


def finish_step(step: torch.Tensor, rms_mult: float, square_sums: torch.Tensor | None = None,
                count: int | None = None) -> torch.Tensor:
    """§3.7: the step normalised over its last two axes, times ``rms_mult`` (``square_sums``: the float64
    :func:`last_axes_square_sums` of ``step.unsqueeze(-1)``, computed here unless given)."""
    return normalise_over_last_axes(step.unsqueeze(-1), square_sums, count).squeeze(-1) * rms_mult


def learned_update(features: torch.Tensor, param: torch.Tensor, network: dict, *, exp_mult: float,
                   rms_mult: float, param_scale_mult: bool, orthogonalize: bool, ns_coefficients=NS_COEFFICIENTS,
                   ns_steps: int = NS_STEPS, ns_eps: float = NS_EPSILON) -> torch.Tensor:
    """§3.4–§3.7 for one whole tensor: normalise the features (``S + (F,)``), run the MLP, form the step (``S``).

    ``param`` is the pre-update value (``S``), read only by ``param_scale_mult``."""
    step = proposed_step(normalise_over_last_axes(features), network, exp_mult=exp_mult,
                         scale=param_scale(param) if param_scale_mult else None)
    if orthogonalize and step.dim() >= 2:
        step = orthogonalise(step, ns_coefficients, ns_steps, ns_eps)
    return finish_step(step, rms_mult)


def apply_step(param: torch.Tensor, step: torch.Tensor, lr, weight_decay) -> torch.Tensor:
    """§3.8: ``p − lr · (u + weight_decay · p)``: decoupled weight decay on the **pre-update** parameter
    (as optax.add_decayed_weights and PyLO; small_fc_lopt decays the updated one). ``lr`` and
    ``weight_decay`` are numbers or 0-d tensors."""
    return param - lr * (step + weight_decay * param)


def learned_step(param: torch.Tensor, grad: torch.Tensor, state: dict, network: dict, decays: Decays, *, lr,
                 weight_decay, exp_mult: float = 0.0, rms_mult: float = 1.0, param_scale_mult: bool = False,
                 orthogonalize: bool = True, ns_coefficients=NS_COEFFICIENTS, ns_steps: int = NS_STEPS,
                 ns_eps: float = NS_EPSILON) -> None:
    """One step of the learned branch for one tensor (§3.2–§3.8), in place on ``state`` and ``param``.

    ``grad`` is the gradient after §3.1 (clipped, clamped). ``param`` may be float32, bfloat16 or
    float16; the math is float32 and the result is written back in its dtype. (``lopt.CELO2`` runs the
    same functions phase by phase over all its tensors.)"""
    shape = tuple(param.shape)
    dims = factored_dims(shape)
    work_shape = shape if shape else (1,)  # a 0-d parameter is the 1-element vector of the JAX definition
    value = param.detach().to(torch.float32).reshape(work_shape)
    batch_grad = grad.detach().to(torch.float32).reshape(work_shape + (1,))
    work_state = {name: (buf.view(work_shape + buf.shape[-1:]) if buf.numel() and not shape else buf)
                  for name, buf in state.items() if name in ACCUMULATOR_KEYS}
    update_accumulators(work_state, batch_grad, decays, dims)
    features = per_element_features(batch_grad, value.unsqueeze(-1), work_state, dims)
    update = learned_update(features, value, network, exp_mult=exp_mult, rms_mult=rms_mult,
                            param_scale_mult=param_scale_mult, orthogonalize=orthogonalize,
                            ns_coefficients=ns_coefficients, ns_steps=ns_steps, ns_eps=ns_eps)
    param.copy_(apply_step(value, update, lr, weight_decay).reshape(shape))


# ------------------------------------------------------------------------------------------ §5 the AdamW branch


def bias_correction(beta, step):
    """``1 − β^t`` in float64 (a Python float; the division by it rounds to float32, as in PyLO). ``beta``: a
    number or a 0-d tensor; ``step``: an int, or a 0-d integer tensor (a compiled step's counter, read on the
    device: then a float64 0-d tensor)."""
    if torch.is_tensor(step):
        return 1.0 - torch.as_tensor(beta, dtype=torch.float64) ** step.to(torch.float64)
    return 1.0 - float(beta) ** step


def adam_direction(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, beta1: float, beta2: float, step: int,
                   eps: float) -> torch.Tensor:
    """``m̂ / (√v̂ + eps)`` with ``m̂ = m / (1 − β1^t)``, ``v̂ = v / (1 − β2^t)``. A tensor ``step`` may also hold one
    count per row of a population (``lopt.meta``: shaped to broadcast), each correction then its own."""
    corrected_avg = exp_avg / _divisor(bias_correction(beta1, step))
    corrected_sq = exp_avg_sq / _divisor(bias_correction(beta2, step))
    return corrected_avg / (torch.sqrt(corrected_sq) + eps)


def _divisor(correction):
    """A bias correction as the float32 divisor the division uses: a Python float or a 0-d float64 tensor is
    rounded to float32 by the division itself; a tensor of corrections is rounded here, so that the same
    float32 division happens (a float64 tensor with axes would make the whole division float64)."""
    return correction.to(torch.float32) if torch.is_tensor(correction) else correction


def update_adam_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, betas) -> None:
    """CELO2's own AdamW moments, in place: ``m ← β1·m + (1 − β1)·g``, ``v ← β2·v + (1 − β2)·g²``."""
    beta1, beta2 = betas
    exp_avg.mul_(beta1).add_((1 - beta1) * grad)
    exp_avg_sq.mul_(beta2).add_((1 - beta2) * (grad * grad))


def adamw_own_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   step: int, *, lr, weight_decay, betas, eps: float) -> torch.Tensor:
    """§5.1, CELO2: AdamW with the parameter's own moments (updated in place; ``step`` counts this
    parameter's AdamW steps, this one included). Returns the new float32 value."""
    update_adam_moments(exp_avg, exp_avg_sq, grad, betas)
    return apply_step(param, adam_direction(exp_avg, exp_avg_sq, betas[0], betas[1], step, eps), lr, weight_decay)


SHARED_ADAM_EPSILON = 1e-8


def adamw_shared_step(param: torch.Tensor, state: dict, step: int, decays: Decays, *, lr,
                      weight_decay) -> torch.Tensor:
    """§5.2, ELO-CELO2: AdamW on the shared accumulators (already updated this step): ``m = mom[..., 0]``
    with the first momentum decay, ``v = rms[..., -1]`` with the last RMS decay, eps 1e-8, bias-corrected
    with the group's step count. Returns the new float32 value."""
    beta1 = decays.momentum[0]  # (0-d float32 tensors: bias_correction reads them, on the host or the device)
    beta2 = decays.rms[-1]
    direction = adam_direction(state["mom"][..., 0], state["rms"][..., -1], beta1, beta2, step, SHARED_ADAM_EPSILON)
    return apply_step(param, direction, lr, weight_decay)
