"""A fused step on a parameter set after warm-up, for Nsight Compute:

    PYTHONPATH=. ncu -k velo_apply -c 1 --section SpeedOfLight python benchmarks/profile_fused.py velo vit-b16
    PYTHONPATH=. ncu -k small_fc_lopt_apply -c 1 --section SpeedOfLight python benchmarks/profile_fused.py small_fc_lopt gpt2-medium fast

The third argument (where the optimizer has one) is its precision, ``exact`` (the default) or ``fast``.
"""

import sys

import torch

from benchmarks.bench_fused import do_step, gradient_sets, make
from lopt import registry
from lopt.param_sets import build_parameters
from lopt.weights import random_weights

name = sys.argv[1] if len(sys.argv) > 1 else "velo"
param_set = sys.argv[2] if len(sys.argv) > 2 else "vit-b16"
params = build_parameters(param_set, "cuda")
for p, g in zip(params, gradient_sets(params, 1)[0]):
    p.grad = g
precision = sys.argv[3] if len(sys.argv) > 3 else None
optimizer = make(name, params, "fused", random_weights(registry.get(name).architecture),
                 {"precision": precision} if precision else None, param_set)
for _ in range(3):
    do_step(optimizer, torch.tensor(2.5, device="cuda"))
torch.cuda.synchronize()
print("profiled step done")
