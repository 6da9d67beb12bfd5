"""Optimizers stepped over a population: every tensor carries a leading population axis ``P``.

:class:`BatchedSmallFCLOpt` computes, for every population member ``m``, exactly the step
``lopt.SmallFCLOpt(backend="naive")`` computes for that member's parameters (docs/small_fc_lopt.md),
with every member allowed its own meta-weights and its own step count; with ``optimizer="elo"``, the
step of ``lopt.ELO(backend="naive")`` (docs/elo.md: the same features and network, ELO's decays used
as given, no ``step_mult``, its own weight decay). The optimizers whose step is batched here are
:data:`lopt.meta.rules.TRAINABLE`; each one's defaults are read from its ``torch.optim`` class, and its decays and
update from its reference module, so nothing of either is restated here. It is built from the
reference functions themselves (``lopt/reference/accumulators.py``, ``lopt/reference/small_fc_lopt.py``)
wherever their broadcasting allows, so that there is one source of truth:

* the accumulators (§3.2) and the 28 per-element features (§3.4, §3.5) are the reference functions
  called on ``(P,) + S`` tensors with the factored axes shifted by one (every reduction they do is
  along one of the member's own axes);
* the per-tensor second-moment normalisation (§3.6): the reference's ``feature_square_sums`` with
  every (member, feature) pair as one column (called on the batch as it is, it would sum over the
  members too), then the reference's ``normalise_by_square_sums`` with the sums broadcast per member;
* the time features (§3.7) are formed per member (members sit at different inner steps);
* the MLP (§3.8) multiplies every member by its own weights (``torch.baddbmm``); all tensors of a
  member go through it in one call;
* the update and weight decay (§3.9) are the reference's ``update_from_mlp`` and ``apply_update``.

A step whose gradients hold a non-finite value (or ``|g| >= 2^64``) changes nothing for that member
(parameters, state, step count), as ``SmallFCLOpt``'s default ``nonfinite="skip"`` does for the whole
optimizer. ``tests/test_meta_batched.py`` checks one member against ``SmallFCLOpt`` step by step.

:class:`BatchedAdamW` is ``torch.optim.AdamW`` (single-tensor formula) with a learning rate per
member, for the baselines of ``lopt meta-eval``. :class:`PopulationStep` is what every batched learned step
shares (this one and ``lopt.meta.batched_celo2.BatchedCELO2``); ``lopt.meta.rules`` says which class steps
which optimizer.
"""

from __future__ import annotations

import math
import warnings

import torch

from lopt.meta.rules import inner_rule
from lopt.reference import accumulators
from lopt.reference import small_fc_lopt as reference

GRADIENT_LIMIT = 2.0**64  # as lopt.optimizers.naive: beyond it g² overflows float32 and the step is skipped
TIMESCALES = torch.tensor(reference.TIMESCALES, dtype=torch.float32)


def _shifted(dims):
    return None if dims is None else (dims[0] + 1, dims[1] + 1)


_TIMESCALES_ON = {}


def batched_time_features(steps: torch.Tensor) -> torch.Tensor:
    """(P, 11): ``tanh(τ / T_i − 1)`` with ``τ = step − 1`` per member (float32, as ``reference.time_features``)."""
    timescales = _TIMESCALES_ON.get(steps.device)
    if timescales is None:  # (kept per device: no host-to-device copy inside a step, which a CUDA graph captures)
        timescales = _TIMESCALES_ON.setdefault(steps.device, TIMESCALES.to(steps.device))
    tau = (steps.to(torch.float32) - 1.0).unsqueeze(-1)
    return torch.tanh(tau / timescales - 1.0)


def _member_square_sums(features: torch.Tensor) -> torch.Tensor:
    """The reference's per-tensor feature statistics (§3.6), per member: (P, ..., 28) → (P, 28).

    ``accumulators.feature_square_sums`` reduces every axis but the last, column by column; with the
    members moved beside the features, each (member, feature) pair is one column, so the reference
    function itself forms every member's sums (whatever it does: float64, which values it leaves out).
    """
    population, columns = features.shape[0], features.shape[-1]
    by_column = features.reshape(population, -1, columns).transpose(0, 1).reshape(-1, population * columns)
    return accumulators.feature_square_sums(by_column).view(population, columns)


def _layer_names(network: dict) -> list:
    """PyLO's MetaMLP layers in order: ``network.input``, ``network.linear_0``, ``network.linear_1``, …, ``network.output``."""
    hidden = sorted((int(k[len("network.linear_"):-len(".weight")]) for k in network
                     if k.startswith("network.linear_") and k.endswith(".weight")))
    return ["network.input"] + [f"network.linear_{i}" for i in hidden] + ["network.output"]


def batched_mlp(inputs: torch.Tensor, network: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """§3.8 per member: ``inputs`` (P, N, 39); each weight either batched (P, out, in) / (P, out), one
    set per member, or shared (out, in) / (out,). ReLU between layers (as many hidden layers as the
    network has). Returns (direction, magnitude), each (P, N)."""

    def layer(x, weight, bias):
        if weight.dim() == 2:
            return torch.nn.functional.linear(x, weight, bias)
        return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))

    names = _layer_names(network)
    x = inputs
    for i, name in enumerate(names):
        x = layer(x, network[f"{name}.weight"], network[f"{name}.bias"])
        if i < len(names) - 1:
            x = torch.relu(x)
    return x[..., 0], x[..., 1]


class PopulationStep:
    """What every population-batched learned step shares: the members' shapes, their lr (a number, or a tensor
    read in place at every step), the per-member skip of a non-finite step, resetting members, and the step
    through ``torch.compile`` with its fallback. Subclasses form ``init_state`` (``"step"`` (P,) int64 and
    ``"tensors"``, one dict of buffers per parameter, each with the leading axis P) and ``_step``."""

    def __init__(self, shapes, population: int, device, *, lr, weight_decay, skip_nonfinite: bool, compiled: bool):
        self.shapes = [tuple(s) for s in shapes]
        self.population = int(population)
        self.device = torch.device(device)
        self.lr = lr.to(self.device) if torch.is_tensor(lr) else lr
        self.weight_decay = weight_decay
        self.skip_nonfinite = skip_nonfinite
        # compiled: the step through torch.compile (inductor, one graph: fullgraph), which fuses its several
        # hundred small elementwise ops per population step into a few kernels; within float32 rounding of the
        # eager step, not bit for bit (inductor contracts and reorders some of them).
        self.compiled = bool(compiled)
        self._compiled_step = torch.compile(self._step, fullgraph=True) if self.compiled else None
        self.compile_failure = None  # why torch.compile failed, where it did (then the step runs eagerly)

    def member_lr(self, dims: int):
        """The lr shaped to broadcast over a ``dims``-dimensional population tensor (one value per member)."""
        lr = self.lr
        return lr.view((-1,) + (1,) * (dims - 1)) if torch.is_tensor(lr) and lr.dim() else lr

    def reset_members(self, state: dict, members: torch.Tensor) -> None:
        """Zero the state of the members where ``members`` (P,) bool is True (a new task)."""
        state["step"].masked_fill_(members, 0)
        for buffers in state["tensors"]:
            for buf in buffers.values():
                if buf.numel():  # (masked_fill, not a product: a non-finite entry is cleared too)
                    buf.masked_fill_(members.view((-1,) + (1,) * (buf.dim() - 1)), 0.0)

    def finite_members(self, grads) -> torch.Tensor:
        """(P,) bool: the members whose every gradient element is finite and below 2^64 in magnitude."""
        ok = torch.ones(self.population, dtype=torch.bool, device=self.device)
        for g in grads:
            ok &= (g.detach().reshape(self.population, -1).abs() < GRADIENT_LIMIT).all(dim=1)
        return ok

    @torch.no_grad()
    def step(self, params, grads, state: dict, network: dict) -> list:
        """One step of every member; returns the new parameters (float32, ``(P,) + S``) and updates ``state``.

        ``network``: the meta-weights' tensors, each batched ``(P,) + shape`` or shared ``shape``.
        """
        if self._compiled_step is not None:
            try:
                return self._compiled_step(params, grads, state, network)
            except Exception as err:  # noqa: BLE001 - narrowed at once (torch._dynamo is imported only here)
                from torch._dynamo.exc import BackendCompilerFailed

                if not isinstance(err, BackendCompilerFailed):
                    raise
                # A compiler that fails on this graph (torch 2.11's inductor raises inside its own tiling
                # code for the CUDA graph of some task families) fails while compiling, before the compiled
                # step runs: nothing has changed, and the eager step is the same math.
                cause = getattr(err, "inner_exception", None) or err  # (what the compiler itself raised)
                warnings.warn(f"lopt.meta: torch.compile of the batched optimizer's step failed "
                              f"({type(err).__name__}: {type(cause).__name__}: {cause}); "
                              "stepping eagerly from now on (the same math: compile_inner changes only the speed)",
                              RuntimeWarning, stacklevel=2)
                self._compiled_step = None
                self.compile_failure = f"{type(cause).__name__}: {cause}"
        return self._step(params, grads, state, network)

    def _step(self, params, grads, state: dict, network: dict) -> list:
        raise NotImplementedError

    @staticmethod
    def keep_where(ok: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """``new`` for the members where ``ok`` (P,), ``old`` for the others."""
        return torch.where(ok.view((-1,) + (1,) * (new.dim() - 1)), new, old)


class BatchedSmallFCLOpt(PopulationStep):
    """small_fc_lopt (or ELO) stepped for ``population`` members at once (tensors ``(P,) + S``).

    Args:
        shapes: the per-member parameter shapes ``S`` (any rank; 0-d is the 1-element vector of §3.6).
        population: ``P``.
        device: where state lives.
        optimizer: ``"small_fc_lopt"`` (``lopt.SmallFCLOpt``'s step) or ``"elo"`` (``lopt.ELO``'s).
        lr, weight_decay, exp_mult, step_mult, momentum_decays, rms_decays, adafactor_decays: as the
            optimizer's class, whose defaults apply where None (ELO takes no ``step_mult``). ``lr`` may
            also be a tensor, 0-d (every member's) or (P,) (one per member), kept on ``device``.

    ``self.lr`` is what the step reads, at every step: a tensor there is read in place, so a schedule
    (``lopt.meta.evaluate.train_population``'s ``lr_schedule``, ``lopt.meta.estimators.InnerPopulation``'s
    ``schedule``) writes it between steps, and a CUDA graph
    captured from the step follows it.

    The state (:meth:`init_state`) is a dict: ``"step"`` (P,) int64 (steps taken, as ``group["step"]``)
    and ``"tensors"``, one dict per parameter with SmallFCLOpt's buffers, each with the leading axis P.
    """

    def __init__(self, shapes, population: int, device="cpu", *, optimizer: str = "small_fc_lopt", lr=None,
                 weight_decay=0.0, exp_mult=None, step_mult=None, momentum_decays=None, rms_decays=None,
                 adafactor_decays=None, skip_nonfinite: bool = True, compiled: bool = False):
        self.rule = inner_rule(optimizer)
        defaults = self.rule.defaults
        if step_mult is not None and "step_mult" not in defaults:
            raise ValueError(f"BatchedSmallFCLOpt: {optimizer} has no step_mult (its lr is its step size); "
                             "leave step_mult out")
        self.exp_mult = defaults["exp_mult"] if exp_mult is None else exp_mult
        self.step_mult = self.rule.step_mult if step_mult is None else step_mult
        given = (momentum_decays, rms_decays, adafactor_decays)
        names = ("momentum_decays", "rms_decays", "adafactor_decays")
        decays = [defaults[name] if value is None else value for name, value in zip(names, given)]
        self.decays = self.rule.reference.Decays.from_offsets(*decays).to(device)
        super().__init__(shapes, population, device, lr=defaults["lr"] if lr is None else lr, weight_decay=weight_decay,
                         skip_nonfinite=skip_nonfinite, compiled=compiled)
        self.work_shapes = [s if s else (1,) for s in self.shapes]
        self.dims = [_shifted(reference.factored_dims(s)) for s in self.shapes]
        self.counts = [math.prod(s) for s in self.work_shapes]

    def init_state(self) -> dict:
        tensors = []
        for shape, dims in zip(self.work_shapes, self.dims):
            state = accumulators.init_state((self.population,) + shape, dims)
            tensors.append({k: v.to(self.device) for k, v in state.items()})
        return {"step": torch.zeros(self.population, dtype=torch.int64, device=self.device), "tensors": tensors}

    def _step(self, params, grads, state: dict, network: dict) -> list:
        P = self.population
        ok = self.finite_members(grads) if self.skip_nonfinite else None
        step = state["step"] + (ok.to(torch.int64) if ok is not None else 1)
        inputs, pending = [], []
        for i, (p, g, work_shape, dims, count) in enumerate(zip(params, grads, self.work_shapes, self.dims, self.counts)):
            grad = g.detach().to(torch.float32).reshape((P,) + work_shape + (1,))
            value = p.detach().to(torch.float32).reshape((P,) + work_shape + (1,))
            buffers = state["tensors"][i]
            old = {k: v.clone() for k, v in buffers.items() if v.numel()} if ok is not None else None
            accumulators.update_accumulators(buffers, grad, self.decays, dims)
            if old is not None:
                for name, buf in old.items():
                    buffers[name].copy_(self.keep_where(ok, buffers[name], buf))
            features = reference.per_element_features(grad, value, buffers, dims)
            sums = _member_square_sums(features)  # (P, 28): the reference's sums, per member
            sums = sums.view((P,) + (1,) * (features.dim() - 2) + (reference.NUM_ELEMENT_FEATURES,))
            normalised = accumulators.normalise_by_square_sums(features, sums, count)
            inputs.append(normalised.reshape(P, count, reference.NUM_ELEMENT_FEATURES))
            pending.append((value.squeeze(-1), count))
        features = torch.cat(inputs, dim=1) if len(inputs) > 1 else inputs[0]
        time = batched_time_features(step).unsqueeze(1).expand(P, features.shape[1], reference.NUM_TIME_FEATURES)
        direction, magnitude = batched_mlp(torch.cat([features, time], dim=-1), network)
        updates = reference.update_from_mlp(direction, magnitude, self.exp_mult, self.step_mult)
        new_params, offset = [], 0
        for (value, count), shape in zip(pending, self.shapes):
            update = updates[:, offset:offset + count].reshape(value.shape)
            offset += count
            new = self.rule.reference.apply_update(value, update, self.member_lr(value.dim()), self.weight_decay)
            if ok is not None:
                new = self.keep_where(ok, new, value)
            new_params.append(new.reshape((P,) + shape))
        state["step"].copy_(step)  # in place: a captured step keeps reading and writing the same tensor
        return new_params


class BatchedAdamW:
    """``torch.optim.AdamW``'s update (``amsgrad=False``) with one learning rate per member.

    ``lr`` is a (P,) tensor (or a number); betas, eps and weight_decay as torch's (defaults 0.9, 0.999,
    1e-8, 1e-2). ``self.lr`` is read at every step, a tensor in place (a schedule writes it between steps, as
    :class:`BatchedSmallFCLOpt`'s). The step count is a device tensor (float64) and the bias corrections are
    formed from it on the device, in the arrangement of torch's ``capturable=True`` AdamW, so a CUDA graph can
    replay the step. Non-finite
    gradients are not skipped (as torch's AdamW).
    """

    def __init__(self, shapes, population: int, device="cpu", *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2):
        self.shapes = [tuple(s) for s in shapes]
        self.population = int(population)
        self.device = torch.device(device)
        self.lr = lr.to(self.device) if torch.is_tensor(lr) else lr
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay

    def init_state(self) -> dict:
        zeros = [torch.zeros((self.population,) + s, device=self.device) for s in self.shapes]
        return {"step": torch.zeros((), dtype=torch.float64, device=self.device), "exp_avg": zeros,
                "exp_avg_sq": [z.clone() for z in zeros]}

    @torch.no_grad()
    def step(self, params, grads, state: dict, network=None) -> list:
        beta1, beta2 = self.betas
        step = state["step"]
        step.add_(1)
        # in float64, as torch's non-capturable AdamW forms them from Python floats, then float32
        bias_correction1 = (1 - torch.pow(beta1, step)).to(torch.float32)
        bias_correction2 = (1 - torch.pow(beta2, step)).to(torch.float32)
        new_params = []
        for p, g, m, v in zip(params, grads, state["exp_avg"], state["exp_avg_sq"]):
            lr = self.lr.view((-1,) + (1,) * (p.dim() - 1)) if torch.is_tensor(self.lr) else self.lr
            p = p.detach() * (1 - lr * self.weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            step_size_neg = -(lr / bias_correction1)
            denom = (v.sqrt() / (bias_correction2.sqrt() * step_size_neg)).add_(self.eps / step_size_neg)
            new_params.append(p + m / denom)
        return new_params
