"""Soak run: many steps of a small real model with each optimizer and backend, checking that nothing
drifts: every parameter stays finite, host and device memory do not grow, time per step stays flat.

    PYTHONPATH=. python benchmarks/soak.py --device cuda --backends fused --out $OUT/soak_cuda.json
    PYTHONPATH=. python benchmarks/soak.py --device cpu --backends naive --out soak_cpu.json

The model is an MLP classifier (784-256-256-10 by default; ``--inputs``/``--hidden``) on a fixed synthetic data set (a different batch every
step); the loss goes to VeLO as a device tensor. Finiteness is checked every ``--check-every`` steps
(one synchronisation each), memory at the start (after warm-up) and at the end, and the time of the
first and last windows of ``--window`` steps is compared.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

import lopt
from benchmarks.bench_fused import environment


def host_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def soak(name: str, backend: str, device: torch.device, steps: int, check_every: int, window: int,
         inputs: int, hidden: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, 10)).to(device)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(64 * 64, inputs, generator=g).to(device)
    labels = torch.randint(0, 10, (64 * 64,), generator=g).to(device)
    weights = lopt.random_weights(name, seed=0)
    if name == "velo":
        opt = lopt.VeLO(model.parameters(), num_steps=steps, weights=weights, backend=backend)
    else:
        opt = lopt.SmallFCLOpt(model.parameters(), weights=weights, backend=backend, weight_decay=0.01)
    assert opt.backend == backend, opt.backend_reason

    def one_step(i):
        batch = slice((i % 64) * 64, (i % 64 + 1) * 64)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(data[batch]), labels[batch])
        loss.backward()
        opt.step(loss.detach()) if opt.requires_loss else opt.step()
        return loss

    def synced_time():
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    for i in range(20):  # warm-up: plans, compilation, allocator pools
        one_step(i)
    start_memory = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    start_rss = host_rss_mib()
    losses, window_ms, finite = [], {}, True
    t0 = synced_time()
    for i in range(steps):
        loss = one_step(i)
        if i + 1 == window:
            window_ms["first"] = (synced_time() - t0) * 1e3 / window
        if i == steps - window:
            t_last = synced_time()
        if (i + 1) % check_every == 0 or i + 1 == steps:
            finite = finite and all(bool(torch.isfinite(p).all()) for p in model.parameters())
            losses.append(round(float(loss.detach()), 5))
    window_ms["last"] = (synced_time() - t_last) * 1e3 / window
    result = {"optimizer": name, "backend": backend, "device": str(device), "steps": steps, "finite": finite,
              "model": f"MLP {inputs}-{hidden}-{hidden}-10", "parameters": sum(p.numel() for p in model.parameters()),
              "loss_every_check": losses, "ms_per_step_first_window": round(window_ms["first"], 4),
              "ms_per_step_last_window": round(window_ms["last"], 4), "host_rss_mib_start": round(start_rss, 1),
              "host_rss_mib_end": round(host_rss_mib(), 1), "skipped_steps": opt.skipped_steps}
    if device.type == "cuda":
        result["cuda_allocated_mib_start"] = round(start_memory / 2**20, 3)
        result["cuda_allocated_mib_end"] = round(torch.cuda.memory_allocated(device) / 2**20, 3)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backends", default="fused")
    parser.add_argument("--optimizers", default="small_fc_lopt,velo")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--check-every", type=int, default=1000)
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--inputs", type=int, default=784)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = []
    for name in args.optimizers.split(","):
        for backend in args.backends.split(","):
            result = soak(name, backend, device, args.steps, args.check_every, args.window, args.inputs, args.hidden)
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "loss_every_check"}), flush=True)
    env = environment() if device.type == "cuda" else {"device": "cpu", "torch": torch.__version__, "lopt": lopt.__version__}
    with open(args.out, "w") as f:
        json.dump({"environment": env, "results": results}, f, indent=2)
    bad = [r for r in results if not r["finite"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
