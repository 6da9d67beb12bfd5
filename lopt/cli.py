"""The ``lopt`` command: ``info``, ``weights list|download|verify``, ``bench``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import lopt
from lopt import weights as weights_lib


def _cmd_info(args) -> int:
    from lopt.fused import launcher

    print(f"lopt {lopt.__version__}  torch {torch.__version__}")
    cupy = launcher.cupy_or_none()
    print(f"CuPy: {cupy.__version__ if cupy is not None else 'not installed'}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            print(f"device cuda:{i}: {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    else:
        print("CUDA: no device available to PyTorch")
    devices = {torch.device("cuda", 0)}  # what the fused backend would need
    print("backends:")
    from lopt.optimizers import OPTIMIZERS

    for name, cls in OPTIMIZERS.items():
        reason = launcher.fused_unavailable_reason(cls.architecture, devices)
        print(f"  {name}: naive available; fused {'available' if reason is None else 'unavailable: ' + reason}")
    print("registered weights:")
    for name, entry in weights_lib.registered_weights().items():
        repos = ", ".join(f"{c.repo_id}@{c.revision}" for c in entry.components.values())
        print(f"  {name} [{entry.architecture}] {repos}: {weights_lib.cached_status(name)}")
    return 0


def _cmd_weights(args) -> int:
    if args.weights_command == "list":
        for name, entry in weights_lib.registered_weights().items():
            repos = ", ".join(f"{c.repo_id}@{c.revision}" for c in entry.components.values())
            print(f"{name}\t{entry.architecture}\t{repos}\t{weights_lib.cached_status(name)}\t{entry.description}")
        return 0
    if args.weights_command == "download":
        directories = weights_lib.download(args.name, force=args.force)
        for directory in directories:
            print(directory)
        return 0
    architecture, loaded = weights_lib.verify(args.path, args.architecture)
    count = sum(len(t) for t in loaded.tensors.values())
    print(f"ok: {args.path} holds valid {architecture} weights ({count} tensors)")
    return 0


def _cmd_bench(args) -> int:
    from tqdm import tqdm

    from lopt import bench
    from lopt.fused import launcher
    from lopt.optimizers import OPTIMIZERS

    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    param_set = args.params or ("gpt2-medium" if cuda else "tiny-lm")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    local = None if args.weights is None else (args.weights[0] if len(args.weights) == 1 else tuple(args.weights))
    weights = bench.resolve_bench_weights(args.optimizer, local, args.require_pretrained)
    label = "" if weights.pretrained else " (untrained weights — timing only)"
    print(f"{args.optimizer} on {param_set} ({len(bench.param_set_shapes(param_set))} tensors) on {device}, "
          f"weights: {weights.source}{label}")

    backends = args.backends.split(",") if args.backends else ["naive", "fused"]
    # On a machine without CUDA, say so (rather than that the CPU parameters are not on a GPU).
    reason = launcher.fused_unavailable_reason(OPTIMIZERS[args.optimizer].architecture,
                                               {device} if args.device == "cpu" else {torch.device("cuda", 0)})
    if "fused" in backends and reason is not None:
        print(f"fused backend skipped: {reason}")
        backends.remove("fused")
    runs = [(args.optimizer, b) for b in backends]
    if cuda and not args.no_adamw:
        runs.append(("adamw", "fused"))
    results = []
    with tqdm(total=len(runs) * args.steps, desc="timing steps", unit="step", disable=args.quiet) as progress:
        for optimizer_name, backend in runs:
            progress.set_postfix_str(f"{optimizer_name}/{backend}")
            result = bench.bench_one(optimizer_name, backend, param_set, weights, device=device, dtype=dtype,
                                     steps=args.steps, warmup=args.warmup, progress=progress)
            if backend == "fused" and optimizer_name != "adamw":
                result.max_rel_error_vs_naive = bench.update_relative_error(optimizer_name, weights, param_set, device, dtype)
            results.append(result)
    print(bench.format_table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(bench.results_json(results, device, weights.source, weights.pretrained))
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lopt", description="Learned optimizers for PyTorch")
    parser.add_argument("--version", action="version", version=f"lopt {lopt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="versions, devices, backends and registered weights")

    weights = sub.add_parser("weights", help="list, download or verify meta-weights")
    wsub = weights.add_subparsers(dest="weights_command", required=True)
    wsub.add_parser("list", help="registered weight sets and whether they are cached")
    download = wsub.add_parser("download", help="download a registered weight set or a hub repo into the Hugging Face cache")
    download.add_argument("name", help="a registered name (lopt weights list) or a hub repo id owner/name[@revision]")
    download.add_argument("--force", action="store_true", help="download again even if cached")
    verify = wsub.add_parser("verify", help="check that a directory, file or name holds valid weights")
    verify.add_argument("path")
    verify.add_argument("--architecture", default=None, help="small_fc_lopt or velo (default: try each)")

    from lopt.optimizers import OPTIMIZERS
    from lopt.param_sets import PARAM_SETS

    bench = sub.add_parser("bench", help="time optimizer steps on a real model's parameter set (naive vs fused)")
    bench.add_argument("--optimizer", default="small_fc_lopt", choices=sorted(OPTIMIZERS))
    bench.add_argument("--params", default=None, choices=sorted(PARAM_SETS),
                       help="parameter set (default: gpt2-medium on CUDA, tiny-lm on the CPU)")
    bench.add_argument("--backends", default=None, help="comma-separated, default naive,fused")
    bench.add_argument("--steps", type=int, default=10, help="timed steps per backend (median reported)")
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--device", default=None, choices=["cpu", "cuda"])
    bench.add_argument("--weights", default=None, nargs="+", metavar="PATH",
                       help="local weights instead of the registered ones: a directory or .safetensors file "
                            "(VeLO: the RNN and the MLP directory)")
    bench.add_argument("--require-pretrained", action="store_true", help="fail instead of using untrained weights")
    bench.add_argument("--no-adamw", action="store_true", help="skip the fused AdamW yardstick")
    bench.add_argument("--json", default=None, help="also write the results as JSON here")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "info":
            return _cmd_info(args)
        if args.command == "weights":
            return _cmd_weights(args)
        return _cmd_bench(args)
    except weights_lib.WeightsError as err:
        print(f"lopt: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
