"""One fused small_fc_lopt step on a parameter set after warm-up, for Nsight Compute:

    ncu -k small_fc_lopt_apply -c 1 --section SpeedOfLight python benchmarks/profile_small_fc_lopt.py vit-b16
"""

import sys

import torch

from lopt import bench
from lopt.param_sets import build_parameters
from lopt.weights import random_weights

params = build_parameters(sys.argv[1] if len(sys.argv) > 1 else "vit-b16", "cuda")
for p, g in zip(params, bench.make_gradients(params)):
    p.grad = g
optimizer = bench.make_optimizer("small_fc_lopt", params, "fused", random_weights("small_fc_lopt"))
for _ in range(3):
    optimizer.step()
torch.cuda.synchronize()
print("profiled step done")
