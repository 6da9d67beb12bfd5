"""One fused small_fc_lopt step on a parameter set after warm-up, for Nsight Compute:

    ncu -k small_fc_lopt_apply -c 1 --section SpeedOfLight python benchmarks/profile_small_fc_lopt.py vit-b16 [MACROS]

MACROS (optional): ','-separated NAME=VALUE kernel macros of a variant, as bench_small_fc_lopt.py --variants takes.
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
if len(sys.argv) > 2 and sys.argv[2]:
    from lopt.fused.small_fc_lopt import SmallFCLOptFused

    optimizer._fused_engine = SmallFCLOptFused(optimizer, defines=tuple(sys.argv[2].split(",")))
for _ in range(3):
    optimizer.step()
torch.cuda.synchronize()
print("profiled step done")
