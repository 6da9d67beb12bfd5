"""Gradient estimators for the meta-parameters θ: truncated PES and full-length antithetic ES.

Both follow google/learned_optimization's ``outer_trainers/truncated_pes.py`` and ``full_es.py``:

* a population of ``num_tasks`` task instances of one family, each trained twice, by the
  learned optimizer with ``θ + ε_i`` and with ``θ − ε_i`` (antithetic pairs; ``ε_i ~ N(0, σ² I)``),
  all ``2·num_tasks`` members stepping together (:class:`InnerPopulation`);
* the per-step meta-objective is the task's training loss at each inner step (before that step's
  update), normalised by the family (clipped to ``1.5·L0``, NaN → ``1.5·L0``), averaged over the
  steps of the unroll (ES) or of the truncation (PES);
* the estimate is ``mean_i (L⁺_i − L⁻_i) · ξ_i / (2σ²)`` with ``ξ_i = ε_i`` for ES.

**Truncated PES** keeps every instance's two inner trainings alive across outer steps and advances
them ``truncation`` steps per outer step, each truncation with fresh noise; ``ξ_i`` is the sum of the
noise the instance has been trained with since its unroll started (PES's accumulator: it makes the
estimate unbiased across truncations). An instance's unroll length is drawn log-uniformly in
``[min_unroll, max_unroll]``; when it is reached, the instance is replaced by a new draw of the task
(new parameters, zero optimizer state, ξ reset to zero). Unroll lengths are rounded up to a
multiple of the truncation, so a reset always falls on a truncation boundary and each truncation's
ξ is exact (learned_optimization resets inside a truncation and switches to the new noise from the
reset on). The starts are staggered as learned_optimization's ``random_initial_iteration_offset``
does: the first unroll of each instance begins at a random truncation boundary inside its length
(the optimizer's step count still starts at 0), so the instances reach the end of their unrolls at
different outer steps.

**Full ES** draws a new population every outer step and unrolls it for a length drawn
log-uniformly in ``[min_unroll, max_unroll]`` (one length per outer step), ``ξ_i = ε_i``; a NaN
difference counts as 0 and ``clip_loss_diff`` optionally bounds each difference, as in ``full_es.py``.

**Inner lr schedule** (``schedule``, lopt's; ``MetaTrainConfig.inner_schedule``): other than ``"constant"``,
every member's lr at inner step ``t`` of its unroll of length ``L`` is ``base · SCHEDULES[schedule](t, L)``
(:mod:`lopt.meta.schedules`), ``base`` the optimizer's lr as constructed. For PES ``t`` is the instance's
position in its unroll (staggered starts included) plus the step within the truncation and ``L`` the
instance's unroll length; for ES ``t`` counts from 0 and ``L`` is the outer step's unroll length. Both
members of an antithetic pair share the lr.
"""

from __future__ import annotations

import math

import torch

from lopt.meta.rules import batched_optimizer
from lopt.meta.schedules import SCHEDULES, multipliers
from lopt.meta.stepper import PopulationStepper, _copy_into


def _dup(value):
    """Repeat along the leading axis for the antithetic pair: rows [+ ... , − ...]."""
    if torch.is_tensor(value):
        return torch.cat([value, value], dim=0)
    if isinstance(value, (tuple, list)):
        return type(value)(_dup(v) for v in value)
    if isinstance(value, dict):
        return {k: _dup(v) for k, v in value.items()}
    raise TypeError(type(value))


def _set_rows(target: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> None:
    """target[mask] = source[mask] along the leading axis, in place (no host sync)."""
    target.copy_(torch.where(mask.view((-1,) + (1,) * (target.dim() - 1)), source, target))


class InnerPopulation:
    """``num_tasks`` instances of ``family``, each trained by ``members`` (2: antithetic, 1: plain)
    copies of the learned optimizer, batched along the leading axis (rows ``[+ for every instance,
    − for every instance]``). Its tensors keep their storage from the first ``start`` on (new draws
    are copied in), so that a step captured as a CUDA graph (:mod:`lopt.meta.stepper`) stays valid.

    ``schedule``: a name of :data:`lopt.meta.schedules.SCHEDULES`. Other than ``"constant"``, the optimizer's lr
    is a (P,) tensor on the device (its lr as constructed, ``lr_base``, per member), and :meth:`unroll` writes
    ``lr_base · multiplier`` into it in place before every step, outside the step (a captured graph reads it).
    ``"constant"`` leaves the optimizer as constructed (its lr a number, unless given as a tensor).

    ``lr_range``: (low, high), or None. Given, every instance draws its learned lr log-uniformly from it whenever it
    is drawn (:meth:`start`, :meth:`reset`; from the generator they are given, after the instance), its members
    (both of an antithetic pair) share it, and it is ``lr_base`` for that instance's rows: the lr of the unroll
    (scaled by the schedule, where there is one)."""

    def __init__(self, family, num_tasks: int, members: int = 2, device="cpu", optimizer_kwargs=None,
                 use_graph: bool = False, schedule: str = "constant", lr_range=None):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
        self.lr_range = None if lr_range is None else (float(lr_range[0]), float(lr_range[1]))
        self.family = family
        self.num_tasks = int(num_tasks)
        self.members = int(members)
        self.population = self.num_tasks * self.members
        self.device = torch.device(device)
        self.schedule = schedule
        self.lr_base = None  # scheduled or drawn (lr_range): the (P,) lr that the multipliers scale
        self.use_graph = use_graph
        self.params = None
        self.opt_state = None
        self.inst = None
        self.stepper = None
        self.set_optimizer(batched_optimizer(family.shapes(), self.population, self.device,
                                              **(optimizer_kwargs or {})))

    @property
    def scheduled(self) -> bool:
        return self.schedule != "constant"

    @property
    def per_member_lr(self) -> bool:
        """Whether the optimizer's lr is a (P,) device tensor this population writes (scheduled, or drawn)."""
        return self.scheduled or self.lr_range is not None

    def set_optimizer(self, optimizer) -> None:
        """Train with ``optimizer`` (a population optimizer over P members; before the first step). Scheduled, its
        ``lr`` (a number, a 0-d or a (P,) tensor) becomes a (P,) float32 tensor on the device that its step reads
        in place, and ``lr_base`` a copy of it."""
        if self.stepper is not None:
            raise RuntimeError("InnerPopulation.set_optimizer: the population has stepped already")
        if self.per_member_lr:
            lr = optimizer.lr
            lr = lr.detach() if torch.is_tensor(lr) else torch.tensor(float(lr))
            self.lr_base = lr.to(device=self.device, dtype=torch.float32).expand(self.population).clone()
            optimizer.lr = self.lr_base.clone()
        self.optimizer = optimizer

    def _expand(self, value):
        return value if self.members == 1 else _dup(value)

    def _draw_lrs(self, generator) -> torch.Tensor | None:
        """(P,): a log-uniform lr from ``lr_range`` per instance, repeated over its members (None without a range)."""
        if self.lr_range is None:
            return None
        low, high = self.lr_range
        u = torch.rand(self.num_tasks, generator=generator, device=generator.device, dtype=torch.float64)
        lrs = torch.exp(math.log(low) + u * (math.log(high) - math.log(low))).to(self.device, torch.float32)
        return self._expand(lrs)

    def _set_lrs(self, lrs: torch.Tensor, member_mask: torch.Tensor | None = None) -> None:
        """Drawn lrs into ``lr_base`` (the rows of ``member_mask``, or all), and into the optimizer's lr where no
        schedule writes it before every step. In place: a captured graph reads the optimizer's tensor."""
        targets = [self.lr_base] + ([] if self.scheduled else [self.optimizer.lr])
        for target in targets:
            if member_mask is None:
                target.copy_(lrs)
            else:
                _set_rows(target, member_mask, lrs)

    def start(self, generator) -> None:
        """Every instance drawn anew (parameters, instance data), the optimizer state zeroed."""
        inst = self.family.sample_instances(self.num_tasks, generator)
        params = [self._expand(p) for p in self.family.init_params(self.num_tasks, inst, generator)]
        lrs = self._draw_lrs(generator)
        if lrs is not None:
            self._set_lrs(lrs)
        if self.params is None:
            self.inst, self.params, self.opt_state = inst, params, self.optimizer.init_state()
            return
        with torch.no_grad():
            _copy_into(self.inst, inst)
            _copy_into(self.params, params)
        self.optimizer.reset_members(self.opt_state, torch.ones(self.population, dtype=torch.bool, device=self.device))

    def reset(self, mask: torch.Tensor, generator) -> None:
        """Replace the instances where ``mask`` (num_tasks,) is True by new draws (parameters, state)."""
        fresh = self.family.sample_instances(self.num_tasks, generator)
        base = self.family.init_params(self.num_tasks, fresh, generator)
        for key, value in self.inst.items():
            _set_rows(value, mask, fresh[key])
        member_mask = self._expand(mask)
        for p, new in zip(self.params, base):
            _set_rows(p, member_mask, self._expand(new))
        lrs = self._draw_lrs(generator)
        if lrs is not None:
            self._set_lrs(lrs, member_mask)
        self.optimizer.reset_members(self.opt_state, member_mask)

    def _stepper(self) -> PopulationStepper:
        if self.stepper is None:
            self.stepper = PopulationStepper(self.family, self.optimizer, self.params, self.opt_state,
                                             lambda: self._expand(self.inst), self._expand, self.use_graph)
        return self.stepper

    def unroll(self, network: dict, steps: int, generator, on_step=None, positions=0, lengths=None) -> torch.Tensor:
        """Train every member ``steps`` steps with its meta-weights (``network``: batched (P, ...) or shared);
        returns the normalised training losses (steps, P), each taken before that step's update.

        Scheduled (``schedule``), the lr of instance i's members at the call's step s is
        ``lr_base · SCHEDULES[schedule](positions[i] + s, lengths[i])``: ``positions`` and ``lengths`` (an int, or
        one per instance) say where in its unroll each instance is at the call's first step and how long that
        unroll is (required then). The (steps, P) multipliers are formed once on the host and copied to the
        device in one copy. Not scheduled, they are ignored."""
        stepper = self._stepper()
        lr = mults = None
        if self.scheduled:
            if lengths is None:
                raise ValueError(f"a scheduled unroll ({self.schedule}) needs the unroll lengths")
            positions = [int(positions)] * self.num_tasks if isinstance(positions, int) else list(positions)
            lengths = [int(lengths)] * self.num_tasks if isinstance(lengths, int) else list(lengths)
            if not len(positions) == len(lengths) == self.num_tasks:
                raise ValueError(f"a scheduled unroll takes one position and one length per instance "
                                 f"({self.num_tasks}), got {len(positions)} and {len(lengths)}")
            per_instance = multipliers(self.schedule, positions, lengths, steps)
            mults = (per_instance if self.members == 1 else per_instance.repeat(1, self.members)).to(self.device)
            lr = self.optimizer.lr
        losses = torch.empty(steps, self.population, device=self.device)
        for t in range(steps):
            if mults is not None:
                # in place and outside the step: a CUDA graph captured from the step reads this storage at every replay
                torch.mul(self.lr_base, mults[t], out=lr)
            loss = stepper.step(network, self.family.sample_batch(self.inst, generator))
            losses[t] = self.family.normalise(loss)
            if on_step is not None:
                on_step()
        return losses

    def state_dict(self) -> dict:
        state = {"params": self.params, "opt_state": self.opt_state, "inst": self.inst}
        if self.lr_range is not None:  # (the drawn lrs; without a range the lr is the constructor's, not state)
            state["lr_base"] = self.lr_base
        return state

    def load_state_dict(self, state: dict) -> None:
        device = self.device
        params = [p.to(device) for p in state["params"]]
        opt_state = {"step": state["opt_state"]["step"].to(device),
                     "tensors": [{k: v.to(device) for k, v in t.items()} for t in state["opt_state"]["tensors"]]}
        inst = {k: v.to(device) for k, v in state["inst"].items()}
        if self.lr_range is not None:
            self._set_lrs(state["lr_base"].to(device))
        if self.params is None:
            self.params, self.opt_state, self.inst = params, opt_state, inst
            return
        with torch.no_grad():
            _copy_into(self.params, params)
            _copy_into(self.opt_state, opt_state)
            _copy_into(self.inst, inst)


def log_uniform_int(low: int, high: int, generator: torch.Generator) -> int:
    u = float(torch.rand((), generator=generator))
    return int(round(math.exp(math.log(low) + u * (math.log(high) - math.log(low)))))


class TruncatedPES:
    """Truncated PES over one task family (see the module docstring)."""

    kind = "pes"

    def __init__(self, family, space, *, num_tasks=8, std=0.01, truncation=50, min_unroll=100, max_unroll=1000,
                 device="cpu", optimizer_kwargs=None, use_graph=False, schedule="constant", lr_range=None):
        self.family = family
        self.space = space
        self.std = float(std)
        self.truncation = int(truncation)
        self.min_unroll, self.max_unroll = int(min_unroll), int(max_unroll)
        self.device = torch.device(device)
        self.inner = InnerPopulation(family, num_tasks, 2, self.device, optimizer_kwargs, use_graph, schedule,
                                     lr_range)
        self.num_tasks = self.inner.num_tasks
        self.accumulator = None   # ξ (num_tasks, D)
        self.position = None      # inner steps taken in the current unroll (num_tasks,), host
        self.length = None        # that unroll's length (num_tasks,), host

    def _length(self, host_gen) -> int:
        length = log_uniform_int(self.min_unroll, self.max_unroll, host_gen)
        return max(self.truncation, -(-length // self.truncation) * self.truncation)

    def start(self, host_gen, device_gen) -> None:
        self.inner.start(device_gen)
        self.accumulator = torch.zeros(self.num_tasks, self.space.dim, device=self.device)
        self.length = [self._length(host_gen) for _ in range(self.num_tasks)]
        # staggered starts: a random truncation boundary inside the first unroll
        self.position = [int(torch.randint(n // self.truncation, (), generator=host_gen)) * self.truncation
                         for n in self.length]

    def estimate(self, theta: torch.Tensor, host_gen, device_gen, on_step=None) -> dict:
        """One truncation: returns {"grad": (D,), "loss": mean normalised loss, "resets": int, ...}."""
        done = [pos >= n for pos, n in zip(self.position, self.length)]
        if any(done):
            mask = torch.tensor(done, device=self.device)
            self.inner.reset(mask, device_gen)
            self.accumulator.masked_fill_(mask.unsqueeze(1), 0.0)
            for i, d in enumerate(done):
                if d:
                    self.position[i], self.length[i] = 0, self._length(host_gen)
        eps = torch.randn(self.num_tasks, self.space.dim, generator=device_gen, device=self.device) * self.std
        members = torch.cat([theta + eps, theta - eps])
        losses = self.inner.unroll(self.space.unflatten(members), self.truncation, device_gen, on_step,
                                   positions=self.position, lengths=self.length)
        mean = losses.mean(0)
        positive, negative = mean[: self.num_tasks], mean[self.num_tasks:]
        delta = torch.nan_to_num(positive - negative, nan=0.0, posinf=0.0, neginf=0.0)
        self.accumulator.add_(eps)
        grad = (delta.unsqueeze(1) * self.accumulator).mean(0) / (2 * self.std**2)
        for i in range(self.num_tasks):
            self.position[i] += self.truncation
        return {"grad": grad, "loss": float(((positive + negative) / 2).mean()), "resets": int(sum(done)),
                "inner_steps": self.truncation * self.inner.population}

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "accumulator": self.accumulator, "position": list(self.position),
                "length": list(self.length)}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        self.accumulator = state["accumulator"].to(self.device)
        self.position, self.length = list(state["position"]), list(state["length"])


class FullES:
    """Antithetic ES over full unrolls (see the module docstring)."""

    kind = "es"

    def __init__(self, family, space, *, num_tasks=8, std=0.01, min_unroll=100, max_unroll=1000,
                 clip_loss_diff=None, device="cpu", optimizer_kwargs=None, truncation=None, use_graph=False,
                 schedule="constant", lr_range=None):
        self.family = family
        self.space = space
        self.std = float(std)
        self.min_unroll, self.max_unroll = int(min_unroll), int(max_unroll)
        self.clip_loss_diff = clip_loss_diff
        self.device = torch.device(device)
        self.inner = InnerPopulation(family, num_tasks, 2, self.device, optimizer_kwargs, use_graph, schedule,
                                     lr_range)
        self.num_tasks = self.inner.num_tasks

    def start(self, host_gen, device_gen) -> None:
        pass

    def estimate(self, theta: torch.Tensor, host_gen, device_gen, on_step=None) -> dict:
        length = log_uniform_int(self.min_unroll, self.max_unroll, host_gen)
        self.inner.start(device_gen)
        eps = torch.randn(self.num_tasks, self.space.dim, generator=device_gen, device=self.device) * self.std
        losses = self.inner.unroll(self.space.unflatten(torch.cat([theta + eps, theta - eps])), length, device_gen,
                                   on_step, positions=0, lengths=length)
        mean = losses.mean(0)
        positive, negative = mean[: self.num_tasks], mean[self.num_tasks:]
        delta = torch.nan_to_num(positive - negative, nan=0.0, posinf=0.0, neginf=0.0)
        if self.clip_loss_diff:
            delta = delta.clamp(-self.clip_loss_diff, self.clip_loss_diff)
        grad = (delta.unsqueeze(1) * eps).mean(0) / (2 * self.std**2)
        return {"grad": grad, "loss": float(((positive + negative) / 2).mean()), "resets": self.num_tasks,
                "inner_steps": length * self.inner.population}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


ESTIMATORS = {"pes": TruncatedPES, "es": FullES}
