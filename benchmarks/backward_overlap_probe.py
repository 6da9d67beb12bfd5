"""Would memory-bound optimizer work hide behind the backward pass? (A go/no-go probe for #12.)

Times a GPT-2 medium training iteration's forward and backward (bfloat16 autocast, as `lopt bench
--mode iteration` runs them) alone, and with a side-stream job launched just before `backward()`: copies
that move about as many bytes as small_fc_lopt's statistics pass and axis sums (~10 GB, ~3.5 ms alone on
an H100). The job does not depend on the gradients; it only asks whether the GPU runs it beside the
backward's kernels, and at what cost to them.

    PYTHONPATH=. python benchmarks/backward_overlap_probe.py --out probe.json
"""
import argparse
import json
import statistics

import torch

from lopt.bench.models import build_model
from lopt.bench.report import environment


def side_job(buffers):
    """The stand-in for the statistics pass: each pair copied once (read + write)."""
    for source, target in buffers:
        target.copy_(source)


def time_ms(function, repeats: int) -> list:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--side-gb", type=float, default=5.0, help="GB read (and as many written) by the side job")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    model = build_model(args.model, device)
    batch = model.random_batch(0)
    pieces = 8
    floats = int(args.side_gb * 1e9 / 4 / pieces)
    buffers = [(torch.randn(floats, device=device), torch.empty(floats, device=device)) for _ in range(pieces)]
    side_stream = torch.cuda.Stream()

    def forward():
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            return model.loss(batch)

    def iteration():
        for p in model.parameters():
            p.grad = None
        forward().backward()

    def iteration_with_side_job():
        for p in model.parameters():
            p.grad = None
        loss = forward()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            side_job(buffers)
        loss.backward()
        torch.cuda.current_stream().wait_stream(side_stream)

    def iteration_then_side_job():
        iteration()
        side_job(buffers)

    for _ in range(3):
        iteration_with_side_job()
        iteration_then_side_job()
    rounds = {"forward_backward": [], "side_job_alone": [], "with_side_job_beside_backward": [],
              "side_job_after_backward": []}
    for _ in range(2):  # alternating blocks, so that drift hits all alike
        rounds["forward_backward"] += time_ms(iteration, args.repeats)
        rounds["side_job_alone"] += time_ms(lambda: side_job(buffers), args.repeats)
        rounds["with_side_job_beside_backward"] += time_ms(iteration_with_side_job, args.repeats)
        rounds["side_job_after_backward"] += time_ms(iteration_then_side_job, args.repeats)
    medians = {name: round(statistics.median(times), 3) for name, times in rounds.items()}
    medians["hidden_ms"] = round(medians["side_job_after_backward"] - medians["with_side_job_beside_backward"], 3)
    record = {"environment": environment(device), "model": args.model, "side_gb": args.side_gb,
              "medians_ms": medians, "all_ms": {k: [round(t, 3) for t in v] for k, v in rounds.items()}}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(json.dumps(medians, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
