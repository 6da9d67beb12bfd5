"""GPU benchmark of small_fc_lopt's step: naive vs fused vs fused AdamW.

    PYTHONPATH=. python benchmarks/bench_small_fc_lopt.py --out benchmarks/results/<name>.json

For each parameter set (GPT-2 medium, ViT-B/16; float32): median step time of >= 20 steps after
warm-up (CUDA events), kernel launches per step (torch.profiler), peak extra memory, the
per-element MLP's achieved multiply-add rate against the float32 CUDA-core peak, the time split between the
fused kernels, and the fused-vs-naive relative update error. Also the device-to-device copy
bandwidth, measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from lopt import bench
from lopt.fused.small_fc_lopt import SmallFCLOptFused
from lopt.param_sets import build_parameters, param_set_numel
from lopt.weights import random_weights

FP32_PEAK_TFLOPS = {"H100": 66.9, "H200": 66.9}  # SXM datasheet: 132 SMs x 128 lanes x 2 x 1.98 GHz


def copy_bandwidth_tb_s() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * src.numel() / (statistics.median(times) * 1e-3) / 1e12


def kernel_split(optimizer) -> dict:
    """CUDA time per kernel name over one step (ms)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        optimizer.step()
        torch.cuda.synchronize()
    split = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            split[event.key] = round(event.device_time_total / 1e3, 3)
    return split


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--param-sets", default="gpt2-medium,vit-b16")
    parser.add_argument("--naive-steps", type=int, default=5)
    parser.add_argument("--variants", default="",
                        help="extra fused variants: ';'-separated lists of ','-separated NAME=VALUE kernel macros")
    args = parser.parse_args()

    device = torch.device("cuda", 0)
    weights = random_weights("small_fc_lopt", seed=0)  # step time does not depend on the weight values
    env = bench.environment(device)
    env["copy_bandwidth_tb_s"] = round(copy_bandwidth_tb_s(), 3)
    peak = next((v for k, v in FP32_PEAK_TFLOPS.items() if k in env["device"]), 66.9)
    records = []
    for param_set in args.param_sets.split(","):
        numel = param_set_numel(param_set)
        rows = [bench.bench_one("adamw", "fused", param_set, None, device=device, steps=args.steps, warmup=args.warmup)]
        for variant in [""] + [v for v in args.variants.split(";") if v]:
            defines = tuple(d for d in variant.split(",") if d)
            params = build_parameters(param_set, device)
            for p, g in zip(params, bench.make_gradients(params)):
                p.grad = g
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
            optimizer = bench.make_optimizer("small_fc_lopt", params, "fused", weights)
            if defines:
                optimizer._fused_engine = SmallFCLOptFused(optimizer, defines=defines)
            times = bench.time_steps(optimizer, args.steps, args.warmup, device)
            median = statistics.median(times)
            backend = f"fused[{variant}]" if variant else "fused"
            result = bench.BenchResult("small_fc_lopt", backend, param_set, median, times,
                                       bench.count_launches(optimizer, device),
                                       (torch.cuda.max_memory_allocated() - baseline) / 2**20)
            result.gmacs_per_s = bench.MLP_MACS_PER_ELEMENT["small_fc_lopt"] * numel / (median * 1e-3) / 1e9
            result.note = json.dumps({"kernel_ms": kernel_split(optimizer),
                                      "fraction_of_fp32_peak": round(2 * result.gmacs_per_s / 1e3 / peak, 3)})
            rows.append(result)
            del optimizer, params
            torch.cuda.empty_cache()
        error = bench.update_relative_error("small_fc_lopt", weights, param_set, device, torch.float32)
        for r in rows:
            if r.backend == "fused" and r.optimizer == "small_fc_lopt":
                r.max_rel_error_vs_naive = error
        if args.naive_steps:
            rows.append(bench.bench_one("small_fc_lopt", "naive", param_set, weights, device=device,
                                        steps=args.naive_steps, warmup=1))
        records += rows
        print(bench.format_table(rows), flush=True)
        for r in rows:
            if r.note:
                print(r.backend, r.note, flush=True)
    payload = {"environment": env, "weights": "random (timing only)", "results": [r.__dict__ for r in records]}
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    print(json.dumps(env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
