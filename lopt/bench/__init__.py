"""``lopt bench``: what a learned optimizer costs, and that the fused backend computes what the naive one does.

Modules: ``contenders`` (adamw, naive, naive+compile, fused: how each is built, why one cannot run),
``measure`` (timing one contender in step or iteration mode, the first-step check against naive),
``models`` (the real models, built from configs), ``curves`` (loss curves with the nudged-weights
yardstick), ``runner`` (a whole plan), ``report`` (table, Markdown, JSON, plots). docs/bench.md
describes the command and the JSON schema.

The functions below are the building blocks the GPU scripts in ``benchmarks/`` use.
"""

from __future__ import annotations

import torch

from lopt.bench.contenders import (TIMING_NUM_STEPS, make_adamw, make_contender, make_learned_optimizer,
                                   step_function)
from lopt.bench.measure import (MLP_MACS_PER_ELEMENT, STEP_MODE_LOSS, BenchResult, StepWorkload, Unavailable,
                                assign_gradients, elapsed_ms, first_step_vs_naive, gradient_sets, make_gradients, measure_contender,
                                mlp_gmacs_per_s)
from lopt.bench.measure import count_launches as _count_launches_of
from lopt.bench.report import environment, format_table
from lopt.bench.runner import resolve_bench_weights
from lopt.param_sets import build_parameters, param_set_numel, param_set_shapes


def make_optimizer(optimizer_name: str, params, backend: str, weights):
    """``adamw`` (backend ``fused`` or ``foreach``) or a learned optimizer with the given backend."""
    if optimizer_name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, fused=backend == "fused", foreach=backend == "foreach")
    return make_learned_optimizer(optimizer_name, params, backend, weights)


def time_steps(optimizer, steps: int, warmup: int, device: torch.device, progress=None, grad_sets=None) -> list:
    """Milliseconds of each of ``steps`` timed steps after ``warmup`` untimed ones.

    ``grad_sets``: gradient sets assigned in turn before each step (outside the timed region);
    None keeps the gradients the parameters already have.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    loss = torch.tensor(STEP_MODE_LOSS, device=device)
    step = step_function(optimizer)
    times = []
    for index in range(warmup + steps):
        if grad_sets:
            assign_gradients(params, grad_sets[index % len(grad_sets)])
        elapsed = elapsed_ms(lambda: step(loss), device)
        if index >= warmup:
            times.append(elapsed)
            if progress is not None:
                progress.update(1)
    return times


def count_launches(optimizer_or_fn, device: torch.device) -> int | None:
    """Kernel launches of one step of an optimizer (or of one call of a function) on CUDA; None on the CPU."""
    if callable(optimizer_or_fn):
        return _count_launches_of(optimizer_or_fn, device)
    loss = torch.tensor(STEP_MODE_LOSS, device=device)
    return _count_launches_of(lambda: step_function(optimizer_or_fn)(loss), device)


def bench_one(optimizer_name: str, backend: str, param_set: str, weights, *, device, dtype=torch.float32, steps=20,
              warmup=3, progress=None, same_grads: bool = False) -> BenchResult:
    """Step mode for one contender on one parameter set (fresh gradient tensors every step unless ``same_grads``)."""
    params = build_parameters(param_set, device, dtype)
    workload = StepWorkload(params, gradient_sets(params, 1 if same_grads else 3), device)
    workload.gradients(0)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    contender_name = "adamw" if optimizer_name == "adamw" else backend
    contender = make_contender(optimizer_name, contender_name, params, weights, device)
    result = measure_contender(workload, contender, weights=weights, param_set=param_set, mode="step", steps=steps,
                               warmup=warmup, baseline_bytes=baseline, progress=progress, num_steps=TIMING_NUM_STEPS)
    result.gmacs_per_s = mlp_gmacs_per_s(optimizer_name, param_set_numel(param_set), result.ms_per_step)
    return result


def update_relative_error(optimizer_name: str, weights, param_set: str, device, dtype, seed: int = 0) -> float:
    """max over tensors of ‖u_fused − u_naive‖ / ‖u_naive‖ for one step from identical state."""
    params = build_parameters(param_set, device, dtype, seed)
    for p, g in zip(params, make_gradients(params)):
        p.grad = g
    contender = make_contender(optimizer_name, "fused", params, weights, device)
    loss = torch.tensor(STEP_MODE_LOSS, device=device)
    error, _ = first_step_vs_naive(contender, params, weights, loss, num_steps=TIMING_NUM_STEPS)
    return error


__all__ = ["BenchResult", "Unavailable", "bench_one", "update_relative_error", "format_table", "environment",
           "resolve_bench_weights", "param_set_shapes", "make_gradients", "make_optimizer", "make_adamw", "time_steps",
           "count_launches", "MLP_MACS_PER_ELEMENT"]
