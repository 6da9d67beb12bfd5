"""``lopt.MuLO``: small_fc_lopt under μP (μLO), as a drop-in ``torch.optim`` optimizer.

MuLO is :class:`lopt.SmallFCLOpt` whose matrix-like parameters take ``lr / width_mult`` (μP's
scaling, as ``mup.MuAdam`` applies it and PyLO's ``MuLO_naive`` wraps ``AdafacLO_naive`` with it).
It does so the way both do: each parameter group given is split into internal groups, one per
width multiplier of its matrix-like parameters (their ``lr`` divided by it) and one of the rest, so
that the per-element math — and the fused engine, which reads each group's ``lr`` — are
SmallFCLOpt's unchanged (``docs/mulo.md``).
"""

from __future__ import annotations

import math
import numbers

import torch

from lopt.optimizers.small_fc_lopt import SmallFCLOpt
from lopt.reference import small_fc_lopt as reference

MISSING_INFSHAPE = ("raise", "finite")


class MuLO(SmallFCLOpt):
    r"""μLO: small_fc_lopt with μP's per-tensor learning rates (docs/mulo.md).

    Every parameter carries μP's ``infshape`` (``mup.set_base_shapes(model, base_model)`` attaches it;
    any object with ``ninf()`` and ``width_mult()`` will do). Then, per parameter:

    * **matrix-like** (``infshape.ninf() == 2``: hidden weights, both dimensions scale with width):
      ``lr / infshape.width_mult()`` — mup's width multiplier of the fan-in, ``fan_in / base_fan_in``;
    * **vector-like** (``ninf() <= 1``: biases, norms, the input embedding and the readout weight,
      0-d parameters): ``lr`` unchanged;
    * ``ninf() > 2``: refused (μP defines no scaling for it; mup and PyLO raise too).

    The step of each tensor is SmallFCLOpt's with that lr (weight decay included:
    ``p -= weight_decay * lr_scaled * p``, as PyLO's MuLO). Each group given becomes one internal
    group per distinct width multiplier of its matrix-like parameters (in order of first appearance;
    ``group["lr"]`` already divided, ``group["width_mult"]`` the multiplier), then one of its
    vector-like parameters (``width_mult`` 1.0); empty groups are left out. ``opt.param_groups`` and
    state dicts show these groups; a scheduler scales each group's lr, so the μP ratios hold.

    Args:
        params: parameters (each with ``infshape``) or parameter groups.
        lr, weight_decay, weights, backend, exp_mult, step_mult, momentum_decays, rms_decays,
        adafactor_decays, max_grad_norm, nonfinite, precision, process_group: as
            :class:`lopt.SmallFCLOpt` (defaults: the published μLO weights ``btherien/mulo``, lr 1.0).
            ``backend="fused"`` runs SmallFCLOpt's fused engine on MuLO's groups.
        missing_infshape: a parameter without ``infshape`` is an error naming it (``"raise"``, default),
            or is treated as finite-width, lr unchanged (``"finite"``: mup's view of a tensor whose
            shape equals its base shape; what ``lopt bench`` and the generic tests use on plain tensors).
    """

    GROUP_KEYS = SmallFCLOpt.GROUP_KEYS | {"width_mult"}
    _PICKLED_ATTRIBUTES = SmallFCLOpt._PICKLED_ATTRIBUTES + ("_missing_infshape",)

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
        missing_infshape: str = "raise",
    ):
        if missing_infshape not in MISSING_INFSHAPE:
            raise ValueError(f"MuLO: missing_infshape must be one of {MISSING_INFSHAPE}, got {missing_infshape!r}")
        self._missing_infshape = missing_infshape
        super().__init__(params, lr, weight_decay, weights, backend, exp_mult=exp_mult, step_mult=step_mult,
                         momentum_decays=momentum_decays, rms_decays=rms_decays, adafactor_decays=adafactor_decays,
                         max_grad_norm=max_grad_norm, nonfinite=nonfinite, precision=precision,
                         process_group=process_group)

    def _start(self, params, defaults: dict, **options) -> None:
        super()._start(params, {**defaults, "width_mult": 1.0}, **options)

    def _validate_group(self, group: dict, where: str) -> None:
        super()._validate_group(group, where)
        width_mult = group.get("width_mult", 1.0)
        if not _is_positive_number(width_mult):
            raise ValueError(f"{type(self).__name__}: invalid {where}: width_mult must be a finite number > 0 (the "
                             f"μP width multiplier this group's lr was divided by), got {width_mult!r}")

    def _lr_as_given(self, group) -> float:
        return super()._lr_as_given(group) * group["width_mult"]

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict) -> None:
        """The group split into MuLO's internal groups (class docstring), each added as SmallFCLOpt adds a
        group; nothing is added if any parameter or part is refused."""
        if not isinstance(param_group, dict) or isinstance(param_group.get("params"), (set, frozenset)):
            return super().add_param_group(param_group)  # (refused there, with torch's wording)
        if "width_mult" in param_group:
            raise ValueError(f"{type(self).__name__}: a param group given cannot set width_mult: MuLO reads each "
                             f"parameter's μP width multiplier from its infshape")
        params = param_group["params"]
        entries = [params] if isinstance(params, torch.Tensor) else list(params)
        first_index = sum(len(group["params"]) for group in self.param_groups)
        matrix_like: dict = {}  # width_mult -> entries, in order of first appearance
        vector_like = []
        for offset, entry in enumerate(entries):
            named = isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
            tensor = entry[1] if named else entry
            what = f"parameter #{first_index + offset}" + (f" ({entry[0]!r})" if named else "")
            width_mult = self._width_mult(tensor, what)
            if width_mult is None:
                vector_like.append(entry)
            else:
                matrix_like.setdefault(width_mult, []).append(entry)
        options = {key: value for key, value in param_group.items() if key != "params"}
        lr = options.get("lr", self.defaults["lr"])
        parts = [{**options, "params": part, "lr": _divided(lr, width_mult), "width_mult": width_mult}
                 for width_mult, part in matrix_like.items()]
        if vector_like or not parts:
            parts.append({**options, "params": vector_like, "width_mult": 1.0})
        before = len(self.param_groups)
        try:
            for part in parts:
                super().add_param_group(part)
        except BaseException:
            del self.param_groups[before:]  # (a later part refused: none of the group is added)
            self._reducer = None
            raise

    def _width_mult(self, tensor, what: str) -> float | None:
        """A matrix-like parameter's width multiplier, or None for a vector-like one (class docstring)."""
        infshape = getattr(tensor, "infshape", None)
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
        if infshape is None:
            if self._missing_infshape == "finite":
                return None
            raise ValueError(
                f"{type(self).__name__}: {what} (shape {shape}) has no infshape. MuLO scales the lr of each "
                f"matrix-like parameter by its μP width multiplier, which mup.set_base_shapes(model, base_model) "
                f"attaches to every parameter as p.infshape: call it before building the optimizer (or pass "
                f"missing_infshape='finite' to leave such parameters' lr unchanged)")
        ninf = infshape.ninf()
        if ninf > 2:
            raise NotImplementedError(f"{type(self).__name__}: {what} (shape {shape}) has {ninf} infinite "
                                      f"dimensions ({infshape!r}); μP scales parameters with at most 2")
        if ninf < 2:
            return None
        width_mult = infshape.width_mult()
        if not _is_positive_number(width_mult):
            raise ValueError(f"{type(self).__name__}: {what} (shape {shape}) has infshape.width_mult() = "
                             f"{width_mult!r}; it must be a finite number > 0")
        return float(width_mult)


def _divided(lr, width_mult: float):
    """``lr / width_mult`` (the same object where the multiplier is 1, so that a tensor lr a scheduler
    updates in place stays the group's; a new 0-d tensor on its device otherwise)."""
    if width_mult == 1.0:
        return lr
    return lr.detach() / width_mult if torch.is_tensor(lr) else lr / width_mult


def _is_positive_number(value) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)
