"""Measuring one contender: time per step or per training iteration, launches, memory, error vs naive.

Step mode (``--mode step``) times ``optimizer.step()`` alone on a parameter set whose gradients
are already on the device. Every step gets gradient tensors other than the previous step's (a
few gradient sets are made beforehand and rotated; assigning them is outside the timed region),
as in training, where backward allocates new ``.grad`` tensors; ``--same-grads`` keeps one set.

Iteration mode (``--mode iteration``) times a whole training iteration of a real model:
``zero_grad(set_to_none=True)``, forward (bfloat16 autocast on CUDA), backward, ``step``.

On CUDA each timed step or iteration is bracketed by CUDA events (the median is reported), kernel
launches of one optimizer step are counted with ``torch.profiler``, and the peak memory above the
parameters (step mode: and the gradients) comes from the caching allocator. On the CPU: wall clock.

The fused and compiled contenders are checked on their first step: the same step, from the same
parameters, gradients and (empty) state, is taken by the naive backend on copies, and the relative
update error ``max over tensors ‖u − u_naive‖ / ‖u_naive‖`` is reported.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import torch

from lopt.bench.contenders import CHECKED_CONTENDERS, Contender, make_learned_optimizer, step_function
from lopt.bench.models import BenchModel

# How many gradient sets step mode rotates (each step's .grad tensors differ from the previous step's).
GRADIENT_SETS = 3
GRADIENT_SCALE = 1e-3
# The training loss step mode hands to optimizers that take one (VeLO).
STEP_MODE_LOSS = 2.5
# Multiply-adds per parameter element of each optimizer's per-element network (after folding).
MLP_MACS_PER_ELEMENT = {"small_fc_lopt": 28 * 32 + 32 * 32 + 32 * 2, "velo": 30 * 4 + 4 * 4 + 4 * 3}


@dataclass
class BenchResult:
    """One measured row. ``ms_per_step`` is per optimizer step (step mode) or per iteration (iteration mode)."""

    optimizer: str
    backend: str
    param_set: str
    ms_per_step: float
    ms_all: list = field(default_factory=list)
    launches_per_step: int | None = None
    peak_extra_mib: float | None = None
    max_rel_error_vs_naive: float | None = None
    gmacs_per_s: float | None = None
    note: str = ""
    contender: str = ""
    mode: str = "step"
    overhead_vs_adamw: float | None = None
    compile_s: float | None = None
    host_ms_per_step: float | None = None  # (median host time to issue a timed step: elapsed_and_host_ms)


@dataclass
class Unavailable:
    """A contender that did not run, and why."""

    optimizer: str
    contender: str
    param_set: str
    mode: str
    reason: str


def mlp_gmacs_per_s(optimizer_name: str, numel: int, ms_per_step: float) -> float | None:
    """The per-element network's multiply-adds per second (10^9) at this step time; None for AdamW."""
    if optimizer_name not in MLP_MACS_PER_ELEMENT:
        return None
    return MLP_MACS_PER_ELEMENT[optimizer_name] * numel / (ms_per_step * 1e-3) / 1e9


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def idle(ms: float) -> None:
    """Wait ``ms`` milliseconds with the host busy: the device idles, but the host does not sleep
    (after a sleep, its share of the next step measured up to 1.3 ms longer: CPU clock and caches)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def elapsed_ms(fn, device: torch.device) -> float:
    """Milliseconds ``fn()`` takes: CUDA events on CUDA, the wall clock on the CPU."""
    return elapsed_and_host_ms(fn, device)[0]


def elapsed_and_host_ms(fn, device: torch.device) -> tuple[float, float]:
    """``elapsed_ms(fn)``, and the host's milliseconds until ``fn()`` returned (the time it took to issue the
    work; on the CPU both are the wall clock). A synchronised step longer than its kernels with a host time
    near the step's is host-bound: the device waited for launches."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        begin = time.perf_counter()
        fn()
        host = (time.perf_counter() - begin) * 1e3
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host
    begin = time.perf_counter()
    fn()
    wall = (time.perf_counter() - begin) * 1e3
    return wall, wall


def wall_seconds(fn, device: torch.device) -> float:
    """Host seconds of ``fn()`` including the device work it queued (compilation shows up here)."""
    _synchronize(device)
    begin = time.perf_counter()
    fn()
    _synchronize(device)
    return time.perf_counter() - begin


def make_gradients(params, seed: int = 1) -> list:
    """Random N(0, 1e-6) gradients of the parameters' shapes, dtypes and devices (made on the CPU)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.randn(p.shape, generator=generator) * GRADIENT_SCALE).to(device=p.device, dtype=p.dtype)
            for p in params]


def gradient_sets(params, count: int, seed: int = 1) -> list:
    """``count`` distinct sets of N(0, 1e-3²) gradients, drawn on the parameters' device (fast for large sets)."""
    device = params[0].device if params else torch.device("cpu")
    sets = []
    for index in range(count):
        generator = torch.Generator(device=device).manual_seed(seed + index)
        sets.append([torch.randn(p.shape, generator=generator, device=device, dtype=torch.float32)
                     .mul_(GRADIENT_SCALE).to(device=p.device, dtype=p.dtype) for p in params])
    return sets


def assign_gradients(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g


def count_launches(fn, device: torch.device) -> int | None:
    """Kernel launches of ``fn()`` as CUPTI sees them (CuPy's launches included; copies and memsets not)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    _synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def relative_update_error(params, before, reference_params) -> float:
    """max over tensors of ‖u − u_ref‖ / ‖u_ref‖ in float64, where u = params − before and
    u_ref = reference_params − before."""
    worst = 0.0
    for p, b, r in zip(params, before, reference_params):
        update = p.detach().double() - b.double()
        reference_update = r.detach().double() - b.double()
        error = float((update - reference_update).norm() / reference_update.norm().clamp_min(1e-30))
        worst = max(worst, error)
    return worst


def first_step_vs_naive(contender: Contender, params, weights, loss, *, num_steps: int) -> tuple[float, float]:
    """Take the contender's first step and the naive backend's from identical state; (error, seconds of the step).

    The naive step runs on copies of the parameters and gradients with its own (empty) state.
    """
    before = [p.detach().clone() for p in params]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for copy, p in zip(copies, params):
        copy.grad = None if p.grad is None else p.grad.detach().clone()
    reference = make_learned_optimizer(contender.optimizer_name, copies, "naive", weights, num_steps=num_steps,
                                       embeddings=contender.embeddings)
    seconds = wall_seconds(lambda: contender.step(loss), params[0].device)
    step_function(reference)(loss)
    error = relative_update_error(params, before, copies)
    del reference, copies, before
    return error, seconds


class StepWorkload:
    """``optimizer.step()`` on a parameter set with pre-made gradient sets, rotated step by step."""

    def __init__(self, params, grad_sets, device):
        self.params, self.grad_sets, self.device = params, grad_sets, device
        self.loss = torch.tensor(STEP_MODE_LOSS, device=device)
        self.contender = None

    def gradients(self, index: int):
        """Make ``.grad`` ready for step ``index`` (untimed); returns the loss of that step."""
        assign_gradients(self.params, self.grad_sets[index % len(self.grad_sets)])
        return self.loss

    def before_timed(self, index: int) -> None:
        self.gradients(index)

    def timed(self, index: int) -> None:
        self.contender.step(self.loss)


class IterationWorkload:
    """One training iteration of a model on a fixed batch: zero_grad, forward, backward, step."""

    def __init__(self, model: BenchModel, batch, device):
        self.model, self.batch, self.device = model, batch, device
        self.params = model.parameters()
        self.contender = None

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward_backward(self):
        with self._autocast():
            loss = self.model.loss(self.batch)
        loss.backward()
        return loss.detach()

    def gradients(self, index: int):
        self.contender.optimizer.zero_grad(set_to_none=True)
        return self._forward_backward()

    def before_timed(self, index: int) -> None:
        pass

    def timed(self, index: int) -> None:
        self.contender.optimizer.zero_grad(set_to_none=True)
        self.contender.step(self._forward_backward())


def measure_contender(workload, contender: Contender, *, weights, param_set: str, mode: str, steps: int,
                      warmup: int, baseline_bytes: int | None, progress=None, num_steps: int,
                      cooldown_ms: float = 0.0) -> BenchResult:
    """Check (fused, compiled), warm up, time ``steps`` steps or iterations, count launches; one result row.
    ``cooldown_ms``: the device idles that long before each timed step (``lopt bench --cooldown-ms``)."""
    device = workload.device
    workload.contender = contender
    error, warm_seconds, index = None, [], 0
    if contender.name in CHECKED_CONTENDERS:  # the check is the first (untimed) step
        loss = workload.gradients(0)
        error, seconds = first_step_vs_naive(contender, workload.params, weights, loss, num_steps=num_steps)
        warm_seconds.append(seconds)
        index = 1
        if progress is not None:
            progress.update(1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    while index < warmup_steps(contender.name, warmup):
        workload.before_timed(index)
        warm_seconds.append(wall_seconds(lambda i=index: workload.timed(i), device))
        index += 1
        if progress is not None:
            progress.update(1)
    times, host_times = [], []
    for _ in range(steps):
        workload.before_timed(index)
        if cooldown_ms:
            _synchronize(device)  # (the idle time starts when the device has finished)
            idle(cooldown_ms)
        elapsed, host = elapsed_and_host_ms(lambda i=index: workload.timed(i), device)
        times.append(elapsed)
        host_times.append(host)
        index += 1
        if progress is not None:
            progress.update(1)
    peak = None
    if device.type == "cuda" and baseline_bytes is not None:
        peak = (torch.cuda.max_memory_allocated(device) - baseline_bytes) / 2**20
    loss = workload.gradients(index)
    launches = count_launches(lambda: contender.step(loss), device)
    median = statistics.median(times)
    result = BenchResult(contender.optimizer_name, contender.backend, param_set, median, times, launches, peak,
                         error, contender=contender.name, mode=mode,
                         host_ms_per_step=round(statistics.median(host_times), 4) if host_times else None)
    if contender.name == "naive+compile":
        # The warm-up calls' time beyond that many steady steps: compilation (and recompilation).
        result.compile_s = max(sum(warm_seconds) - len(warm_seconds) * median / 1e3, 0.0)
    return result


def warmup_steps(contender_name: str, warmup: int) -> int:
    """Untimed steps before the timed ones: the checked first step counts as one; the compiled
    contender gets at least 3 (it compiles on its first call and once more when the step counter
    turns dynamic)."""
    if contender_name == "naive+compile":
        return max(warmup, 3)
    return max(warmup, 1) if contender_name in CHECKED_CONTENDERS else warmup
