"""The host's share of a fused step: wall time of ``step()`` on the CPU (no synchronisation) and
where it goes (cProfile), after warm-up, with a fresh set of gradient tensors every step as in
bench_fused.py:

    PYTHONPATH=. python benchmarks/profile_host.py [velo|small_fc_lopt] [gpt2-medium] > host.txt
"""

import cProfile
import pstats
import statistics
import sys
import time

import torch

from benchmarks.bench_fused import do_step, gradient_sets, make
from lopt.param_sets import build_parameters
from lopt.weights import random_weights

name = sys.argv[1] if len(sys.argv) > 1 else "velo"
param_set = sys.argv[2] if len(sys.argv) > 2 else "gpt2-medium"
params = build_parameters(param_set, "cuda")
grad_sets = gradient_sets(params)
optimizer = make(name, params, "fused", random_weights(name))
loss = torch.tensor(2.5, device="cuda")


def one_step(i):
    for p, g in zip(params, grad_sets[i % len(grad_sets)]):
        p.grad = g
    start = time.perf_counter()
    do_step(optimizer, loss)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host


for i in range(5):
    one_step(i)
hosts = [one_step(i) for i in range(30)]
print(f"{name} on {param_set}: host time of step() (no sync): median {statistics.median(hosts) * 1e3:.3f} ms, "
      f"min {min(hosts) * 1e3:.3f} ms")
profiler = cProfile.Profile()
profiler.enable()
for i in range(30):
    one_step(i)
profiler.disable()
stats = pstats.Stats(profiler)
stats.sort_stats("tottime").print_stats(25)
stats.sort_stats("cumulative").print_stats(40)
