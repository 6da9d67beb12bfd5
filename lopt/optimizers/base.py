"""What every lopt optimizer shares: meta-weights, backend choice, input checks, step counters."""

from __future__ import annotations

import warnings
from typing import Iterable

import torch
from torch.optim import Optimizer

from lopt import weights as weights_lib

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "naive", "fused")


class LearnedOptimizer(Optimizer):
    """Base class: a ``torch.optim.Optimizer`` driven by frozen meta-weights.

    Subclasses set ``architecture`` (a registry architecture name) and implement
    ``_step_group_naive`` and, where a fused backend exists, ``_make_fused_engine``.
    """

    architecture: str = ""
    display_name: str = ""

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
