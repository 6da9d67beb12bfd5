"""``lopt.CELO2`` and ``lopt.ELO_CELO2``: CELO2's learned update as drop-in ``torch.optim`` optimizers, and
:func:`param_groups_for`, the JAX code's routing of embeddings to the AdamW branch (docs/celo2.md)."""

from __future__ import annotations

import math
import numbers

import torch

from lopt import distributed
from lopt.distributed import SumPacket, is_dtensor
from lopt.optimizers.base import (DECAY_OFFSET_COUNTS, LearnedOptimizer, _check_counter, _check_scalar, _is_real_number,
                                  _saved_positions, counter_value)
from lopt.reference import accumulators
from lopt.reference import celo2 as reference

PRECISIONS = ("exact", "fast")

# The group keys both optimizers have (their defaults); CELO2 adds its AdamW betas and eps.
_SHARED_GROUP_KEYS = frozenset({
    "lr", "weight_decay", "exp_mult", "momentum_decays", "rms_decays", "adafactor_decays", "orthogonalize",
    "adam_lr_mult", "adam_weight_decay", "use_adamw_for_1d", "max_grad_norm", "grad_clip_value", "rms_mult",
    "param_scale_mult", "ns_coefficients", "ns_steps", "ns_eps", "is_embedding"})
_OWN_ADAM_KEYS = ("adam_betas", "adam_eps")
_BOOLEAN_KEYS = ("orthogonalize", "use_adamw_for_1d", "param_scale_mult", "is_embedding")
_TUPLE_KEYS = ("adam_betas", "ns_coefficients")


class _CELO2Family(LearnedOptimizer):
    """What CELO2 and ELO-CELO2 share: validation, the learned branch, the naive step. They differ in the
    AdamW branch (``_OWN_ADAM_MOMENTS``) and in their defaults."""

    architecture = "celo2"
    reference = reference
    PRECISIONS = PRECISIONS
    requires_loss = False  # step() takes an optional closure, not the loss
    # lr is an Adam-like learning rate here (1e-3 by default: the learned step is normalised to unit RMS)
    _WARNS_ABOUT_ADAM_HABITS = False
    _OWN_ADAM_MOMENTS = True
    _PICKLED_ATTRIBUTES = LearnedOptimizer._PICKLED_ATTRIBUTES + ("_precision",)

    @staticmethod
    def _shared_defaults(*, lr, weight_decay, orthogonalize, adam_lr_mult, adam_weight_decay, use_adamw_for_1d,
                         max_grad_norm, grad_clip_value, exp_mult, rms_mult, param_scale_mult, momentum_decays,
                         rms_decays, adafactor_decays, ns_coefficients, ns_steps, ns_eps) -> dict:
        """The group defaults of both optimizers; ``adam_weight_decay=None`` is ``weight_decay``'s value."""
        as_tuple = lambda value: tuple(value) if isinstance(value, (list, tuple)) else value  # noqa: E731
        return dict(lr=lr, weight_decay=weight_decay, exp_mult=exp_mult, momentum_decays=as_tuple(momentum_decays),
                    rms_decays=as_tuple(rms_decays), adafactor_decays=as_tuple(adafactor_decays),
                    orthogonalize=orthogonalize, adam_lr_mult=adam_lr_mult,
                    adam_weight_decay=weight_decay if adam_weight_decay is None else adam_weight_decay,
                    use_adamw_for_1d=use_adamw_for_1d, max_grad_norm=max_grad_norm, grad_clip_value=grad_clip_value,
                    rms_mult=rms_mult, param_scale_mult=param_scale_mult,
                    ns_coefficients=as_tuple(ns_coefficients), ns_steps=ns_steps, ns_eps=ns_eps, is_embedding=False)

    def _set_precision(self, precision) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"{type(self).__name__}: precision must be one of {PRECISIONS}, got {precision!r} "
                             f"('fast': the fused backend's Newton–Schulz in bfloat16)")
        self._precision = precision

    @property
    def precision(self) -> str:
        """The fused backend's Newton–Schulz arithmetic, fixed at construction: ``"exact"`` float32 products (TF32
        off), ``"fast"`` bfloat16 ones. The naive backend always computes in float32."""
        return self._precision

    def _fused_unsupported_reason(self) -> str | None:
        reason = super()._fused_unsupported_reason()
        if reason is None and self.has_sharded_parameters:
            reason = "the fused CELO2 does not step sharded (DTensor, FSDP2) parameters yet"
        return reason

    # ------------------------------------------------------------------ validation

    def _validate_group(self, group: dict, where: str) -> None:
        name = type(self).__name__
        try:
            for key, count in DECAY_OFFSET_COUNTS:
                decays = group[key]
                if (isinstance(decays, (str, bytes)) or not hasattr(decays, "__len__") or len(decays) != count
                        or not all(_is_real_number(x) and 0.0 <= x <= 1.0 for x in decays)):
                    raise ValueError(f"{key} needs {count} decays in [0, 1] (CELO2 has no offset parametrisation: "
                                     f"they are the decays themselves), got {decays!r}")
        except (ValueError, TypeError) as err:
            raise type(err)(f"{name}: invalid {where}: {err}") from None
        super()._validate_group(group, where)  # lr, weight_decay, exp_mult
        try:
            for key in _BOOLEAN_KEYS:
                if not isinstance(group[key], bool):
                    raise TypeError(f"{key} must be True or False, got {group[key]!r}")
            _check_scalar("adam_lr_mult", group["adam_lr_mult"], allow_tensor=False)
            if group["adam_weight_decay"] is None:
                raise ValueError("adam_weight_decay must be a finite number >= 0 in a param group (None, meaning "
                                 "weight_decay, is resolved by the constructor)")
            _check_scalar("adam_weight_decay", group["adam_weight_decay"])
            if self._OWN_ADAM_MOMENTS:
                betas = group["adam_betas"]
                if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
                    raise ValueError(f"adam_betas must be a pair (beta1, beta2), got {betas!r}")
                for index, beta in enumerate(betas):
                    if not (_is_real_number(beta) and 0.0 <= beta < 1.0):
                        raise ValueError(f"adam_betas must lie in [0, 1) (Invalid beta parameter at index {index}: "
                                         f"{beta!r})")
                eps = group["adam_eps"]
                if not (_is_real_number(eps) and math.isfinite(eps) and eps >= 0):
                    raise ValueError(f"adam_eps must be a finite number >= 0 (Invalid epsilon value: {eps!r})")
            else:
                foreign = [key for key in _OWN_ADAM_KEYS if key in group]
                if foreign:
                    raise ValueError(f"{name} takes no {' or '.join(foreign)}: its AdamW branch reads the shared "
                                     f"accumulators, with the first momentum decay and the RMS decay as its betas "
                                     f"and eps 1e-8 (lopt.CELO2 has AdamW moments of its own)")
            max_grad_norm = group["max_grad_norm"]
            if max_grad_norm is not None:
                _check_scalar("max_grad_norm", max_grad_norm, strict=True, allow_tensor=False)
            _check_scalar("grad_clip_value", group["grad_clip_value"], strict=True, allow_tensor=False)
            _check_scalar("rms_mult", group["rms_mult"], minimum=-math.inf, allow_tensor=False)
            coefficients = group["ns_coefficients"]
            if (isinstance(coefficients, (str, bytes)) or not hasattr(coefficients, "__len__")
                    or len(coefficients) != 3 or not all(_is_real_number(c) and math.isfinite(c) for c in coefficients)):
                raise ValueError(f"ns_coefficients needs 3 finite numbers (a, b, c) of X <- aX + (bA + cA^2)X, got "
                                 f"{coefficients!r}")
            steps = group["ns_steps"]
            if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < 0:
                raise ValueError(f"ns_steps must be an int >= 0 (Newton-Schulz iterations), got {steps!r}")
            _check_scalar("ns_eps", group["ns_eps"], strict=True, allow_tensor=False)
        except (ValueError, TypeError) as err:
            raise type(err)(f"{name}: invalid {where}: {err}") from None

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # (validates the group first)
        group = self.param_groups[-1]
        for key in _TUPLE_KEYS:
            if key in group:
                group[key] = tuple(float(x) for x in group[key])

    # ------------------------------------------------------------------ branches and state

    @staticmethod
    def uses_adamw(group: dict, p: torch.Tensor) -> bool:
        """Whether ``p`` (of ``group``) takes the AdamW branch: rank <= 1 or an ``is_embedding`` group, unless the
        group sets ``use_adamw_for_1d=False`` (then every parameter takes the learned branch)."""
        return bool(group["use_adamw_for_1d"]) and (p.dim() <= 1 or bool(group["is_embedding"]))

    def ensure_state(self, p, group: dict | None = None) -> dict:
        """The parameter's state, created on first use (ELO-CELO2: the accumulators, whatever the branch)."""
        return super().ensure_state(p)

    def _group_of(self, p) -> dict:
        return next(group for group in self.param_groups if any(q is p for q in group["params"]))

    def _adam_state_shapes(self, p) -> dict:
        return {key: tuple(p.shape) for key in reference.ADAM_KEYS}

    # ------------------------------------------------------------------ the step

    def _naive_step(self, inputs) -> None:
        """The naive backend (docs/celo2.md §3): check (with the global norm's sums), gradient clipping,
        accumulate, the learned branch's phases over all its tensors, each AdamW tensor's update. Sums over
        a tensor split among processes (FSDP2) complete in one reduce per phase."""
        for group, p, _ in inputs.entries(self.param_groups):
            self.ensure_state(p, group)
        tensors = self._naive_tensors(inputs)
        check = SumPacket(self.reducer)
        norm_sums = self._global_square_sums(tensors, check)
        if not self._naive_step_allowed(tensors, inputs, packet=check):
            return
        self._advance_step_counters()
        square_sum = self._global_square_sum(check, norm_sums)
        norm = reference.global_norm(square_sum) if square_sum is not None else None
        for t in tensors:
            max_norm = t.group["max_grad_norm"]
            scale = reference.clip_scale(norm.to(t.grad.device), max_norm) if max_norm is not None else None
            # (torch.unsqueeze: a frame that names torch is one torch.compile traces after the check's host read)
            t.step_grad = torch.unsqueeze(reference.clip_gradient(t.grad, scale, t.group["grad_clip_value"]), -1)
        adamw = [self.uses_adamw(t.group, t.param) for t in tensors]
        learned = [t for t, takes_adamw in zip(tensors, adamw) if not takes_adamw]
        self._naive_accumulate(learned if self._OWN_ADAM_MOMENTS else tensors)
        new_values = iter(self._learned_values(learned))
        for t, takes_adamw in zip(tensors, adamw):
            t.write_back(self._adamw_value(t) if takes_adamw else next(new_values))

    @staticmethod
    def _spans_the_split(t) -> bool:
        """Whether the last two axes of a tensor split among processes (along axis 0) include axis 0: a vector's
        or a matrix's sums over them are partial, and Newton–Schulz needs the matrix gathered."""
        return t.split and 0 in reference.normalisation_axes(len(t.shape))

    def _learned_values(self, tensors: list) -> list:
        """The learned branch's new values (§3.3–§3.8), phase by phase over all its tensors: statistics (the
        features' sums over the last two axes, Σ p²), the MLP and Newton–Schulz (a matrix split among processes
        gathered whole: its rows placed in zeros and summed), the step's sums, the update. The apply phases
        recompute the features rather than keeping them (one tensor's features alive at a time)."""
        packet = SumPacket(self.reducer)
        statistics = []
        for t in tensors:
            sums = packet.add(reference.last_axes_square_sums(self._features(t)), split=self._spans_the_split(t))
            param_sums = (packet.add(accumulators.float64_sum(accumulators.finite_part(t.value) ** 2), split=t.split)
                          if t.group["param_scale_mult"] else None)
            statistics.append((sums, param_sums))
        packet.reduce()
        steps, gather, gathered = [], SumPacket(self.reducer), {}
        for index, (t, (sums, param_sums)) in enumerate(zip(tensors, statistics)):
            group = t.group
            count = reference.last_axes_count(t.shape)
            normalised = reference.normalise_over_last_axes(self._features(t), packet[sums], count)
            scale = reference.param_scale(t.value, packet[param_sums], t.count) if param_sums is not None else None
            step = reference.proposed_step(normalised, self.weights_on(t.value.device)["mlp"],
                                           exp_mult=group["exp_mult"], scale=scale)
            if group["orthogonalize"] and step.dim() >= 2:
                if self._spans_the_split(t):
                    layout = distributed.shard_layout(t.param)
                    whole = step.new_zeros(t.shape)
                    whole[layout.offset:layout.offset + layout.rows] = accumulators.finite_part(step)
                    gathered[index] = gather.add(whole)
                else:
                    step = reference.orthogonalise(step, group["ns_coefficients"], group["ns_steps"],
                                                   group["ns_eps"])
            steps.append(step)
        gather.reduce()
        for index, handle in gathered.items():
            t, group = tensors[index], tensors[index].group
            layout = distributed.shard_layout(t.param)
            whole = reference.newton_schulz(gather[handle].to(torch.float32), group["ns_coefficients"],
                                            group["ns_steps"], group["ns_eps"])
            rows = whole[layout.offset:layout.offset + layout.rows]
            steps[index] = torch.where(torch.isfinite(steps[index]), rows, steps[index])
        output = SumPacket(self.reducer)
        output_sums = [output.add(reference.last_axes_square_sums(step.unsqueeze(-1)), split=self._spans_the_split(t))
                       for t, step in zip(tensors, steps)]
        output.reduce()
        values = []
        for t, step, sums in zip(tensors, steps, output_sums):
            group = t.group
            update = reference.finish_step(step, group["rms_mult"], output[sums], reference.last_axes_count(t.shape))
            values.append(reference.apply_step(t.value, update, group["lr"], group["weight_decay"]))
        return values

    def _adamw_value(self, t) -> torch.Tensor:
        raise NotImplementedError


class CELO2(_CELO2Family):
    r"""CELO2: a learned per-element MLP proposes each matrix's update, which Newton–Schulz orthogonalises;
    embeddings and rank <= 1 parameters take AdamW (Moudgil et al. 2026, arXiv 2602.19142).

    For each parameter of rank >= 2, every step (docs/celo2.md):

    .. math::
        m_k, v, R_k, C_k &\leftarrow \text{EMAs of } g,\ g^2,\ \text{Adafactor's row/col means of } g^2 + 10^{-30} \\
        x &= \text{normalise}_{\text{last two axes}}(f_{0..29}(g, p, m, v, R, C)), \qquad (d, s) = \text{MLP}(x) \\
        u &= \text{rms\_mult}\cdot\text{normalise}_{\text{last two axes}}\big(\text{NS}_5(d\cdot e^{\text{exp\_mult}\cdot s})\big),
        \qquad p \leftarrow p - \text{lr}\cdot(u + \text{weight\_decay}\cdot p)

    The semantics are PyLO's ``CELO2_naive`` (the port of the JAX ``celo2_optax``) with lopt's decisions,
    all listed in docs/celo2.md §7: a stable tie rule for the factored axes, a 0-d parameter as JAX's
    1-element vector, float32 state and math for every parameter dtype, float64 sums, and non-finite
    parameter elements kept in their element.

    Args:
        params: parameters, parameter groups, or ``lopt.param_groups_for(model)``, which routes embeddings
            to the AdamW branch as CELO2's JAX code does (a group with ``is_embedding=True``).
        lr: the learning rate (Adam-like: the learned step has unit RMS over each matrix). A number or a
            0-d tensor; a scheduler changes it.
        weight_decay: decoupled, on the pre-update parameter: ``p -= lr * (u + weight_decay * p)``.
        weights: meta-weights — a registered name (default ``"celo2"``: hub repo ``DiamondXL/celo2``), a hub
            repo id, a local directory in PyLO's ``save_pretrained`` layout, a ``.safetensors`` file, or a
            :class:`lopt.MetaWeights`.
        backend: ``"auto"`` (fused for CUDA parameters where it can run, else naive), ``"fused"`` or ``"naive"``.
        orthogonalize: Newton–Schulz on the learned step of rank >= 2 parameters (False: "celo2-base").
        adam_lr_mult, adam_weight_decay, adam_betas, adam_eps: the AdamW branch (its lr is
            ``adam_lr_mult * lr``; ``adam_weight_decay=None`` is ``weight_decay``). It keeps its own moments.
        use_adamw_for_1d: False sends every parameter, embeddings too, through the learned branch.
        max_grad_norm: clip all gradients of the optimizer together to this global 2-norm first
            (optax.clip_by_global_norm); None: no global clipping.
        grad_clip_value: then clamp every gradient element to ±this (1000, as both sources).
        exp_mult, rms_mult, param_scale_mult: the step's scalings (JAX's defaults 0.0, 1.0, False).
        momentum_decays, rms_decays, adafactor_decays: the accumulators' decays (3, 1, 3 values in [0, 1]).
        ns_coefficients, ns_steps, ns_eps: the Newton–Schulz iteration (Muon's quintic, 5 steps, 1e-8).
        precision: the fused backend's Newton–Schulz, in the spirit of torch's TF32 switches: ``"exact"``
            (default) float32 products without TF32 (updates within 1e-5 of the naive backend);
            ``"fast"`` bfloat16 products, as torch.optim.Muon computes them: a faster step whose updates
            differ from naive's by about 1e-2 per step (docs/celo2.md §8). The naive backend always
            computes in float32.
        nonfinite: ``"skip"`` (default) or ``"raise"``: what a step with a NaN, ±inf or overflowing
            (|g| >= 2^64) gradient does (nothing changes either way).
        process_group: as for the other lopt optimizers: one process, DDP, ZeroRedundancyOptimizer (the global
            norm spans the processes) and FSDP2 (sums over the shards; a matrix gathered for Newton-Schulz).

    State per parameter (float32): the learned branch keeps PyLO's accumulators ``mom`` ``S+(3,)``,
    ``rms`` ``S+(1,)``, ``fac_vec_row``/``fac_vec_col`` (rank >= 2) or ``fac_vec_v``; the AdamW branch
    ``exp_avg``, ``exp_avg_sq`` (``S``) and ``adam_step`` (an int64 CPU tensor). Each group counts its steps in
    ``group["step"]``.
    """

    GROUP_KEYS = _SHARED_GROUP_KEYS | frozenset(_OWN_ADAM_KEYS)
    TENSOR_STATE_KEYS = ()  # (which entries a parameter has depends on its branch: _state_shapes)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        weights="celo2",
        backend: str = "auto",
        *,
        orthogonalize: bool = True,
        adam_lr_mult: float = 1.0,
        adam_weight_decay: float | None = None,
        adam_betas=(0.9, 0.95),
        adam_eps: float = 1e-8,
        use_adamw_for_1d: bool = True,
        max_grad_norm: float | None = None,
        grad_clip_value: float = reference.GRAD_CLIP_VALUE,
        exp_mult: float = 0.0,
        rms_mult: float = 1.0,
        param_scale_mult: bool = False,
        momentum_decays=reference.MOMENTUM_DECAYS,
        rms_decays=reference.RMS_DECAYS,
        adafactor_decays=reference.ADAFACTOR_DECAYS,
        ns_coefficients=reference.NS_COEFFICIENTS,
        ns_steps: int = reference.NS_STEPS,
        ns_eps: float = reference.NS_EPSILON,
        precision: str = "exact",
        nonfinite: str = "skip",
        process_group=None,
    ):
        defaults = self._shared_defaults(
            lr=lr, weight_decay=weight_decay, orthogonalize=orthogonalize, adam_lr_mult=adam_lr_mult,
            adam_weight_decay=adam_weight_decay, use_adamw_for_1d=use_adamw_for_1d, max_grad_norm=max_grad_norm,
            grad_clip_value=grad_clip_value, exp_mult=exp_mult, rms_mult=rms_mult, param_scale_mult=param_scale_mult,
            momentum_decays=momentum_decays, rms_decays=rms_decays, adafactor_decays=adafactor_decays,
            ns_coefficients=ns_coefficients, ns_steps=ns_steps, ns_eps=ns_eps)
        defaults["adam_betas"] = tuple(adam_betas) if isinstance(adam_betas, (list, tuple)) else adam_betas
        defaults["adam_eps"] = adam_eps
        self._set_precision(precision)
        # (LearnedOptimizer's own constructor called from here: its warnings point at the caller's line)
        LearnedOptimizer.__init__(self, params, defaults, weights=weights, backend=backend, nonfinite=nonfinite,
                                  process_group=process_group)

    def ensure_state(self, p, group: dict | None = None) -> dict:
        """The parameter's state, created (zeros, float32, on its device) for its branch on first use: the
        accumulators (learned branch) or ``exp_avg``, ``exp_avg_sq``, ``adam_step`` (AdamW branch). A parameter
        whose group changes branch later gets the other branch's entries then (as in PyLO)."""
        state = self.state[p]
        if group is None:
            if state:
                return state
            group = self._group_of(p)
        if self.uses_adamw(group, p):
            if reference.ADAM_KEYS[0] not in state:
                local = distributed.local_part(p)
                for key in reference.ADAM_KEYS:
                    moments = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
                    state[key] = distributed.sharded_like(moments, p, True) if is_dtensor(p) else moments
                # (an int64 tensor on the CPU, as torch's Adam keeps its step on the CPU: read without a device sync)
                state[reference.ADAM_STEP_KEY] = torch.zeros((), dtype=torch.int64)
        elif "mom" not in state:
            kept = {key: state.pop(key) for key in list(state)}  # (the AdamW entries of a group that changed branch)
            LearnedOptimizer.ensure_state(self, p)
            state.update(kept)
        return state

    def _state_shapes(self, p) -> dict:
        """The entries of ``p``'s state for the branch its group gives it now, with their shapes."""
        if self.uses_adamw(self._group_of(p), p):
            return self._adam_state_shapes(p)
        return super()._state_shapes(p)

    def _saved_state_shapes(self, p, values: dict) -> dict:
        """A saved state holds the entries of the branches the parameter stepped with (one, or both where its
        group changed branch): each branch present must be whole and of the right shapes."""
        shapes = {}
        if any(key in values for key in reference.ACCUMULATOR_KEYS):
            shapes.update(LearnedOptimizer._state_shapes(self, p))
        if any(key in values for key in reference.ADAM_KEYS + (reference.ADAM_STEP_KEY,)):
            shapes.update(self._adam_state_shapes(p))
        return shapes or self._state_shapes(p)

    def _validate_state_dict(self, state_dict) -> None:
        super()._validate_state_dict(state_dict)
        for index, values in state_dict["state"].items():
            if reference.ADAM_KEYS[0] in values:
                if reference.ADAM_STEP_KEY not in values:
                    raise ValueError(f"CELO2.load_state_dict: not a CELO2 state dict: the state of parameter #{index} "
                                     f"lacks {[reference.ADAM_STEP_KEY]}")
                try:
                    _check_counter(f"the saved {reference.ADAM_STEP_KEY} of parameter #{index}",
                                   values[reference.ADAM_STEP_KEY])
                except (TypeError, ValueError) as err:
                    raise ValueError(f"CELO2.load_state_dict: {err}; nothing was changed") from None

    def load_state_dict(self, state_dict):
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key in _TUPLE_KEYS:
                group[key] = tuple(float(x) for x in group[key])
        # torch casts every state tensor but "step" to the parameter's dtype and device: the AdamW step count
        # is restored as the int64 CPU tensor it is (an int, as PyLO saves it, is taken too)
        params = list(self._all_params())
        positions = _saved_positions(state_dict)
        for index, values in saved_state.items():
            if reference.ADAM_STEP_KEY in values:
                count = int(values[reference.ADAM_STEP_KEY])
                self.state[params[positions[index]]][reference.ADAM_STEP_KEY] = torch.tensor(count, dtype=torch.int64)

    def _check_gradients(self):
        # (the general check only: the fused engine's fast check passes only the parameters, shapes and
        # storage its plan was made for, so a parameter resized since comes here)
        inputs = super()._check_gradients()
        for params in inputs.params:
            for p in params:
                moments = self.state.get(p, {}).get(reference.ADAM_KEYS[0])
                if moments is not None and moments.shape != p.shape:
                    index = next(i for i, q in enumerate(self._all_params()) if q is p)
                    raise RuntimeError(
                        f"CELO2: parameter #{index} has shape {tuple(p.shape)}, but its optimizer state was made for "
                        f"shape {tuple(moments.shape)} (it was resized, e.g. through .data, after it took a step); "
                        f"build a new optimizer for the resized parameters. Nothing was changed")
        return inputs

    def _adamw_value(self, t) -> torch.Tensor:
        """§5.1: AdamW with the parameter's own moments, bias-corrected by its own count of AdamW steps."""
        group = t.group
        state = self.state[t.param]
        count = state[reference.ADAM_STEP_KEY]
        count += 1  # (in place, on the CPU)
        exp_avg, exp_avg_sq = (distributed.local_part(state[key]).view(t.value.shape) for key in reference.ADAM_KEYS)
        return reference.adamw_own_step(
            t.value, t.step_grad.squeeze(-1), exp_avg, exp_avg_sq, counter_value(count),
            lr=group["adam_lr_mult"] * group["lr"], weight_decay=group["adam_weight_decay"],
            betas=group["adam_betas"], eps=group["adam_eps"])


class ELO_CELO2(_CELO2Family):
    r"""ELO-CELO2: CELO2's update with meta-weights trained under ELO's expert guidance, ELO's defaults
    (``weight_decay=0.1``, global gradient clipping at 1.0) and the shared-accumulator AdamW branch.

    Everything is :class:`lopt.CELO2`'s (docs/celo2.md) except (§5.2): every parameter keeps the CELO2
    accumulators (the AdamW branch's too, which updates all of them), and the AdamW branch steps with
    ``m = mom[..., 0]``, ``v = rms[..., -1]``, the first momentum decay and the RMS decay as its betas,
    eps 1e-8 and the group's step count; it takes no ``adam_betas`` or ``adam_eps``. The arguments are
    CELO2's otherwise; the default weights are ``"elo-celo2"`` (hub repo ``DiamondXL/elo-celo2``).

    State per parameter (float32, PyLO's names and layout): ``mom`` ``S+(3,)``, ``rms`` ``S+(1,)``,
    ``fac_vec_row``/``fac_vec_col`` (rank >= 2) or ``fac_vec_v``. Each group counts its steps in
    ``group["step"]``.
    """

    GROUP_KEYS = _SHARED_GROUP_KEYS
    _OWN_ADAM_MOMENTS = False

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        weights="elo-celo2",
        backend: str = "auto",
        *,
        max_grad_norm: float | None = 1.0,
        orthogonalize: bool = True,
        adam_lr_mult: float = 1.0,
        adam_weight_decay: float | None = None,
        use_adamw_for_1d: bool = True,
        grad_clip_value: float = reference.GRAD_CLIP_VALUE,
        exp_mult: float = 0.0,
        rms_mult: float = 1.0,
        param_scale_mult: bool = False,
        momentum_decays=reference.MOMENTUM_DECAYS,
        rms_decays=reference.RMS_DECAYS,
        adafactor_decays=reference.ADAFACTOR_DECAYS,
        ns_coefficients=reference.NS_COEFFICIENTS,
        ns_steps: int = reference.NS_STEPS,
        ns_eps: float = reference.NS_EPSILON,
        precision: str = "exact",
        nonfinite: str = "skip",
        process_group=None,
    ):
        defaults = self._shared_defaults(
            lr=lr, weight_decay=weight_decay, orthogonalize=orthogonalize, adam_lr_mult=adam_lr_mult,
            adam_weight_decay=adam_weight_decay, use_adamw_for_1d=use_adamw_for_1d, max_grad_norm=max_grad_norm,
            grad_clip_value=grad_clip_value, exp_mult=exp_mult, rms_mult=rms_mult, param_scale_mult=param_scale_mult,
            momentum_decays=momentum_decays, rms_decays=rms_decays, adafactor_decays=adafactor_decays,
            ns_coefficients=ns_coefficients, ns_steps=ns_steps, ns_eps=ns_eps)
        self._set_precision(precision)
        # (LearnedOptimizer's own constructor called from here: its warnings point at the caller's line)
        LearnedOptimizer.__init__(self, params, defaults, weights=weights, backend=backend, nonfinite=nonfinite,
                                  process_group=process_group)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["ns_coefficients"] = tuple(float(x) for x in group["ns_coefficients"])

    def _adamw_value(self, t) -> torch.Tensor:
        """§5.2: AdamW on the shared accumulators (updated this step), bias-corrected by the group's step."""
        group = t.group
        return reference.adamw_shared_step(t.value, t.state, group["step"], self.decays(group),
                                           lr=group["adam_lr_mult"] * group["lr"],
                                           weight_decay=group["adam_weight_decay"])


EMBEDDING_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def param_groups_for(model: torch.nn.Module, *, name_patterns=("embed",), embedding_modules=EMBEDDING_MODULES,
                     named: bool = False, **options) -> list:
    """Parameter groups for :class:`CELO2` / :class:`ELO_CELO2` that route ``model``'s parameters as CELO2's
    JAX code does (``'adam' if ndim <= 1 or 'embed' in path``).

    Every parameter whose name contains one of ``name_patterns`` (``"embed"``, case-sensitive, as in JAX),
    and every parameter of an ``embedding_modules`` module (``torch.nn.Embedding``/``EmbeddingBag``: a
    PyTorch GPT-2's ``wte``/``wpe``, whose names do not say "embed"), goes to a group with
    ``is_embedding=True``, which the AdamW branch steps; the others to a first group, whose parameters of
    rank <= 1 take the AdamW branch too (``use_adamw_for_1d``). A parameter shared by several modules
    (tied weights) appears once. Add e.g. ``"lm_head"`` to ``name_patterns`` to route an untied output
    embedding as the JAX models' ``token_embed_out``. ``named=True`` gives ``(name, parameter)`` pairs
    (state dicts then carry ``param_names``); ``options`` (``lr=...``, ...) are set in both groups. Empty
    groups are left out.
    """
    embedding_ids = {id(p) for module in model.modules() if isinstance(module, tuple(embedding_modules))
                     for p in module.parameters(recurse=False)}
    learned, adamw = [], []
    for name, p in model.named_parameters():
        routed = id(p) in embedding_ids or any(pattern in name for pattern in name_patterns)
        (adamw if routed else learned).append((name, p) if named else p)
    groups = []
    if learned:
        groups.append({"params": learned, **options})
    if adamw:
        groups.append({"params": adamw, **options, "is_embedding": True})
    return groups
