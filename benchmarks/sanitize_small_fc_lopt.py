"""A few small fused small_fc_lopt steps, for compute-sanitizer (memcheck, racecheck) on the device."""

import torch

import lopt

# Small tensors and one of 78,000 elements (many blocks of the apply pass).
shapes = [(), (5,), (33, 17), (4, 4), (2, 3, 5), (6, 2, 3, 3), (1, 9), (300,), (300, 260)]
params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
params.append(torch.nn.Parameter(torch.randn(7, 5, device="cuda", dtype=torch.bfloat16)))
optimizer = lopt.SmallFCLOpt(params, weights=lopt.random_weights("small_fc_lopt"), backend="fused", weight_decay=0.01)
for step in range(3):
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    optimizer.step()
torch.cuda.synchronize()
assert all(torch.isfinite(p).all() for p in params)
print("sanitize run ok")
