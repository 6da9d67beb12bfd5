"""Step-time benchmark of lopt's optimizers on real models' parameter sets (``lopt bench``).

Times ``optimizer.step()`` only: parameters and gradients (random normal × 1e-3) are already on
the device. On CUDA: warm-up steps, then each step timed with CUDA events (median reported),
kernel launches per step counted with ``torch.profiler``, peak extra memory from the caching
allocator. On the CPU: wall-clock time per step. Before timing, the fused backend is checked
against the naive one (one step from identical state and gradients): the relative error of the
update is reported with the times.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field

import torch

import lopt
from lopt import weights as weights_lib
from lopt.optimizers import OPTIMIZERS
from lopt.param_sets import build_parameters, param_set_numel, param_set_shapes

# Multiply-adds per parameter element of each optimizer's per-element network (after folding).
MLP_MACS_PER_ELEMENT = {"small_fc_lopt": 28 * 32 + 32 * 32 + 32 * 2, "velo": 30 * 4 + 4 * 4 + 4 * 3}
OPTIMIZER_KWARGS = {"velo": {"num_steps": 10_000}}


@dataclass
class BenchResult:
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


def resolve_bench_weights(optimizer_name: str, weights_arg, require_pretrained: bool, say=print):
    """The weights to benchmark with: ``weights_arg``, else the registered ones, else random (timing only)."""
    architecture = OPTIMIZERS[optimizer_name].architecture
    if weights_arg is not None:
        return weights_lib.load_weights(weights_arg, architecture)
    try:
        return weights_lib.load_weights(architecture, architecture)
    except weights_lib.WeightsError as err:
        if require_pretrained:
            raise
        say(f"pretrained weights unavailable ({str(err).split(':')[0]}): using untrained weights — timing only")
        return weights_lib.random_weights(architecture)


def make_gradients(params, seed: int = 1):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.randn(p.shape, generator=generator) * 1e-3).to(device=p.device, dtype=p.dtype) for p in params]


def make_optimizer(optimizer_name: str, params, backend: str, weights):
    if optimizer_name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, fused=backend == "fused", foreach=backend == "foreach")
    return OPTIMIZERS[optimizer_name](params, weights=weights, backend=backend, **OPTIMIZER_KWARGS.get(optimizer_name, {}))


def _step(optimizer, loss):
    if getattr(optimizer, "requires_loss", False):
        optimizer.step(loss)
    else:
        optimizer.step()


def time_steps(optimizer, steps: int, warmup: int, device: torch.device, progress=None) -> list:
    """Milliseconds of each of ``steps`` timed steps after ``warmup`` untimed ones."""
    loss = torch.tensor(2.5, device=device)
    for _ in range(warmup):
        _step(optimizer, loss)
    times = []
    for i in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(optimizer, loss)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            _step(optimizer, loss)
            times.append((time.perf_counter() - begin) * 1e3)
        loss = loss * 0.999
        if progress is not None:
            progress.update(1)
    return times


def count_launches(optimizer, device: torch.device) -> int | None:
    """Kernel launches of one step, as CUPTI sees them (CuPy's launches included)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    loss = torch.tensor(2.5, device=device)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(optimizer, loss)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
               and "memset" not in e.name.lower())


def update_relative_error(optimizer_name: str, weights, param_set: str, device, dtype, seed: int = 0) -> float:
    """max over tensors of ‖u_fused − u_naive‖ / ‖u_naive‖ for one step from identical state."""
    updates = {}
    for backend in ("naive", "fused"):
        params = build_parameters(param_set, device, dtype, seed)
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, make_gradients(params)):
            p.grad = g
        _step(make_optimizer(optimizer_name, params, backend, weights), torch.tensor(2.5, device=device))
        updates[backend] = [(p.detach() - b).double() for p, b in zip(params, before)]
        del params, before
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return max(float((f - n).norm() / n.norm().clamp_min(1e-30)) for f, n in zip(updates["fused"], updates["naive"]))


def bench_one(optimizer_name: str, backend: str, param_set: str, weights, *, device, dtype=torch.float32, steps=20,
              warmup=3, progress=None, count=True) -> BenchResult:
    params = build_parameters(param_set, device, dtype)
    for p, g in zip(params, make_gradients(params)):
        p.grad = g
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    optimizer = make_optimizer(optimizer_name, params, backend, weights)
    times = time_steps(optimizer, steps, warmup, device, progress)
    peak = None
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - baseline) / 2**20
    launches = count_launches(optimizer, device) if count else None
    median = statistics.median(times)
    result = BenchResult(optimizer_name, backend, param_set, median, times, launches, peak)
    if optimizer_name in MLP_MACS_PER_ELEMENT:
        result.gmacs_per_s = MLP_MACS_PER_ELEMENT[optimizer_name] * param_set_numel(param_set) / (median * 1e-3) / 1e9
    del optimizer, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def environment(device: torch.device) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "lopt": lopt.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception:
        info["cupy"] = None
    # A copy of the tree whose .git is absent or stale (the GPU machine) is told its commit through LOPT_COMMIT.
    info["commit"] = os.environ.get("LOPT_COMMIT")
    if not info["commit"]:
        try:
            info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            timeout=5).stdout.strip() or None
        except Exception:
            info["commit"] = None
    return info


def format_table(results: list) -> str:
    header = ("optimizer", "backend", "params", "ms/step", "launches", "peak MiB", "rel.err vs naive", "GMAC/s")
    rows = [header]
    for r in results:
        rows.append((r.optimizer, r.backend, r.param_set, f"{r.ms_per_step:.2f}",
                     "-" if r.launches_per_step is None else str(r.launches_per_step),
                     "-" if r.peak_extra_mib is None else f"{r.peak_extra_mib:.0f}",
                     "-" if r.max_rel_error_vs_naive is None else f"{r.max_rel_error_vs_naive:.2e}",
                     "-" if r.gmacs_per_s is None else f"{r.gmacs_per_s:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def results_json(results: list, device, weights_source: str, pretrained: bool) -> str:
    return json.dumps({"environment": environment(device), "weights": weights_source, "pretrained": pretrained,
                       "results": [asdict(r) for r in results]}, indent=2)


__all__ = ["BenchResult", "bench_one", "update_relative_error", "format_table", "results_json", "environment",
           "resolve_bench_weights", "param_set_shapes"]
