"""A/B in one process: the fused step with and without the fast check's early statistics launch
(``FusedEngine._statistics_early``), alternating blocks of synchronised steps so that both see the
same host and device conditions. Prints and writes (JSON) the median ms per step of each.

    PYTHONPATH=. python benchmarks/early_statistics_ab.py [small_fc_lopt|velo] [vit-b16] out.json
"""

import json
import statistics
import sys

import torch

from benchmarks.bench_fused import gradient_sets, make, time_steps
from lopt.bench.report import environment
from lopt.fused.engine import FusedEngine
from lopt.param_sets import build_parameters
from lopt.weights import random_weights

name = sys.argv[1] if len(sys.argv) > 1 else "small_fc_lopt"
param_set = sys.argv[2] if len(sys.argv) > 2 else "vit-b16"
out = sys.argv[3] if len(sys.argv) > 3 else None
BLOCKS, STEPS = 12, 20

params = build_parameters(param_set, "cuda")
grad_sets = gradient_sets(params)
optimizer = make(name, params, "fused", random_weights(name))
early = FusedEngine._statistics_early
times = {"early statistics": [], "one statistics launch": []}
time_steps(optimizer, params, grad_sets, 5, 5)  # (warm-up: the plan, the fast check)
for block in range(2 * BLOCKS):
    label = "early statistics" if block % 2 == 0 else "one statistics launch"
    FusedEngine._statistics_early = early if block % 2 == 0 else (lambda self, *args: None)
    times[label] += time_steps(optimizer, params, grad_sets, STEPS, 2)
FusedEngine._statistics_early = early
result = {"environment": environment(torch.device("cuda")), "optimizer": name, "param_set": param_set, "blocks": BLOCKS, "steps": STEPS,
          **{label: {"median_ms": statistics.median(t), "p25_ms": statistics.quantiles(t, n=4)[0],
                     "p75_ms": statistics.quantiles(t, n=4)[2]} for label, t in times.items()}}
print(f"{name} on {param_set} ({BLOCKS} alternating blocks of {STEPS} synchronised steps):")
for label in times:
    r = result[label]
    print(f"  {label:<22} median {r['median_ms']:.3f} ms  (quartiles {r['p25_ms']:.3f} .. {r['p75_ms']:.3f})")
if out:
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
