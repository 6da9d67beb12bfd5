"""Optimizers timed against each other inside a real training iteration, in one process. GPU only.

``lopt bench --mode iteration`` times one optimizer after another; between processes and machines its
medians move by about ±0.5 ms, as much as most kernel changes. This script builds one model and one
batch (GPT-2 medium, bfloat16 autocast, as the iteration mode), one optimizer per build over the same
parameters (fused AdamW first), and times alternating blocks of iterations (``lopt bench``'s own:
zero_grad, forward, backward, step), so every build sees the same conditions. The parameters drift as each optimizer steps
them in turn; the timing does not depend on their values. A build is a fused lopt optimizer with an
optional precision, ``small_fc_lopt``, ``small_fc_lopt:fast`` or ``velo``; to compare two versions of a
kernel, run this once per commit on the same machine and compare each build's overhead over AdamW.

While the blocks run, ``nvidia-smi`` samples the SM clock, the power draw and the active clock-event
reasons; each sample is credited to the build whose block it fell in. After the blocks, one profiled
iteration per build gives its kernels' CUDA time inside the iteration (the optimizer's own kernels
named, the rest summed as forward and backward).

    PYTHONPATH=. python3 benchmarks/iteration_ab.py --out it.json [--builds small_fc_lopt,small_fc_lopt:fast,velo]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lopt  # noqa: E402
from bench_fused import make  # noqa: E402
from clock_probe import start_smi  # noqa: E402
from lopt.bench.contenders import Contender, step_function  # noqa: E402
from lopt.bench.measure import IterationWorkload, elapsed_ms  # noqa: E402
from lopt.bench.models import build_model  # noqa: E402
from lopt.bench.report import environment  # noqa: E402

SMI_FIELDS = ("timestamp", "clocks.sm", "power.draw", "clocks_event_reasons.active")
POWER_CAP = 0x4  # clocks_event_reasons: software power cap


def contender(label: str, optimizer_name: str, opt) -> Contender:
    """A build as ``lopt bench`` runs it (its step function hands VeLO the loss)."""
    return Contender(optimizer_name, label, "fused", opt, step_function(opt))


def timed_block(workload: IterationWorkload, build: Contender, iterations: int) -> list:
    """``iterations`` timed training iterations of ``build`` (``lopt bench --mode iteration``'s)."""
    workload.contender = build
    return [elapsed_ms(lambda: workload.timed(0), workload.device) for _ in range(iterations)]


def kernel_split(workload: IterationWorkload, build: Contender,
                 own_prefixes=("small_fc_lopt", "adafactor", "velo")) -> dict:
    """CUDA ms of one profiled iteration: the optimizer's kernels by name, the rest as one sum."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    workload.contender = build
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        workload.timed(0)
        torch.cuda.synchronize()
    split = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name if e.name.startswith(own_prefixes) else (
            "adamw" if "FusedAdam" in e.name else "forward_backward_and_other")
        split[name] = split.get(name, 0.0) + e.device_time_total / 1e3
    return {k: round(v, 3) for k, v in sorted(split.items(), key=lambda kv: -kv[1])}


def samples_by_block(smi, spans) -> dict:
    """{label: summary of the nvidia-smi samples taken inside that label's blocks}; spans: (label, t0, t1)."""
    if smi is None:
        return {}
    smi.terminate()
    out, _ = smi.communicate()
    credited = {}
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(SMI_FIELDS):
            continue
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            clock, power, reasons = float(parts[1]), float(parts[2]), int(parts[3], 16)
        except ValueError:
            continue
        for label, t0, t1 in spans:
            if t0 <= when <= t1:
                credited.setdefault(label, []).append((clock, power, reasons))
    summary = {}
    for label, rows in credited.items():
        clocks, powers = [r[0] for r in rows], [r[1] for r in rows]
        summary[label] = {"samples": len(rows), "sm_clock_median_mhz": statistics.median(clocks),
                          "sm_clock_min_mhz": min(clocks), "power_median_w": statistics.median(powers),
                          "power_max_w": max(powers),
                          "power_capped_share": round(sum(1 for r in rows if r[2] & POWER_CAP) / len(rows), 3)}
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--builds", default="small_fc_lopt,small_fc_lopt:fast,velo",
                        help="','-separated OPTIMIZER[:PRECISION] (fused AdamW always runs first)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=4, help="timed iterations per block")
    args = parser.parse_args()

    model = build_model(args.model, "cuda")
    workload = IterationWorkload(model, model.random_batch(), torch.device("cuda"))
    params = model.parameters()
    builds = args.builds.split(",")
    if len(set(builds)) != len(builds) or "adamw" in builds:
        raise SystemExit(f"--builds lists a build twice or names adamw: {args.builds!r}")
    optimizers = {"adamw": contender("adamw", "adamw", make("adamw", params, "fused", None))}
    for label in builds:
        name, _, precision = label.partition(":")
        if name not in ("small_fc_lopt", "velo"):
            raise SystemExit(f"--builds: unknown optimizer {name!r} (small_fc_lopt or velo)")
        weights = lopt.random_weights(name, seed=0)  # timing only
        optimizers[label] = contender(label, name, make(name, params, "fused", weights,
                                                        {"precision": precision} if precision else None))
    labels = list(optimizers)
    for label in labels:  # warm-up: compiles, plans, allocator
        timed_block(workload, optimizers[label], 3)
    times = {label: [] for label in labels}
    spans = []
    smi = start_smi(SMI_FIELDS)
    for block in range(args.blocks):
        order = labels if block % 2 == 0 else labels[::-1]
        for label in order:
            t0 = datetime.datetime.now().timestamp()
            times[label] += timed_block(workload, optimizers[label], args.iterations)
            spans.append((label, t0, datetime.datetime.now().timestamp()))
    power = samples_by_block(smi, spans)
    adamw = statistics.median(times["adamw"])
    result = {"environment": environment(torch.device("cuda")), "model": args.model,
              "blocks": args.blocks, "iterations_per_block": args.iterations, "builds": {}}
    print(f"{args.model}: {args.blocks} alternating blocks of {args.iterations} iterations (bfloat16 autocast)")
    for label in labels:
        median = statistics.median(times[label])
        q1, _, q3 = statistics.quantiles(times[label], n=4)
        row = {"median_ms": round(median, 3), "p25_ms": round(q1, 3), "p75_ms": round(q3, 3),
               "overhead_vs_adamw": round(median / adamw - 1, 4), "kernel_ms": kernel_split(workload, optimizers[label]),
               "power": power.get(label)}
        result["builds"][label] = row
        print(f"  {label:45s} {median:8.2f} ms ({q1:.2f} .. {q3:.2f}), {100 * row['overhead_vs_adamw']:+.1f}% "
              f"over AdamW; {row['kernel_ms']}; {row['power']}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
