"""What every lopt optimizer shares: meta-weights, backend choice, input checks, step counters."""

from __future__ import annotations

import numbers
import warnings
from typing import Iterable

import torch
from torch.optim import Optimizer

from lopt import weights as weights_lib
from lopt.reference.accumulators import init_state

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "naive", "fused")


class LearnedOptimizer(Optimizer):
    """Base class: a ``torch.optim.Optimizer`` driven by frozen meta-weights.

    Subclasses set ``architecture`` (a registry architecture name) and implement
    ``_step_group_naive`` and, where a fused backend exists, ``_make_fused_engine``.
    """

    architecture: str = ""
    reference = None  # the optimizer's reference module: provides Decays and factored_dims

    @staticmethod
    def accumulator_defaults(*, lr, weight_decay, exp_mult, step_mult, momentum_decays, rms_decays,
                             adafactor_decays) -> dict:
        """Validated group defaults shared by every optimizer built on lopt's accumulators."""
        if not (isinstance(lr, numbers.Real) and not isinstance(lr, bool) and lr >= 0):
            raise ValueError(f"lr must be a non-negative number, got {lr!r}")
        if not (isinstance(weight_decay, numbers.Real) and not isinstance(weight_decay, bool) and weight_decay >= 0):
            raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
        for name, offsets, n in (("momentum_decays", momentum_decays, 3), ("rms_decays", rms_decays, 1),
                                 ("adafactor_decays", adafactor_decays, 3)):
            if len(offsets) != n:
                raise ValueError(f"{name} needs {n} meta-learned offsets, got {len(offsets)}")
        return dict(lr=lr, weight_decay=weight_decay, exp_mult=exp_mult, step_mult=step_mult,
                    momentum_decays=tuple(float(x) for x in momentum_decays),
                    rms_decays=tuple(float(x) for x in rms_decays),
                    adafactor_decays=tuple(float(x) for x in adafactor_decays))

    def __init__(self, params, defaults: dict, *, weights, backend: str):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        super().__init__(params, defaults)
        self._check_parameters()
        # Load the meta-weights before anything else can fail half-way: construction either
        # succeeds with validated weights or raises.
        self.meta_weights = weights_lib.load_weights(weights, self.architecture)
        self._weights_by_device: dict = {}
        self.backend_requested = backend
        self.backend, self.backend_reason = self._choose_backend(backend)
        self._fused_engine = None
        if self.backend == "fused":
            try:
                self._fused_engine = self._make_fused_engine()
            except Exception as err:  # compilation failure, unsupported option, ...
                if backend == "fused":
                    raise RuntimeError(f"{type(self).__name__}(backend='fused') cannot run: {err}") from err
                warnings.warn(f"{type(self).__name__}: using the naive backend because the fused backend failed to "
                              f"start: {err}", RuntimeWarning, stacklevel=2)
                self.backend, self.backend_reason = "naive", str(err)

    # ------------------------------------------------------------------ checks

    def _all_params(self) -> Iterable[torch.Tensor]:
        for group in self.param_groups:
            yield from group["params"]

    def _check_parameters(self) -> None:
        for index, p in enumerate(self._all_params()):
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"{type(self).__name__}: parameter #{index} has dtype {p.dtype}; supported are float32, bfloat16 "
                    f"and float16 (optimizer state and math are float32). Convert the model, e.g. model.float()"
                )

    def _check_gradients(self) -> None:
        """Validate every gradient before touching any state, so a bad input changes nothing."""
        for index, p in enumerate(self._all_params()):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse or g.layout != torch.strided:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (parameter #{index}, shape {tuple(p.shape)}): "
                    f"use dense gradients, e.g. torch.nn.Embedding(..., sparse=False)"
                )
            if g.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{type(self).__name__}: gradient of parameter #{index} has unsupported dtype {g.dtype}")
            if g.shape != p.shape:
                raise RuntimeError(
                    f"{type(self).__name__}: gradient of parameter #{index} has shape {tuple(g.shape)} but the parameter "
                    f"has shape {tuple(p.shape)}"
                )
            if g.device != p.device:
                raise RuntimeError(
                    f"{type(self).__name__}: gradient of parameter #{index} is on {g.device} but the parameter is on {p.device}"
                )

    # ------------------------------------------------------------------ backends

    def _param_devices(self) -> set:
        return {p.device for p in self._all_params()}

    def _choose_backend(self, requested: str) -> tuple[str, str]:
        if requested == "naive":
            return "naive", "requested"
        from lopt.fused import launcher

        reason = launcher.fused_unavailable_reason(self.architecture, self._param_devices())
        if requested == "fused":
            if reason:
                raise RuntimeError(f"{type(self).__name__}(backend='fused') cannot run: {reason}. Use backend='naive' or 'auto'.")
            return "fused", "requested"
        # auto
        if reason is None:
            return "fused", "CUDA parameters and a working fused backend"
        if any(d.type == "cuda" for d in self._param_devices()):
            warnings.warn(f"{type(self).__name__}: using the naive backend because {reason}", RuntimeWarning, stacklevel=3)
        return "naive", reason

    def _make_fused_engine(self):
        raise NotImplementedError(f"{type(self).__name__} has no fused backend yet; use backend='naive'")

    def decays(self, group, device=None):
        """The group's effective float32 decays (computed on the CPU once, cached per device)."""
        key = (group["momentum_decays"], group["rms_decays"], group["adafactor_decays"], str(device))
        cache = self.__dict__.setdefault("_decays_cache", {})
        if key not in cache:
            decays = self.reference.Decays.from_offsets(*key[:3])
            cache[key] = decays.to(device) if device is not None else decays
        return cache[key]

    def ensure_state(self, p) -> dict:
        """The parameter's state, created (zero accumulators, float32, on its device) on first use."""
        state = self.state[p]
        if not state:
            for name, buf in init_state(p.shape, self.reference.factored_dims(tuple(p.shape))).items():
                state[name] = buf.to(p.device)
        return state

    def weights_on(self, device) -> dict:
        """The meta-weights as ``{component: {name: float32 tensor}}`` on ``device`` (cached)."""
        key = torch.device(device)
        if key not in self._weights_by_device:
            self._weights_by_device[key] = self.meta_weights.to(key).tensors
        return self._weights_by_device[key]

    # ------------------------------------------------------------------ step counters, state dicts

    @staticmethod
    def _host_step(group) -> int:
        step = group.get("step", 0)
        return int(step.item()) if torch.is_tensor(step) else int(step)

    def state_dict(self):
        state = super().state_dict()
        for group in state["param_groups"]:
            if torch.is_tensor(group.get("step")):
                group["step"] = int(group["step"].item())  # portable: loads into either backend
        return state

    def load_state_dict(self, state_dict):
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        # torch casts floating-point state to each parameter's dtype (bfloat16 momentum for a
        # bfloat16 parameter); lopt's state is float32 for every parameter dtype, so restore the
        # saved float32 values (an independent copy on the parameter's device).
        params = [p for group in self.param_groups for p in group["params"]]
        for index, values in saved_state.items():
            param = params[index]
            for key, value in values.items():
                if torch.is_tensor(value) and value.is_floating_point():
                    self.state[param][key] = value.to(device=param.device, dtype=torch.float32, copy=True)
        if self._fused_engine is not None:
            self._fused_engine.invalidate()

    def __repr__(self):
        return f"{type(self).__name__}(backend={self.backend!r}, weights={self.meta_weights.source!r}, groups={len(self.param_groups)})"
