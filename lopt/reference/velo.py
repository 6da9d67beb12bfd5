"""VeLO (HyperV2 as ported by PyLO's ``VeLO_naive``), the reference math in plain PyTorch.

VeLO is a per-tensor LSTM that, every step, writes the weights of a small per-element MLP. The
semantics are specified in ``docs/velo.md``; section numbers below refer to its "Semantics"
part. One step, in the phases both backends share:

1. **Loss buffer** (§1): ten bias-corrected EMAs of the (spike-clipped) training loss and their
   running minima give 9 loss features, shared by every tensor.
2. **Statistics** (§3): per tensor, from the pre-update ``p`` and the *old* accumulators:
   ``mean p²``, ``ν = rsqrt(max(mean p², 1e-9))``, the mean of ``ν·v`` and the variances of
   ``ν·m_k`` (and of ``ν·v`` around the *momentum* means — a bug of the original the weights were
   trained with), accumulated in float64. With the fraction of training done, the loss features
   and the rank one-hot they form one 30-feature row per tensor.
3. **Control** (§4, §5), batched over all tensors and evaluated in float64: mixing layers (a
   max over all tensors couples them), one LSTM step, heads giving a control vector
   ``c ∈ R^256`` and a step multiplier ``λ`` per tensor; weight generation
   ``W = 100 · mean_k c_k W^(k)`` turns each ``c`` into one MLP 30 → 4 → 4 → 3. Its outputs are
   rounded to float32 (the generation sums 256 terms that can cancel: in float32, two summation
   orders alone move an update by up to ~1e-3).
4. **Apply** (§2, §6–§8), per tensor, float32: accumulators updated with the clipped gradient,
   30 per-element features, per-column normalisation, the generated MLP gives direction ``d`` and
   magnitude ``μ``, and ``p ← p − lr·λ·param_scale·d·exp(exp_mult·μ)·step_mult``, then decoupled
   weight decay.

The fused backend (``lopt/fused/velo.py``, ``cuda_src/velo.cu``) runs the same phases with the
same names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lopt.reference import accumulators
from lopt.reference.accumulators import (  # the shared steps (update_accumulators, apply_update, ...)
    adafactor_features,
    apply_update,
    factored_gradient,
    feature_square_sums,
    finite_part,
    float64_square_sum,
    float64_sum,
    normalise_by_square_sums,
    second_moment_normalizer,
    stable_factored_dims,
    update_accumulators,
)

LSTM_HIDDEN_SIZE = 512
NUM_CANDIDATES = 256  # candidate MLPs mixed by the control vector ("param_inits")
NUM_LSTM_FEATURES = 30
NUM_ELEMENT_FEATURES = 30
NUM_LOSS_TIMESCALES = 10
NUM_LOSS_FEATURES = NUM_LOSS_TIMESCALES - 1
FRACTION_TIMESCALES = (0.03, 0.1, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.1)
NUM_RANK_CLASSES = 5  # ranks 0..4 one-hot; 5 or more axes of size > 1 get all zeros (JAX)

GRADIENT_CLIP = 1000.0
GRADIENT_FEATURE_CLIP = 0.1
WEIGHT_GENERATION_SCALE = 100.0
LOSS_RUNNING_MIN_INIT = 999999999999.0  # float32: 999999995904
# JAX VeLO prefab runs longer trainings through gradient accumulation so that the optimizer never
# sees more steps than this: the meta-training distribution's horizon.
DESIGN_HORIZON_STEPS = 150_000
# The longest horizon whose loss-buffer decays (loss_buffer_decays) all stay below 1 in float32 (2^25 + 2):
# beyond it the slowest, exp(-1/num_steps), rounds to 1.0, its bias correction 1 - δ^n is 0 and every
# step would turn NaN. lopt refuses longer horizons (tests/test_reliability.py checks this bound).
MAX_NUM_STEPS = 33_554_434

# VeLO has no meta-learned decay offsets: the mapping with zero offsets reproduces the decays.
MOMENTUM_DECAY_OFFSETS = (0.0, 0.0, 0.0)
RMS_DECAY_OFFSETS = (0.0,)
ADAFACTOR_DECAY_OFFSETS = (0.0, 0.0, 0.0)

LSTM_FEATURE_NAMES = tuple(
    [f"fraction_left_{i}" for i in range(len(FRACTION_TIMESCALES))]
    + [f"loss_feature_{j}" for j in range(NUM_LOSS_FEATURES)]
    + ["mean_rms"]
    + [f"rank_{r}" for r in range(NUM_RANK_CLASSES)]
    + [f"var_momentum_{k}" for k in range(3)]
    + [f"var_rms_{k}" for k in range(3)]
)

ELEMENT_FEATURE_NAMES = tuple(
    ["grad", "clipped_grad", "param"] + accumulators.MOMENTUM_RMS_FEATURE_NAMES
    + accumulators.FACTORED_GRAD_FEATURE_NAMES + ["grad_times_rsqrt_rms"] + accumulators.ADAFACTOR_FEATURE_NAMES
)

# Registry tensor names of the candidate stacks (component "mlp"), by role in the generated MLP.
MLP_CANDIDATE_TENSORS = {
    "input_weight": "input_weights_",
    "input_bias": "input_bias_",
    "hidden_weight": "hidden_weights_.0",
    "hidden_bias": "hidden_bias_.0",
    "output_weight": "output_weights_",
    "output_bias": "output_bias_",
}


class Decays(accumulators.Decays):
    """VeLO's decays: the shared mapping with zero offsets (0.9, 0.99, 0.999 etc., bit-exactly)."""

    DEFAULT_OFFSETS = (MOMENTUM_DECAY_OFFSETS, RMS_DECAY_OFFSETS, ADAFACTOR_DECAY_OFFSETS)


# --------------------------------------------------------------------------------------------
# §3.2 Loss buffer and loss features
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossBuffer:
    """Ten EMAs of the training loss (§1.2): ``means`` μ, ``running_min`` ρ (float32, 10 each), and
    ``count`` n (int32, 0-d) — the number of losses seen. ``decays`` δ are derived from ``num_steps``."""

    decays: torch.Tensor
    means: torch.Tensor
    running_min: torch.Tensor
    count: torch.Tensor


def loss_buffer_timescales(num_steps: int) -> torch.Tensor:
    """h = logspace(1, log10 N, 10) in float32 (h_0 = 10, h_9 = N, geometric between)."""
    return torch.logspace(1, torch.log10(torch.tensor(num_steps, dtype=torch.float32)).item(), NUM_LOSS_TIMESCALES,
                          dtype=torch.float32)


def loss_buffer_decays(num_steps: int, device=None) -> torch.Tensor:
    """δ_j = exp(−1/h_j), h the :func:`loss_buffer_timescales`."""
    return torch.exp(-1.0 / loss_buffer_timescales(num_steps)).to(device)


def init_loss_buffer(num_steps: int, device=None) -> LossBuffer:
    """μ = 0, ρ = float32(999999999999), n = 0."""
    return LossBuffer(
        decays=loss_buffer_decays(num_steps, device),
        means=torch.zeros(NUM_LOSS_TIMESCALES, dtype=torch.float32, device=device),
        running_min=torch.full((NUM_LOSS_TIMESCALES,), LOSS_RUNNING_MIN_INIT, dtype=torch.float32, device=device),
        count=torch.zeros((), dtype=torch.int32, device=device),
    )


def update_loss_buffer(buffer: LossBuffer, loss: torch.Tensor) -> LossBuffer:
    """One loss ``ℓ`` (float32, 0-d, on the buffer's device) into the buffer; returns the new buffer.

    With n the count before the call: ``A = max_j μ_j/(1 − δ_j^{n+1})`` (``A = ℓ`` when n = 0),
    ``ℓ' = min(2|A|, ℓ)`` (spikes clipped from above), ``μ ← δ·μ + (1 − δ)·ℓ'``,
    ``ρ ← min(ρ, μ/(1 − δ^{n+1}))``, ``n ← n + 1``. Pure tensor ops: no host synchronisation.
    """
    decays, count = buffer.decays, buffer.count
    bias_correction = 1 - decays ** (count + 1)
    approx_max = torch.where(count == 0, loss, torch.max(buffer.means / bias_correction))
    clipped_loss = torch.minimum(torch.abs(approx_max) * 2, loss)
    means = buffer.means * decays + clipped_loss * (1.0 - decays)
    running_min = torch.minimum(buffer.running_min, means / bias_correction)
    return LossBuffer(decays, means, running_min, count + 1)


def loss_features(buffer: LossBuffer) -> torch.Tensor:
    """The 9 loss features of the (updated) buffer.

    ``a_j = μ_j/(1 − δ_j^n)``; ``f_j = clip((a_j − ρ_j)/max(1e-8, a_{j+1} − ρ_j) − 1, −1, 1)``
    for j = 0..8: where the loss sits between its running minimum and a slower average. All zero
    while n ≤ 2.
    """
    corrected = buffer.means / (1 - buffer.decays ** buffer.count)
    running_min = buffer.running_min[:-1]
    spread = torch.clamp_min(corrected[1:] - running_min, 1e-8)
    features = torch.clamp((corrected[:-1] - running_min) / spread - 1.0, -1.0, 1.0)
    return torch.where(buffer.count <= 2, features * 0, features)


# --------------------------------------------------------------------------------------------
# §3.3 Factored dims (PyLO VeLO's tie rule)
# --------------------------------------------------------------------------------------------


def factored_dims(shape) -> tuple[int, int] | None:
    """VeLO's ``(d1, d0)``: the two largest axes, with PyLO VeLO's swap rule for ties.

    Take ``(a, b)`` = the last two axes of the **stable** size order (equal sizes keep ascending
    axis index). Different sizes: ``(d1, d0) = (a, b)``. Equal sizes: swapped, ``(b, a)``, except
    a rank-4 tensor whose tie is between axes 0 and 1, which keeps ``(0, 1)``. The swap gives a
    square PyTorch Linear weight ``(out, in)`` the row/col roles haiku's ``(in, out)`` had in
    meta-training. ``None`` for rank < 2.
    """
    dims = stable_factored_dims(shape)
    if dims is None:
        return None
    second, largest = dims
    if shape[second] != shape[largest]:
        return second, largest
    if len(shape) == 4 and (second, largest) == (0, 1):
        return 0, 1
    return largest, second


# --------------------------------------------------------------------------------------------
# §3.4 Statistics stage: per-tensor LSTM input features
# --------------------------------------------------------------------------------------------


def clip_gradient(grad: torch.Tensor) -> torch.Tensor:
    """ĝ = clip(g, −1000, 1000), in float32: the only gradient VeLO ever looks at."""
    return torch.clamp(grad.to(torch.float32), -GRADIENT_CLIP, GRADIENT_CLIP)


@dataclass(frozen=True)
class TensorStatistics:
    """Per-tensor statistics of the statistics phase: ``mean_square_param`` (mean p², float32 0-d)
    and the 7 raw LSTM statistics ``lstm`` = ``[μ_v, var_m (3), var_v (3)]`` (float32)."""

    mean_square_param: torch.Tensor
    lstm: torch.Tensor


@dataclass(frozen=True)
class TensorMoments:
    """The first pass of the statistics: ``mean_square_param`` (mean p², float32 0-d), ``norm_mult``
    ν = rsqrt(max(mean p², 1e-9)) (float32 value, float64 0-d), and the float64 means of the scaled
    accumulators ``mean_mom`` μ_m,k (3) and ``mean_rms`` μ_v (1)."""

    mean_square_param: torch.Tensor
    norm_mult: torch.Tensor
    mean_mom: torch.Tensor
    mean_rms: torch.Tensor


def moment_sums(param: torch.Tensor, mom: torch.Tensor, rms: torch.Tensor) -> torch.Tensor:
    """First-pass sums over the tensor's elements, float64: ``[Σ p², Σ m_0, Σ m_1, Σ m_2, Σ v]``, each
    without its non-finite terms (``accumulators.finite_part``: a NaN parameter element stays in its
    element instead of reaching the LSTM input, and through the controller's max every tensor)."""
    axes = list(range(param.dim()))
    square_param = float64_square_sum(finite_part(param)).reshape(1)
    return torch.cat([square_param, float64_sum(finite_part(mom), axes), float64_sum(finite_part(rms), axes)])


def tensor_moments(sums: torch.Tensor, count: int) -> TensorMoments:
    """The :class:`TensorMoments` of a tensor of ``count`` elements from its :func:`moment_sums`.

    ``μ_m,k = ν·Σm_k/n`` is the mean of ``m̃ = ν·m`` (ν, not ν²), and likewise ``μ_v``.
    """
    mean_square_param = (sums[0] / count).to(torch.float32)
    norm_mult = torch.rsqrt(torch.clamp_min(mean_square_param, 1e-9)).to(torch.float64)
    return TensorMoments(mean_square_param, norm_mult, norm_mult * sums[1:4] / count, norm_mult * sums[4:5] / count)


def centred_square_sums(mom: torch.Tensor, rms: torch.Tensor, moments: TensorMoments) -> torch.Tensor:
    """Second-pass sums, float64: ``[Σ (m̃_k − μ_m,k)² (3), Σ (ṽ − μ_m,k)² (3)]`` — ṽ around the
    **momentum** means: the original's bug, kept."""
    axes = list(range(mom.dim() - 1))
    scaled_mom = mom.to(torch.float64) * moments.norm_mult
    scaled_rms = rms.to(torch.float64) * moments.norm_mult
    return torch.cat([float64_sum(finite_part((scaled_mom - moments.mean_mom) ** 2), axes),
                      float64_sum(finite_part((scaled_rms - moments.mean_mom) ** 2), axes)])


def statistics_from_sums(moments: TensorMoments, centred_sums: torch.Tensor, count: int) -> TensorStatistics:
    """``var_m,k`` and ``var_v,k`` from the :func:`centred_square_sums`, with ``μ_v``: the float32 statistics."""
    lstm = torch.cat([moments.mean_rms, centred_sums / count]).to(torch.float32)
    return TensorStatistics(moments.mean_square_param, lstm)


def tensor_statistics(param: torch.Tensor, mom: torch.Tensor, rms: torch.Tensor) -> TensorStatistics:
    """Statistics of the pre-update ``param`` and the **old** accumulators, accumulated in float64.

    ``mean p²`` is rounded to float32; ``ν = rsqrt(max(mean p², 1e-9))`` (float32); with
    ``m̃ = ν·m`` and ``ṽ = ν·v`` (ν, not ν²): ``μ_m,k = mean m̃_k``, ``var_m,k = mean (m̃_k − μ_m,k)²``,
    ``μ_v = mean ṽ``, ``var_v,k = mean (ṽ − μ_m,k)²`` (the momentum mean: the original's bug,
    kept), each two-pass in float64 and rounded to float32. ``param`` has the work shape (a 0-d
    parameter as ``(1,)``), ``mom`` and ``rms`` a trailing decay axis. (``lopt.VeLO`` runs the two
    passes over all tensors at once, completing each pass's sums across processes in between.)
    """
    count = param.numel()
    moments = tensor_moments(moment_sums(param, mom, rms), count)
    return statistics_from_sums(moments, centred_square_sums(mom, rms, moments), count)


def clip_log_abs(x: torch.Tensor, scale: float = 10.0) -> torch.Tensor:
    """L(x) = 0.5 · clip(ln(1e-8 + |scale·x|), −5, 5)."""
    return torch.clamp(torch.log(1e-8 + torch.abs(x * scale)), -5, 5) * 0.5


def fraction_features(steps_taken, num_steps: int, timescales: torch.Tensor) -> torch.Tensor:
    """φ_i = tanh(10·(t/N − s_i)) for the 9 ``FRACTION_TIMESCALES`` (``timescales``, float32).

    ``t/N`` is divided in double and enters the float32 arithmetic as a scalar (no host-to-device
    copy). Not clipped: past ``num_steps`` the features keep saturating towards +1. ``steps_taken``:
    an int, or a 0-d integer tensor (a compiled step's counter: divided in double on the device).
    """
    if torch.is_tensor(steps_taken):
        steps_taken = steps_taken.to(device=timescales.device, dtype=torch.float64)
    fraction = steps_taken / num_steps
    return torch.tanh((fraction - timescales) * 10)


def rank_one_hot_table(device=None) -> torch.Tensor:
    """Row r = one-hot(r) over 5 classes for r < 5; row 5 = zeros (rank ≥ 5, the JAX encoding)."""
    return torch.cat([torch.eye(NUM_RANK_CLASSES), torch.zeros(1, NUM_RANK_CLASSES)]).to(device)


def tensor_rank(shape) -> int:
    """VeLO's rank: the number of axes of size > 1."""
    return sum(1 for size in shape if size > 1)


def lstm_input_features(fraction: torch.Tensor, loss_feats: torch.Tensor, statistics: torch.Tensor,
                        rank_one_hot: torch.Tensor) -> torch.Tensor:
    """The ``N_t × 30`` LSTM input, one row per tensor, in sorted key order (``LSTM_FEATURE_NAMES``):
    fraction (9), loss features (9), L(μ_v), rank one-hot (5), L(var_m) (3), L(var_v) (3).

    ``fraction`` ``N_t×9``, ``loss_feats`` ``9``, ``statistics`` ``N_t×7`` (``TensorStatistics.lstm``),
    ``rank_one_hot`` ``N_t×5``.
    """
    logs = clip_log_abs(statistics)
    loss_rows = loss_feats.unsqueeze(0).expand(statistics.shape[0], -1)
    return torch.cat([fraction, loss_rows, logs[:, 0:1], rank_one_hot, logs[:, 1:4], logs[:, 4:7]], dim=1)


# --------------------------------------------------------------------------------------------
# §3.5 Controller stage: mixing layers, one LSTM step, heads (batched over tensors)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ControllerOutput:
    controls: torch.Tensor  # N_t × 256, raw (no activation)
    lr_mult: torch.Tensor  # N_t, λ (raw, may be negative)
    hidden: torch.Tensor  # N_t × 512, new LSTM h
    cell: torch.Tensor  # N_t × 512, new LSTM c


def mixing_max(inputs: torch.Tensor, rnn: dict) -> torch.Tensor:
    """``max_rows relu(X A2ᵀ + a2)`` (512): the only quantity through which tensors see each other.

    With no rows it is zero, the identity of a max of ReLU outputs: a process holding some of the
    tensors (ZeRO) computes the max of its rows, and the reduce phase takes the max over processes.
    """
    weight, bias = rnn["mix_layer2.weight"], rnn["mix_layer2.bias"]
    if inputs.shape[0] == 0:
        return torch.zeros(weight.shape[0], dtype=inputs.dtype, device=inputs.device)
    return torch.max(F.relu(F.linear(inputs, weight, bias)), dim=0).values


def mix_tensor_inputs(inputs: torch.Tensor, rnn: dict, shared: torch.Tensor | None = None) -> torch.Tensor:
    """``x̂ = X A3ᵀ + a3 + max_rows relu(X A2ᵀ + a2)``: every tensor sees the whole model through the max.

    ``shared`` is the max over all tensors' rows (:func:`mixing_max` of ``inputs`` unless given).
    (The checkpoint's first mixing layer ``mix_layer1`` is computed and discarded by JAX; skipped.)
    """
    if shared is None:
        shared = mixing_max(inputs, rnn)
    return F.linear(inputs, rnn["final_mix_layer.weight"], rnn["final_mix_layer.bias"]) + shared


def lstm_cell(inputs: torch.Tensor, hidden: torch.Tensor, cell: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """haiku's LSTM: ``z = [x, h] Wᵀ + b`` split into gates i, g, f, o (in that order);
    ``c' = σ(z_f + 1)·c + σ(z_i)·tanh(z_g)``, ``h' = σ(z_o)·tanh(c')``. Returns ``(h', c')``."""
    gates = F.linear(torch.cat([inputs, hidden], dim=-1), weight, bias)
    input_gate, candidate, forget_gate, output_gate = gates.chunk(4, dim=-1)
    new_cell = torch.sigmoid(forget_gate + 1) * cell + torch.sigmoid(input_gate) * torch.tanh(candidate)
    new_hidden = torch.sigmoid(output_gate) * torch.tanh(new_cell)
    return new_hidden, new_cell


def controller_heads(hidden: torch.Tensor, rnn: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``controls = h Wcᵀ + bc`` (``N_t × 256``) and ``λ = h wsᵀ + bs`` (``N_t``), no activations."""
    controls = F.linear(hidden, rnn["rnn_to_controls.weight"], rnn["rnn_to_controls.bias"])
    lr_mult = F.linear(hidden, rnn["step_size.weight"], rnn["step_size.bias"]).squeeze(-1)
    return controls, lr_mult


def controller_step(inputs: torch.Tensor, hidden: torch.Tensor, cell: torch.Tensor, rnn: dict,
                    shared: torch.Tensor | None = None) -> ControllerOutput:
    """Mixing, one LSTM step and the heads for all ``N_t`` tensors at once (``inputs`` ``N_t × 30``;
    ``shared``: the mixing max over every tensor of the model, when ``inputs`` holds only some)."""
    mixed = mix_tensor_inputs(inputs, rnn, shared)
    new_hidden, new_cell = lstm_cell(mixed, hidden, cell, rnn["lstm.linear.weight"], rnn["lstm.linear.bias"])
    controls, lr_mult = controller_heads(new_hidden, rnn)
    return ControllerOutput(controls, lr_mult, new_hidden, new_cell)


# --------------------------------------------------------------------------------------------
# §3.8 Weight generation (batched over tensors)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GeneratedMLP:
    """The per-element MLP 30 → 4 → 4 → 3 of one tensor (or of ``N_t`` tensors, with a leading axis)."""

    input_weight: torch.Tensor  # 4 × 30
    input_bias: torch.Tensor  # 4
    hidden_weight: torch.Tensor  # 4 × 4
    hidden_bias: torch.Tensor  # 4
    output_weight: torch.Tensor  # 3 × 4
    output_bias: torch.Tensor  # 3

    def select(self, index: int, device=None) -> "GeneratedMLP":
        """Tensor ``index``'s MLP out of a batch, on ``device``."""
        return GeneratedMLP(*(getattr(self, role)[index].to(device) for role in MLP_CANDIDATE_TENSORS))

    def to(self, dtype) -> "GeneratedMLP":
        return GeneratedMLP(*(getattr(self, role).to(dtype) for role in MLP_CANDIDATE_TENSORS))


def generate_mlp_weights(controls: torch.Tensor, mlp: dict) -> GeneratedMLP:
    """``W = 100 · (1/K) Σ_k c_k W^(k)`` for each of the six candidate stacks (K = 256).

    ``controls`` is ``N_t × K``; every stack is mixed for all tensors in one matrix multiply.
    The mean over candidates comes first, then the ×100 (as in the sources).
    """
    generated = {}
    for role, tensor_name in MLP_CANDIDATE_TENSORS.items():
        candidates = mlp[tensor_name]
        num_candidates = candidates.shape[0]
        mean = (controls @ candidates.reshape(num_candidates, -1)) / num_candidates
        generated[role] = (mean * WEIGHT_GENERATION_SCALE).reshape((controls.shape[0],) + tuple(candidates.shape[1:]))
    return GeneratedMLP(**generated)


# --------------------------------------------------------------------------------------------
# §3.3, §3.6–3.9 Apply stage (one tensor)
# --------------------------------------------------------------------------------------------



def per_element_features(grad: torch.Tensor, param: torch.Tensor, state: dict, dims,
                         row_col_mean: torch.Tensor | None = None) -> torch.Tensor:
    """§3.6: the 30 features ``S + (30,)`` (``ELEMENT_FEATURE_NAMES``) from the **updated**
    accumulators and the pre-update param; ``grad`` (clipped) and ``param`` carry a trailing axis of 1.

    ``ρ = rsqrt(v + 1e-6)``. Rank ≥ 2: row/col are ``R_k``/``C_k`` broadcast, features 27–29
    ``m_k·rf_k·cf_k``. Rank ≤ 1: ``V_k`` twice, features 27–29 ``m_k·V_k^(−1/2)`` (no epsilon,
    unlike small_fc_lopt). ``row_col_mean``: see ``accumulators.adafactor_factors``.
    """
    mom, rms = state["mom"], state["rms"]
    rsqrt_rms = torch.rsqrt(rms + 1e-6)
    features = [
        grad, torch.clamp(grad, -GRADIENT_FEATURE_CLIP, GRADIENT_FEATURE_CLIP), param, mom, rms, mom * rsqrt_rms,
        rsqrt_rms, factored_gradient(grad, state, dims, row_col_mean), grad * rsqrt_rms,
    ]
    features += adafactor_features(state, dims, full_momentum_epsilon=0.0, row_col_mean=row_col_mean)
    return torch.cat(features, dim=-1)


def normalise_features(features: torch.Tensor) -> torch.Tensor:
    """§3.7: each feature column times ``rsqrt(1e-5 + mean over the tensor's elements of x_j²)``."""
    return second_moment_normalizer(features)


def per_element_mlp(features: torch.Tensor, mlp: GeneratedMLP) -> tuple[torch.Tensor, torch.Tensor]:
    """§3.8: ``o = W2 relu(W1 relu(W0 x + b0) + b1) + b2``; returns (direction o_0, magnitude o_1)."""
    hidden = F.relu(F.linear(features, mlp.input_weight, mlp.input_bias))
    hidden = F.relu(F.linear(hidden, mlp.hidden_weight, mlp.hidden_bias))
    output = F.linear(hidden, mlp.output_weight, mlp.output_bias)
    return output[..., 0], output[..., 1]


def param_scale(mean_square_param: torch.Tensor) -> torch.Tensor:
    """``sqrt(mean p² + 1e-9)`` of the pre-update tensor (0-d), from ``TensorStatistics.mean_square_param``."""
    return torch.sqrt(mean_square_param + 1e-9)


def velo_update(direction: torch.Tensor, magnitude: torch.Tensor, lr_mult: torch.Tensor, scale: torch.Tensor,
                exp_mult: float, step_mult: float) -> torch.Tensor:
    """§3.9: ``u = λ · param_scale · d · exp(exp_mult·μ) · step_mult`` (no clipping)."""
    return lr_mult * (scale * (direction * torch.exp(magnitude * exp_mult) * step_mult))



def update_from_features(features: torch.Tensor, square_sums: torch.Tensor, count: int, mlp: GeneratedMLP,
                         lr_mult: torch.Tensor, scale: torch.Tensor, *, exp_mult: float, step_mult: float) -> torch.Tensor:
    """§3.7–§3.9 for one tensor: normalise the 30 features (``S + (30,)``) by the tensor's float64
    ``square_sums`` over its ``count`` elements, run the generated MLP; returns u (``S``)."""
    direction, magnitude = per_element_mlp(normalise_by_square_sums(features, square_sums, count), mlp)
    return velo_update(direction, magnitude, lr_mult, scale, exp_mult, step_mult)


def apply_stage(param: torch.Tensor, grad: torch.Tensor, state: dict, dims, decays: Decays, mlp: GeneratedMLP,
                lr_mult: torch.Tensor, scale: torch.Tensor, *, lr, weight_decay, exp_mult: float,
                step_mult: float) -> torch.Tensor:
    """Everything after the controller for one tensor; returns the new float32 param.

    ``param`` (float32, pre-update) and ``grad`` (float32, clipped) have the work shape (a 0-d
    parameter as ``(1,)``); ``state`` holds the accumulators in that shape and is updated in place;
    ``mlp`` and ``lr_mult`` are this tensor's controller outputs, ``scale`` its ``param_scale``.
    (``lopt.VeLO`` runs these steps phase by phase over all its tensors.)
    """
    batch_grad = grad.unsqueeze(-1)
    batch_param = param.unsqueeze(-1)
    update_accumulators(state, batch_grad, decays, dims)
    features = per_element_features(batch_grad, batch_param, state, dims)
    update = update_from_features(features, feature_square_sums(features), param.numel(), mlp, lr_mult, scale,
                                  exp_mult=exp_mult, step_mult=step_mult)
    return apply_update(param, update, lr, weight_decay)


def work_shape(shape) -> tuple:
    """The shape the math runs in: a 0-d parameter is the 1-element vector of the JAX definition."""
    return tuple(shape) if len(shape) else (1,)


def initial_lstm_state(rnn: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The meta-learned initial ``(h, c)`` of one tensor's LSTM row (each ``(512,)``)."""
    return rnn["lstm_init_state.0"][0], rnn["lstm_init_state.1"][0]
