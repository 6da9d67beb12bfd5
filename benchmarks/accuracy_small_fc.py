"""Fused-vs-naive update errors of small_fc_lopt over the CUDA tests' step sequence, per kernel build.

Runs the sequence of ``tests/test_fused.py::test_fused_matches_naive_every_rank_and_dtype`` (float32,
every test shape, the test's random weights, each step from the same state) once per build and
prints, per build, the worst per-step error, the worst and the 99th percentile of the per-tensor
errors (tensors of 64 elements or more), the tensor-steps above 5e-6 and 1e-5, and the worst tiny
tensor (relative to its own update, and as the tests judge it: fused_helpers.tensor_update_error).
For comparing arithmetic designs; the tests hold the bounds.

    PYTHONPATH=. python benchmarks/accuracy_small_fc.py --steps 200 --out acc.json \
        --variants "SFC_LAYER2_FP16=0"

A variant is ``bench_fused.py``'s ','-separated ``NAME=VALUE`` list (kernel macros, ``precision=...``).
``--precision`` is the precision of the default build (always first) and of every variant that names none.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import lopt  # noqa: E402
from fused_helpers import (ALL_SHAPES, TINY_TENSOR_NUMEL, flat, make_params, random_grads, relative_error,  # noqa: E402
                           set_grads, sync_into, tensor_update_error, update_scale)
from benchmarks.bench_fused import split_variant  # noqa: E402
from lopt.fused.small_fc_lopt import SmallFCLOptFused  # noqa: E402


def errors_of_build(defines: tuple, steps: int, first_seed: int = 0, precision: str = "exact") -> dict:
    weights = lopt.random_weights("small_fc_lopt", seed=7)
    fused_params, naive_params = make_params(ALL_SHAPES, seed=0), make_params(ALL_SHAPES, seed=0)
    options = dict(weights=weights, lr=0.7, weight_decay=0.007 / 0.7)
    fused = lopt.SmallFCLOpt(fused_params, backend="fused", precision=precision, **options)
    if defines:
        fused._fused_engine = SmallFCLOptFused(fused, defines=defines)
    naive = lopt.SmallFCLOpt(naive_params, backend="naive", **options)
    step_errors, tensor_errors, tiny_errors, tiny_against_step, where = [], [], [], [], []
    for index in range(steps):
        grads = random_grads(fused_params, seed=first_seed + index)
        set_grads(fused_params, grads)
        set_grads(naive_params, grads)
        before = [p.detach().clone() for p in fused_params]
        fused.step()
        naive.step()
        fused_updates = [f.detach() - b for f, b in zip(fused_params, before)]
        naive_updates = [n.detach() - b for n, b in zip(naive_params, before)]
        step_errors.append(relative_error(flat(fused_updates), flat(naive_updates)))
        scale = update_scale(naive_updates)
        for uf, un, shape in zip(fused_updates, naive_updates, ALL_SHAPES):
            if uf.numel() >= TINY_TENSOR_NUMEL:
                tensor_errors.append(relative_error(uf, un))
                where.append((first_seed + index, list(shape)))
            else:
                tiny_errors.append(relative_error(uf, un))
                tiny_against_step.append(tensor_update_error(uf, un, scale))
        sync_into(naive, naive_params, fused, fused_params)
    tensor = torch.tensor(tensor_errors, dtype=torch.float64)
    return {
        "defines": list(defines), "precision": precision, "steps": steps,
        "worst_step": max(step_errors),
        "worst_tensor": float(tensor.max()), "worst_tensor_at (gradient seed, shape)": where[int(tensor.argmax())],
        "p99_tensor": float(tensor.quantile(0.99)),
        "median_tensor": float(tensor.median()),
        "tensor_steps_above_5e-6": int((tensor > 5e-6).sum()), "tensor_steps_above_1e-5": int((tensor > 1e-5).sum()),
        "tensor_steps": len(tensor_errors), "worst_tiny": max(tiny_errors),
        "worst_tiny_against_step_scale": max(tiny_against_step),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--first-seed", type=int, default=0, help="gradient seed of the first step (the test: 0)")
    parser.add_argument("--variants", default="", help="';'-separated variants (kernel macros, precision=...)")
    parser.add_argument("--precision", default="exact", choices=("exact", "fast"),
                        help="the precision of the default build and of variants that name none")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    builds = [((), args.precision)]
    for variant in filter(None, args.variants.split(";")):
        defines, options = split_variant(variant)
        builds.append((defines, (options or {}).get("precision", args.precision)))
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": os.environ.get("LOPT_COMMIT", "unknown"), "builds": []}
    for defines, precision in builds:
        row = errors_of_build(defines, args.steps, args.first_seed, precision)
        record["builds"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
