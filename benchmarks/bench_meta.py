"""Meta-training's inner throughput: population steps of the learned optimizer on a preset's task families,
inner steps per second (members × steps / seconds), by population size and by how the batched optimizer's
step runs (eager torch ops, or through torch.compile: ``compile_inner``), with CUDA graphs where the device
has them (docs/meta_training.md §6, §7).

    PYTHONPATH=. python3 benchmarks/bench_meta.py --out benchmarks/results/meta_throughput_h200.json
    PYTHONPATH=. python3 benchmarks/bench_meta.py --device cpu --populations 4 --steps 5 --out /tmp/meta.json   (smoke)

Each (family, population, compile) row: a fresh ``InnerPopulation`` (antithetic members: population =
2·tasks) with random meta-weights, ``--warmup`` untimed steps (graph capture, compilation), then ``--steps``
timed ones, synchronised. The task's own forward and backward are in every step, as in meta-training.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import lopt
from lopt.bench.report import environment
from lopt.meta import tasks as tasks_lib
from lopt.meta.estimators import InnerPopulation
from lopt.meta.metaparams import MetaParamSpace
from lopt.meta.presets import preset


def measure(family, population: int, compiled: bool, device: torch.device, steps: int, warmup: int,
            use_graph: bool) -> dict:
    inner = InnerPopulation(family, population // 2, members=2, device=device,
                            optimizer_kwargs={"compiled": compiled}, use_graph=use_graph)
    generator = torch.Generator(device=device).manual_seed(0)
    inner.start(generator)
    space = MetaParamSpace("small_fc_lopt")
    network = {k: v.to(device) for k, v in space.unflatten(space.flatten(lopt.random_weights("small_fc_lopt"))).items()}
    started = time.perf_counter()
    inner.unroll(network, warmup, generator)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    warmup_seconds = time.perf_counter() - started
    started = time.perf_counter()
    inner.unroll(network, steps, generator)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    stepper = inner.stepper
    return {"family": family.name, "population": population, "compile_inner": compiled,
            "inner_steps_per_second": round(population * steps / seconds), "ms_per_population_step":
            round(1e3 * seconds / steps, 4), "warmup_seconds": round(warmup_seconds, 2),
            "graph_steps": stepper.graph_steps, "eager_steps": stepper.eager_steps,
            "compile_failure": inner.optimizer.compile_failure}  # (then the rows' steps ran eagerly)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="mulo", help="whose task families (default: mulo's three)")
    parser.add_argument("--populations", default="16,64,256", help="members per family (even)")
    parser.add_argument("--compile", default="off,on", help="compile_inner settings to time: off, on or both")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-graphs", action="store_true", help="eager population steps on CUDA too")
    args = parser.parse_args()
    device = torch.device(args.device)
    populations = [int(p) for p in args.populations.split(",")]
    if any(p < 2 or p % 2 for p in populations):
        parser.error(f"--populations takes even sizes of at least 2 (antithetic pairs), got {args.populations}")
    settings = {"off": False, "on": True}
    compiles = [settings[c] for c in args.compile.split(",")]
    families = [tasks_lib.build(spec).to(device) for spec in preset(args.preset).resolved().tasks]
    rows = []
    record = {"environment": environment(device), "preset": args.preset, "steps": args.steps, "warmup": args.warmup,
              "cuda_graphs": device.type == "cuda" and not args.no_graphs, "results": rows}
    for family in families:
        for population in populations:
            for compiled in compiles:
                row = measure(family, population, compiled, device, args.steps, args.warmup,
                              use_graph=not args.no_graphs)
                rows.append(row)
                print(f"{row['family']:<40} P={population:<5} compile_inner={str(compiled):<5} "
                      f"{row['inner_steps_per_second']:>10,} inner steps/s  {row['ms_per_population_step']:.3f} ms/step"
                      + ("  (compile failed: eager)" if row["compile_failure"] else ""), flush=True)
                with open(args.out, "w") as f:  # (after every row: a run cut short keeps what it measured)
                    json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
