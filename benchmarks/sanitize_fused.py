"""A few small fused steps of both optimizers, for compute-sanitizer (memcheck, racecheck) on the device:

    compute-sanitizer --tool memcheck python benchmarks/sanitize_fused.py
    SANITIZE_ONLY=celo2 compute-sanitizer --tool racecheck python benchmarks/sanitize_fused.py   (CELO2's part alone)
"""

import os

import torch

import lopt

# Every rank, small tensors and one of 78,000 elements (many blocks of each pass), a matrix whose rows are a
# multiple of 32 long (small_fc_lopt's slow-entry vectors), two dtypes, two groups; small_fc_lopt a second
# time with max_grad_norm in one group (norm jobs and clip factors), a third with precision="fast", and a
# fourth with weights of another MLP geometry (the generic float32 path).
shapes = [(), (5,), (33, 17), (4, 4), (2, 3, 5), (6, 2, 3, 3), (1, 9), (300,), (300, 260), (40, 96)]
ONLY = os.environ.get("SANITIZE_ONLY")  # small_fc_lopt, velo or celo2: that part alone
for name, max_grad_norm, precision in (("small_fc_lopt", None, "exact"), ("small_fc_lopt", 0.1, "exact"),
                                       ("small_fc_lopt", None, "fast"), ("small_fc_lopt", None, "h8x2"),
                                       ("velo", None, None)):
    if ONLY and name != ONLY:
        continue
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(7, 5, device="cuda", dtype=torch.bfloat16)))
    groups = [{"params": params[:5]}, {"params": params[5:], "weight_decay": 0.01}]
    if max_grad_norm is not None:
        groups[1]["max_grad_norm"] = max_grad_norm
    weights = (lopt.random_weights(name, hidden_size=8, hidden_layers=2) if precision == "h8x2"
               else lopt.random_weights(name))
    precision = "exact" if precision == "h8x2" else precision
    if name == "velo":
        optimizer = lopt.VeLO(groups, num_steps=100, weights=weights, backend="fused")
    else:
        optimizer = lopt.SmallFCLOpt(groups, weights=weights, backend="fused", precision=precision)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-2
        optimizer.step(torch.tensor(2.0 - 0.1 * step, device="cuda")) if name == "velo" else optimizer.step()
    torch.cuda.synchronize()
    assert all(torch.isfinite(p).all() for p in params), name

# CELO2 and ELO-CELO2: learned matrices (two of one shape: a Newton–Schulz stack of two), a transposed one,
# vectors, 3-d tensors and 4-d kernels (sliced: celo2_slices, _3x3, _1x1), a class token and a column (scalar
# matrices), an embedding group on the AdamW branch; ELO-CELO2 clips globally. CELO2's run has a NaN in one matrix:
# its proposed step is not all finite, so the final step's other path (the proposed step read first, the matrix
# flagged by celo2_normalise) runs too.
for cls, precision in ((lopt.CELO2, "exact"), (lopt.ELO_CELO2, "fast")):
    if ONLY and ONLY != "celo2":
        continue
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(33, 17, device="cuda")))
    params.append(torch.nn.Parameter(torch.randn(12, 5, 1, 1, device="cuda")))  # (celo2_slices_1x1)
    # (slices of more than 32 elements, a warp each in celo2_slices: a 7 x 7 conv kernel's, a 3-d tensor's 8 x 5)
    params += [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in ((3, 2, 7, 7), (2, 8, 5))]
    # (scalar matrices, whose whole Newton–Schulz celo2_normalise runs: a class token and a column)
    params += [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in ((1, 1, 301), (77, 1))]
    embedding = torch.nn.Parameter(torch.randn(50, 8, device="cuda"))
    groups = [{"params": params[:6]}, {"params": params[6:], "weight_decay": 0.01},
              {"params": [embedding], "is_embedding": True}]
    optimizer = cls(groups, weights=lopt.random_weights("celo2"), backend="fused", precision=precision)
    poisoned = cls is lopt.CELO2
    if poisoned:
        with torch.no_grad():
            params[9][3, 5] = float("nan")
    for step in range(3):
        for p in params + [embedding]:
            p.grad = torch.randn_like(p) * 1e-2
        optimizer.step()
    torch.cuda.synchronize()
    assert int((~torch.isfinite(params[9])).sum()) == (1 if poisoned else 0), cls.__name__
    assert all(torch.isfinite(p).all() for i, p in enumerate(params + [embedding]) if i != 9), cls.__name__
print("sanitize run ok")
