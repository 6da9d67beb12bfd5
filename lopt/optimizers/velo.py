"""``lopt.VeLO``: VeLO as a drop-in ``torch.optim`` optimizer that takes the training loss."""

from __future__ import annotations

import functools
import math
import numbers
import operator
import warnings
from dataclasses import dataclass

import torch

from lopt.optimizers.base import _TORCH_SET_PHRASE, LearnedOptimizer, float32_math
from lopt.reference import velo as reference

_MISSING_LOSS = (
    "VeLO.step needs the training loss: call opt.step(loss) with the loss of this step (a number or a one-element "
    "tensor), opt.step(closure) with a closure that returns it, or, where a training loop calls step() for you, "
    "hand each micro-batch's loss to opt.accumulate_loss(loss) before it does"
)


@dataclass(frozen=True)
class StepLoss:
    """The loss a step uses, as the backends read it: a host ``value``, or a device ``tensor``
    (a user's loss tensor, or the sum of accumulated losses, then divided by ``count``)."""

    value: float | None = None
    tensor: torch.Tensor | None = None
    count: int = 1


def _validate_num_steps(num_steps) -> int:
    if isinstance(num_steps, bool):
        raise TypeError(f"num_steps must be a positive int (the planned number of optimizer steps), got {num_steps!r}")
    try:
        value = operator.index(num_steps)
    except TypeError:
        raise TypeError(
            f"num_steps must be a positive int (the planned number of optimizer steps), got {num_steps!r} "
            f"of type {type(num_steps).__name__}; e.g. num_steps=int(1e4)"
        ) from None
    if value <= 0:
        raise ValueError(f"num_steps must be a positive int (the planned number of optimizer steps), got {value}")
    if value > reference.MAX_NUM_STEPS:
        raise ValueError(
            f"num_steps={value} is longer than VeLO's loss buffer can represent: its slowest timescale's decay "
            f"exp(-1/num_steps) rounds to 1.0 in float32 beyond num_steps={reference.MAX_NUM_STEPS}, which would "
            f"make every step NaN. VeLO was meta-trained on runs of up to {reference.DESIGN_HORIZON_STEPS} steps: "
            f"run a longer training as gradient accumulation over fewer optimizer steps (as JAX's VeLO does), "
            f"with num_steps the number of optimizer steps")
    return value


class VeLO(LearnedOptimizer):
    r"""VeLO (Metz et al. 2022, "VeLO: Training Versatile Learned Optimizers by Scaling Up").

    A per-tensor LSTM reads, once per step, 30 features of every parameter tensor (momentum and
    RMS statistics, its rank, the fraction of ``num_steps`` done, and 9 features of the training
    loss history) and writes, for each tensor, a step multiplier :math:`\lambda` and the weights
    of a small MLP that proposes every element's update:

    .. math::
        (c, \lambda) &= \text{LSTM}(\text{tensor features}), \qquad
        W = 100\cdot\tfrac{1}{256}\textstyle\sum_k c_k W^{(k)} \\
        (d, \mu) &= \text{MLP}_W(\text{normalised per-element features of } \hat g, p, m, v, R, C) \\
        p &\leftarrow p - \text{lr}\cdot\lambda\cdot\text{rms}(p)\cdot d\cdot e^{\text{exp\_mult}\,\mu}\cdot
        \text{step\_mult}, \qquad p \leftarrow p - \text{weight\_decay}\cdot\text{lr}\cdot p

    with :math:`\hat g` the gradient clipped to ±1000. The semantics are PyLO's ``VeLO_naive``
    (the JAX ``HyperV2`` of learned_optimization; ``docs/velo.md``) with these decisions:

    * ``lr`` defaults to **1.0**, the step VeLO was meta-trained with (JAX VeLO has no lr).
      PyLO's constructor default ``1e-3`` makes every step 1000× smaller than VeLO's; pass
      ``lr=1e-3`` for bit-compatible PyLO defaults.
    * Ties between equal axis sizes when choosing the factored axes: stable order, then PyLO
      VeLO's swap rule (deterministic on every platform).
    * 0-d parameters follow the JAX definition (the scalar as a 1-element vector; PyLO crashes).
    * Rank ≥ 5 tensors (five or more axes of size > 1) get the all-zero rank encoding (JAX).
    * A tensor without a gradient in a step, or with no elements, is skipped: no LSTM row, no
      state change.
    * The controller (mixing layers, LSTM, heads, weight generation) is evaluated in float64 and
      its outputs rounded to float32, so that rounding does not depend on the summation order.
    * State and math are float32 for every parameter dtype; the parameter keeps its dtype.

    Args:
        params: parameters or parameter groups (groups may set ``lr``, ``weight_decay``, ...).
        num_steps: the planned length of training in optimizer steps (required). VeLO's features
            include the fraction of it done, and its loss features average over timescales from
            10 steps up to ``num_steps``. VeLO was meta-trained on runs of up to 150k steps
            (JAX's prefab turns longer runs into gradient accumulation); stepping past
            ``num_steps`` works, with the fraction features saturating. At most 33_554_434
            (``reference.MAX_NUM_STEPS``: beyond, the float32 loss buffer's slowest decay is 1.0).
        lr: multiplies VeLO's step (1.0 = the meta-trained step). Below 0.02 (other than 0) warns once
            with :class:`lopt.AdamHabitWarning`: almost certainly an Adam learning rate.
        weight_decay: decoupled weight decay after the update, ``p -= weight_decay * lr * p``.
        weights: meta-weights — a registered name (default ``"velo"``: hub repos
            ``Pauljanson002/VeLO_RNN`` and ``Pauljanson002/VeLO_MLP``), a pair ``(rnn, mlp)`` or
            dict ``{"rnn": ..., "mlp": ...}`` of local directories in PyLO's hub layout, hub repo
            ids or ``.safetensors`` files, or a :class:`lopt.weights.MetaWeights`.
        backend: ``"auto"`` (fused on CUDA when available, else naive), ``"naive"`` or ``"fused"``.
        exp_mult, step_mult: output scalings (PyLO defaults 0.001 and 0.001).
        momentum_decays, rms_decays, adafactor_decays: offsets added to the decays
            (0.9, 0.99, 0.999) / (0.999,) / (0.9, 0.99, 0.999) in PyLO's parametrisation; VeLO's
            weights were meta-trained with zeros.

        nonfinite: ``"skip"`` (default): a step whose loss or any gradient is NaN, ±inf or beyond
            2^64 changes nothing (parameters, state, loss buffer, step counters) and is counted in
            :attr:`skipped_steps` (warned about at once by the naive step; by reading
            :attr:`skipped_steps` after a fused or compiled one); ``"raise"``: it raises
            :class:`lopt.NonFiniteGradientError`.
        process_group: the processes this optimizer works with under ``torch.distributed``
            (``docs/distributed.md``): ``None`` (default) is the default group when
            torch.distributed is initialized, else none; ``"local"`` never communicates; or a
            ``ProcessGroup``. With DDP, ZeroRedundancyOptimizer or FSDP2 it makes every process
            step exactly like one process holding the whole model: the loss is averaged over the
            group (see ``average_loss``), the skip decision for non-finite values is taken
            together, the controller's max over tensors spans the processes' tensors (ZeRO), and
            statistics of DTensor parameters sharded on dim 0 (FSDP2) span their shards.
        average_loss: ``True`` (default): the loss VeLO sees is the mean of the processes' losses
            (one all-reduce of a scalar on the device per step, no host synchronisation; the
            mean over the data-parallel ranks is the loss of the global batch); ``False``: each
            process uses its own loss, and DDP replicas then drift apart.

    ``step(loss)`` needs this step's training loss (a Python number, or a tensor with one element
    on any device) or a closure that returns it; loops that call ``step()`` themselves hand the
    loss over with :meth:`accumulate_loss` first. See :meth:`step`.

    State: per parameter (float32, PyLO's accumulator names and layout, decay axis last) ``mom``
    ``S+(3,)``, ``rms`` ``S+(1,)``, ``fac_vec_row``/``fac_vec_col`` (rank ≥ 2) or ``fac_vec_v``,
    and the tensor's LSTM row ``lstm_hidden``, ``lstm_cell`` (512 each). Each group counts its
    steps in ``group["step"]``. The optimizer-wide state lives in the first group:
    ``num_steps``, the loss buffer ``loss_means``, ``loss_running_min`` (10 each) and
    ``loss_count``, and ``skipped_steps``.
    """

    architecture = "velo"
    reference = reference
    requires_loss = True
    # Optimizer-wide state. It lives in the first param group so that torch's own state_dict carries
    # it (group entries are saved and restored verbatim; ``add_param_group`` does not copy them).
    GLOBAL_STATE_KEYS = ("num_steps", "loss_means", "loss_running_min", "loss_count")
    TENSOR_STATE_KEYS = LearnedOptimizer.TENSOR_STATE_KEYS + ("lstm_hidden", "lstm_cell")
    _PICKLED_ATTRIBUTES = LearnedOptimizer._PICKLED_ATTRIBUTES + ("controller_device", "_loss_sum", "_losses",
                                                                 "average_loss")

    def __init__(
        self,
        params,
        num_steps: int,
        lr: float = 1.0,
        weight_decay: float = 0.0,
        weights="velo",
        backend: str = "auto",
        *,
        exp_mult: float = 0.001,
        step_mult: float = 0.001,
        momentum_decays=reference.MOMENTUM_DECAY_OFFSETS,
        rms_decays=reference.RMS_DECAY_OFFSETS,
        adafactor_decays=reference.ADAFACTOR_DECAY_OFFSETS,
        nonfinite: str = "skip",
        process_group=None,
        average_loss: bool = True,
    ):
        num_steps = _validate_num_steps(num_steps)
        if not isinstance(average_loss, bool):
            raise TypeError(f"VeLO: average_loss must be True or False, got {average_loss!r}")
        self.average_loss = average_loss
        if isinstance(params, torch.Tensor):
            raise TypeError(f"VeLO: params argument given to the optimizer should be an iterable of Tensors or dicts, "
                            f"but got {torch.typename(params)}; pass [tensor] or model.parameters()")
        if isinstance(params, (set, frozenset)):
            raise TypeError(f"VeLO: {_TORCH_SET_PHRASE}")
        params = list(params)  # (a generator is read twice: for the controller device, then by torch)
        defaults = self.accumulator_defaults(
            lr=lr, weight_decay=weight_decay, exp_mult=exp_mult, step_mult=step_mult, momentum_decays=momentum_decays,
            rms_decays=rms_decays, adafactor_decays=adafactor_decays)
        self._constants_cache: dict = {}
        # The loss buffer and the batched controller live on the first parameter's device.
        self.controller_device = _first_param_device(params)
        self._loss_sum = None  # accumulate_loss: running sum on the controller device
        # ... and how many losses it holds (known on the host: no sync), in a dict step() mutates in place
        # (inside a compiled step dynamo replays container writes, not attribute assignments)
        self._losses = {"accumulated": 0}
        super().__init__(params, defaults, weights=weights, backend=backend, nonfinite=nonfinite,
                         process_group=process_group)

        buffer = reference.init_loss_buffer(num_steps, self.controller_device)
        first = self.param_groups[0]
        first["num_steps"] = num_steps
        first["loss_means"] = buffer.means
        first["loss_running_min"] = buffer.running_min
        first["loss_count"] = buffer.count
        # State is created eagerly (as PyLO does), so the first step allocates nothing and
        # host-to-device copies of the meta-weights happen here, not inside step().
        self.weights_on(self.controller_device, torch.float64)
        for p in self._all_params():
            if p.requires_grad:
                self.ensure_state(p)
        for group in self.param_groups:
            for device in {p.device for p in group["params"]} | {self.controller_device}:
                self.decays(group, device)
                self._constants(device)
        if num_steps > reference.DESIGN_HORIZON_STEPS:
            warnings.warn(
                f"VeLO was meta-trained on runs of up to {reference.DESIGN_HORIZON_STEPS} steps; num_steps={num_steps} "
                f"is outside that range (JAX's VeLO runs longer trainings as gradient accumulation over "
                f"{reference.DESIGN_HORIZON_STEPS} optimizer steps)", UserWarning, stacklevel=2)

    _ADAM_HABIT_NOTE = " (PyLO's VeLO defaults to lr=1e-3: pass it only to reproduce PyLO runs made with it)"

    def _init_caches(self) -> None:
        super()._init_caches()
        self._constants_cache = {}

    # ------------------------------------------------------------------ global state

    @property
    def num_steps(self) -> int:
        """The planned number of steps (stored in the first param group, so state_dict carries it)."""
        return self.param_groups[0]["num_steps"]

    def loss_buffer(self) -> reference.LossBuffer:
        """The current loss buffer (its tensors are those stored in the first param group)."""
        first = self.param_groups[0]
        decays = self._constants(self.controller_device)["loss_decays", first["num_steps"]]
        return reference.LossBuffer(decays, first["loss_means"], first["loss_running_min"], first["loss_count"])

    def _constants(self, device) -> dict:
        """Per-device constant tensors, built once so that step() makes no host-to-device copies."""
        key = torch.device(device)
        if key not in self._constants_cache:
            self._constants_cache[key] = {
                "fraction_timescales": torch.tensor(reference.FRACTION_TIMESCALES, dtype=torch.float32, device=key),
                "rank_one_hot": reference.rank_one_hot_table(key),
            }
        constants = self._constants_cache[key]
        num_steps = self.param_groups[0]["num_steps"]
        if ("loss_decays", num_steps) not in constants:
            constants["loss_decays", num_steps] = reference.loss_buffer_decays(num_steps, key)
        return constants

    def _state_shapes(self, p) -> dict:
        shapes = super()._state_shapes(p)
        for key, index in (("lstm_hidden", 0), ("lstm_cell", 1)):
            shapes[key] = tuple(self.meta_weights.tensors["rnn"][f"lstm_init_state.{index}"].shape[1:])
        return shapes

    def ensure_state(self, p) -> dict:
        state = self.state[p]
        if not state:
            super().ensure_state(p)
            hidden, cell = reference.initial_lstm_state(self.weights_on(p.device)["rnn"])
            state["lstm_hidden"] = hidden.clone()
            state["lstm_cell"] = cell.clone()
        return state

    # ------------------------------------------------------------------ loss

    def accumulate_loss(self, loss) -> None:
        """Hand over one micro-batch's loss, for a training loop that calls ``step()`` without one.

        ``loss`` is a number or a one-element tensor on any device (detached; on a GPU nothing
        synchronises). The next ``step()`` uses the **mean** of the losses accumulated since the
        previous step — with gradient accumulation, the loss of the whole batch — and starts over.
        Use it where the loop owns the ``step()`` call (HF ``Trainer``, Lightning with gradient
        accumulation, ``accelerate``); see ``docs/integrations.md``.
        """
        value = _validated_loss(loss)
        if isinstance(value, torch.Tensor):
            value = float(value.item()) if value.device.type == "cpu" else value.detach().reshape(())
        if not isinstance(value, torch.Tensor):
            value = _as_float32(value)  # (beyond float32's range: inf, which the step's non-finite check sees)
        if self._loss_sum is None:
            self._loss_sum = torch.zeros((), dtype=torch.float32, device=self.controller_device)
        if self._losses["accumulated"] == 0:
            self._loss_sum.fill_(value)  # (a 0-d tensor on the device is read there: no synchronisation)
        else:
            self._loss_sum.add_(value)
        self._losses["accumulated"] += 1

    def _step_loss(self, explicit, from_closure) -> StepLoss:
        """The loss this step uses (validated; raises before anything changes)."""
        count = self._losses["accumulated"]
        if count:
            if explicit is not None:
                raise ValueError(
                    f"VeLO.step got a loss, but {count} loss(es) were handed over with "
                    f"accumulate_loss() since the last step: use one way or the other")
            # (consumed by step() once the step has run or been skipped: a step that raises keeps them)
            return StepLoss(tensor=self._loss_sum, count=count)
        loss = explicit if explicit is not None else from_closure
        if loss is None:
            raise TypeError(_MISSING_LOSS)
        value = _validated_loss(loss)
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and self.controller_device.type != "cpu":
                return StepLoss(value=float(value.detach().float().item()))  # (reading a CPU tensor costs nothing)
            return StepLoss(tensor=value.detach().reshape(()))  # (a tensor: a compiled step does not specialise on it)
        return StepLoss(value=_as_float32(value))  # (beyond float32's range: inf, the non-finite policy's case)

    def _averaged_loss(self, loss: StepLoss) -> StepLoss:
        """The step's loss averaged over the process group (``average_loss``): one all-reduce of a
        float32 scalar on the controller device, without synchronising with the host."""
        if not self.average_loss or self.reducer.is_identity:
            return loss
        value = self._loss_on_controller(loss).clone()  # (never reduce the caller's tensor in place)
        return StepLoss(tensor=self.reducer.mean_(value.reshape(1)).reshape(()))

    def _loss_on_controller(self, loss: StepLoss) -> torch.Tensor:
        """The step's loss as a float32 0-d tensor on the controller device (naive backend)."""
        device = self.controller_device
        if loss.tensor is None:
            return torch.full((), loss.value, dtype=torch.float32, device=device)  # (writes on the device: no copy)
        value = loss.tensor.to(device=device, dtype=torch.float32)
        return value / loss.count if loss.count != 1 else value

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, loss=None, *, closure=None):
        """One VeLO step.

        ``loss`` is this step's training loss: a Python number, a one-element tensor on any device,
        or a closure (also accepted as ``closure=``, as Lightning passes it) that re-evaluates the
        model with gradients and returns it. Losses handed over with :meth:`accumulate_loss` since
        the last step take the place of both (their mean is used; a closure still runs, for its
        gradients). Returns the loss as given (the closure's result for a closure).

        A missing or malformed loss raises ``TypeError``/``ValueError`` before anything changes. A
        non-finite loss or gradient follows the ``nonfinite`` policy: by default the step changes
        nothing and is counted in :attr:`skipped_steps`. On a GPU the fused backend decides on the
        device without synchronising.
        """
        if callable(loss):
            if closure is not None:
                raise TypeError("VeLO.step got two closures (positionally and as closure=)")
            closure, loss = loss, None
        returned = loss
        from_closure = None
        if closure is not None:
            if loss is not None:
                raise TypeError("VeLO.step takes a loss or a closure, not both")
            with torch.enable_grad():
                returned = from_closure = closure()  # (under the caller's autocast, if any: it runs the model)
            if not self._losses["accumulated"] and not self._host.get("warned_lightning_accumulation"):
                self._warn_about_lightning_accumulation(closure)
        accumulated = self._losses["accumulated"]
        step_loss = self._step_loss(loss, from_closure)
        with float32_math():  # the optimizer's own math is float32 whatever the ambient autocast
            inputs = self._checked_inputs()
            averaged = self._averaged_loss(step_loss)
            self.engine.step(inputs, averaged)
        if accumulated:
            self._losses["accumulated"] = 0  # the accumulated losses are used (or the step was skipped)
        return returned

    def _checked_inputs(self):
        num_steps = self.param_groups[0].get("num_steps")
        if not (type(num_steps) is int and 0 < num_steps <= reference.MAX_NUM_STEPS):  # (changed since: re-check)
            try:
                _validate_num_steps(num_steps)
            except (TypeError, ValueError) as err:
                raise ValueError(f"VeLO.step: the first param group's {err}. Nothing was changed") from None
        return super()._checked_inputs()

    def _warn_about_lightning_accumulation(self, closure) -> None:
        """Once: a Lightning closure with accumulate_grad_batches > 1 and no losses handed over (no
        VeLOLossCallback) returns the last micro-batch's loss divided by accumulate_grad_batches."""
        accumulation = _lightning_accumulation(closure)
        if accumulation > 1:
            self._host["warned_lightning_accumulation"] = True
            warnings.warn(
                f"VeLO.step got Lightning's closure with accumulate_grad_batches={accumulation} and no loss handed "
                f"over with accumulate_loss: that closure returns only the last micro-batch's loss divided by "
                f"{accumulation}, so VeLO would see 1/{accumulation} of the loss. Add "
                f"lopt.integrations.lightning.VeLOLossCallback() to the Trainer's callbacks (it hands VeLO every "
                f"micro-batch's loss); see docs/integrations.md", UserWarning, stacklevel=3)

    def _naive_step(self, inputs, averaged: StepLoss) -> None:
        """The naive backend, phase by phase over all tensors (``lopt/reference/velo.py``): check,
        statistics (two passes), control (float64, batched over every tensor), accumulate, feature
        statistics, apply. Each phase's sums over a tensor split among processes complete in one
        reduce for all tensors; the controller's max over tensors in one reduce where the processes
        hold different tensors (ZeRO). ``averaged``: the step's loss (as the fused engine takes it)."""
        loss = self._loss_on_controller(averaged)
        tensors = self._naive_tensors(inputs)
        if not self._naive_step_allowed(tensors, inputs, loss):
            return
        device = self.controller_device
        first = self.param_groups[0]
        num_steps = first["num_steps"]

        # Loss buffer and loss features (shared by every tensor).
        new_buffer = reference.update_loss_buffer(self.loss_buffer(), loss)
        loss_feats = reference.loss_features(new_buffer)

        # Statistics of the pre-update parameters and the old accumulators, in two passes.
        first_pass = self._complete_sums(
            tensors, [reference.moment_sums(t.value, t.state["mom"], t.state["rms"]) for t in tensors])
        moments = [reference.tensor_moments(sums, t.count) for t, sums in zip(tensors, first_pass)]
        second_pass = self._complete_sums(
            tensors, [reference.centred_square_sums(t.state["mom"], t.state["rms"], m) for t, m in zip(tensors, moments)])
        statistics = [reference.statistics_from_sums(m, sums, t.count)
                      for t, m, sums in zip(tensors, moments, second_pass)]

        # Control: one LSTM input row per tensor; mixing, LSTM, heads and weight generation for
        # every tensor at once, in float64.
        constants = self._constants(device)
        weights = self.weights_on(device, torch.float64)
        rows = torch.zeros((0, reference.NUM_LSTM_FEATURES), dtype=torch.float64, device=device)
        if tensors:
            rows = reference.lstm_input_features(
                torch.stack([reference.fraction_features(self._steps_taken(t.group), num_steps,
                                                         constants["fraction_timescales"]) for t in tensors]),
                loss_feats, torch.stack([s.lstm.to(device) for s in statistics]),
                torch.stack([constants["rank_one_hot"][min(reference.tensor_rank(t.param.shape),
                                                           reference.NUM_RANK_CLASSES)] for t in tensors])).double()
        shared = reference.mixing_max(rows, weights["rnn"])
        if not self.has_sharded_parameters:
            # Processes holding different tensors (ZeRO) take the max over all of them (a process
            # without rows this step contributes zeros); where every process holds every tensor
            # (DDP) this changes nothing. FSDP2's processes each have every tensor's row already.
            self.reducer.max_(shared)
        if tensors:
            controller = reference.controller_step(
                rows, torch.stack([self.state[t.param]["lstm_hidden"].to(device) for t in tensors]).double(),
                torch.stack([self.state[t.param]["lstm_cell"].to(device) for t in tensors]).double(),
                weights["rnn"], shared)
            mlps = reference.generate_mlp_weights(controller.controls, weights["mlp"]).to(torch.float32)
            lr_mult = controller.lr_mult.to(torch.float32)

        # Accumulate, with the clipped gradient (the step counters advance first: PyLO's order).
        self._advance_step_counters()
        for t in tensors:
            t.step_grad = reference.clip_gradient(t.grad).unsqueeze(-1)
        self._naive_accumulate(tensors)

        # Feature statistics, then apply.
        square_sums = self._naive_feature_square_sums(tensors)
        for index, (t, stats, sums) in enumerate(zip(tensors, statistics, square_sums)):
            at = t.value.device
            group = t.group
            update = reference.update_from_features(
                self._features(t), sums, t.count, mlps.select(index, at), lr_mult[index].to(at),
                reference.param_scale(stats.mean_square_param.to(at)), exp_mult=group["exp_mult"],
                step_mult=group["step_mult"])
            t.write_back(reference.apply_update(t.value, update, group["lr"], group["weight_decay"]))
            self.state[t.param]["lstm_hidden"].copy_(controller.hidden[index])
            self.state[t.param]["lstm_cell"].copy_(controller.cell[index])
        # New tensors rather than in-place writes: a state_dict taken earlier keeps its values.
        first["loss_means"], first["loss_running_min"], first["loss_count"] = (
            new_buffer.means, new_buffer.running_min, new_buffer.count)

    # ------------------------------------------------------------------ state dicts

    def state_dict(self):
        state = super().state_dict()
        first = state["param_groups"][0]
        for key in self.GLOBAL_STATE_KEYS:  # independent copies (they are replaced, not mutated, but be safe)
            if torch.is_tensor(first.get(key)):
                first[key] = first[key].clone()
        return state

    def _validate_state_dict(self, state_dict) -> None:
        super()._validate_state_dict(state_dict)
        first = state_dict["param_groups"][0]
        try:
            _validate_num_steps(first["num_steps"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"VeLO.load_state_dict: the saved {err}; nothing was changed") from None
        timescales = (reference.NUM_LOSS_TIMESCALES,)
        expected = {"loss_means": timescales, "loss_running_min": timescales, "loss_count": ()}
        for key, shape in expected.items():
            value = first[key]
            try:
                value = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError):
                value = None
            integral = key == "loss_count"
            if (value is None or tuple(value.shape) != shape or value.is_complex() or value.dtype == torch.bool
                    or (not integral and not value.is_floating_point())):
                what = (f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}" if value is not None
                        else type(first[key]).__name__)
                want = "an int >= 0 (or a 0-d integer tensor)" if integral else f"a float tensor of shape {shape}"
                raise ValueError(f"VeLO.load_state_dict: the saved {key!r} is {what}; it must be {want}; nothing "
                                 f"was changed")
            if integral:
                count = float(value)
                if not (count >= 0 and count == int(count)):
                    raise ValueError(f"VeLO.load_state_dict: the saved 'loss_count' is {count!r}; it must be an int "
                                     f">= 0; nothing was changed")

    def load_state_dict(self, state_dict):
        self._validate_state_dict(state_dict)
        num_steps = _validate_num_steps(state_dict["param_groups"][0]["num_steps"])
        if num_steps != self.num_steps:
            warnings.warn(
                f"VeLO.load_state_dict: the checkpoint was saved with num_steps={num_steps} and is resumed with that "
                f"horizon, not with this optimizer's num_steps={self.num_steps} (the checkpoint's loss buffer and "
                f"schedule were planned for it). To plan for {self.num_steps} steps from here instead, set "
                f"opt.param_groups[0]['num_steps'] = {self.num_steps} after loading", UserWarning, stacklevel=2)
        super().load_state_dict(state_dict)
        first = self.param_groups[0]
        first["num_steps"] = num_steps
        for key, dtype in (("loss_means", torch.float32), ("loss_running_min", torch.float32),
                           ("loss_count", torch.int32)):
            first[key] = torch.as_tensor(first[key]).to(device=self.controller_device, dtype=dtype, copy=True)

    def _restore_after_unpickling(self) -> None:
        self._constants_cache = {}


def _first_param_device(params) -> torch.device:
    """The device of the first parameter of ``params`` (an iterable of tensors or of param-group dicts)."""
    for item in params:
        group_params = item["params"] if isinstance(item, dict) else [item]
        if isinstance(group_params, torch.Tensor):
            group_params = [group_params]
        for p in group_params:
            if isinstance(p, tuple) and len(p) == 2:  # (name, tensor), as model.named_parameters() gives
                p = p[1]
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"VeLO: optimizer can only optimize Tensors, but one of the params is "
                                f"{torch.typename(p)}")
            return p.device
    raise ValueError("VeLO: optimizer got an empty parameter list")


# float32's largest value, and the smallest magnitude that rounds to ±inf (halfway between it and 2^128).
_FLOAT32_MAX = 2.0**128 - 2.0**104
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


def _as_float32(value: float) -> float:
    """A Python number as the step reads it: ±inf where float32 rounds it to ±inf (so that the non-finite
    check sees it, instead of a float32 conversion failing), float32's largest value where it rounds to
    that, else unchanged (rounded to float32 where it is used)."""
    value = float(value)
    if abs(value) >= _FLOAT32_OVERFLOW:
        return math.copysign(math.inf, value)
    return math.copysign(_FLOAT32_MAX, value) if abs(value) > _FLOAT32_MAX else value


def _lightning_accumulation(closure) -> int:
    """``accumulate_grad_batches`` of the Lightning Trainer whose optimizer-step closure this is, else 1.

    Lightning's precision plugins call ``optimizer.step(closure=partial(plugin._wrap_closure, module,
    optimizer, closure))``; the LightningModule knows its trainer."""
    if not isinstance(closure, functools.partial):
        return 1
    owner = getattr(closure.func, "__self__", None)
    if not type(owner).__module__.startswith(("lightning", "pytorch_lightning")):
        return 1
    for argument in closure.args:
        accumulation = getattr(getattr(argument, "_trainer", None), "accumulate_grad_batches", None)
        if isinstance(accumulation, int):
            return accumulation
    return 1


def _validated_loss(loss):
    """A loss as a Python number or a one-element real tensor (raises TypeError/ValueError otherwise)."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(
                f"VeLO needs the scalar training loss, got a tensor of shape {tuple(loss.shape)}; reduce it first "
                f"(e.g. loss.mean())")
        if loss.is_complex() or loss.dtype == torch.bool:
            raise TypeError(f"VeLO needs a real-valued loss, got a tensor of dtype {loss.dtype}")
        return loss
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return float(loss)
    raise TypeError(f"{_MISSING_LOSS}; got {type(loss).__name__}")
