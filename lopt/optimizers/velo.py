"""``lopt.VeLO``: VeLO as a drop-in ``torch.optim`` optimizer that takes the training loss."""

from __future__ import annotations

import math
import numbers
import operator
import warnings

import torch

from lopt.optimizers.base import LearnedOptimizer
from lopt.reference import velo as reference

# Optimizer-wide state. It lives in the first param group so that torch's own state_dict carries it
# (group entries are saved and restored verbatim; ``add_param_group`` does not copy them).
GLOBAL_STATE_KEYS = ("num_steps", "loss_means", "loss_running_min", "loss_count", "skipped_steps")
TENSOR_STATE_KEYS = ("mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v", "lstm_hidden", "lstm_cell")

_MISSING_LOSS = (
    "VeLO.step needs the training loss: call opt.step(loss) with the loss of this step (a float or a 0-d tensor, "
    "computed before backward), or opt.step(closure) with a closure that returns it"
)


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
    (``shared/spec/velo.md``; the JAX ``HyperV2`` of learned_optimization) with these decisions:

    * ``lr`` defaults to **1.0**, the step VeLO was meta-trained with (JAX VeLO has no lr).
      PyLO's constructor default ``1e-3`` makes every step 1000× smaller than VeLO's; pass
      ``lr=1e-3`` for bit-compatible PyLO defaults.
    * Ties between equal axis sizes when choosing the factored axes: stable order, then PyLO
      VeLO's swap rule (deterministic on every platform).
    * 0-d parameters follow the JAX definition (the scalar as a 1-element vector; PyLO crashes).
    * Rank ≥ 5 tensors (five or more axes of size > 1) get the all-zero rank encoding (JAX).
    * A tensor without a gradient in a step is skipped: no LSTM row, no state change.
    * State and math are float32 for every parameter dtype; the parameter keeps its dtype.

    Args:
        params: parameters or parameter groups (groups may set ``lr``, ``weight_decay``, ...).
        num_steps: the planned length of training in optimizer steps (required). VeLO's features
            include the fraction of it done, and its loss features average over timescales from
            10 steps up to ``num_steps``. VeLO was meta-trained on runs of up to 150k steps
            (JAX's prefab turns longer runs into gradient accumulation); stepping past
            ``num_steps`` works, with the fraction features saturating.
        lr: multiplies VeLO's step (1.0 = the meta-trained step).
        weight_decay: decoupled weight decay after the update, ``p -= weight_decay * lr * p``.
        weights: meta-weights — a registered name (default ``"velo"``: hub repos
            ``Pauljanson002/VeLO_RNN`` and ``Pauljanson002/VeLO_MLP``), a pair ``(rnn, mlp)`` or
            dict ``{"rnn": ..., "mlp": ...}`` of local directories in PyLO's hub layout, hub repo
            ids or ``.safetensors`` files, or a :class:`lopt.weights.MetaWeights`.
        backend: ``"auto"`` or ``"naive"`` (VeLO has no fused backend yet; ``"fused"`` raises).
        exp_mult, step_mult: output scalings (PyLO defaults 0.001 and 0.001).
        momentum_decays, rms_decays, adafactor_decays: offsets added to the decays
            (0.9, 0.99, 0.999) / (0.999,) / (0.9, 0.99, 0.999) in PyLO's parametrisation; VeLO's
            weights were meta-trained with zeros.

    ``step(loss)`` needs this step's training loss (a Python number, or a tensor with one element
    on any device) or a closure that returns it; see :meth:`step`.

    State: per parameter (float32, PyLO's accumulator names and layout, decay axis last) ``mom``
    ``S+(3,)``, ``rms`` ``S+(1,)``, ``fac_vec_row``/``fac_vec_col`` (rank ≥ 2) or ``fac_vec_v``,
    and the tensor's LSTM row ``lstm_hidden``, ``lstm_cell`` (512 each). Each group counts its
    steps in ``group["step"]``. The optimizer-wide state lives in the first group:
    ``num_steps``, the loss buffer ``loss_means``, ``loss_running_min`` (10 each) and
    ``loss_count``, and ``skipped_steps`` (steps skipped for a non-finite loss on a GPU).
    """

    architecture = "velo"
    reference = reference
    requires_loss = True

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
    ):
        num_steps = _validate_num_steps(num_steps)
        defaults = self.accumulator_defaults(
            lr=lr, weight_decay=weight_decay, exp_mult=exp_mult, step_mult=step_mult, momentum_decays=momentum_decays,
            rms_decays=rms_decays, adafactor_decays=adafactor_decays)
        self._constants_cache: dict = {}
        super().__init__(params, defaults, weights=weights, backend=backend)

        # The loss buffer and the batched controller live on the first parameter's device.
        self.controller_device = next(iter(self._all_params())).device
        buffer = reference.init_loss_buffer(num_steps, self.controller_device)
        first = self.param_groups[0]
        first["num_steps"] = num_steps
        first["loss_means"] = buffer.means
        first["loss_running_min"] = buffer.running_min
        first["loss_count"] = buffer.count
        first["skipped_steps"] = torch.zeros((), dtype=torch.int64, device=self.controller_device)
        for group in self.param_groups:
            group.setdefault("step", 0)
        # State is created eagerly (as PyLO does), so the first step allocates nothing and
        # host-to-device copies of the meta-weights happen here, not inside step().
        self.weights_on(self.controller_device)
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

    def ensure_state(self, p) -> dict:
        state = self.state[p]
        if not state:
            super().ensure_state(p)
            hidden, cell = reference.initial_lstm_state(self.weights_on(p.device)["rnn"])
            state["lstm_hidden"] = hidden.clone()
            state["lstm_cell"] = cell.clone()
        return state

    # ------------------------------------------------------------------ loss

    def _loss_on_controller(self, loss) -> tuple[torch.Tensor, bool]:
        """(float32 0-d loss on the controller device, whether its finiteness is checked on the device).

        Raises before anything changes if the loss is missing or malformed, or non-finite where it
        can be checked without stalling a GPU (Python numbers, CPU tensors, CPU parameters).
        """
        if loss is None:
            raise TypeError(_MISSING_LOSS)
        device = self.controller_device
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"VeLO.step needs the scalar training loss, got a tensor of shape {tuple(loss.shape)}; "
                    f"reduce it first (e.g. loss.mean())"
                )
            if loss.is_complex() or loss.dtype == torch.bool:
                raise TypeError(f"VeLO.step needs a real-valued loss, got a tensor of dtype {loss.dtype}")
            if loss.device.type != "cpu" and device.type != "cpu":
                # Checking on the host would wait for the whole forward/backward: check on the device.
                return loss.detach().reshape(()).to(device=device, dtype=torch.float32), True
            loss = loss.detach().item()
        elif isinstance(loss, numbers.Real) and not isinstance(loss, bool):
            loss = float(loss)
        else:
            raise TypeError(f"{_MISSING_LOSS}; got {type(loss).__name__}")
        if not math.isfinite(loss):
            raise ValueError(
                f"VeLO.step got a non-finite loss ({loss}); nothing was changed. VeLO's loss features would be "
                f"corrupted for the rest of training: skip this step (or lower the learning rate / fix the model)"
            )
        # torch.full writes the value on the device without a host-to-device copy.
        return torch.full((), loss, dtype=torch.float32, device=device), False

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, loss=None):
        """One VeLO step.

        ``loss`` is this step's training loss: a Python number, a one-element tensor on any device,
        or a closure that re-evaluates the model (with gradients) and returns it. Returns the loss
        as given (the closure's result for a closure).

        Missing, malformed or non-finite losses raise (``TypeError``/``ValueError``) before any
        state or parameter changes. One exception, so that a CUDA training loop never waits for
        the GPU: a loss tensor on a GPU (with parameters on a GPU) is checked on the device, and if
        it is not finite the step changes no tensor (parameters, accumulators, LSTM state and loss
        buffer keep their values) and ``param_groups[0]["skipped_steps"]`` counts it; the step
        counters still advance (the step happened in the schedule, as an LR scheduler's would).
        """
        if callable(loss):
            with torch.enable_grad():
                loss = loss()
        returned = loss
        loss_value, check_on_device = self._loss_on_controller(loss)
        self._check_gradients()

        device = self.controller_device
        keep = torch.isfinite(loss_value) if check_on_device else None  # device-side "apply this step"
        first = self.param_groups[0]
        num_steps = first["num_steps"]

        # 1. Loss buffer and loss features (shared by every tensor).
        new_buffer = reference.update_loss_buffer(self.loss_buffer(), loss_value)
        loss_feats = reference.loss_features(new_buffer)

        # 2. Statistics stage: one LSTM input row per tensor with a gradient, from the old state.
        entries = []  # (group, param, state)
        statistics, fractions, ranks, hiddens, cells = [], [], [], [], []
        constants = self._constants(device)
        for group in self.param_groups:
            steps_taken = self._host_step(group)
            fraction = reference.fraction_features(steps_taken, num_steps, constants["fraction_timescales"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.ensure_state(p)
                view = self._work_view(p, state)
                entries.append((group, p, state))
                param32 = p.detach().to(torch.float32).reshape(view["shape"])
                statistics.append(reference.lstm_statistics(param32, view["mom"], view["rms"]).to(device))
                fractions.append(fraction)
                ranks.append(constants["rank_one_hot"][min(reference.tensor_rank(p.shape), reference.NUM_RANK_CLASSES)])
                hiddens.append(state["lstm_hidden"].to(device))
                cells.append(state["lstm_cell"].to(device))

        if entries:
            # 3. Controller stage, batched over every tensor of the model.
            inputs = reference.lstm_input_features(torch.stack(fractions), loss_feats, torch.stack(statistics),
                                                   torch.stack(ranks))
            weights = self.weights_on(device)
            controller = reference.controller_step(inputs, torch.stack(hiddens), torch.stack(cells), weights["rnn"])
            mlps = reference.generate_mlp_weights(controller.controls, weights["mlp"])

        # 4. Apply stage, per tensor (the step counters advance first: PyLO's order).
        for group in self.param_groups:
            group["step"] = self._host_step(group) + 1
        for index, (group, p, state) in enumerate(entries):
            self._apply(group, p, state, mlps.select(index, p.device), controller.lr_mult[index].to(p.device),
                        controller.hidden[index], controller.cell[index], keep)

        self._commit_loss_buffer(new_buffer, keep)
        return returned

    def _work_view(self, p, state) -> dict:
        """The tensor's shape for the math and its accumulators viewed in it (0-d → (1,))."""
        shape = reference.work_shape(p.shape)
        view = {"shape": shape}
        for name in ("mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v"):
            buf = state[name]
            view[name] = buf.view(shape + buf.shape[-1:]) if buf.numel() and p.dim() == 0 else buf
        return view

    def _apply(self, group, p, state, mlp, lr_mult, hidden, cell, keep) -> None:
        view = self._work_view(p, state)
        shape = view.pop("shape")
        accumulators = view if keep is None else {name: buf.clone() for name, buf in view.items()}
        param32 = p.detach().to(torch.float32).reshape(shape)
        grad32 = reference.clip_gradient(p.grad).reshape(shape)
        new_param = reference.apply_stage(
            param32, grad32, accumulators, reference.factored_dims(tuple(p.shape)), self.decays(group, p.device), mlp,
            lr_mult, lr=group["lr"], weight_decay=group["weight_decay"], exp_mult=group["exp_mult"],
            step_mult=group["step_mult"],
        )
        new_param = new_param.reshape(p.shape)
        if keep is None:
            p.copy_(new_param)
            state["lstm_hidden"].copy_(hidden)
            state["lstm_cell"].copy_(cell)
            return
        keep = keep.to(p.device)
        for name, buf in view.items():
            buf.copy_(torch.where(keep, accumulators[name], buf))
        p.copy_(torch.where(keep, new_param.to(p.dtype), p))
        state["lstm_hidden"].copy_(torch.where(keep.to(hidden.device), hidden, state["lstm_hidden"].to(hidden.device)))
        state["lstm_cell"].copy_(torch.where(keep.to(cell.device), cell, state["lstm_cell"].to(cell.device)))

    def _commit_loss_buffer(self, buffer: reference.LossBuffer, keep) -> None:
        # New tensors rather than in-place writes: a state_dict taken earlier keeps its values.
        first = self.param_groups[0]
        if keep is None:
            first["loss_means"], first["loss_running_min"], first["loss_count"] = (
                buffer.means, buffer.running_min, buffer.count)
            return
        first["loss_means"] = torch.where(keep, buffer.means, first["loss_means"])
        first["loss_running_min"] = torch.where(keep, buffer.running_min, first["loss_running_min"])
        first["loss_count"] = torch.where(keep, buffer.count, first["loss_count"])
        first["skipped_steps"] = first["skipped_steps"] + (~keep).to(torch.int64)

    # ------------------------------------------------------------------ state dicts

    def state_dict(self):
        state = super().state_dict()
        first = state["param_groups"][0]
        for key in GLOBAL_STATE_KEYS:  # independent copies (they are replaced, not mutated, but be safe)
            if torch.is_tensor(first.get(key)):
                first[key] = first[key].clone()
        return state

    def load_state_dict(self, state_dict):
        groups = state_dict.get("param_groups") or [{}]
        missing = [key for key in GLOBAL_STATE_KEYS if key not in groups[0]]
        if missing:
            raise ValueError(
                f"not a VeLO state dict: its first param group lacks {missing} (VeLO keeps num_steps, the loss "
                f"buffer and the skipped-step count there)"
            )
        for index, values in state_dict.get("state", {}).items():
            absent = [key for key in TENSOR_STATE_KEYS if key not in values]
            if absent:
                raise ValueError(f"not a VeLO state dict: the state of parameter #{index} lacks {absent}")
        super().load_state_dict(state_dict)
        first = self.param_groups[0]
        first["num_steps"] = _validate_num_steps(first["num_steps"])
        for key, dtype in (("loss_means", torch.float32), ("loss_running_min", torch.float32),
                           ("loss_count", torch.int32), ("skipped_steps", torch.int64)):
            first[key] = torch.as_tensor(first[key]).to(device=self.controller_device, dtype=dtype, copy=True)
