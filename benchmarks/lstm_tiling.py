"""velo_lstm's tiling, rows x units per block: its kernel time on real parameter sets, and whether every
tiling steps bit-identically to the first (each sum runs over k in order, whatever the tiling).

    PYTHONPATH=. python benchmarks/lstm_tiling.py [32x32 32x16 ...] > tiling.txt

The tiling is part of lopt's Python/CUDA contract (``CONSTANTS["VELO_LSTM_ROWS"]``, ``["VELO_LSTM_UNITS"]``):
it is patched here before each optimizer is built, so each variant compiles its own kernels.
"""

import sys

import torch

import lopt
from benchmarks.bench_fused import do_step, gradient_sets, profile_step
from lopt.fused import contract
from lopt.fused import velo as fused_velo
from lopt.param_sets import build_parameters
from lopt.weights import random_weights

tilings = [tuple(map(int, t.split("x"))) for t in (sys.argv[1:] or ["32x32", "32x16", "16x32", "16x16", "32x8"])]
weights = random_weights("velo")
loss = torch.tensor(2.5, device="cuda")
for param_set in ("vit-b16", "gpt2-medium"):
    grad_sets = gradient_sets(build_parameters(param_set, "cpu"))
    first = None
    for rows, units in tilings:
        contract.CONSTANTS["VELO_LSTM_ROWS"], contract.CONSTANTS["VELO_LSTM_UNITS"] = rows, units
        fused_velo.LSTM_ROWS, fused_velo.LSTM_UNITS = rows, units
        params = build_parameters(param_set, "cuda")
        opt = lopt.VeLO(params, num_steps=10_000, weights=weights, backend="fused")
        for i in range(3):
            for p, g in zip(params, grad_sets[i % len(grad_sets)]):
                p.grad = g
            do_step(opt, loss)
        launches, kernel_ms = profile_step(opt, params, grad_sets)
        result = torch.cat([p.detach().reshape(-1) for p in params])
        if first is None:
            first, same = result, "(the reference)"
        else:
            same = "bit-identical" if torch.equal(result, first) else \
                f"DIFFERS (max |diff| {float((result - first).abs().max()):.3e})"
        print(f"{param_set} {rows}x{units}: velo_lstm {kernel_ms['velo_lstm']:.4f} ms, launches {launches}, "
              f"8 steps {same}", flush=True)
        del opt, params, result
        torch.cuda.empty_cache()
