"""What every lopt optimizer shares: groups and their validation, the check phase's validation of
every gradient, backend choice, state dicts and copies.

A step runs in phases that both backends share (``docs/design.md``):

1. **check** — here: every gradient is validated before anything changes; the naive backend then
   unscales AMP gradients and applies the non-finite policy on the host (``naive.py``), the fused
   backend does both on the device inside its statistics pass;
2. **accumulate**, 3. **statistics**, 4. **reduce**, 5. **control**, 6. **apply** — ``naive.py`` and
   the optimizer's reference module (naive), or its fused engine.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Iterable

import torch
from torch.optim import Optimizer

from lopt import distributed
from lopt import weights as weights_lib
from lopt.distributed import is_dtensor, local_part
from lopt.optimizers.naive import NaivePhases, NonFiniteGradientError, StepInputs  # noqa: F401  (public here too)
from lopt.reference.accumulators import init_state

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "naive", "fused")
NONFINITE_POLICIES = ("skip", "raise")


def _is_real_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_scalar(name: str, value, *, minimum: float = 0.0, strict: bool = False, allow_tensor: bool = True) -> None:
    """A finite number (or 0-d floating tensor) >= minimum (> when strict); raises ValueError naming it."""
    bound = f"> {minimum}" if strict else f">= {minimum}"
    if torch.is_tensor(value):
        if not allow_tensor:
            raise TypeError(f"{name} must be a number, got a tensor")
        if value.numel() != 1 or value.dim() != 0 or not value.is_floating_point():
            raise ValueError(f"{name} as a tensor must be a 0-d floating-point tensor, got shape "
                             f"{tuple(value.shape)} and dtype {value.dtype}")
        number = float(value.detach().cpu())  # construction and add_param_group only, never in step()
    elif _is_real_number(value):
        number = float(value)
    else:
        raise TypeError(f"{name} must be a finite number {bound}, got {value!r} of type {type(value).__name__}")
    if not math.isfinite(number) or number < minimum or (strict and number == minimum):
        raise ValueError(f"{name} must be a finite number {bound}, got {number!r}")


class LearnedOptimizer(NaivePhases, Optimizer):
    """Base class: a ``torch.optim.Optimizer`` driven by frozen meta-weights.

    Subclasses set ``architecture`` (a registry architecture name) and ``reference`` (their
    reference module), implement ``_naive_step`` and, where a fused backend exists,
    ``_make_fused_engine``.
    """

    architecture: str = ""
    reference = None  # the optimizer's reference module: provides Decays and factored_dims
    requires_loss = False
    # GradScaler hands grad_scale and found_inf to step() (as fused AdamW): gradients are unscaled
    # inside the step and an overflowing step changes nothing, without a separate unscale pass.
    _step_supports_amp_scaling = True
    # Attributes that __getstate__ carries besides torch's (defaults, state, param_groups).
    _PICKLED_ATTRIBUTES = ("meta_weights", "backend", "backend_reason", "nonfinite", "process_group")

    @staticmethod
    def accumulator_defaults(*, lr, weight_decay, exp_mult, step_mult, momentum_decays, rms_decays,
                             adafactor_decays) -> dict:
        """The group defaults shared by every optimizer built on lopt's accumulators."""
        return dict(lr=lr, weight_decay=weight_decay, exp_mult=exp_mult, step_mult=step_mult,
                    momentum_decays=tuple(momentum_decays), rms_decays=tuple(rms_decays),
                    adafactor_decays=tuple(adafactor_decays))

    def __init__(self, params, defaults: dict, *, weights, backend: str, nonfinite: str = "skip", process_group=None):
        distributed.resolve_process_group(process_group)  # (validates the option's type)
        self.process_group = process_group
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self._validate_group(dict(defaults), where="arguments")
        super().__init__(params, defaults)  # add_param_group validates every group and its parameters
        # Load the meta-weights before anything else can fail half-way: construction either
        # succeeds with validated weights or raises.
        self.meta_weights = weights_lib.load_weights(weights, self.architecture)
        weights_lib.warn_if_untrained(self.meta_weights, type(self).__name__)
        self.nonfinite = nonfinite
        first = self.param_groups[0]
        first.setdefault("skipped_steps", 0)
        for group in self.param_groups:
            group.setdefault("step", 0)
        self._init_caches()
        self.reducer  # validates the parameters' layouts against the process group, before anything else
        self.backend, self.backend_reason = self._choose_backend(backend)
        self._start_fused_engine(strict=backend == "fused")
        self._create_sharded_state()

    @property
    def has_sharded_parameters(self) -> bool:
        """True when the parameters are DTensors sharded on dim 0 (FSDP2; then all of them are)."""
        return any(is_dtensor(p) for p in self._all_params())

    def _create_sharded_state(self) -> None:
        """DTensor (FSDP2) parameters get their (zero) state at once: torch.distributed.checkpoint's
        get/set_optimizer_state_dict would otherwise create it by running a step with zero gradients."""
        for p in self._all_params():
            if is_dtensor(p) and p.requires_grad:
                self.ensure_state(p)

    def _init_caches(self) -> None:
        """Per-process caches (rebuilt after unpickling, never saved)."""
        self._weights_by_device: dict = {}
        self._decays_cache: dict = {}
        self._fused_engine = None
        # Host-side bookkeeping lives in a dict that step() mutates in place: inside a compiled step,
        # dynamo replays writes into containers, not attribute assignments on the optimizer.
        self._host = {"skipped_seen": 0}
        self._reducer = None

    @property
    def reducer(self) -> distributed.Reducer:
        """The reduce phase's :class:`lopt.distributed.Reducer` (the identity on one process).

        Its group is ``process_group`` (by default the default group when torch.distributed is
        initialized), or the device mesh's group of DTensor parameters (which must hold the same
        processes). Built at construction and again after ``add_param_group`` (never inside a step).
        """
        if self._reducer is None:
            self._reducer = distributed.reducer_for(self.process_group, self._all_params(), type(self).__name__)
        return self._reducer

    def _start_fused_engine(self, strict: bool) -> None:
        if self.backend != "fused":
            return
        try:
            self._fused_engine = self._make_fused_engine()
        except Exception as err:  # compilation failure, unsupported option, ...
            if strict:
                raise RuntimeError(f"{type(self).__name__}(backend='fused') cannot run: {err}") from err
            warnings.warn(f"{type(self).__name__}: using the naive backend because the fused backend failed to "
                          f"start: {err}", RuntimeWarning, stacklevel=3)
            self.backend, self.backend_reason = "naive", str(err)

    def _check_fused_processes_hold_the_same_tensors(self) -> None:
        """First fused step in a multi-process run: refuse (before anything changes) if the processes'
        optimizers hold different tensors, as under ZeroRedundancyOptimizer. The fused engines do not
        take part in the reduce phase yet (VeLO's max over all tensors, the shared skip decision), so
        they are exact only where every process holds every tensor (DDP). One small all-reduce, once."""
        if self._host.get("fused_processes_checked") or self.reducer.is_identity:
            return
        shapes = tuple(tuple(p.shape) for p in self._all_params())
        fingerprint = float(hash(shapes) % 2**52)  # (hashes of int tuples are the same in every process)
        device = next(iter(self._param_devices()))
        extremes = self.reducer.max_(torch.tensor([fingerprint, -fingerprint], dtype=torch.float64, device=device))
        if float(extremes[0]) != -float(extremes[1]):
            raise RuntimeError(
                f"{type(self).__name__}(backend='fused'): the processes' optimizers hold different parameters (as "
                f"under ZeroRedundancyOptimizer), and the fused backend does not take part in the reduce phase yet, "
                f"so it would not step like one process; use backend='naive' (exact), or DDP. Nothing was changed")
        self._host["fused_processes_checked"] = True

    # ------------------------------------------------------------------ groups

    def _validate_group(self, group: dict, where: str) -> None:
        """Hyper-parameters of one group (raises ValueError/TypeError naming ``where``); subclasses extend."""
        try:
            _check_scalar("lr", group["lr"])
            _check_scalar("weight_decay", group["weight_decay"])
            for name in ("exp_mult", "step_mult"):
                _check_scalar(name, group[name], minimum=-math.inf, allow_tensor=False)
            for name, n in (("momentum_decays", 3), ("rms_decays", 1), ("adafactor_decays", 3)):
                offsets = group[name]
                if len(offsets) != n or not all(_is_real_number(x) and math.isfinite(x) for x in offsets):
                    raise ValueError(f"{name} needs {n} finite meta-learned offsets, got {offsets!r}")
        except (ValueError, TypeError) as err:
            raise type(err)(f"{type(self).__name__}: invalid {where}: {err}") from None

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, with the group's hyper-parameters validated first (nothing is added on error)."""
        where = f"param group #{len(self.param_groups)}"
        params = param_group["params"]
        param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)  # (a generator once)
        first_index = sum(len(group["params"]) for group in self.param_groups)
        for offset, p in enumerate(param_group["params"]):
            if isinstance(p, torch.Tensor):
                self._check_parameter_dtype(p, f"parameter #{first_index + offset}")
        distributed.check_supported_parameters(
            list(self._all_params()) + [p for p in param_group["params"] if isinstance(p, torch.Tensor)],
            type(self).__name__)
        candidate = dict(param_group)
        for name, default in self.defaults.items():
            candidate.setdefault(name, default)
        self._validate_group(candidate, where=where)
        for name in ("momentum_decays", "rms_decays", "adafactor_decays"):
            if name in param_group:
                param_group[name] = tuple(float(x) for x in param_group[name])
        super().add_param_group(param_group)
        self.param_groups[-1].setdefault("step", 0)
        self._reducer = None
        if hasattr(self, "meta_weights"):  # (not while torch's constructor adds the first groups)
            self.reducer
            self._create_sharded_state()
        if getattr(self, "_fused_engine", None) is not None:
            self._fused_engine.invalidate()

    # ------------------------------------------------------------------ checks

    def _all_params(self) -> Iterable[torch.Tensor]:
        for group in self.param_groups:
            yield from group["params"]

    def _check_parameter_dtype(self, p, what: str) -> None:
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{type(self).__name__}: {what} has dtype {p.dtype}; supported are float32, bfloat16 and float16 "
                f"(optimizer state and math are float32). Convert the model, e.g. model.float()"
            )
        reason = distributed.unsupported_layout_reason(p) if is_dtensor(p) else None
        if reason:
            raise TypeError(f"{type(self).__name__}: {what} (shape {tuple(p.shape)}) is {reason}. "
                            f"{distributed.SUPPORTED_LAYOUTS}")

    def _checked_inputs(self) -> StepInputs:
        """Check phase. The fused engine first tries its fast check (the gradients of exactly the
        tensors its last step planned, validated and read in one pass); anything else, including
        anything wrong, goes through :meth:`_check_gradients`, which says what is wrong."""
        for group in self.param_groups:
            _validate_live_group(self, group)
        if self.backend == "fused":
            grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
            checked = self._fused_engine.checked_gradients(grad_scale, found_inf)
            if checked is not None:
                params, grads, gathered = checked
                return StepInputs(params, grads, grad_scale, found_inf, gathered)
        return self._check_gradients()

    def _check_gradients(self) -> StepInputs:
        """Check phase, part 1 (after the groups' live hyper-parameters, :meth:`_checked_inputs`):
        validate every gradient before touching any state, so a bad input changes nothing; returns the
        participating parameters and GradScaler's tensors."""
        participating, gradients = [], []
        index = 0
        strided, supported, plain = torch.strided, SUPPORTED_DTYPES, distributed.PLAIN_TENSOR_TYPES
        states = self.state
        for group in self.param_groups:
            params, grads = [], []
            for p in group["params"]:
                g = p.grad
                if g is not None:
                    # (the common case in one expression, DTensors left to _check_gradient, which says
                    # what is wrong, if anything)
                    if not (type(g) in plain and type(p) in plain and g.layout == strided and g.dtype in supported
                            and g.shape == p.shape and g.device == p.device):
                        self._check_gradient(index, p, g)
                    if p.numel() > 0:  # zero-element parameters take no part (no state, no statistics)
                        momentum = states.get(p, {}).get("mom")
                        if momentum is not None and momentum.shape[:-1] != p.shape:
                            self._refuse_resized_parameter(index, p, momentum)
                        params.append(p)
                        grads.append(g)
                index += 1
            participating.append(params)
            gradients.append(grads)
        return StepInputs(participating, gradients, getattr(self, "grad_scale", None), getattr(self, "found_inf", None))

    def _refuse_resized_parameter(self, index: int, p, momentum) -> None:
        """A parameter whose shape changed (``p.data = ...``) after its state was made: its accumulators
        no longer match its elements, so no step can be exact (and the fused kernels would index the
        state by the new shape)."""
        raise RuntimeError(
            f"{type(self).__name__}: parameter #{index} has shape {tuple(p.shape)}, but its optimizer state was "
            f"made for shape {tuple(momentum.shape[:-1])} (it was resized, e.g. through .data, after it took a "
            f"step); build a new optimizer for the resized parameters. Nothing was changed")

    def _check_gradient(self, index: int, p, g) -> None:
        name = type(self).__name__
        if g.is_sparse or g.layout != torch.strided:
            raise RuntimeError(
                f"{name} does not support sparse gradients (parameter #{index}, shape {tuple(p.shape)}): "
                f"use dense gradients, e.g. torch.nn.Embedding(..., sparse=False)"
            )
        if g.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: gradient of parameter #{index} has unsupported dtype {g.dtype}; "
                            f"supported are float32, bfloat16 and float16")
        if g.shape != p.shape:
            raise RuntimeError(
                f"{name}: gradient of parameter #{index} has shape {tuple(g.shape)} but the parameter has shape "
                f"{tuple(p.shape)}"
            )
        if g.device != p.device:
            raise RuntimeError(f"{name}: gradient of parameter #{index} is on {g.device} but the parameter is on {p.device}")
        if is_dtensor(p) and not (is_dtensor(g) and g.placements == p.placements
                                              and g.device_mesh == p.device_mesh):
            layout = (f"a DTensor with placements {tuple(g.placements)}" if is_dtensor(g)
                      else "a plain tensor")
            raise RuntimeError(f"{name}: gradient of parameter #{index} is {layout}, but the parameter is a DTensor "
                               f"with placements {tuple(p.placements)}; the gradient must be sharded like the "
                               f"parameter (as FSDP2 leaves it)")

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite (or overflowing) gradient or loss so far.

        The fused backend counts on the device without synchronising; reading this property
        synchronises and warns if steps were skipped since it was last read.
        """
        count = int(self.param_groups[0]["skipped_steps"])
        seen = self._host["skipped_seen"]
        if count > seen:
            warnings.warn(f"{type(self).__name__}: {count - seen} step(s) were skipped since the last "
                          f"check because a gradient or the loss was not finite ({count} in total)", RuntimeWarning,
                          stacklevel=2)
        self._host["skipped_seen"] = count
        return count

    # ------------------------------------------------------------------ backends

    def _param_devices(self) -> set:
        return {p.device for p in self._all_params()}

    def _choose_backend(self, requested: str) -> tuple[str, str]:
        if requested == "naive":
            return "naive", "requested"
        from lopt.fused import launcher

        reason = launcher.fused_unavailable_reason(self.architecture, self._param_devices())
        if reason is None:
            reason = self._fused_unsupported_reason()
        if requested == "fused":
            if reason:
                raise RuntimeError(f"{type(self).__name__}(backend='fused') cannot run: {reason}. Use backend='naive' or 'auto'.")
            return "fused", "requested"
        # auto
        if reason is None:
            return "fused", "CUDA parameters and a working fused backend"
        if any(d.type == "cuda" for d in self._param_devices()):
            warnings.warn(f"{type(self).__name__}: using the naive backend because {reason}", RuntimeWarning, stacklevel=4)
        return "naive", reason

    def _fused_unsupported_reason(self) -> str | None:
        """Why this optimizer's settings or parameters rule out the fused backend (None if they do not)."""
        from lopt.fused.engine import non_dense_parameter

        return non_dense_parameter(self._all_params())

    def _make_fused_engine(self):
        raise NotImplementedError(f"{type(self).__name__} has no fused backend yet; use backend='naive'")

    def decays(self, group, device=None):
        """The group's effective float32 decays (computed on the CPU once, cached per device)."""
        key = (group["momentum_decays"], group["rms_decays"], group["adafactor_decays"], str(device))
        if key not in self._decays_cache:
            decays = self.reference.Decays.from_offsets(*key[:3])
            self._decays_cache[key] = decays.to(device) if device is not None else decays
        return self._decays_cache[key]

    def ensure_state(self, p) -> dict:
        """The parameter's state, created (zero accumulators, float32, on its device) on first use.

        For a DTensor parameter (sharded on dim 0) each state tensor is a DTensor too: ``Shard(0)``
        like the parameter where it keeps the parameter's axis 0, else ``Replicate()`` (the
        Adafactor vector that averages over axis 0, identical on every process): so that
        ``torch.distributed.checkpoint`` saves and loads it shard by shard.
        """
        state = self.state[p]
        if state:
            return state
        dims = self.reference.factored_dims(tuple(p.shape))
        if not is_dtensor(p):
            for name, buf in init_state(p.shape, dims).items():
                state[name] = buf.to(p.device)
            return state
        local = local_part(p)
        # R lacks axis d0 and C lacks axis d1: each keeps the parameter's axis 0 unless it is the one
        # removed. The unused entries (shape (0,)) are whole on every process.
        keeps_axis_0 = {"mom": True, "rms": True, "fac_vec_v": dims is None,
                        "fac_vec_row": dims is not None and dims[1] != 0, "fac_vec_col": dims is not None and dims[0] != 0}
        for name, buf in init_state(local.shape, dims).items():
            state[name] = distributed.sharded_like(buf.to(local.device), p, keeps_axis_0[name])
        return state

    def weights_on(self, device, dtype=torch.float32) -> dict:
        """The meta-weights as ``{component: {name: tensor}}`` on ``device`` in ``dtype`` (cached)."""
        key = (torch.device(device), dtype)
        if key not in self._weights_by_device:
            self._weights_by_device[key] = {
                component: {name: t.to(device=key[0], dtype=dtype) for name, t in tensors.items()}
                for component, tensors in self.meta_weights.tensors.items()}
        return self._weights_by_device[key]

    # ------------------------------------------------------------------ step counters, state dicts, copies

    @staticmethod
    def _host_step(group) -> int:
        step = group.get("step", 0)
        return int(step.item()) if torch.is_tensor(step) else int(step)

    # Keys of the first param group that hold optimizer-wide state (counters, buffers), not hyper-parameters.
    GLOBAL_STATE_KEYS: tuple = ()
    # State entries every parameter's state must carry (state dicts are checked against them).
    TENSOR_STATE_KEYS: tuple = ("mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v")

    def state_dict(self):
        state = super().state_dict()
        for group in state["param_groups"]:
            for key in ("step", "skipped_steps"):
                if torch.is_tensor(group.get(key)):
                    group[key] = int(group[key].item())  # portable: loads into either backend
        return state

    def _validate_state_dict(self, state_dict) -> None:
        """Raise ValueError (changing nothing) unless ``state_dict`` is one of this optimizer's."""
        name = type(self).__name__
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(f"{name}.load_state_dict: not an optimizer state dict (needs 'state' and 'param_groups')")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{name}.load_state_dict: the state dict has {len(groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        foreign = _foreign_optimizer(state_dict, self)
        if foreign:
            raise ValueError(f"{name}.load_state_dict: this is a state dict of {foreign}, not of {name}; nothing "
                             f"was changed")
        missing = [key for key in self.GLOBAL_STATE_KEYS if key not in groups[0]]
        if missing:
            raise ValueError(f"{name}.load_state_dict: not a {name} state dict: its first param group lacks {missing}")
        for index, (group, saved) in enumerate(zip(self.param_groups, groups)):
            if len(group["params"]) != len(saved.get("params", ())):
                raise ValueError(f"{name}.load_state_dict: saved param group #{index} has "
                                 f"{len(saved.get('params', ()))} parameters, this optimizer's {len(group['params'])}")
        params = [p for group in self.param_groups for p in group["params"]]
        positions = _saved_positions(state_dict)
        for index, values in state_dict["state"].items():
            absent = [key for key in self.TENSOR_STATE_KEYS if key not in values]
            if absent:
                raise ValueError(f"{name}.load_state_dict: not a {name} state dict: the state of parameter #{index} "
                                 f"lacks {absent}")
            if index not in positions:
                raise ValueError(f"{name}.load_state_dict: state for parameter #{index}, but the optimizer has "
                                 f"{len(params)} parameters")
            param = params[positions[index]]
            expected = tuple(param.shape) + (3,)
            if tuple(values["mom"].shape) != expected:
                raise ValueError(f"{name}.load_state_dict: parameter #{index} has shape {tuple(param.shape)} "
                                 f"but its saved momentum has shape {tuple(values['mom'].shape)} (expected {expected})")
            if is_dtensor(param) != is_dtensor(values["mom"]):
                raise ValueError(
                    f"{name}.load_state_dict: parameter #{index} is "
                    f"{'a DTensor' if is_dtensor(param) else 'a plain tensor'} but its saved state is "
                    f"{'a DTensor' if is_dtensor(values['mom']) else 'plain tensors'}; save and load "
                    f"sharded (FSDP2) optimizer state with torch.distributed.checkpoint's get_optimizer_state_dict "
                    f"and set_optimizer_state_dict (full_state_dict=True converts between the two)")
        for index, group in enumerate(groups):
            candidate = dict(self.defaults)
            candidate.update({k: v for k, v in group.items() if k != "params"})
            self._validate_group(candidate, where=f"saved param group #{index}")

    def load_state_dict(self, state_dict):
        self._validate_state_dict(state_dict)
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        # torch casts floating-point state to each parameter's dtype (bfloat16 momentum for a
        # bfloat16 parameter); lopt's state is float32 for every parameter dtype, so restore the
        # saved float32 values (an independent copy on the parameter's device).
        params = [p for group in self.param_groups for p in group["params"]]
        positions = _saved_positions(state_dict)
        for index, values in saved_state.items():
            param = params[positions[index]]
            for key, value in values.items():
                if torch.is_tensor(value) and value.is_floating_point():
                    self.state[param][key] = value.to(device=param.device, dtype=torch.float32, copy=True)
        for group in self.param_groups:
            for name in ("momentum_decays", "rms_decays", "adafactor_decays"):
                group[name] = tuple(float(x) for x in group[name])
        self.param_groups[0].setdefault("skipped_steps", 0)  # (state dicts of lopt 0.1 lack it)
        self._host["skipped_seen"] = int(self.param_groups[0]["skipped_steps"])
        if self._fused_engine is not None:
            self._fused_engine.invalidate()

    def __getstate__(self):
        if self.process_group not in (None, distributed.LOCAL):
            raise TypeError(f"{type(self).__name__} with an explicit process_group cannot be copied or pickled (a "
                            f"ProcessGroup belongs to its processes); save opt.state_dict() instead")
        state = super().__getstate__()
        for name in self._PICKLED_ATTRIBUTES:
            state[name] = getattr(self, name)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._init_caches()
        self.reducer
        self._restore_after_unpickling()
        self._start_fused_engine(strict=False)

    def _restore_after_unpickling(self) -> None:
        """Subclass hook: rebuild per-process attributes after a copy or unpickling."""

    def __repr__(self):
        weights = getattr(getattr(self, "meta_weights", None), "source", None)
        return (f"{type(self).__name__}(backend={getattr(self, 'backend', None)!r}, weights={weights!r}, "
                f"groups={len(getattr(self, 'param_groups', []))})")


def _validate_live_group(optimizer, group) -> None:
    """Cheap per-step re-check of host-side hyper-parameters that code may have changed since (a
    scheduler, a user): a negative or non-finite lr would silently reverse or poison the step."""
    for name in ("lr", "weight_decay"):
        value = group[name]
        if not torch.is_tensor(value) and not (_is_real_number(value) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{type(optimizer).__name__}.step: param group {name} is {value!r}; it must be a finite "
                             f"number >= 0 (or a 0-d tensor). Nothing was changed")


def _saved_positions(state_dict) -> dict:
    """Position among the optimizer's parameters of each key of a saved state (indices, or the
    parameter names torch.distributed.checkpoint uses), by the order of the saved groups' params."""
    keys = (key for group in state_dict["param_groups"] for key in group.get("params", ()))
    return {key: position for position, key in enumerate(keys)}


def _foreign_optimizer(state_dict, optimizer) -> str | None:
    """The kind of optimizer a state dict came from, if it is recognisably not ``optimizer``'s kind."""
    from lopt.optimizers.velo import VeLO

    first = state_dict["param_groups"][0] if state_dict["param_groups"] else {}
    is_velo = isinstance(optimizer, VeLO)
    if "num_steps" in first and "loss_means" in first and not is_velo:
        return "lopt.VeLO"
    if is_velo and "num_steps" not in first and any("mom" in v for v in state_dict["state"].values()):
        return "lopt.SmallFCLOpt"
    for values in state_dict["state"].values():
        keys = set(values)
        if {"exp_avg", "exp_avg_sq"} & keys:
            return "torch.optim.Adam/AdamW"
        if "momentum_buffer" in keys:
            return "torch.optim.SGD"
        if "mom" not in keys:
            return f"another optimizer (parameter state keys {sorted(keys)})"
    return None
