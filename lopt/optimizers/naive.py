"""The naive backend's phases, shared by both optimizers (plain PyTorch over this process's part of
each tensor): the check phase's host-side part (AMP unscaling, the non-finite policy), the accumulate
phase, the statistics phase's feature sums, each with one packed reduce across processes
(:mod:`lopt.distributed`; the identity on one process). Each optimizer's ``_naive_step`` runs them
in order with its own control and apply phases (``docs/design.md``).

Inside a compiled step (``torch.compile(opt.step)``, ``nonfinite="skip"``) the check decides on the
device instead of the host (:class:`DeviceDecision`), so that the step compiles without a graph break.
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass

import torch

from lopt import distributed
from lopt.distributed import SumPacket, local_part
from lopt.errors import NonFiniteGradientError
from lopt.reference import accumulators


# A gradient element at or beyond 2^64 in magnitude has a square that overflows float32, which the
# optimizer's float32 second-moment state cannot hold: it is treated like a non-finite element.
GRADIENT_LIMIT = 2.0**64




@dataclass
class StepInputs:
    """What the check phase hands to a backend.

    ``params[g]`` lists group ``g``'s parameters that take part in this step (a gradient and at
    least one element), ``grads[g]`` their gradients as checked (read once, so a backend steps
    exactly the tensors the check saw). ``grad_scale`` and ``found_inf`` are GradScaler's device
    tensors when it drives the step (``_step_supports_amp_scaling``), else None. ``gathered`` is
    what the fused engine's fast check read beside them (its plan, the gradients' pointers and
    dtypes), else None. ``decision`` is the naive check's :class:`DeviceDecision` in a compiled step,
    else None.
    """

    params: list
    grads: list
    grad_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    gathered: object = None
    # Set by the naive check inside a compiled step: the decision the engine commits after the step.
    decision: DeviceDecision | None = None

    def entries(self, groups):
        """(group, param, grad) for every participating parameter, in group order."""
        for group, params, grads in zip(groups, self.params, self.grads):
            for p, g in zip(params, grads):
                yield group, p, g


@dataclass
class NaiveTensor:
    """One participating parameter as the naive phases see it: this process's part of it.

    For a plain tensor that is the whole tensor; for a DTensor sharded on dim 0 (FSDP2) it is the
    local rows (possibly none), and ``split`` says that sums over the elements or along axis 0
    are partial until the reduce phase completes them. ``shape`` (the global shape, a 0-d
    parameter as ``(1,)``), ``dims`` (factored axes, chosen from the global shape) and ``count``
    (global number of elements) describe the whole tensor; ``value`` (float32, pre-update),
    ``grad`` (float32, AMP-unscaled) and ``state`` (the accumulators) are local, in the work shape.
    (A new one every step, and nothing keyed by its identity: a compiled step would recompile.)
    """

    group: dict
    param: torch.Tensor
    shape: tuple
    dims: tuple | None
    count: int
    split: bool
    value: torch.Tensor
    grad: torch.Tensor
    state: dict
    # The gradient the accumulators and features use (after max_grad_norm's or VeLO's clipping), with a
    # trailing axis of size 1: set by the optimizer before the accumulate phase.
    step_grad: torch.Tensor | None = None
    row_col_mean: torch.Tensor | None = None  # set by the accumulate phase where R's d1 axis is split

    def write_back(self, new_value: torch.Tensor) -> None:
        """Store the new float32 value (work shape) into the parameter's local part, in its dtype."""
        local = local_part(self.param)
        local.copy_(new_value.reshape(local.shape))


@dataclass
class DeviceDecision:
    """The check's decision inside a compiled step, made on the device: no host read, so no graph break.

    The step then runs as a kept step (the eager step's computation, unchanged), and :meth:`commit`
    keeps what it wrote where ``keep`` (0-d bool) holds and restores, bit for bit, what was there
    before where it does not: ``tensors`` are written in place (each beside its value before the
    step: the parameters' and their state entries' local parts), ``entries`` are replaced in their
    dicts (the groups' step counters and the optimizer-wide state of the first group, as
    ``GLOBAL_STATE_KEYS`` names it). A step must write nothing else.
    """

    keep: torch.Tensor
    tensors: list
    entries: list

    @classmethod
    def before_writes(cls, keep: torch.Tensor, optimizer, tensors: list) -> DeviceDecision:
        """Records what a step of ``tensors`` may write, as it is before the step (state created already)."""
        written = []
        for t in tensors:
            written.append(local_part(t.param))
            written.extend(local_part(value) for value in optimizer.state[t.param].values() if torch.is_tensor(value))
        first = optimizer.param_groups[0]
        entries = [(group, "step") for group in optimizer.param_groups]
        entries += [(first, key) for key in optimizer.GLOBAL_STATE_KEYS if torch.is_tensor(first.get(key))]
        return cls(keep, [(x, x.clone()) for x in written],
                   [(container, key, container[key].clone()) for container, key in entries])

    def commit(self) -> None:
        """After the step: its writes where ``keep`` holds, the values from before it elsewhere."""
        for tensor, before in self.tensors:
            tensor.copy_(torch.where(self.keep.to(tensor.device), tensor, before))
        for container, key, before in self.entries:
            container[key] = torch.where(self.keep.to(before.device), container[key], before)


def device_counter(value, device) -> torch.Tensor:
    """A step counter (an int, or a tensor) as a 0-d int64 tensor on ``device``, as a compiled step keeps it
    (the fused engine keeps its counters so too)."""
    return torch.as_tensor(value, dtype=torch.int64, device=device)


class NaiveEngine:
    """The naive backend behind the interface of a fused engine (``lopt.fused.engine.FusedEngine``), so that
    a front-end steps whichever engine it has the same way: ``engine.step(inputs, *args)`` runs the
    optimizer's ``_naive_step``; the naive backend has no fast check and nothing planned to forget."""

    def __init__(self, optimizer):
        # (the optimizer owns its engine: a weak reference, no cycle; a weakref.ref, which torch.compile
        # traces, where a weakref.proxy would break the compiled step's graph)
        self._optimizer = weakref.ref(optimizer)

    def checked_gradients(self, grad_scale=None, found_inf=None):
        return None  # (the general check: _check_gradients)

    def step(self, inputs, *args) -> None:
        self._optimizer()._naive_step(inputs, *args)
        if inputs.decision is not None:  # (a compiled step, decided on the device)
            inputs.decision.commit()

    def invalidate(self) -> None:
        pass


class NaivePhases:
    """The naive phases as methods of :class:`lopt.optimizers.base.LearnedOptimizer`."""

    def _gradient_square_sums(self, tensors: list) -> tuple:
        """Σ g² (float64) of the participating gradients, for a global norm: ``(split, whole)``, the sums of
        the tensors split among processes (FSDP2: this process's parts) and of the whole ones, on one device."""
        device = tensors[0].grad.device if tensors else next(iter(self._param_devices()))
        split = whole = torch.zeros((), dtype=torch.float64, device=device)
        for t in tensors:
            square_sum = accumulators.float64_square_sum(t.grad).to(device)
            if t.split:
                split = split + square_sum
            else:
                whole = whole + square_sum
        return split, whole

    def _global_square_sums(self, tensors: list, check) -> tuple | None:
        """Check phase: what a global norm over every gradient of every group needs, added to the check's
        :class:`~lopt.distributed.SumPacket` (one reduce), where some group clips (the same decision on every
        process): Σ g² of the tensors split among processes (FSDP2), Σ g² of the whole tensors both as this
        process's and as summed over the processes, and the shape fingerprint's marks that say which of the
        two counts each tensor once (``lopt.distributed.same_tensors_marks``: this process's where every
        process holds the same tensors, one process or DDP; the total where each holds its own, ZeRO).
        Handles for :meth:`_global_square_sum`, or None."""
        if all(group.get("max_grad_norm") is None for group in self.param_groups):
            return None
        split, whole = self._gradient_square_sums(tensors)
        marks = distributed.same_tensors_marks(self._all_params(), split.device)
        return check.add(split), check.add(whole, split=False), check.add(whole), check.add(marks)

    def _global_square_sum(self, check, handles) -> torch.Tensor | None:
        """Σ g² (float64, 0-d) over every gradient of every process's tensors, each counted once, from the
        reduced check (:meth:`_global_square_sums`'s handles); None where no group clips."""
        if handles is None:
            return None
        split, local_whole, total_whole, marks = (check[handle] for handle in handles)
        return split + torch.where(distributed.marks_say_same_tensors(marks), local_whole, total_whole)

    def _naive_tensors(self, inputs: StepInputs) -> list:
        """Naive check phase, part 2: every participating parameter as a :class:`NaiveTensor` (this
        process's part, the gradient float32 and AMP-unscaled), its state created on first use."""
        inverse_scale = None
        if inputs.grad_scale is not None:
            inverse_scale = inputs.grad_scale.double().reciprocal().float()  # as GradScaler.unscale_ forms it
        tensors = []
        for group, p, g in inputs.entries(self.param_groups):
            layout = distributed.shard_layout(p)
            shape = layout.global_shape if layout.global_shape else (1,)  # a 0-d parameter: a 1-element vector
            local_shape = (layout.rows,) + shape[1:]
            grad = local_part(g).to(torch.float32)
            if inverse_scale is not None:
                grad = grad * inverse_scale.to(grad.device)
            state = self.ensure_state(p)
            views = {}
            for name in ("mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v"):
                if name not in state:  # (CELO2's AdamW branch keeps moments of its own instead)
                    continue
                buf = local_part(state[name])
                views[name] = buf.view(local_shape + buf.shape[-1:]) if buf.numel() and p.dim() == 0 else buf
            tensors.append(NaiveTensor(
                group=group, param=p, shape=shape,
                dims=self.reference.factored_dims(layout.global_shape), count=math.prod(shape), split=layout.split,
                value=local_part(p).detach().to(torch.float32).reshape(local_shape), grad=grad.reshape(local_shape),
                state=views))
        return tensors

    def _naive_step_allowed(self, tensors: list, inputs: StepInputs, loss=None, packet: SumPacket | None = None) -> bool:
        """Naive check phase, part 3 (one reduce over the process group, one host read): False if the
        step must be skipped. ``packet`` may hold sums a subclass wants completed in the same collective.

        An AMP overflow (GradScaler's ``found_inf``) skips silently: GradScaler expects it and
        lowers its scale. A non-finite or overflowing gradient (|g| >= 2^64), a non-finite loss, or
        a tensor ``lr``/``weight_decay`` holding NaN, ±inf or a negative value (checked here, in the
        same read, as host numbers are in ``_validate_live_group``) raises under
        ``nonfinite="raise"``; else the step is skipped, counted and warned about.
        The counts of such elements are summed over the processes, so that all of them decide alike.

        Inside a compiled step under ``nonfinite="skip"`` nothing is read on the host and nothing is
        warned about: the step is decided on the device (:meth:`_decided_on_device`) and this returns
        True; the engine then commits the decision (``inputs.decision``).
        """
        packet = packet if packet is not None else SumPacket(self.reducer)
        device = tensors[0].grad.device if tensors else self._param_devices().pop()
        zero = torch.zeros((), dtype=torch.float64, device=device)
        bad_counts = [_bad_element_count(t.grad) for t in tensors]
        hyper = _tensor_hyperparameters(self.param_groups)
        # What every process adds up, whichever tensors it holds: bad loss, bad elements of its whole
        # tensors (per-tensor counts of split tensors are summed one by one below), GradScaler's flag,
        # bad tensor hyper-parameters.
        shared = torch.stack([
            (~torch.isfinite(loss)).to(device=device, dtype=torch.float64).reshape(()) if loss is not None else zero,
            sum((c.to(device) for c, t in zip(bad_counts, tensors) if not t.split), zero),
            inputs.found_inf.to(device=device, dtype=torch.float64).reshape(()) if inputs.found_inf is not None else zero,
            sum((_bad_hyperparameter(value).to(device) for _, _, value in hyper), zero),
        ])
        shared_handle = packet.add(shared)
        count_handles = [packet.add(count, split=t.split) for count, t in zip(bad_counts, tensors)]
        packet.reduce()
        totals = torch.cat([packet[shared_handle]] + [packet[h].reshape(1).to(device) for h in count_handles])
        if torch.compiler.is_compiling() and self.nonfinite == "skip":
            inputs.decision = self._decided_on_device(tensors, totals)
            return True
        # The step's one host read, a statement of its own: under torch.compile with nonfinite="raise" it is
        # the step's one graph break, which dynamo splits cleanly here (inside a generator it gave up on the
        # whole frame and compiled every function it calls on its own, recompiling SumPacket.add for each call).
        values = totals.cpu().tolist()
        loss_total, whole_total, found_inf, hyper_total = values[:4]
        tensor_totals = values[4:]
        if found_inf > 0:  # GradScaler's overflow
            return False
        if loss_total == 0 and whole_total == 0 and hyper_total == 0 and not any(tensor_totals):
            return True
        problem = self._describe_problem(tensors, bad_counts, tensor_totals, loss, hyper if hyper_total else ())
        if self.nonfinite == "raise":
            raise NonFiniteGradientError(f"{type(self).__name__}.step: {problem}; nothing was changed "
                                         f"(nonfinite='raise')")
        first = self.param_groups[0]
        first["skipped_steps"] = int(first["skipped_steps"]) + 1
        self._host["skipped_seen"] = first["skipped_steps"]
        warnings.warn(f"{type(self).__name__}: step skipped because {problem}; parameters, state and step counters "
                      f"are unchanged ({first['skipped_steps']} skipped so far; nonfinite='raise' stops instead)",
                      RuntimeWarning, stacklevel=4)
        return False

    def _decided_on_device(self, tensors: list, totals: torch.Tensor) -> DeviceDecision:
        """The check's decision inside a compiled step, from the reduced ``totals`` (on the device): the step
        is kept if every count is 0; a skipped one is counted on the device, as the fused backend counts it,
        unless GradScaler's overflow skipped it (:attr:`skipped_steps` warns when it is read). The step
        counters become 0-d int64 tensors on the device, and what the step may write is recorded as it is
        before the step (:class:`DeviceDecision`)."""
        flagged = totals > 0  # the loss, whole tensors, GradScaler's found_inf, hyper-parameters, each split tensor
        keep = ~flagged.any()
        first = self.param_groups[0]
        skipped = ~keep & ~flagged[2]
        first["skipped_steps"] = device_counter(first["skipped_steps"], keep.device) + skipped.to(torch.int64)
        for group in self.param_groups:
            group["step"] = device_counter(group["step"], keep.device)
        return DeviceDecision.before_writes(keep, self, tensors)

    def _describe_problem(self, tensors, local_counts, totals, loss, hyper=()) -> str:
        """What made the check fail, in the terms of this process (a bad tensor hyper-parameter, else the
        first bad gradient, else the loss)."""
        for index, name, value in hyper:
            number = float(value)
            if not (math.isfinite(number) and number >= 0):
                return (f"param group #{index}'s {name} is a tensor holding {number!r} (it must be a finite number "
                        f">= 0)")
        for t, local, total in zip(tensors, local_counts, totals):
            if total > 0:
                index = next(i for i, p in enumerate(self._all_params()) if p is t.param)
                what = f"the gradient of parameter #{index} (shape {tuple(t.param.shape)})"
                if float(local) > 0:
                    return f"{what} holds {_describe_peak(float(t.grad.abs().amax()))}"
                return f"{what} holds a non-finite or overflowing value in another process's shard"
        if loss is not None and not bool(torch.isfinite(loss)):
            return f"the loss is not finite ({float(loss)})"
        return "a gradient or the loss of another process is not finite (or overflows)"

    def _naive_accumulate(self, tensors: list) -> None:
        """Accumulate phase (naive) for all tensors: momentum, rms and the Adafactor accumulators from
        each tensor's ``step_grad``; the means along a split axis 0 complete in one reduce.

        A factored tensor splits at most one of its factored axes: where that is d0, R's mean over
        it needs the reduce; where it is d1, C's mean does, and so does the mean of R over d1 (the
        row factor's normaliser), which is computed from the new R before the reduce.
        """
        packet = SumPacket(self.reducer)
        pending = []
        for t in tensors:
            grad = t.step_grad
            decays = self.decays(t.group, grad.device)
            accumulators.update_momentum(t.state["mom"], grad, decays.momentum)
            accumulators.update_rms(t.state["rms"], grad, decays.rms)
            if t.dims is None:
                accumulators.update_adafactor(t.state, grad, decays.adafactor, None)
                continue
            d1, d0 = t.dims
            row_sum, col_sum = accumulators.adafactor_axis_sums(grad, t.dims)
            handles = {"row": packet.add(row_sum, split=t.split and d0 == 0),
                       "col": packet.add(col_sum, split=t.split and d1 == 0)}
            if t.split and d1 == 0:
                accumulators.ema_(t.state["fac_vec_row"], decays.adafactor,
                                  accumulators.mean_from_sum(row_sum, t.shape[d0]))
                handles["row_col"] = packet.add(accumulators.row_col_sum(t.state["fac_vec_row"], t.dims))
            pending.append((t, decays, handles))
        packet.reduce()
        for t, decays, handles in pending:
            d1, d0 = t.dims
            if "row_col" not in handles:
                accumulators.ema_(t.state["fac_vec_row"], decays.adafactor,
                                  accumulators.mean_from_sum(packet[handles["row"]], t.shape[d0]))
            else:
                t.row_col_mean = accumulators.mean_from_sum(packet[handles["row_col"]], t.shape[d1])
            accumulators.ema_(t.state["fac_vec_col"], decays.adafactor,
                              accumulators.mean_from_sum(packet[handles["col"]], t.shape[d1]))

    def _complete_sums(self, tensors: list, partial_sums: list) -> list:
        """Each tensor's float64 ``partial_sums`` over its elements, completed across processes in one reduce."""
        packet = SumPacket(self.reducer)
        handles = [packet.add(sums, split=t.split) for t, sums in zip(tensors, partial_sums)]
        packet.reduce()
        return [packet[h] for h in handles]

    def _naive_feature_square_sums(self, tensors: list) -> list:
        """Statistics phase (naive): every tensor's per-feature Σ x² (float64) of ``self._features(t)``,
        completed across processes in one reduce. The apply phase recomputes the features rather than
        keeping them, so that no more than one tensor's features are alive at a time."""
        return self._complete_sums(tensors, [accumulators.feature_square_sums(self._features(t)) for t in tensors])

    def _features(self, t: NaiveTensor) -> torch.Tensor:
        """The per-element features of a tensor (from the updated accumulators and the pre-update value)."""
        return self.reference.per_element_features(t.step_grad, t.value.unsqueeze(-1), t.state, t.dims,
                                                   t.row_col_mean)


def _tensor_hyperparameters(groups) -> list:
    """(group index, name, tensor) of every group's lr and weight decay given as a tensor."""
    return [(index, name, group[name]) for index, group in enumerate(groups) for name in ("lr", "weight_decay")
            if torch.is_tensor(group[name])]


def _bad_hyperparameter(value: torch.Tensor) -> torch.Tensor:
    """1.0 where a tensor lr or weight decay is not a finite number >= 0 (NaN, ±inf, negative), else 0.0."""
    return (~((value.detach() >= 0) & (value.detach() < math.inf))).to(torch.float64).reshape(())


def _bad_element_count(values: torch.Tensor) -> torch.Tensor:
    """How many of ``values`` are non-finite or at least 2^64 in magnitude (float64, 0-d, on their device)."""
    return torch.count_nonzero(~(values.detach().abs() < GRADIENT_LIMIT)).to(torch.float64)


def _describe_peak(peak: float) -> str:
    if math.isnan(peak):
        return "NaN"
    if math.isinf(peak):
        return "an infinite value"
    return f"a value of magnitude {peak:.3g}, whose square overflows float32 (|g| >= 2^64)"


