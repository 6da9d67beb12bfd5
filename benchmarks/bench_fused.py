"""GPU benchmark of the fused optimizer steps, in one process beside fused AdamW.

    PYTHONPATH=. python benchmarks/bench_fused.py --out $OUT/bench.json [--optimizers small_fc_lopt,velo]

For each parameter set (GPT-2 medium, ViT-B/16; float32 parameters, random gradients × 1e-3, a
fresh set of gradient tensors every step): median step time after warm-up (CUDA events), kernel
launches per step (torch.profiler), peak memory beyond parameters and gradients, the time per
kernel (median over PROFILED_STEPS profiled steps), achieved bandwidth against the bytes each kernel must move, and the fused-vs-naive relative
update error (one step from identical state). The device-to-device copy bandwidth is measured in the
same process. ``--optimizers`` takes registered names (small_fc_lopt, velo, elo, mulo); ``--fast`` adds each one's
``precision="fast"`` row (``--only-fast``: that row alone, for an A/B of the fast mode), ``--max-grad-norm`` a
clipped row;
``--graph`` also times each step captured in a CUDA graph and replayed, back to back and after 40 ms idle
(no host share; the "unthrottled" time, see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

import lopt
from lopt import registry
from lopt.bench.measure import elapsed_and_host_ms
from lopt.bench.report import environment
from lopt.param_sets import build_parameters, embedding_flags, param_set_shapes


def copy_bandwidth_tb_s() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return 2 * src.numel() / (statistics.median(times) * 1e-3) / 1e12


def gradient_sets(params, count=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(p.shape, generator=g) * 1e-3).to("cuda") for p in params] for _ in range(count)]


def make(name, params, backend, weights, options=None, param_set=None):
    """fused AdamW, or lopt's ``name`` on ``backend`` with the optimizer ``options`` (e.g. precision). An
    optimizer with an AdamW branch for embeddings (CELO2) gets the parameter set's embeddings in a group of
    their own (``is_embedding``), as ``lopt.param_groups_for`` routes a model's."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    horizon = {"num_steps": 10_000} if name == "velo" else {}  # (VeLO's planned length: a long run's)
    entry = registry.get(name)
    if param_set is not None and hasattr(entry.front_end_class, "uses_adamw"):
        flags = embedding_flags(param_set)
        groups = [{"params": [p for p, embedding in zip(params, flags) if not embedding]},
                  {"params": [p for p, embedding in zip(params, flags) if embedding], "is_embedding": True}]
        params = [group for group in groups if group["params"]]
    return entry.build(params, weights=weights, backend=backend, **horizon, **(options or {}))


def do_step(opt, loss):
    opt.step(loss) if getattr(opt, "requires_loss", False) else opt.step()


def time_steps(opt, params, grad_sets, steps, warmup):
    """The ms of each of ``steps`` steps after ``warmup`` (CUDA events), and the host's ms to issue each;
    each step gets a different set of gradient tensors."""
    loss = torch.tensor(2.5, device="cuda")
    times, host_times = [], []
    for i in range(warmup + steps):
        for p, g in zip(params, grad_sets[i % len(grad_sets)]):
            p.grad = g
        elapsed, host = elapsed_and_host_ms(lambda: do_step(opt, loss), torch.device("cuda"))
        if i >= warmup:
            times.append(elapsed)
            host_times.append(host)
    return times, host_times


def capture_step(opt, params, grads, warmup: int):
    """``opt``'s step on the gradient tensors ``grads`` (static: a replay reads them where they are), after
    ``warmup`` steps on a side stream, captured in a CUDA graph; (graph, loss): keep both alive."""
    for p, g in zip(params, grads):
        p.grad = g
    loss = torch.tensor(2.5, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            do_step(opt, loss)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        do_step(opt, loss)
    return graph, loss


def time_replays(graph, steps: int, warmup: int, pause_ms: float = 0.0) -> list:
    """The ms of each of ``steps`` replays of ``graph`` after ``warmup`` untimed ones (CUDA events);
    ``pause_ms``: the device idles that long before each replay (a cool device, as in training)."""
    times = []
    for i in range(warmup + steps):
        if pause_ms:
            time.sleep(pause_ms / 1e3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def make_capturable(name, params, weights, options=None, param_set=None):
    """``make``'s fused optimizer, AdamW with ``capturable=True`` (lopt's fused steps always are)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, fused=True, capturable=True)
    return make(name, params, "fused", weights, options, param_set)


PAUSE_MS = 40.0  # before each replay of the unthrottled timing


def graph_step_ms(name, param_set, weights, steps, warmup, options=None) -> tuple:
    """Median ms of one step captured in a CUDA graph and replayed (static gradient tensors, as in a
    captured training loop): the step without the host's share; replayed back to back, and with the
    device idle PAUSE_MS before each replay (the exact small_fc_lopt step otherwise runs at the H100's
    power cap, which a training iteration does not reach: docs/performance.md)."""
    params = build_parameters(param_set, "cuda")
    opt = make_capturable(name, params, weights, options=options, param_set=param_set)
    graph, loss = capture_step(opt, params, gradient_sets(params, 1)[0], warmup)
    times = time_replays(graph, steps, warmup)
    paused = time_replays(graph, steps, 1, PAUSE_MS)
    del graph, loss, opt, params
    torch.cuda.empty_cache()
    return round(statistics.median(times), 4), round(statistics.median(paused), 4)


PROFILED_STEPS = 5  # the per-kernel times are medians over these (one profiled step can be an outlier)


def profile_step(opt, params, grad_sets, steps: int = PROFILED_STEPS) -> tuple:
    """(kernel launches per step, {kernel: median ms per step}) over ``steps`` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    loss = torch.tensor(2.5, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            for p, g in zip(params, grad_sets[i % len(grad_sets)]):
                p.grad = g
            do_step(opt, loss)
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()),
                     key=lambda e: e.time_range.start)
    if len(kernels) % steps:
        raise RuntimeError(f"{len(kernels)} kernels in {steps} profiled steps: not the same launches every step")
    launches = len(kernels) // steps
    per_step = [{} for _ in range(steps)]
    for index, e in enumerate(kernels):
        times = per_step[index // launches]
        times[e.name] = times.get(e.name, 0.0) + e.device_time_total / 1e3
    names = {name for times in per_step for name in times}
    return launches, {name: round(statistics.median(times.get(name, 0.0) for times in per_step), 4) for name in names}


def update_error(name, param_set, weights, options=None) -> float:
    """max over tensors of ‖u_fused − u_naive‖ / ‖u_naive‖ for one step from identical state
    (``options``: the optimizer's, for both backends)."""
    updates = {}
    for backend in ("naive", "fused"):
        params = build_parameters(param_set, "cuda")
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, gradient_sets(params, 1)[0]):
            p.grad = g
        opt = make(name, params, backend, weights, options, param_set)
        do_step(opt, torch.tensor(2.5, device="cuda"))
        updates[backend] = [(p.detach() - b).double() for p, b in zip(params, before)]
        del opt, params, before
        torch.cuda.empty_cache()
    return max(float((f - n).norm() / n.norm().clamp_min(1e-30)) for f, n in zip(updates["fused"], updates["naive"]))


def measure(name, backend, param_set, weights, steps, warmup, options=None) -> dict:
    params = build_parameters(param_set, "cuda")
    grad_sets = gradient_sets(params)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    opt = make(name, params, backend, weights, options, param_set)
    times, host_times = time_steps(opt, params, grad_sets, steps, warmup)
    peak = (torch.cuda.max_memory_allocated() - baseline) / 2**20
    launches, split = profile_step(opt, params, grad_sets)
    label = backend + "".join(f"+{key}={value}" for key, value in (options or {}).items())
    row = {"optimizer": name, "backend": label, "param_set": param_set, "mode": "step",
           "ms_per_step": round(statistics.median(times), 4), "ms_all": [round(t, 4) for t in times],
           "host_ms_per_step": round(statistics.median(host_times), 4),
           "launches_per_step": launches, "peak_extra_mib": round(peak, 1), "kernel_ms": split}
    print(f"  measured {name} {label} on {param_set}: {row['ms_per_step']:.3f} ms/step "
          f"(host issues it in {row['host_ms_per_step']:.3f}); "
          + ", ".join(f"{k}: {v:.3f}" for k, v in sorted(split.items(), key=lambda kv: -kv[1])[:3]), flush=True)
    del opt, params, grad_sets
    torch.cuda.empty_cache()
    return row


def write_record(path, env, rows) -> None:
    """The run's JSON so far: written after every measurement, so a run cut short by a time limit keeps
    the rows it measured."""
    with open(path, "w") as f:
        json.dump({"environment": env, "weights": "random (timing only)", "results": rows}, f, indent=2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--optimizers", default="small_fc_lopt,velo", help="registered optimizers with a fused engine")
    parser.add_argument("--param-sets", default="gpt2-medium,vit-b16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--naive-steps", type=int, default=3, help="0: skip the naive rows")
    parser.add_argument("--graph", action="store_true",
                        help="also time each fused step (and AdamW's) captured in a CUDA graph and replayed")
    parser.add_argument("--max-grad-norm", type=float, default=None,
                        help="also time each optimizer but VeLO fused with this max_grad_norm (gradients are ~1e-3 x "
                             "sqrt(numel))")
    parser.add_argument("--fast", action="store_true",
                        help="also time each optimizer that has it fused with precision='fast'")
    parser.add_argument("--only-fast", action="store_true",
                        help="time each optimizer's precision='fast' row alone beside AdamW (an A/B of the fast mode)")
    args = parser.parse_args()
    args.fast = args.fast or args.only_fast
    optimizers = args.optimizers.split(",")
    option_rows = {name: ([{"max_grad_norm": args.max_grad_norm}] if args.max_grad_norm is not None and name != "velo"
                          else [])
                         + ([{"precision": "fast"}] if args.fast and "fast" in getattr(registry.get(name).front_end_class, "PRECISIONS", ())
                            else [])
                   for name in optimizers}

    env = environment(torch.device("cuda", 0))
    env["copy_bandwidth_tb_s"] = round(copy_bandwidth_tb_s(), 3)
    weights = {name: lopt.random_weights(registry.get(name).architecture, seed=0) for name in optimizers}  # time only
    rows = []
    for param_set in args.param_sets.split(","):
        numel = sum(math.prod(s) for _, s in param_set_shapes(param_set))
        adamw = measure("adamw", "fused", param_set, None, args.steps, args.warmup)
        rows.append(adamw)
        if args.graph:
            adamw["graph_ms_per_step"], adamw["graph_paused_ms_per_step"] = graph_step_ms("adamw", param_set, None,
                                                                                          args.steps, args.warmup)
        write_record(args.out, env, rows)
        for name in optimizers:
            fused = None
            if not args.only_fast:
                fused = measure(name, "fused", param_set, weights[name], args.steps, args.warmup)
                fused["max_rel_error_vs_naive"] = update_error(name, param_set, weights[name])
                rows.append(fused)
                write_record(args.out, env, rows)
            for options in option_rows.get(name, ()):
                rows.append(measure(name, "fused", param_set, weights[name], args.steps, args.warmup, options=options))
                rows[-1]["max_rel_error_vs_naive"] = update_error(name, param_set, weights[name], options=options)
                if args.graph:
                    rows[-1]["graph_ms_per_step"], rows[-1]["graph_paused_ms_per_step"] = graph_step_ms(
                        name, param_set, weights[name], args.steps, args.warmup, options)
                write_record(args.out, env, rows)
            if args.graph and fused is not None:
                fused["graph_ms_per_step"], fused["graph_paused_ms_per_step"] = graph_step_ms(
                    name, param_set, weights[name], args.steps, args.warmup)
            if args.naive_steps and not args.only_fast:
                rows.append(measure(name, "naive", param_set, weights[name], args.naive_steps, 1))
            write_record(args.out, env, rows)
        for row in rows:
            if row["param_set"] == param_set:
                row["overhead_vs_adamw"] = round(row["ms_per_step"] / adamw["ms_per_step"], 3)
                row["numel"] = numel
        print(f"\n{param_set} ({numel / 1e6:.1f} M parameters), copy bandwidth {env['copy_bandwidth_tb_s']} TB/s")
        print(f"{'optimizer':<14}{'backend':<34}{'ms/step':>10}{'x AdamW':>9}{'launches':>10}{'peak MiB':>10}{'rel.err':>10}")
        for row in rows:
            if row["param_set"] == param_set:
                error = row.get("max_rel_error_vs_naive")
                print(f"{row['optimizer']:<14}{row['backend']:<34}{row['ms_per_step']:>10.3f}{row['overhead_vs_adamw']:>9.2f}"
                      f"{row['launches_per_step']:>10}{row['peak_extra_mib']:>10.0f}{'' if error is None else f'{error:.1e}':>10}")
                if "graph_ms_per_step" in row:
                    graph_ms = row["graph_ms_per_step"]
                    paused = row["graph_paused_ms_per_step"]
                    print(f"    captured in a CUDA graph: {graph_ms:.3f} ms/step "
                          f"({graph_ms / adamw['graph_ms_per_step']:.2f} x AdamW captured); after {PAUSE_MS:.0f} ms "
                          f"idle: {paused:.3f} ({paused / adamw['graph_paused_ms_per_step']:.2f} x AdamW); "
                          f"uncaptured, the host issues the step in {row['host_ms_per_step']:.3f}")
                if row["backend"].startswith("fused") and row["optimizer"] != "adamw":
                    print("    " + ", ".join(f"{k}: {v:.3f}" for k, v in sorted(row["kernel_ms"].items(), key=lambda kv: -kv[1])))
        sys.stdout.flush()
    write_record(args.out, env, rows)
    print(json.dumps(env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
