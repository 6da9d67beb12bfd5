"""Would small_fc_lopt's statistics pass hide behind its apply pass? A probe, GPU only.

The apply pass is bound by issue and latency (DRAM ~30% busy in the exact mode, ~55% in the fast one);
the statistics pass is bound by DRAM. If the statistics of some tensors ran while the apply pass of
others runs, a step would pay less than the sum. This times, in one process, the apply pass of one
GPT-2-medium optimizer (A) and the statistics pass of another (B, its own parameters), alone and
launched together on two streams (A first), for A's apply grid at its default blocks per SM and at
fewer (room for B's blocks), and for B's statistics kernel built at its default register bound and
at a tighter one (LOPT_STATS_MIN_BLOCKS=4: 64 registers, a block beside four apply blocks).

    PYTHONPATH=. python3 benchmarks/overlap_probe.py --out overlap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lopt  # noqa: E402
from bench_fused import gradient_sets, make  # noqa: E402
from lopt.bench.report import environment  # noqa: E402
from lopt.param_sets import build_parameters  # noqa: E402


def ready(params, options, defines=()):
    """An optimizer after two steps: its plan and tables exist."""
    opt = make("small_fc_lopt", params, "fused", WEIGHTS, defines, options)
    for p, g in zip(params, gradient_sets(params, count=1)[0]):
        p.grad = g
    opt.step()
    opt.step()
    engine = opt._fused_engine
    engine.kept_optimizer = opt  # (the engine holds its optimizer weakly)
    flags = engine.flags(engine.plan, types.SimpleNamespace(grad_scale=None, found_inf=None))
    return engine, flags


PAUSE_S = 0.0  # --pause-ms


def timed(launches, reps=15, warmup=3) -> float:
    """Median ms from the first launch to the last one's end; ``launches``: (stream, fn) in launch order."""
    main = torch.cuda.current_stream()
    times = []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        time.sleep(PAUSE_S)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        for stream, fn in launches:
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                fn()
        for stream, _ in launches:
            main.wait_stream(stream)
        end.record(main)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return round(statistics.median(times), 3)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--pause-ms", type=float, default=0.0,
                        help="idle the device this long before each timed launch (unthrottled clocks: variants_ab.py)")
    args = parser.parse_args()
    global PAUSE_S
    PAUSE_S = args.pause_ms / 1e3
    env = environment(torch.device("cuda", 0))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    params_a = build_parameters("gpt2-medium", device="cuda")
    params_b = build_parameters("gpt2-medium", device="cuda", seed=1)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    stats = {}
    for label, defines in (("stats_default", ()), ("stats_64regs", ("LOPT_STATS_MIN_BLOCKS=4",))):
        engine, flags = ready(params_b, {}, defines)
        stats[label] = (engine, lambda engine=engine, flags=flags: engine._statistics(engine.plan, flags))
        del engine
    rows = []
    for precision, blocks in (("exact", (5, 4)), ("fast", (7, 6))):
        engine, flags = ready(params_a, {"precision": precision})
        default_grid = engine.apply_grid
        for per_sm in blocks:
            engine.apply_grid = sms * per_sm
            apply = (s1, lambda engine=engine, flags=flags: engine._apply(engine.plan, flags))
            row = {"precision": precision, "apply_blocks_per_sm": per_sm, "default_grid": default_grid,
                   "apply_alone_ms": timed([apply])}
            for label, (_, fn) in stats.items():
                row[f"{label}_alone_ms"] = timed([(s2, fn)])
                row[f"apply_with_{label}_ms"] = timed([apply, (s2, fn)])
                row[f"sequential_{label}_ms"] = timed([apply, (s1, fn)])
            rows.append(row)
            print(json.dumps(row), flush=True)
        engine.apply_grid = default_grid
        del engine
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": env, "pause_ms": args.pause_ms, "rows": rows}, indent=1))
    return 0


WEIGHTS = lopt.random_weights("small_fc_lopt", seed=0)

if __name__ == "__main__":
    sys.exit(main())
