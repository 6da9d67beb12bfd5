"""``lopt.ELO``: ELO as a drop-in ``torch.optim`` optimizer (small_fc_lopt's front-end, ELO's differences)."""

from __future__ import annotations

import torch

from lopt.distributed import SumPacket
from lopt.optimizers.base import DECAY_OFFSET_COUNTS
from lopt.optimizers.small_fc_lopt import SmallFCLOpt
from lopt.reference import elo as reference


class ELO(SmallFCLOpt):
    r"""ELO: small_fc_lopt's 39-input MLP with raw decays and its own update rule.

    Everything small_fc_lopt computes per element — momentum, RMS and Adafactor accumulators, the 28
    features normalised per tensor, the 11 time features, the 39 → 32 → 32 → 2 MLP giving
    ``(direction, magnitude)`` — ELO computes the same way (``docs/elo.md``), except:

    .. math::
        \beta &= \text{the decays as given (no reparameterisation)}, \\
        g &\leftarrow g \cdot \min\big(1, \text{max\_grad\_norm} / \lVert (g_i)_{\text{all tensors}} \rVert_2\big)
            \quad (\text{if max\_grad\_norm is set: the global norm}), \\
        p &\leftarrow p - \text{lr}\cdot\big(\text{direction}\cdot e^{\text{exp\_mult}\cdot\text{magnitude}}
            + \text{weight\_decay}\cdot p\big).

    The semantics are PyLO's ``ELO_naive`` with small_fc_lopt's decisions (stable tie rule for the
    factored axes, a 0-d parameter normalised per feature, float32 math, non-finite gradients skip the
    step instead of being zeroed): ``docs/elo.md`` §5.

    Args:
        params: parameters or parameter groups (groups may set ``lr``, ``weight_decay``, ...).
        lr: ELO's step size (its ``step_mult``; 1e-3 is the step the weights were meta-trained with).
            A number or a 0-d tensor. Unlike SmallFCLOpt's, it is not a multiplier of a learned step, so
            small values do not warn.
        weight_decay: decoupled weight decay of the pre-update parameter, inside the step:
            ``p -= lr * (update + weight_decay * p)`` (a number or a 0-d tensor).
        weights: meta-weights — a registered name (default ``"elo"``: hub repo ``DiamondXL/elo``), a hub
            repo id, a local directory in PyLO's hub layout, a ``.safetensors`` file, or a
            :class:`lopt.weights.MetaWeights` of the ``elo`` architecture.
        backend: ``"auto"`` (fused on CUDA where CuPy works, else naive), ``"naive"`` or ``"fused"``: small_fc_lopt's
            kernels with ELO's update rule and global clipping (``lopt/fused/elo.py``).
        exp_mult: the magnitude's exponent multiplier (0.001).
        max_grad_norm: if set, every gradient of this group is multiplied by
            ``min(1, max_grad_norm / ‖g‖₂)``, ``‖g‖₂`` the norm of all the optimizer's gradients together
            (every group's; PyLO's ``clip_grad=True, clip_norm=max_grad_norm``). None (default): no clipping.
        momentum_decays, rms_decays, adafactor_decays: the accumulators' decays, each in [0, 1], used as given.
        nonfinite: ``"skip"`` (default) or ``"raise"``, as :class:`lopt.SmallFCLOpt`.
        precision: ``"exact"`` or ``"fast"`` (the fused backend's BF16 MLP products), as SmallFCLOpt; the naive
            backend always computes in float32.

    State per parameter: SmallFCLOpt's (PyLO's names and layout). Each group counts its steps in
    ``group["step"]``.
    """

    architecture = "elo"
    reference = reference
    GROUP_KEYS = frozenset({"lr", "weight_decay", "exp_mult", "momentum_decays", "rms_decays", "adafactor_decays",
                            "max_grad_norm"})
    _WARNS_ABOUT_ADAM_HABITS = False  # (lr=1e-3 is ELO's own step)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        weights="elo",
        backend: str = "auto",
        *,
        exp_mult: float = 0.001,
        max_grad_norm: float | None = None,
        momentum_decays=reference.MOMENTUM_DECAYS,
        rms_decays=reference.RMS_DECAYS,
        adafactor_decays=reference.ADAFACTOR_DECAYS,
        nonfinite: str = "skip",
        precision: str = "exact",
        process_group=None,
    ):
        defaults = self.accumulator_defaults(lr=lr, weight_decay=weight_decay, exp_mult=exp_mult,
                                             momentum_decays=momentum_decays, rms_decays=rms_decays,
                                             adafactor_decays=adafactor_decays)
        defaults["max_grad_norm"] = max_grad_norm
        self._start(params, defaults, weights=weights, backend=backend, nonfinite=nonfinite, precision=precision,
                    process_group=process_group)

    def _validate_group(self, group: dict, where: str) -> None:
        super()._validate_group(group, where)
        for name, _ in DECAY_OFFSET_COUNTS:
            outside = [x for x in group[name] if not 0.0 <= x <= 1.0]
            if outside:
                raise ValueError(f"{type(self).__name__}: invalid {where}: {name} are ELO's decays, used as given, "
                                 f"so each must lie in [0, 1]; got {tuple(group[name])!r}")

    # ------------------------------------------------------------------ the naive step's two differences

    def _naive_clipping_sums(self, tensors: list, check: SumPacket):
        """Check phase: Σ g² over every participating gradient of every group, where some group clips
        (the naive phases' global norm sums, shared with CELO2)."""
        return self._global_square_sums(tensors, check)

    def _naive_clipped_gradients(self, tensors: list, check: SumPacket, clipping) -> list:
        """Every gradient of a clipping group times its group's :func:`~lopt.reference.elo.global_clip_factor`."""
        total = self._global_square_sum(check, clipping)
        if total is None:
            return [t.grad for t in tensors]
        factors: dict = {}
        grads = []
        for t in tensors:
            limit = t.group["max_grad_norm"]
            if limit is None:
                grads.append(t.grad)
                continue
            key = (limit, t.grad.device)
            if key not in factors:
                factors[key] = reference.global_clip_factor(total.to(t.grad.device), limit)
            grads.append(t.grad * factors[key])
        return grads

    def _naive_new_value(self, t, square_sums: torch.Tensor) -> torch.Tensor:
        """Apply phase for one tensor: small_fc_lopt's normalisation, time features and MLP, then ELO's
        update (§3.9: no step_mult, the weight decay of the pre-update value inside the step)."""
        group = t.group
        update = reference.update_from_features(
            self._features(t), square_sums, t.count, group["step"], self.weights_on(t.value.device)["mlp"],
            exp_mult=group["exp_mult"], step_mult=reference.STEP_MULT)
        return reference.apply_update(t.value, update, group["lr"], group["weight_decay"])
