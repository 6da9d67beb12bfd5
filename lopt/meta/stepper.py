"""One training step of a whole population, eager or replayed from a CUDA graph.

A step is: expand the per-source batch to the members (inside the step), the task's loss per member,
its gradients (autograd), the batched optimizer's step, the new parameters written into the same
tensors. Everything it touches lives in tensors that keep their storage (parameters, optimizer
state, instance data, the network's weights, the batch, the optimizer's ``lr`` where it is a tensor,
which a schedule writes in place between steps), so on CUDA the step can be captured once
as a CUDA graph and replayed: one launch instead of hundreds per step, which is what bounds a
population of small tasks on a GPU. The batch is drawn outside the graph (the same draws, in the
same order, as the eager step makes) and copied into the graph's input; new meta-weights are copied
into its copy of the network.

If capture fails, the stepper warns once and stays eager; nothing has changed then (capturing records
kernels without running them). ``tests/test_meta_batched.py::test_cuda_graph_steps_equal_eager_steps``
checks, on a GPU, that replayed steps give what eager steps give.
"""

from __future__ import annotations

import warnings

import torch

# Tests set this to follow the graph path on the CPU (PopulationStepper's ``emulate``).
EMULATE_ON_CPU = False


def _copy_into(target, source):
    if target is None:
        return
    if torch.is_tensor(target):
        target.copy_(source)
    elif isinstance(target, dict):
        for k in target:
            _copy_into(target[k], source[k])
    else:
        for t, s in zip(target, source):
            _copy_into(t, s)


def _clone(value):
    if value is None:
        return None
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return type(value)(_clone(v) for v in value)


def _same_layout(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_layout(a[k], b[k]) for k in a)
    return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))


class PopulationStepper:
    """Steps ``params`` (a list of tensors updated in place) with ``optimizer`` on ``family``'s loss.

    ``expand(source_batch)`` maps the drawn batch to one batch per member (inside the step);
    ``inst`` is the members' instance data (rows per member), or a function that forms it (inside the
    step, so that a captured step follows in-place changes of what it reads); ``use_graph``: capture
    on CUDA.
    """

    WARMUP = 3  # eager steps on a side stream before capture (on that stream), as torch.cuda.graph's documentation asks

    def __init__(self, family, optimizer, params, opt_state, inst, expand, use_graph: bool = True,
                 emulate: bool | None = None):
        self.family = family
        self.optimizer = optimizer
        self.params = params
        self.opt_state = opt_state
        self.inst = inst
        self.expand = expand
        self.device = params[0].device
        # emulate: take the graph path on the CPU (static copies of batch and network, the warm-up), "replaying"
        # by running the step on the static tensors and checking that no state tensor changed its storage (tests)
        self.emulate = EMULATE_ON_CPU if emulate is None else bool(emulate)
        self.use_graph = bool(use_graph) and (self.device.type == "cuda" or self.emulate)
        self.graph = None
        self.eager_steps = 0
        self.graph_steps = 0
        self._static_batch = None
        self._static_network = None
        self._static_loss = None
        self._stream = None

    def _step(self, network, source_batch) -> torch.Tensor:
        batch = self.expand(source_batch)
        leaves = [p.detach().requires_grad_(True) for p in self.params]
        with torch.enable_grad():
            loss = self.family.loss(leaves, batch, self.inst() if callable(self.inst) else self.inst)
            grads = torch.autograd.grad(loss.sum(), leaves)
        new = self.optimizer.step(leaves, grads, self.opt_state, network)
        with torch.no_grad():
            for p, value in zip(self.params, new):
                if value.data_ptr() != p.data_ptr():  # (an optimizer that stepped p in place returns p's storage)
                    p.copy_(value)
        return loss.detach()

    def step(self, network, source_batch) -> torch.Tensor:
        """One step of every member; returns the raw training loss per member (before the update)."""
        if not self.use_graph:
            self.eager_steps += 1
            return self._step(network, source_batch)
        if self.graph is None:
            if self.eager_steps < self.WARMUP and self.emulate:
                self.eager_steps += 1
                return self._step(network, source_batch)
            if self.eager_steps < self.WARMUP:
                if self._stream is None:
                    self._stream = torch.cuda.Stream(self.device)
                side = self._stream
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    loss = self._step(network, source_batch)
                torch.cuda.current_stream(self.device).wait_stream(side)
                self.eager_steps += 1
                return loss
            if not self._capture(network, source_batch):
                self.eager_steps += 1
                return self._step(network, source_batch)
        if not (_same_layout(self._static_network, network) and _same_layout(self._static_batch, source_batch)):
            raise ValueError("a captured population step takes a network and a batch of the captured shapes")
        _copy_into(self._static_network, network)
        _copy_into(self._static_batch, source_batch)
        self.graph.replay()
        self.graph_steps += 1
        return self._static_loss.clone()

    def _storage(self) -> list:
        tensors = []

        def walk(value):
            if torch.is_tensor(value):
                tensors.append(value.data_ptr())
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    walk(v)

        lr = getattr(self.optimizer, "lr", None)  # (a scheduled lr: written in place between replays, never replaced)
        walk([self.params, self.opt_state, self._static_network, self._static_batch,
              None if callable(self.inst) else self.inst, lr if torch.is_tensor(lr) else None])
        return tensors

    def _capture(self, network, source_batch) -> bool:
        self._static_network = _clone(network)
        self._static_batch = _clone(source_batch)
        if self.emulate:
            self.graph = _EmulatedGraph(self)
            return True
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize(self.device)
            # captured on the stream the warm-up ran on (libraries' per-stream handles and workspaces exist by then)
            with torch.cuda.graph(graph, stream=self._stream):
                self._static_loss = self._step(self._static_network, self._static_batch)
        except Exception as err:  # noqa: BLE001 - any capture failure: fall back to eager steps
            warnings.warn(f"lopt.meta: CUDA graph capture of the population step failed ({type(err).__name__}: {err}); "
                          f"running eagerly", RuntimeWarning, stacklevel=3)
            self.use_graph = False
            self._static_network = self._static_batch = self._static_loss = None
            return False
        self.graph = graph
        return True


class _EmulatedGraph:
    """What ``emulate=True`` replays: the step on the static tensors, whose storage must never change."""

    def __init__(self, stepper: PopulationStepper):
        self.stepper = stepper
        self.storage = stepper._storage()

    def replay(self) -> None:
        stepper = self.stepper
        loss = stepper._step(stepper._static_network, stepper._static_batch)
        if stepper._static_loss is None:
            stepper._static_loss = loss.clone()
        stepper._static_loss.copy_(loss)
        if stepper._storage() != self.storage:
            raise AssertionError("a population step replaced a tensor a captured graph reads (it must update in place)")
