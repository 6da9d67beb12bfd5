"""``lopt.SmallFCLOpt``: small_fc_lopt as a drop-in ``torch.optim`` optimizer."""

from __future__ import annotations

import math
import numbers

import torch

from lopt.optimizers.base import LearnedOptimizer
from lopt.reference import small_fc_lopt as reference


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
            follow a scheduler without recompiling or re-capturing).
        weight_decay: decoupled weight decay, applied after the update as ``p -= weight_decay*lr*p``
            (a number or a 0-d tensor).
        weights: meta-weights — a registered name (default ``"small_fc_lopt"``: hub repo
            ``btherien/mulo``), a hub repo id ``owner/name[@revision]``, a local directory in PyLO's
            hub layout, a ``.safetensors`` file, or a :class:`lopt.weights.MetaWeights`.
        backend: ``"auto"`` (fused on CUDA when available, else naive), ``"naive"`` or ``"fused"``.
        exp_mult, step_mult: output scalings (PyLO defaults 0.001 and 0.01).
        momentum_decays, rms_decays, adafactor_decays: meta-learned decay offsets (PyLO's defaults).
        max_grad_norm: if set, each tensor's gradient is clipped to this 2-norm first (PyLO option;
            the gradient tensor itself is not modified).
        nonfinite: what a step does when a gradient holds NaN, ±inf or a value whose square
            overflows float32 (|g| >= 2^64): ``"skip"`` (default) leaves parameters, state and
            step counters untouched, counts it in :attr:`skipped_steps` and warns; ``"raise"``
            raises :class:`lopt.NonFiniteGradientError` (the fused backend then reads one flag
            from the device per step).

    State per parameter (float32, PyLO's names and layout, decay axis last): ``mom`` ``S+(3,)``,
    ``rms`` ``S+(1,)``, ``fac_vec_row``/``fac_vec_col`` (rank >= 2) or ``fac_vec_v`` (rank <= 1).
    Each group counts its steps in ``group["step"]``.

    Works with ``torch.amp.GradScaler`` like fused AdamW: ``scaler.step(opt)`` hands its scale and
    overflow flag to the step, which unscales the gradients itself and changes nothing on overflow.
    """

    architecture = "small_fc_lopt"
    reference = reference
    requires_loss = False  # step() takes an optional closure, not the loss

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
    ):
        defaults = self.accumulator_defaults(
            lr=lr, weight_decay=weight_decay, exp_mult=exp_mult, step_mult=step_mult, momentum_decays=momentum_decays,
            rms_decays=rms_decays, adafactor_decays=adafactor_decays)
        defaults["max_grad_norm"] = max_grad_norm
        super().__init__(params, defaults, weights=weights, backend=backend, nonfinite=nonfinite)

    def _validate_group(self, group: dict, where: str) -> None:
        super()._validate_group(group, where)
        max_grad_norm = group.get("max_grad_norm")
        if max_grad_norm is not None and not (_is_positive_number(max_grad_norm)):
            raise ValueError(f"{type(self).__name__}: invalid {where}: max_grad_norm must be a finite number > 0 "
                             f"or None, got {max_grad_norm!r}")

    def _fused_unsupported_reason(self) -> str | None:
        if any(group["max_grad_norm"] is not None for group in self.param_groups):
            return ("max_grad_norm is not supported by the fused backend yet; clip gradients before step() "
                    "(torch.nn.utils.clip_grad_norm_) or use backend='naive'")
        return super()._fused_unsupported_reason()

    def _make_fused_engine(self):
        from lopt.fused.small_fc_lopt import SmallFCLOptFused

        return SmallFCLOptFused(self)

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimisation step. ``closure`` (optional) re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inputs = self._check_gradients()
        if self.backend == "fused":
            if any(group["max_grad_norm"] is not None for group in self.param_groups):  # (a group added later)
                raise RuntimeError("SmallFCLOpt: max_grad_norm is not supported by the fused backend yet; clip "
                                   "gradients before step() or use backend='naive'. Nothing was changed")
            self._fused_engine.step(inputs)
        else:
            self._naive_step(inputs)
        return loss

    def _naive_step(self, inputs) -> None:
        grads = self._unscaled_gradients(inputs)
        if not self._naive_step_allowed(inputs, grads):
            return
        for group, params in zip(self.param_groups, inputs.params):
            group["step"] = self._host_step(group) + 1
            for p in params:
                grad = grads[p]
                if group["max_grad_norm"] is not None:
                    grad = reference.clip_gradient_norm(grad, group["max_grad_norm"])
                reference.small_fc_lopt_step(
                    p, grad, self.ensure_state(p), group["step"], self.weights_on(p.device)["mlp"],
                    self.decays(group, p.device), lr=group["lr"], weight_decay=group["weight_decay"],
                    exp_mult=group["exp_mult"], step_mult=group["step_mult"],
                )


def _is_positive_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0
