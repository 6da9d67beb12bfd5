"""``lopt.SmallFCLOpt``: small_fc_lopt as a drop-in ``torch.optim`` optimizer."""

from __future__ import annotations

import math
import numbers

import torch

from lopt.distributed import SumPacket
from lopt.optimizers.base import LearnedOptimizer
from lopt.reference import small_fc_lopt as reference

PRECISIONS = ("exact", "fast")


class SmallFCLOpt(LearnedOptimizer):
    r"""small_fc_lopt (AdafacMLPLOpt): a 39-32-32-2 MLP proposes every parameter element's update.

    For each parameter tensor, every step:

    .. math::
        m_k &\leftarrow \beta_{m,k} m_k + (1-\beta_{m,k}) g, \quad
        v \leftarrow \beta_v v + (1-\beta_v) g^2, \quad
        R_k, C_k \text{ (or } V_k) \leftarrow \text{Adafactor EMAs of } g^2 + 10^{-30} \\
        x &= \big[\text{normalise}(f_{0..27}(g, p, m, v, R, C)),\ \tanh((t-1)/T_i - 1)_{i<11}\big] \\
        (d, s) &= \text{MLP}(x), \qquad u = d \cdot e^{\text{exp\_mult}\cdot s} \cdot \text{step\_mult} \\
        p &\leftarrow p - \text{lr}\cdot u, \qquad
        p \leftarrow p - \text{weight\_decay}\cdot\text{lr}\cdot p \ \ (\text{if weight\_decay} > 0)

    The semantics are PyLO's ``AdafacLO_naive`` (docs/small_fc_lopt.md) with two decisions of
    lopt: ties between equal axis sizes when choosing the factored axes are broken by a stable sort
    (lowest axis first) on every platform, and a 0-d parameter has each feature normalised by
    itself (the JAX definition) rather than by one value shared by all 28 features.

    Args:
        params: parameters or parameter groups (groups may set ``lr``, ``weight_decay``, ...).
        lr: multiplies the meta-learned step (1.0 = the step the weights were meta-trained with).
            A number or a 0-d tensor (a CUDA tensor lets a compiled step or a captured CUDA graph
            follow a scheduler without recompiling or re-capturing). Below 0.02 (other than 0) warns
            once with :class:`lopt.AdamHabitWarning`: almost certainly an Adam learning rate.
        weight_decay: decoupled weight decay, applied after the update as ``p -= weight_decay*lr*p``
            (a number or a 0-d tensor).
        weights: meta-weights — a registered name (default ``"small_fc_lopt"``: hub repo
            ``btherien/mulo``), a hub repo id ``owner/name[@revision]``, a local directory in PyLO's
            hub layout, a ``.safetensors`` file, or a :class:`lopt.weights.MetaWeights`.
        backend: ``"auto"`` (fused on CUDA when available, else naive), ``"naive"`` or ``"fused"``.
        exp_mult, step_mult: output scalings (PyLO defaults 0.001 and 0.01).
        momentum_decays, rms_decays, adafactor_decays: meta-learned decay offsets (PyLO's defaults).
        max_grad_norm: if set, each tensor's gradient is clipped to this 2-norm first (PyLO option;
            the gradient tensor itself is not modified). Both backends; the fused one takes each
            tensor's norm from sums its accumulate phase forms anyway (docs/small_fc_lopt.md).
        nonfinite: what a step does when a gradient holds NaN, ±inf or a value whose square
            overflows float32 (|g| >= 2^64): ``"skip"`` (default) leaves parameters, state and
            step counters untouched and counts it in :attr:`skipped_steps` (the naive step warns at
            once; the fused backend and a compiled step count on the device, and reading
            :attr:`skipped_steps` warns); ``"raise"`` raises :class:`lopt.NonFiniteGradientError`
            (the fused backend then reads one flag from the device per step).
        precision: the arithmetic of the fused backend's MLP, in the spirit of torch's TF32 switches.
            ``"exact"`` (default): float32-accurate products (per-step updates within 1e-5 of the
            naive backend). ``"fast"``: the two 32-wide hidden layers multiply BF16-rounded operands
            and the output layer FP16 ones (float32 accumulation; one tensor-core product instead of
            three or four, none on the CUDA cores): a faster step whose
            updates differ from the naive backend's by about 1e-3 per step (bounds, loss curves
            and times: docs/small_fc_lopt.md §3.10). The naive backend always computes in
            float32, whatever this says.

    State per parameter (float32, PyLO's names and layout, decay axis last): ``mom`` ``S+(3,)``,
    ``rms`` ``S+(1,)``, ``fac_vec_row``/``fac_vec_col`` (rank >= 2) or ``fac_vec_v`` (rank <= 1).
    Each group counts its steps in ``group["step"]``.

    Works with ``torch.amp.GradScaler`` like fused AdamW: ``scaler.step(opt)`` hands its scale and
    overflow flag to the step, which unscales the gradients itself and changes nothing on overflow.
    """

    architecture = "small_fc_lopt"
    reference = reference
    PRECISIONS = PRECISIONS
    requires_loss = False  # step() takes an optional closure, not the loss
    GROUP_KEYS = frozenset({"lr", "weight_decay", "exp_mult", "step_mult", "momentum_decays", "rms_decays",
                            "adafactor_decays", "max_grad_norm"})

    def __init__(
        self,
        params,
        lr: float = 1.0,
        weight_decay: float = 0.0,
        weights="small_fc_lopt",
        backend: str = "auto",
        *,
        exp_mult: float = 0.001,
        step_mult: float = 0.01,
        momentum_decays=reference.MOMENTUM_DECAY_OFFSETS,
        rms_decays=reference.RMS_DECAY_OFFSETS,
        adafactor_decays=reference.ADAFACTOR_DECAY_OFFSETS,
        max_grad_norm: float | None = None,
        nonfinite: str = "skip",
        precision: str = "exact",
        process_group=None,
    ):
        defaults = self.accumulator_defaults(
            lr=lr, weight_decay=weight_decay, exp_mult=exp_mult, step_mult=step_mult, momentum_decays=momentum_decays,
            rms_decays=rms_decays, adafactor_decays=adafactor_decays)
        defaults["max_grad_norm"] = max_grad_norm
        self._start(params, defaults, weights=weights, backend=backend, nonfinite=nonfinite, precision=precision,
                    process_group=process_group)

    def _start(self, params, defaults: dict, *, weights, backend, nonfinite, precision, process_group) -> None:
        """The constructor's common part (subclasses with other group defaults, ELO and MuLO, call it too)."""
        if precision not in PRECISIONS:
            raise ValueError(f"{type(self).__name__}: precision must be one of {PRECISIONS}, got {precision!r} "
                             f"('exact': float32-accurate MLP products; 'fast': BF16 products in the fused backend)")
        self._precision = precision
        LearnedOptimizer.__init__(self, params, defaults, weights=weights, backend=backend, nonfinite=nonfinite,
                                  process_group=process_group)

    _PICKLED_ATTRIBUTES = LearnedOptimizer._PICKLED_ATTRIBUTES + ("_precision",)

    @property
    def precision(self) -> str:
        """``"exact"`` or ``"fast"``: the fused backend's MLP arithmetic (fixed at construction)."""
        return self._precision

    def _validate_group(self, group: dict, where: str) -> None:
        super()._validate_group(group, where)
        max_grad_norm = group.get("max_grad_norm")
        if max_grad_norm is not None and not (_is_positive_number(max_grad_norm)):
            raise ValueError(f"{type(self).__name__}: invalid {where}: max_grad_norm must be a finite number > 0 "
                             f"or None, got {max_grad_norm!r}")

    def _naive_step(self, inputs) -> None:
        """The naive backend, phase by phase over all tensors (``lopt/reference/small_fc_lopt.py`` per
        tensor): check (with ``max_grad_norm``'s Σg²), accumulate, feature statistics, apply. Each
        phase's sums over a tensor split among processes complete in one reduce for all tensors.
        (ELO differs in two hooks: :meth:`_naive_clipping_sums` with :meth:`_naive_clipped_gradients`,
        and :meth:`_naive_new_value`.)"""
        tensors = self._naive_tensors(inputs)
        check = SumPacket(self.reducer)
        clipping = self._naive_clipping_sums(tensors, check)
        if not self._naive_step_allowed(tensors, inputs, packet=check):
            return
        self._advance_step_counters()
        for t, grad in zip(tensors, self._naive_clipped_gradients(tensors, check, clipping)):
            # (torch.unsqueeze: a frame that names torch is one torch.compile traces when it resumes after
            # the check's host read; without it dynamo skips this frame and compiles each callee on its own)
            t.step_grad = torch.unsqueeze(grad, -1)
        self._naive_accumulate(tensors)
        square_sums = self._naive_feature_square_sums(tensors)
        for t, sums in zip(tensors, square_sums):
            t.write_back(self._naive_new_value(t, sums))

    def _naive_clipping_sums(self, tensors: list, check: SumPacket) -> list:
        """Check phase: what ``max_grad_norm`` needs, added to the check's packet (completed by its reduce):
        here each clipped tensor's own Σ g² (a handle per tensor, None where its group does not clip)."""
        return [check.add(reference.gradient_square_sum(t.grad), split=t.split)
                if t.group["max_grad_norm"] is not None else None for t in tensors]

    def _naive_clipped_gradients(self, tensors: list, check: SumPacket, clipping) -> list:
        """Each tensor's gradient after ``max_grad_norm`` (PyLO's per-tensor clipping, §3.1)."""
        return [reference.clip_gradient_norm(t.grad, t.group["max_grad_norm"], check[handle])
                if handle is not None else t.grad for t, handle in zip(tensors, clipping)]

    def _naive_new_value(self, t, square_sums: torch.Tensor) -> torch.Tensor:
        """Apply phase for one tensor: normalisation, time features, the MLP and the update (§3.6–§3.9)."""
        group = t.group
        update = reference.update_from_features(
            self._features(t), square_sums, t.count, group["step"], self.weights_on(t.value.device)["mlp"],
            exp_mult=group["exp_mult"], step_mult=group["step_mult"])
        return reference.apply_update(t.value, update, group["lr"], group["weight_decay"])


def _is_positive_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0
