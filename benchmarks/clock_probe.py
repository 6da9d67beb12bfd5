"""Where a captured step's time goes beyond its kernels, and what the SM clock does meanwhile. GPU only.

Run it on a new GPU kind, or after a kernel change, before trusting back-to-back timings: on an H100
the exact and fast small_fc_lopt steps, replayed back to back, draw the board's power cap and the SM
clock drops by about a sixth, which a training iteration does not do (docs/performance.md). For fused
AdamW and small_fc_lopt in each ``--precisions`` entry, in one process:

1. replays each optimizer's captured step under torch.profiler and splits every replay into its
   kernels' busy time and the gaps between them (first kernel's start to the last one's end);
2. replays each step back to back for a few seconds while ``nvidia-smi`` samples the SM clock, the
   power draw and the active clock-event reasons, and once with an idle pause between replays, to see
   whether a sustained exact step runs at a lower clock (power) than isolated profiled steps.

    PYTHONPATH=. python3 benchmarks/clock_probe.py --out clock.json [--param-set gpt2-medium] [--precisions exact,fast]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lopt  # noqa: E402
from bench_fused import capture_step, gradient_sets, make_capturable, time_replays  # noqa: E402
from lopt.bench.report import environment  # noqa: E402
from lopt.param_sets import build_parameters  # noqa: E402

SMI_FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active")


def replay_breakdown(graph, replays: int = 20) -> dict:
    """Medians over ``replays`` profiled replays: event-timed ms, kernel busy ms, gaps between kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    spans = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            spans.append(start.elapsed_time(end))
            time.sleep(0.002)  # a visible idle gap separates the replays in the trace
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if not events:
        return {"event_ms": round(statistics.median(spans), 4), "kernels_traced": 0}
    # Group the trace into replays at idle gaps longer than 1 ms.
    groups, current = [], [events[0]]
    for e in events[1:]:
        if e.time_range.start - max(x.time_range.end for x in current) > 1000:
            groups.append(current)
            current = []
        current.append(e)
    groups.append(current)
    rows = []
    for group in groups:
        first = min(e.time_range.start for e in group)
        last = max(e.time_range.end for e in group)
        busy = sum(e.time_range.end - e.time_range.start for e in group)
        rows.append({"span_ms": (last - first) / 1e3, "busy_ms": busy / 1e3, "nodes": len(group),
                     "per_node": [(e.name[:60], round((e.time_range.end - e.time_range.start) / 1e3, 4),
                                   round((e.time_range.start - first) / 1e3, 4)) for e in group]})
    middle = rows[len(rows) // 2]
    return {"event_ms": round(statistics.median(spans), 4), "replays_traced": len(rows),
            "span_ms": round(statistics.median(r["span_ms"] for r in rows), 4),
            "busy_ms": round(statistics.median(r["busy_ms"] for r in rows), 4),
            "nodes": middle["nodes"], "middle_replay": middle["per_node"]}


def start_smi(fields) -> subprocess.Popen | None:
    """``nvidia-smi`` sampling ``fields`` of GPU 0 every 20 ms (CSV lines on its stdout, read after
    terminate()), or None where there is no nvidia-smi."""
    try:
        return subprocess.Popen(["nvidia-smi", "--id=0", f"--query-gpu={','.join(fields)}",
                                 "--format=csv,noheader,nounits", "-lms", "20"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        return None


def sampled(run, seconds: float) -> dict:
    """``run()`` repeated for ``seconds`` while nvidia-smi samples every 20 ms; medians of the samples."""
    smi = start_smi(SMI_FIELDS)
    count, begin = 0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        run()
        count += 1
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - begin
    result = {"runs": count, "ms_per_run": round(1e3 * elapsed / count, 4)}
    if smi is None:
        return result | {"smi": "nvidia-smi not found"}
    smi.terminate()
    out, err = smi.communicate()
    samples = [line.split(", ") for line in out.strip().splitlines() if line.strip()]
    samples = samples[len(samples) // 4:]  # the first quarter warms up
    if not samples or len(samples[0]) != len(SMI_FIELDS):
        return result | {"smi": (out + err)[-400:]}
    for i, field in enumerate(SMI_FIELDS[:-1]):
        values = [float(s[i]) for s in samples if s[i].replace(".", "", 1).isdigit()]
        result[field] = round(statistics.median(values), 1) if values else None
    reasons = {}
    for s in samples:
        reasons[s[-1]] = reasons.get(s[-1], 0) + 1
    result["event_reasons"] = reasons
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--param-set", default="gpt2-medium")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--precisions", default="exact,fast", help="','-separated small_fc_lopt precisions")
    args = parser.parse_args()
    params = build_parameters(args.param_set, "cuda")
    grads = gradient_sets(params, 1)[0]
    weights = lopt.random_weights("small_fc_lopt", seed=0)
    rows = {}
    for label in ["adamw"] + args.precisions.split(","):
        if label == "adamw":
            opt = make_capturable("adamw", params, None)
        else:
            opt = make_capturable("small_fc_lopt", params, weights, {"precision": label})
        graph, loss = capture_step(opt, params, grads, 3)
        time_replays(graph, 5, 2)
        row = {"replays": replay_breakdown(graph)}
        row["back_to_back"] = sampled(graph.replay, args.seconds)

        def paused(graph=graph):
            graph.replay()
            torch.cuda.synchronize()
            time.sleep(0.02)
        row["paused_20ms"] = sampled(paused, args.seconds)
        rows[label] = row
        print(label, json.dumps({k: (v if k != "replays" else {x: y for x, y in v.items() if x != "middle_replay"})
                                 for k, v in row.items()}), flush=True)
        for name, ms, at in row["replays"].get("middle_replay", []):
            print(f"    {at:9.3f} +{ms:8.4f}  {name}")
        del graph, loss, opt
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"environment": environment(torch.device("cuda")),
                                          "param_set": args.param_set, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
