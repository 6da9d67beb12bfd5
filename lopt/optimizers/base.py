"""What every lopt optimizer shares: groups and their validation, the check phase's validation of
every gradient, backend choice, state dicts and copies.

A step runs in phases that both backends share (``docs/design.md``):

1. **check** — here: every gradient is validated before anything changes; the naive backend then
   unscales AMP gradients and applies the non-finite policy on the host (``naive.py``; on the device
   inside a compiled step), the fused backend does both on the device inside its statistics pass;
2. **accumulate**, 3. **statistics**, 4. **reduce**, 5. **control**, 6. **apply** — ``naive.py`` and
   the optimizer's reference module (naive), or its fused engine.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import sys
import warnings
from typing import Iterable

import torch
from torch.optim import Optimizer

from lopt import distributed, registry
from lopt import weights as weights_lib
from lopt.distributed import is_dtensor, local_part
from lopt.errors import AdamHabitWarning, NonFiniteGradientError  # noqa: F401  (public here too)
from lopt.optimizers.naive import NaiveEngine, NaivePhases, StepInputs
from lopt.reference.accumulators import init_state

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "naive", "fused")
NONFINITE_POLICIES = ("skip", "raise")
# Keys some torch versions add to an optimizer's defaults or groups themselves (torch 2.11 adds
# "differentiable" to the defaults but not to every saved group): not lopt's hyper-parameters, so a state
# dict is not told apart by them.
TORCH_GROUP_KEYS = frozenset({"differentiable", "foreach", "maximize", "capturable", "fused", "decoupled_weight_decay"})
DECAY_OFFSET_COUNTS = (("momentum_decays", 3), ("rms_decays", 1), ("adafactor_decays", 3))

# torch.optim's own wording for the same errors, included in lopt's messages so that tools written
# for torch.optim recognise them.
_TORCH_PHRASES = {"lr": "Invalid learning rate", "weight_decay": "Invalid weight_decay value"}
_TORCH_SET_PHRASE = ("optimizer parameters need to be organized in ordered collections, but the ordering of tensors "
                     "in sets will change between runs. Please use a list instead.")

# Below this, an lr is almost certainly an Adam learning rate (torch.optim.Adam's default is 1e-3, and
# Adam's usual range ends near 1e-2), not a deliberate scaling of the learned step (lr=1.0 is the step
# the meta-weights were trained for; lopt's own experiments scale it down to 0.05 at most).
ADAM_HABIT_LR = 0.02

# Device types torch.autocast knows; step() turns autocast off for each that has it on.
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla")




def float32_math():
    """A context in which the optimizer's math runs in float32 whatever the ambient ``torch.autocast``:
    autocast is turned off for every device type that has it on (nothing is entered otherwise)."""
    enabled = [device_type for device_type in _AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(device_type)]
    if not enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for device_type in enabled:
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def _is_real_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _torch_phrase(name: str, value) -> str:
    phrase = _TORCH_PHRASES.get(name)
    return f" ({phrase}: {value!r})" if phrase else ""


def _check_scalar(name: str, value, *, minimum: float = 0.0, strict: bool = False, allow_tensor: bool = True) -> None:
    """A finite number (or 0-d floating tensor) >= minimum (> when strict); raises ValueError naming it."""
    bound = f"> {minimum}" if strict else f">= {minimum}"
    if torch.is_tensor(value):
        if not allow_tensor:
            raise TypeError(f"{name} must be a number, got a tensor")
        if value.numel() != 1 or value.dim() != 0 or not value.is_floating_point():
            raise ValueError(f"{name} as a tensor must be a 0-d floating-point tensor (Tensor {name} must be "
                             f"1-element), got shape {tuple(value.shape)} and dtype {value.dtype}")
        if value.device.type == "meta":
            raise ValueError(f"{name} as a tensor is on the meta device (it has no value); pass a number or a "
                             f"0-d tensor on the CPU or the parameters' device")
        number = float(value.detach().cpu())  # construction and add_param_group only, never in step()
    elif _is_real_number(value):
        number = float(value)
    else:
        raise TypeError(f"{name} must be a finite number {bound}, got {value!r} of type {type(value).__name__}")
    if not math.isfinite(number) or number < minimum or (strict and number == minimum):
        raise ValueError(f"{name} must be a finite number {bound}, got {number!r}{_torch_phrase(name, number)}")


def counter_value(counter):
    """A step counter as the naive step's math reads it: an int (a tensor counter is read on the host), but
    inside a compiled step the counter as it is, there a tensor (``naive.device_counter``) that the math
    reads on the device: no host read, no graph break."""
    if torch.compiler.is_compiling():
        return counter
    return int(counter.item()) if torch.is_tensor(counter) else int(counter)


def _check_counter(what: str, value) -> None:
    """A step counter: an int >= 0, or a 0-d tensor holding one (raises ValueError/TypeError naming ``what``)."""
    if torch.is_tensor(value):
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{what} must be an int >= 0 (or a 0-d tensor holding one), got a tensor of shape "
                            f"{tuple(value.shape)} and dtype {value.dtype}")
        number = float(value.detach().cpu())  # (state dicts only, never in step())
        if not (math.isfinite(number) and number >= 0 and number == int(number)):
            raise ValueError(f"{what} must be an int >= 0, got a tensor holding {number!r}")
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int >= 0, got {value!r} of type {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r}")


def _default_weights(cls) -> str | None:
    """The weight set ``cls``'s constructor loads where weights= is left out (its signature's default), if a name."""
    import inspect

    parameter = inspect.signature(cls.__init__).parameters.get("weights")
    return parameter.default if parameter is not None and isinstance(parameter.default, str) else None


def _own_frames_above(optimizer) -> int:
    """How many frames directly above ``LearnedOptimizer.__init__`` (its caller and up) belong to
    ``optimizer``'s own construction: methods whose ``self`` is it (called from ``__init__`` only)."""
    frame, count = sys._getframe(2), 0
    while frame is not None and frame.f_locals.get("self") is optimizer:
        frame, count = frame.f_back, count + 1
    return count


def _overlapping_memory(p: torch.Tensor) -> bool:
    """Whether several elements of ``p`` share memory (an ``expand``-ed or otherwise overlapping view)."""
    sizes_strides = sorted((stride, size) for size, stride in zip(p.shape, p.stride()) if size > 1)
    if any(stride == 0 for stride, _ in sizes_strides):
        return True
    extent = 1
    for stride, size in sizes_strides:
        if stride < extent:
            break  # (rare: a layout whose axes interleave; decided exactly below)
        extent = stride * size
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(p.shape, p.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return torch.unique(offsets).numel() < offsets.numel()


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
    def accumulator_defaults(*, lr, weight_decay, exp_mult, momentum_decays, rms_decays, adafactor_decays,
                             step_mult=None) -> dict:
        """The group defaults shared by every optimizer built on lopt's accumulators (``step_mult`` only
        where the optimizer has one: ELO's ``lr`` is its step multiplier)."""
        defaults = dict(lr=lr, weight_decay=weight_decay, exp_mult=exp_mult, step_mult=step_mult,
                        momentum_decays=tuple(momentum_decays), rms_decays=tuple(rms_decays),
                        adafactor_decays=tuple(adafactor_decays))
        if step_mult is None:
            del defaults["step_mult"]
        return defaults

    def __init__(self, params, defaults: dict, *, weights, backend: str, nonfinite: str = "skip", process_group=None):
        # Construction's warnings point at the line that built the optimizer, above every frame of this
        # object's own constructors (a subclass's __init__, SmallFCLOpt._start, ...).
        self._warning_stacklevel = 3 + _own_frames_above(self)
        distributed.resolve_process_group(process_group)  # (validates the option's type)
        self.process_group = process_group
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if isinstance(params, (set, frozenset)):
            raise TypeError(f"{type(self).__name__}: {_TORCH_SET_PHRASE}")
        self._validate_group(dict(defaults), where="arguments")
        super().__init__(params, defaults)  # add_param_group validates every group and its parameters
        # Load the meta-weights before anything else can fail half-way: construction either
        # succeeds with validated weights or raises.
        self.meta_weights = weights_lib.load_weights(weights, self.architecture)
        weights_lib.warn_if_untrained(self.meta_weights, type(self).__name__, default=_default_weights(type(self)),
                                      stacklevel=self._warning_stacklevel)
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
        self._warn_about_adam_habits()

    def _warn_about_adam_habits(self) -> None:
        """One :class:`AdamHabitWarning` at construction where a group's lr is below ``ADAM_HABIT_LR``
        (and not 0, which freezes a group on purpose): almost certainly an Adam learning rate."""
        if not self._WARNS_ABOUT_ADAM_HABITS:
            return
        habits = []
        for index, group in enumerate(self.param_groups):
            lr = self._lr_as_given(group)
            if 0 < lr < ADAM_HABIT_LR:
                habits.append(f"param group #{index} has lr={lr:g}" if len(self.param_groups) > 1 else f"lr={lr:g}")
        if habits:
            warnings.warn(
                f"{type(self).__name__}: {', '.join(habits)}, which looks like an Adam learning rate. A learned "
                f"optimizer's lr multiplies the step its meta-weights propose; lr=1.0 is the step they were trained "
                f"for, so lr={ADAM_HABIT_LR:g} or less shrinks every step 50-fold or more{self._ADAM_HABIT_NOTE}. "
                f"Keep the default lr=1.0 (a scheduler may scale it), or silence this with "
                f"warnings.filterwarnings('ignore', category=lopt.AdamHabitWarning)", AdamHabitWarning,
                stacklevel=self._warning_stacklevel)

    _ADAM_HABIT_NOTE = ""
    # False where lr is the step itself rather than a multiplier of the meta-trained step (ELO: 1e-3).
    _WARNS_ABOUT_ADAM_HABITS = True

    def _lr_as_given(self, group) -> float:
        """The group's lr as the user gave it, a number (construction only: a tensor is read on the host).
        MuLO's internal groups hold it divided by their width multiplier."""
        lr = group["lr"]
        return float(lr.detach().cpu()) if torch.is_tensor(lr) else float(lr)

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
        self._naive_engine = NaiveEngine(self)
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
        if not distributed.processes_hold_the_same_tensors(self.reducer, self._all_params(),
                                                           next(iter(self._param_devices()))):
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
                if name in group:  # (ELO has no step_mult)
                    _check_scalar(name, group[name], minimum=-math.inf, allow_tensor=False)
            for name, n in DECAY_OFFSET_COUNTS:
                offsets = group[name]
                if (isinstance(offsets, (str, bytes)) or not hasattr(offsets, "__len__") or len(offsets) != n
                        or not all(_is_real_number(x) and math.isfinite(x) for x in offsets)):
                    raise ValueError(f"{name} needs {n} finite meta-learned offsets, got {offsets!r}")
        except (ValueError, TypeError) as err:
            raise type(err)(f"{type(self).__name__}: invalid {where}: {err}") from None

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, with the group's hyper-parameters validated first (nothing is added on error)."""
        where = f"param group #{len(self.param_groups)}"
        if not isinstance(param_group, dict):
            raise TypeError(f"{type(self).__name__}: param_group must be a dict, but got {type(param_group)}")
        params = param_group["params"]
        if isinstance(params, (set, frozenset)):
            raise TypeError(f"{type(self).__name__}: {_TORCH_SET_PHRASE}")
        param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)  # (a generator once)
        first_index = sum(len(group["params"]) for group in self.param_groups)
        # (named parameters, as model.named_parameters() gives them, are (name, tensor) pairs: torch's
        # add_param_group splits them into "params" and "param_names")
        named = [(p[1], repr(p[0])) if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) else (p, None)
                 for p in param_group["params"]]
        tensors = [p for p, _ in named]
        for offset, (p, name) in enumerate(named):
            if isinstance(p, torch.Tensor):
                self._check_parameter(p, f"parameter #{first_index + offset}" + (f" ({name})" if name else ""))
        distributed.check_supported_parameters(
            list(self._all_params()) + [p for p in tensors if isinstance(p, torch.Tensor)], type(self).__name__)
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

    def _check_parameter(self, p, what: str) -> None:
        """A parameter's dtype, device and memory layout, at construction and in add_param_group."""
        self._check_parameter_dtype(p, what)
        name = type(self).__name__
        if p.device.type == "meta":
            raise ValueError(
                f"{name}: {what} (shape {tuple(p.shape)}) is on the meta device: it has no data to optimize. "
                f"Materialize the model first (e.g. model.to_empty(device=...) and initialize its weights), then "
                f"build the optimizer from its parameters")
        local = local_part(p) if is_dtensor(p) else p
        if _overlapping_memory(local):
            raise ValueError(
                f"{name}: {what} (shape {tuple(p.shape)}, strides {tuple(local.stride())}) is an expanded or "
                f"overlapping view: more than one element of it refers to a single memory location, so no update "
                f"can write each element once. Optimize a tensor that owns its elements, e.g. "
                f"torch.nn.Parameter(t.clone()) or t.contiguous()")

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
        for index, group in enumerate(self.param_groups):
            _validate_live_group(self, group, index)
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        checked = self.engine.checked_gradients(grad_scale, found_inf)
        if checked is not None:
            params, grads, gathered = checked
            return StepInputs(params, grads, grad_scale, found_inf, gathered)
        return self._check_gradients()

    @property
    def engine(self):
        """What runs this optimizer's steps: its fused engine (``lopt.fused``), or the naive one
        (``NaiveEngine``, the optimizer's ``_naive_step``), behind one interface — ``step(inputs, *args)``,
        ``checked_gradients(...)``, ``invalidate()`` — so that ``step()`` never asks which it is."""
        return self._fused_engine if self.backend == "fused" else self._naive_engine

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

        The fused backend and a compiled naive step count on the device without synchronising;
        reading this property synchronises and warns if steps were skipped since it was last read.
        """
        count = int(self.param_groups[0]["skipped_steps"])
        seen = self._host["skipped_seen"]
        if count > seen:
            warnings.warn(f"{type(self).__name__}: {count - seen} step(s) were skipped since the last "
                          f"check because a gradient or the loss was not finite, or a tensor hyper-parameter (lr, weight "
                          f"decay) was not a finite number >= 0 ({count} in total)", RuntimeWarning,
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
            warnings.warn(f"{type(self).__name__}: using the naive backend because {reason}", RuntimeWarning,
                          stacklevel=getattr(self, "_warning_stacklevel", 4))
        return "naive", reason

    def _fused_unsupported_reason(self) -> str | None:
        """Why this optimizer's settings or parameters rule out the fused backend (None if they do not)."""
        from lopt.fused.engine import non_dense_parameter

        return non_dense_parameter(self._all_params())

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimisation step. ``closure`` (optional) re-evaluates the model and returns the loss.

        The phases (check, then the engine's accumulate, statistics, reduce, control and apply) are the same
        for every optimizer that does not need the loss; one that does (VeLO) overrides this."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # (under the caller's autocast, if any: it runs the model)
        with float32_math():  # the optimizer's own math is float32 whatever the ambient autocast
            inputs = self._checked_inputs()
            self.engine.step(inputs)
        return loss

    def _make_fused_engine(self):
        """The registry's fused engine for this optimizer (``lopt.registry``)."""
        engine = registry.entry_for(self).fused_engine_class
        if engine is None:
            raise NotImplementedError(f"{type(self).__name__} has no fused backend yet; use backend='naive'")
        return engine(self)

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
    def _steps_taken(group):
        """The group's step counter as the naive step's math reads it (:func:`counter_value`)."""
        return counter_value(group.get("step", 0))

    def _advance_step_counters(self) -> None:
        """Every group's step counter + 1: a step counts itself before its accumulate phase (PyLO's order)."""
        for group in self.param_groups:
            group["step"] = self._steps_taken(group) + 1

    # Keys of the first param group that hold optimizer-wide state (counters, buffers), not hyper-parameters.
    GLOBAL_STATE_KEYS: tuple = ()
    # State entries every parameter's state must carry (state dicts are checked against them).
    TENSOR_STATE_KEYS: tuple = ("mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v")
    # The hyper-parameter keys of the optimizer's param groups (its defaults, torch's own keys left out),
    # declared by optimizers that share their state layout and their GLOBAL_STATE_KEYS (SmallFCLOpt, ELO,
    # MuLO): load_state_dict tells their state dicts apart by them. None: not declared.
    GROUP_KEYS: frozenset | None = None

    def _state_shapes(self, p) -> dict:
        """The shape of every entry of ``TENSOR_STATE_KEYS`` for parameter ``p`` (its global shape for a
        DTensor), as :meth:`ensure_state` creates them (``accumulators.init_state``), without allocating."""
        shape = tuple(p.shape)
        dims = self.reference.factored_dims(shape)
        shapes = {"mom": shape + (3,), "rms": shape + (1,), "fac_vec_row": (0,), "fac_vec_col": (0,), "fac_vec_v": (0,)}
        if dims is None:
            shapes["fac_vec_v"] = shape + (3,)
        else:
            d1, d0 = dims
            shapes["fac_vec_row"] = tuple(s for i, s in enumerate(shape) if i != d0) + (3,)
            shapes["fac_vec_col"] = tuple(s for i, s in enumerate(shape) if i != d1) + (3,)
        return shapes

    def _saved_state_shapes(self, p, values: dict) -> dict:
        """The entries (and their shapes) the saved state ``values`` of parameter ``p`` must hold: those of
        :meth:`_state_shapes`, unless the optimizer's state depends on more than the parameter (CELO2's branch)."""
        return self._state_shapes(p)

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
        if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) and "params" in g for g in groups):
            raise ValueError(f"{name}.load_state_dict: not an optimizer state dict (its param_groups must be dicts "
                             f"with 'params'); nothing was changed")
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{name}.load_state_dict: the state dict has {len(groups)} param groups, this optimizer "
                             f"{len(self.param_groups)} (loaded state dict has a different number of parameter "
                             f"groups); nothing was changed")
        foreign = _foreign_optimizer(state_dict, self)
        if foreign:
            raise ValueError(f"{name}.load_state_dict: this is a state dict of {foreign}, not of {name}; nothing "
                             f"was changed")
        own_keys = set(self.defaults) | set(self.GLOBAL_STATE_KEYS) | {"params", "param_names", "step", "skipped_steps"}
        for index, saved in enumerate(groups):
            # (a never-stepped torch optimizer's state dict has no per-parameter state to tell it apart:
            # its param groups do)
            lacking = [key for key in self.defaults if key not in saved and key not in TORCH_GROUP_KEYS]
            if lacking:
                others = sorted(key for key in saved if key not in own_keys)
                raise ValueError(f"{name}.load_state_dict: this is a state dict of {_optimizer_of_group(others)}, "
                                 f"not of {name}: its param group #{index} lacks {lacking}"
                                 + (f" and has {others}" if others else "") + "; nothing was changed")
        missing = [key for key in self.GLOBAL_STATE_KEYS if key not in groups[0]]
        if missing:
            raise ValueError(f"{name}.load_state_dict: not a {name} state dict: its first param group lacks {missing}")
        for index, (group, saved) in enumerate(zip(self.param_groups, groups)):
            if len(group["params"]) != len(saved.get("params", ())):
                raise ValueError(f"{name}.load_state_dict: saved param group #{index} has "
                                 f"{len(saved.get('params', ()))} parameters, this optimizer's {len(group['params'])} "
                                 f"(loaded state dict contains a parameter group that doesn't match the size of "
                                 f"optimizer's group); nothing was changed")
            counters = ("step", "skipped_steps") if index == 0 else ("step",)
            for key in counters:
                if key in saved:
                    try:
                        _check_counter(f"saved param group #{index}'s {key}", saved[key])
                    except (TypeError, ValueError) as err:
                        raise ValueError(f"{name}.load_state_dict: {err}; nothing was changed") from None
        params = [p for group in self.param_groups for p in group["params"]]
        positions = _saved_positions(state_dict)
        if not isinstance(state_dict["state"], dict):
            raise ValueError(f"{name}.load_state_dict: not an optimizer state dict (its 'state' must be a dict)")
        for index, values in state_dict["state"].items():
            if not isinstance(values, dict):
                raise ValueError(f"{name}.load_state_dict: the state of parameter #{index} is a "
                                 f"{type(values).__name__}, not a dict of tensors; nothing was changed")
            absent = [key for key in self.TENSOR_STATE_KEYS if key not in values]
            if absent:
                raise ValueError(f"{name}.load_state_dict: not a {name} state dict: the state of parameter #{index} "
                                 f"lacks {absent}")
            if index not in positions:
                raise ValueError(f"{name}.load_state_dict: state for parameter #{index}, but the optimizer has "
                                 f"{len(params)} parameters")
            param = params[positions[index]]
            shapes = self._saved_state_shapes(param, values)
            absent = [key for key in shapes if key not in values]
            if absent:
                raise ValueError(f"{name}.load_state_dict: not a {name} state dict: the state of parameter #{index} "
                                 f"lacks {absent}")
            for key, expected in shapes.items():
                value = values[key]
                label = "momentum" if key == "mom" else repr(key)
                if not torch.is_tensor(value) or not value.is_floating_point():
                    kind = f"a tensor of dtype {value.dtype}" if torch.is_tensor(value) else type(value).__name__
                    raise ValueError(f"{name}.load_state_dict: the saved {label} of parameter #{index} is {kind}; "
                                     f"it must be a floating-point tensor (float32 is what lopt saves); nothing was "
                                     f"changed")
                if tuple(value.shape) != expected:
                    raise ValueError(f"{name}.load_state_dict: parameter #{index} has shape {tuple(param.shape)} "
                                     f"but its saved {label} has shape {tuple(value.shape)} (expected {expected}); "
                                     f"nothing was changed")
            first_key = next(iter(shapes), None)
            if first_key is not None and is_dtensor(param) != is_dtensor(values[first_key]):
                raise ValueError(
                    f"{name}.load_state_dict: parameter #{index} is "
                    f"{'a DTensor' if is_dtensor(param) else 'a plain tensor'} but its saved state is "
                    f"{'a DTensor' if is_dtensor(values[first_key]) else 'plain tensors'}; save and load "
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


def _validate_live_group(optimizer, group, index: int = 0) -> None:
    """Cheap per-step re-check of host-side hyper-parameters that code may have changed since (a
    scheduler, a user): a negative or non-finite lr would silently reverse or poison the step, a
    malformed value would fail half-way through it. Host metadata only, never a device read: a tensor
    lr or weight decay has its shape, dtype and device checked here, and its value in the check phase
    (the naive backend's non-finite check, the fused backend's on the device)."""
    where = f"{type(optimizer).__name__}.step: param group"
    done = "Nothing was changed"
    for name in ("lr", "weight_decay"):
        value = group[name]
        if torch.is_tensor(value):
            if value.dim() != 0 or not value.is_floating_point():
                raise ValueError(f"{where} {name} is a tensor of shape {tuple(value.shape)} and dtype {value.dtype} "
                                 f"(param group #{index}); it must be a 0-d floating-point tensor (Tensor {name} "
                                 f"must be 1-element). {done}")
            # (the fused backend reads a tensor on another device on the host; the naive one would fail
            # half-way: only it pays for this loop over the group)
            if (value.device.type != "cpu" and getattr(optimizer, "backend", None) != "fused"
                    and any(p.device != value.device for p in group["params"])):
                raise ValueError(f"{where} {name} is a tensor on {value.device} (param group #{index}), but the "
                                 f"group's parameters are not all there; put it on the CPU or on their device. {done}")
        elif not (_is_real_number(value) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{where} {name} is {value!r}; it must be a finite number >= 0 (or a 0-d tensor)"
                             f"{_torch_phrase(name, value)} (param group #{index}). {done}")
    for name in ("exp_mult", "step_mult"):
        if name not in optimizer.defaults:
            continue  # (ELO has no step_mult)
        value = group[name]
        if not (_is_real_number(value) and math.isfinite(value)):
            raise ValueError(f"{where} {name} is {value!r} (param group #{index}); it must be a finite number. {done}")
    max_grad_norm = group.get("max_grad_norm")
    if max_grad_norm is not None and not (_is_real_number(max_grad_norm) and math.isfinite(max_grad_norm)
                                          and max_grad_norm > 0):
        raise ValueError(f"{where} max_grad_norm is {max_grad_norm!r} (param group #{index}); it must be a finite "
                         f"number > 0 or None. {done}")
    for name, n in DECAY_OFFSET_COUNTS:
        offsets = group[name]
        if type(offsets) is tuple and len(offsets) == n and all(type(x) is float and math.isfinite(x) for x in offsets):
            continue  # (the form add_param_group and load_state_dict store)
        if (isinstance(offsets, (str, bytes)) or not hasattr(offsets, "__len__") or len(offsets) != n
                or not all(_is_real_number(x) and math.isfinite(x) for x in offsets)):
            raise ValueError(f"{where} {name} is {offsets!r} (param group #{index}); it needs {n} finite "
                             f"meta-learned offsets. {done}")
        group[name] = tuple(float(x) for x in offsets)  # (a list, say: stored as the tuple it stands for)
    step = group.get("step", 0)
    if not (type(step) is int and step >= 0):
        if torch.is_tensor(step):
            if step.dim() != 0 or step.is_floating_point() or step.is_complex() or step.dtype == torch.bool:
                raise ValueError(f"{where} step is a tensor of shape {tuple(step.shape)} and dtype {step.dtype} "
                                 f"(param group #{index}); it must be an int >= 0 (or a 0-d integer tensor). {done}")
        elif not (isinstance(step, numbers.Integral) and not isinstance(step, bool) and step >= 0):
            raise ValueError(f"{where} step is {step!r} (param group #{index}); it must be an int >= 0 (the number "
                             f"of steps taken). {done}")


def _optimizer_of_group(keys) -> str:
    """The kind of optimizer whose param groups carry ``keys`` (the ones lopt's groups do not have)."""
    keys = set(keys)
    if "betas" in keys:
        return "torch.optim.Adam/AdamW"
    if keys & {"momentum", "dampening", "nesterov"}:
        return "torch.optim.SGD"
    return "another optimizer"


def _registered_optimizer_of_group(first: dict, optimizer, others) -> str | None:
    """The registered optimizer (among ``others``) whose declared ``GROUP_KEYS`` fit a saved first param
    group best — the most keys, every one present — where ``optimizer``'s own hyper-parameters do not
    fit it at least as well (a scheduler's ``initial_lr`` and other extra keys do not matter)."""
    keys = set(first)
    best = None
    for cls in others:
        declared = cls.GROUP_KEYS
        if declared and declared <= keys and (best is None or len(declared) > len(best.GROUP_KEYS)):
            best = cls
    if best is None:
        return None
    own = set(optimizer.defaults) - TORCH_GROUP_KEYS
    if own <= keys and len(own) >= len(best.GROUP_KEYS):
        return None
    return f"lopt.{best.__name__}"


def _saved_positions(state_dict) -> dict:
    """Position among the optimizer's parameters of each key of a saved state (indices, or the
    parameter names torch.distributed.checkpoint uses), by the order of the saved groups' params."""
    keys = (key for group in state_dict["param_groups"] for key in group.get("params", ()))
    return {key: position for position, key in enumerate(keys)}


def _foreign_optimizer(state_dict, optimizer) -> str | None:
    """The kind of optimizer a state dict came from, if it is recognisably not ``optimizer``'s kind: another
    registered lopt optimizer (by the optimizer-wide keys it keeps in its first param group), or torch's."""
    first = state_dict["param_groups"][0] if state_dict["param_groups"] else {}
    own = set(type(optimizer).GLOBAL_STATE_KEYS)
    try:
        own_class = registry.entry_for(optimizer).front_end_class  # (a subclass of a registered optimizer: its base)
    except ValueError:
        own_class = type(optimizer)
    others = [entry.front_end_class for entry in registry.OPTIMIZERS.values() if entry.front_end_class is not own_class]
    for cls in others:
        markers = set(cls.GLOBAL_STATE_KEYS) - own
        if markers and markers <= set(first):
            return f"lopt.{cls.__name__}"
    by_group_keys = _registered_optimizer_of_group(first, optimizer, others)
    if by_group_keys:
        return by_group_keys
    if type(optimizer).GROUP_KEYS and type(optimizer).GROUP_KEYS <= set(first):
        return None  # its own declared hyper-parameters (CELO2's AdamW-branch state holds exp_avg, as Adam's does)
    if own and not own & set(first) and any("mom" in v for v in state_dict["state"].values()):
        plain = [f"lopt.{cls.__name__}" for cls in others if not cls.GLOBAL_STATE_KEYS]
        return " or ".join(plain) if plain else "another lopt optimizer"
    for values in state_dict["state"].values():
        keys = set(values)
        if {"exp_avg", "exp_avg_sq"} & keys:
            return "torch.optim.Adam/AdamW"
        if "momentum_buffer" in keys:
            return "torch.optim.SGD"
        if "mom" not in keys:
            return f"another optimizer (parameter state keys {sorted(keys)})"
    return None
