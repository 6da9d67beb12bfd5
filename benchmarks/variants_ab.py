"""Kernel variants timed against each other in one process, in alternating blocks of synchronised steps
(fused AdamW among them), so every variant sees the same host and device conditions. One variant after
another (``bench_fused.py --variants``) lets drift between the runs pass for a difference; alternating
blocks spread it over all of them. Prints and writes (JSON) the median and quartiles of each variant's
step, and each variant's per-kernel CUDA times (median of profiled steps, taken after the timing).
``--graph`` alternates replays of each build's step captured in a CUDA graph instead (static gradient
tensors; no host share, so the blocks compare the kernels alone).

    PYTHONPATH=. python benchmarks/variants_ab.py --out ab.json --param-set gpt2-medium [--graph] \\
        --variants "precision=fast;precision=fast,SFC_ENTRIES_BEFORE_USE=1"

A variant is ``bench_fused.py``'s ','-separated ``NAME=VALUE`` list (kernel macros, ``precision=...``);
the empty variant is the default build.
"""

import argparse
import json
import statistics

import torch

import lopt
from benchmarks.bench_fused import (capture_step, gradient_sets, make, make_capturable, profile_step, split_variant,
                                    time_replays, time_steps)
from lopt.bench.report import environment
from lopt.param_sets import build_parameters


def quartiles(times) -> dict:
    q1, median, q3 = statistics.quantiles(times, n=4)  # (the middle cut is the median)
    return {"median_ms": round(median, 4), "p25_ms": round(q1, 4), "p75_ms": round(q3, 4),
            "steps": len(times)}


def variant_labels(spec: str) -> list:
    """``--variants``' ';'-separated builds as (label, variant): the empty variant is labelled "default"."""
    variants = spec.split(";")
    labels = [v or "default" for v in variants]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"--variants lists a build twice: {spec!r}")
    return list(zip(labels, variants))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--optimizer", default="small_fc_lopt", choices=("small_fc_lopt", "velo"))
    parser.add_argument("--param-set", default="gpt2-medium")
    parser.add_argument("--variants", required=True, help="';'-separated variants; '' (e.g. a leading ';') is the default")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block")
    parser.add_argument("--graph", action="store_true", help="time replays of each step captured in a CUDA graph")
    parser.add_argument("--pause-ms", type=float, default=0.0,
                        help="with --graph: idle the device this long before each replay. Replayed back to back, "
                             "an exact GPT-2-medium step draws the H100's 700 W and its SM clock drops to ~1650 MHz; "
                             "inside a training iteration it runs at 1980 (benchmarks/iteration_ab.py), so a pause "
                             "of ~40 ms times it as the iteration runs it")
    args = parser.parse_args()

    params = build_parameters(args.param_set, "cuda")
    grad_sets = gradient_sets(params)
    weights = lopt.random_weights(args.optimizer, seed=0)  # timing only
    builds = variant_labels(args.variants)
    labels = ["adamw"] + [label for label, _ in builds]
    optimizers = {"adamw": make_capturable("adamw", params, None) if args.graph else make("adamw", params, "fused", None)}
    for label, variant in builds:
        defines, options = split_variant(variant)
        optimizers[label] = make(args.optimizer, params, "fused", weights, defines, options)
    times = {label: [] for label in labels}
    for label in labels:  # warm-up: compiles, plans, the fast check
        time_steps(optimizers[label], params, grad_sets, 3, 3)
    graphs = {label: capture_step(optimizers[label], params, grad_sets[0], 3) for label in labels} if args.graph else {}
    for block in range(args.blocks):
        order = labels if block % 2 == 0 else labels[::-1]  # no variant always follows the same one
        for label in order:
            times[label] += (time_replays(graphs[label][0], args.steps, 2, args.pause_ms) if args.graph
                             else time_steps(optimizers[label], params, grad_sets, args.steps, 2))
    graphs.clear()
    result = {"environment": environment(torch.device("cuda")), "optimizer": args.optimizer,
              "param_set": args.param_set, "blocks": args.blocks, "steps_per_block": args.steps,
              "timing": "graph replays" if args.graph else "synchronised steps", "pause_ms": args.pause_ms,
              "variants": {}}
    print(f"{args.optimizer} on {args.param_set}: {args.blocks} alternating blocks of {args.steps} "
          f"{'replays of captured steps' if args.graph else 'synchronised steps'}")
    for label in labels:
        launches, kernel_ms = profile_step(optimizers[label], params, grad_sets)
        row = {**quartiles(times[label]), "launches_per_step": launches, "kernel_ms": kernel_ms}
        row["x_adamw"] = round(row["median_ms"] / statistics.median(times["adamw"]), 3)
        result["variants"][label] = row
        top = ", ".join(f"{k}: {v:.3f}" for k, v in sorted(kernel_ms.items(), key=lambda kv: -kv[1])[:2])
        print(f"  {label:<48} median {row['median_ms']:7.3f} ms (quartiles {row['p25_ms']:.3f} .. {row['p75_ms']:.3f}), "
              f"x AdamW {row['x_adamw']:.2f}; {top}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
