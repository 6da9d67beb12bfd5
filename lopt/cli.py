"""The ``lopt`` command: ``info``, ``weights list|download|verify``, ``bench``."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from pathlib import Path

import torch

import lopt
from lopt import registry
from lopt import weights as weights_lib
from lopt.bench.models import BenchSetupError


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
    for name, entry in registry.OPTIMIZERS.items():
        reason = launcher.fused_unavailable_reason(entry.architecture, devices)
        print(f"  {name}: naive available; fused {'available' if reason is None else 'unavailable: ' + reason}")
    print("registered weights:")
    for name, entry in weights_lib.registered_weights().items():
        repos = ", ".join(c.location() for c in entry.components.values())
        print(f"  {name} [{entry.architecture}] {repos}: {weights_lib.cached_status(name)}")
    return 0


def _cmd_weights(args) -> int:
    if args.weights_command == "list":
        print("name\tarchitecture\tsource\tcache\tdescription")
        for name, entry in weights_lib.registered_weights().items():
            repos = ", ".join(c.location() for c in entry.components.values())
            print(f"{name}\t{entry.architecture}\t{repos}\t{weights_lib.cached_status(name)}\t{entry.description}")
        return 0
    if args.weights_command == "download":
        directories = weights_lib.download(args.name, force=args.force)
        entry = weights_lib.registered_weights().get(args.name)
        if entry is not None and all(c.shipped for c in entry.components.values()):
            print(f"{args.name} ships with lopt: nothing to download (files checked: {', '.join(map(str, directories))})")
            return 0
        for directory in directories:
            print(directory)
        return 0
    source = _weights_source(args.paths)
    architecture, loaded = weights_lib.verify(source, args.architecture)
    count = sum(len(t) for t in loaded.tensors.values())
    print(f"ok: {' + '.join(args.paths)} holds valid {architecture} weights ({count} tensors)")
    return 0


def _weights_source(paths):
    """One path, or VeLO's pair (rnn, mlp) as a tuple."""
    return paths[0] if len(paths) == 1 else tuple(paths)


# ------------------------------------------------------------------------------------------ bench


class UsageError(Exception):
    """A bad combination of options, found before any work; printed as one line, exit code 2."""


def _bench_defaults(args, device: torch.device) -> None:
    """Fill the options whose default depends on the device (or on another option)."""
    cuda = device.type == "cuda"
    args.optimizers = registry.names() if args.optimizer == "all" else [args.optimizer]
    args.param_sets = args.params or ["gpt2-medium" if cuda else "tiny-lm"]
    args.steps = args.steps or (10 if cuda else 5)
    args.warmup = (2 if cuda else 1) if args.warmup is None else args.warmup
    if args.curves:  # without --curves the --curves-* options stay None (and are refused if given)
        args.curves_model = args.curves_model or ("gpt2-4x256" if cuda else "gpt2-1x64")
        args.curves_steps = args.curves_steps or (200 if cuda else 60)


def _bench_device(args) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise UsageError(f"--device cuda: no CUDA device is available to PyTorch (torch {torch.__version__}, {built}); "
                         f"use --device cpu or leave --device out")
    if args.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _check_bench_options(args) -> None:
    """Combinations argparse cannot check; each a one-line UsageError."""
    from lopt.param_sets import MODELS, model_spec

    if args.mode == "iteration" and args.dtype is not None:
        raise UsageError("--dtype applies to --mode step; iteration mode trains float32 parameters "
                         "(under bfloat16 autocast on CUDA)")
    for option, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and args.mode != "iteration":
            raise UsageError(f"{option} applies to --mode iteration (the models are trained there)")
    if args.seq_len is not None:
        for name in args.param_sets:
            spec = model_spec(name)
            if not spec.is_language_model:
                raise UsageError(f"--seq-len: {name} is not a language model (it takes images)")
            limit = spec.config.get("n_positions")
            if limit is not None and args.seq_len > limit:
                raise UsageError(f"--seq-len {args.seq_len}: {name} has {limit} positions; "
                                 f"use --seq-len {limit} or less")
    if args.weights is not None:
        if len(args.optimizers) != 1:
            raise UsageError("--weights needs one --optimizer (small_fc_lopt or velo): the weights are one optimizer's")
        if len(args.weights) > 2:
            raise UsageError(f"--weights takes one path, or two for VeLO (the RNN and the MLP directory), "
                             f"got {len(args.weights)}")
    curves_options = {"--curves-steps": args.curves_steps, "--curves-model": args.curves_model,
                      "--curves-contender": args.curves_contender, "--curves-lr": args.curves_lr,
                      "--curves-weight-decay": args.curves_weight_decay}
    for option, value in curves_options.items():
        if value is not None and not args.curves:
            raise UsageError(f"{option} applies only with --curves FILE.png")
    if args.curves and not model_spec(args.curves_model).is_language_model:
        language_models = ", ".join(name for name, spec in MODELS.items() if spec.is_language_model)
        raise UsageError(f"--curves-model {args.curves_model}: the loss curves train a language model; "
                         f"choose one of {language_models}")


def _check_output_paths(args) -> None:
    """Each output file can be written, checked before the benchmark runs (the directory is created), and
    no two outputs are the same file. Records what it creates (``args.created``: directories, and the
    output files that did not exist) for :func:`_remove_created_outputs`."""
    args.created = {"directories": [], "files": []}
    seen = {}
    for option in ("json", "markdown", "plot", "curves"):
        value = getattr(args, option)
        if value is None:
            continue
        path = Path(value)
        flag = "--" + option
        if path.is_dir():
            raise UsageError(f"{flag} {value}: is a directory; give a file name")
        same = seen.get(path.resolve())
        if same is not None:
            raise UsageError(f"{same} and {flag} both name {value}: one would overwrite the other; give each "
                             f"output its own file")
        seen[path.resolve()] = flag
        try:
            missing = [d for d in path.absolute().parents if not d.exists()]  # (deepest first)
            path.parent.mkdir(parents=True, exist_ok=True)
            args.created["directories"] += missing
            existed = path.exists()
            if not existed:
                args.created["files"].append(path)
            with open(path, "a"):
                pass
            if not existed:
                path.unlink()
        except OSError as err:
            raise UsageError(f"{flag} {value}: cannot write there ({err.strerror or err})") from None


def _check_libraries(args) -> None:
    from lopt.bench.models import require_matplotlib, require_model_libraries

    if args.mode == "iteration":
        require_model_libraries(args.param_sets, "--mode iteration")
    if args.curves:
        require_model_libraries([args.curves_model], "--curves")
    for option in ("plot", "curves"):
        if getattr(args, option):
            require_matplotlib("--" + option)


def _loss_curves(args, weights: dict, device: torch.device) -> dict:
    from lopt.bench import contenders as contenders_lib
    from lopt.bench.curves import curves_contender, loss_curves
    from lopt.bench.runner import make_progress_factory
    from lopt.param_sets import model_spec

    contender, why = curves_contender(device, args.curves_contender)
    slow = " (compiling the step once per optimizer takes minutes on a small CPU)" if contender == "naive+compile" \
        and device.type == "cpu" else ""
    print(f"curves: training {args.curves_model} ({model_spec(args.curves_model).description}) for "
          f"{args.curves_steps} steps per run; naive vs {contender}: {why}{slow}")
    unavailable = {name: contenders_lib.availability(name, [contender], weights[name], device)[contender]
                   for name in args.optimizers}
    options = {name: value for name, value in (("lr", args.curves_lr), ("weight_decay", args.curves_weight_decay))
               if value is not None}
    return loss_curves(args.optimizers, weights, args.curves_model, steps=args.curves_steps, device=device,
                       contender=contender, why=why, unavailable=unavailable,
                       make_progress=make_progress_factory(not args.quiet), options=options)


def _cmd_bench(args) -> int:
    from lopt.bench import contenders as contenders_lib
    from lopt.bench import report, runner
    from lopt.param_sets import param_set_numel, param_set_shapes

    device = _bench_device(args)
    _bench_defaults(args, device)
    _check_bench_options(args)
    _check_output_paths(args)
    _check_libraries(args)

    selected = args.backends or contenders_lib.default_contenders(args.optimizers)
    contenders = [c for c in contenders_lib.CONTENDERS if c in selected]
    if args.no_adamw and "adamw" in contenders:
        contenders.remove("adamw")
    local = None if args.weights is None else _weights_source(args.weights)
    weights = {name: runner.resolve_bench_weights(name, local, args.require_pretrained) for name in args.optimizers}
    plan = runner.BenchPlan(
        mode=args.mode, optimizers=args.optimizers, param_sets=args.param_sets, contenders=contenders, device=device,
        weights=weights, steps=args.steps, warmup=args.warmup,
        dtype=getattr(torch, args.dtype or "float32"), same_grads=args.same_grads, batch_size=args.batch_size,
        seq_len=args.seq_len, show_progress=not args.quiet, cooldown_ms=args.cooldown_ms)
    plan.availability = runner.probe_availability(plan)
    if not runner.runnable(plan):
        reasons = "; ".join(f"{name} {c}: {reason}" for name in args.optimizers
                            for c, reason in plan.availability[name].items() if c in contenders and reason)
        raise UsageError(f"nothing to run with --backends {','.join(contenders)}: {reasons}")

    for name, w in weights.items():
        print(f"{name} weights: {w.source}" + ("" if w.pretrained else " (untrained weights — timing only)"))
    sets = ", ".join(f"{s} ({len(param_set_shapes(s))} tensors, {param_set_numel(s) / 1e6:.2f} M)"
                     for s in args.param_sets)
    what = "optimizer step" if args.mode == "step" else "training iteration (zero_grad + forward + backward + step)"
    env = report.environment(device)
    print(f"{args.mode} mode on {device} ({env['device']}): time per {what} on {sets}")

    with contenders_lib.quiet_graph_breaks():
        results, unavailable = runner.run_benchmarks(plan)
        curves = _loss_curves(args, weights, device) if args.curves else None

    print(report.format_table(results, unavailable, args.mode))
    if report.naive_note(results):
        print(report.naive_note(results))
    if curves:
        print(report.format_curves_summary(curves))
    weights_line = report.weights_status(weights)
    settings = {"steps": args.steps, "warmup": args.warmup, "dtype": (args.dtype or "float32") if args.mode == "step"
                else None, "same_grads": args.same_grads, "cooldown_ms": args.cooldown_ms, "contenders": contenders,
                "param_sets": args.param_sets,
                "batch_size": args.batch_size, "seq_len": args.seq_len,
                "autocast": "bfloat16" if args.mode == "iteration" and device.type == "cuda" else None}
    written = []
    if args.json:
        Path(args.json).write_text(report.results_json(results, unavailable, mode=args.mode, env=env, settings=settings,
                                                       weights=weights, curves=curves))
        written.append(args.json)
    if args.markdown:
        Path(args.markdown).write_text(report.markdown(results, unavailable, args.mode, env, weights_line, curves))
        written.append(args.markdown)
    if args.plot:
        report.plot_times(args.plot, results, unavailable, mode=args.mode, env=env, weights_line=weights_line)
        written.append(args.plot)
    if args.curves:
        report.plot_curves(args.curves, curves, env=env, weights_line=weights_line)
        written.append(args.curves)
    for path in written:
        print(f"wrote {path}")
    return 0


# ------------------------------------------------------------------------------------------ parser


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (the usage of ``lopt bench`` alone is a screenful)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _at_least(number: type, minimum, what: str, strict: bool = False):
    """An argparse type: a finite ``number`` (int or float) >= ``minimum`` (> where ``strict``)."""
    def parse(text: str):
        try:
            value = number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if (isinstance(value, float) and not math.isfinite(value)) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    return parse


def _name_list(known, what: str):
    """A comma-separated list of names from ``known`` (order kept, duplicates dropped)."""
    def parse(text: str) -> list:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"needs at least one {what}; choose from {', '.join(known)}")
        for name in names:
            if name not in known:
                raise argparse.ArgumentTypeError(f"unknown {what} {name!r}; choose from {', '.join(known)} "
                                                 f"(comma-separated)")
        return list(dict.fromkeys(names))

    return parse


def _png_path(text: str) -> str:
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"must be a .png file name, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    from lopt.bench.contenders import CONTENDERS, DEFAULT_CONTENDERS
    from lopt.param_sets import MODELS

    parser = _Parser(prog="lopt", description="Learned optimizers for PyTorch")
    parser.add_argument("--version", action="version", version=f"lopt {lopt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="versions, devices, backends and registered weights")

    weights = sub.add_parser("weights", help="list, download or verify meta-weights")
    wsub = weights.add_subparsers(dest="weights_command", required=True)
    wsub.add_parser("list", help="registered weight sets and whether they are cached")
    download = wsub.add_parser("download",
                               help="download a registered weight set or a hub repo into the Hugging Face cache")
    download.add_argument("name", help="a registered name (lopt weights list) or a hub repo id owner/name[@revision]")
    download.add_argument("--force", action="store_true", help="download again even if cached")
    verify = wsub.add_parser("verify", help="check that a directory, file or name holds valid weights "
                                            "(VeLO: its RNN and MLP directories)")
    verify.add_argument("paths", nargs="+", metavar="PATH",
                        help="a directory, .safetensors file or registered name; for VeLO two paths: RNN and MLP")
    verify.add_argument("--architecture", default=None, help="small_fc_lopt or velo (default: try each)")

    bench = sub.add_parser("bench", help="what a learned optimizer costs (per step or per training iteration), "
                                         "and that fused computes what naive does")
    bench.add_argument("--mode", default="step", choices=["step", "iteration"],
                       help="step: optimizer.step() alone on a model's parameter set (default); iteration: "
                            "zero_grad + forward + backward + step of the real model")
    bench.add_argument("--optimizer", default="all", choices=registry.names() + ["all"],
                       help="learned optimizer(s) to time (default: all)")
    bench.add_argument("--params", default=None, type=_name_list(list(MODELS), "parameter set"), metavar="SET[,SET]",
                       help=f"comma-separated parameter sets / models: {', '.join(MODELS)} "
                            f"(default: gpt2-medium on CUDA, tiny-lm on the CPU)")
    bench.add_argument("--backends", default=None, type=_name_list(CONTENDERS, "contender"), metavar="C[,C]",
                       help=f"comma-separated contenders: {', '.join(CONTENDERS)} "
                            f"(default: {','.join(DEFAULT_CONTENDERS)}, and muon with "
                            f"{' or '.join(n for n in registry.names() if registry.get(n).orthogonalizes)})")
    bench.add_argument("--steps", metavar="N", type=_at_least(int, 1, "a positive integer"), default=None,
                       help="timed steps (or iterations) per contender, median reported "
                            "(default: 10 on CUDA, 5 on the CPU)")
    bench.add_argument("--warmup", metavar="N", type=_at_least(int, 0, "an integer >= 0"), default=None,
                       help="untimed steps first (default: 2 on CUDA, 1 on the CPU)")
    bench.add_argument("--same-grads", action="store_true",
                       help="step mode: reuse one set of gradient tensors (default: new .grad tensors every step)")
    bench.add_argument("--cooldown-ms", metavar="MS", type=_at_least(float, 0.0, "a number of milliseconds >= 0"),
                       default=0.0,
                       help="idle the device this long before each timed step (default 0: back to back). Repeated "
                            "back to back, a step that keeps the GPU's arithmetic busy can reach its power cap and "
                            "run at a lower clock than between a training run's forward and backward passes; "
                            "~40 ms on an H100 times it at full clock (docs/bench.md)")
    bench.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="step mode: parameter dtype (default float32)")
    bench.add_argument("--batch-size", metavar="N", type=_at_least(int, 1, "a positive integer"), default=None,
                       help="iteration mode: batch size (default: the model's, e.g. 8 for GPT-2, 64 for ViT-B/16)")
    bench.add_argument("--seq-len", metavar="N", type=_at_least(int, 1, "a positive integer"), default=None,
                       help="iteration mode: tokens per sequence (default: the model's, 1024 for GPT-2)")
    bench.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    bench.add_argument("--weights", default=None, nargs="+", metavar="PATH",
                       help="local weights instead of the registered ones: a directory or .safetensors file "
                            "(VeLO: the RNN and the MLP directory); needs one --optimizer")
    bench.add_argument("--require-pretrained", action="store_true", help="fail instead of using untrained weights")
    bench.add_argument("--no-adamw", action="store_true", help="leave out the AdamW yardstick")
    bench.add_argument("--plot", default=None, type=_png_path, metavar="FILE.png",
                       help="draw ms per step (or iteration) per contender and parameter set")
    bench.add_argument("--curves", default=None, type=_png_path, metavar="FILE.png",
                       help="train a small GPT-2 with naive and fused (CPU: naive+compile) and draw the loss curves "
                            "beside the nudged-weights yardstick")
    bench.add_argument("--curves-steps", metavar="N", type=_at_least(int, 2, "an integer >= 2"), default=None,
                       help="training steps per curve (default: 200 on CUDA, 60 on the CPU)")
    bench.add_argument("--curves-model", default=None, choices=list(MODELS),
                       help="model the curves train (default: gpt2-4x256 on CUDA, gpt2-1x64 on the CPU)")
    bench.add_argument("--curves-contender", default=None, choices=["fused", "fused-fast", "naive+compile"],
                       help="compared with naive in the curves (default: fused on CUDA, naive+compile on the CPU)")
    bench.add_argument("--curves-lr", metavar="LR", type=_at_least(float, 0.0, "a positive number", strict=True),
                       default=None, help="learning rate of every curves run (default: the optimizers' own, 1; "
                                          "untrained meta-weights diverge there, docs/bench.md)")
    bench.add_argument("--curves-weight-decay", metavar="WD", type=_at_least(float, 0.0, "a number >= 0"),
                       default=None, help="weight decay of every curves run (default: the optimizers' own)")
    bench.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON (docs/bench.md)")
    bench.add_argument("--markdown", default=None, metavar="FILE", help="also write the results as a Markdown table")
    bench.add_argument("--quiet", action="store_true", help="no progress bars (they are drawn only on a terminal)")
    from lopt.meta.cli import add_commands as add_meta_commands  # meta-train, meta-eval (docs/meta_training.md)

    add_meta_commands(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "meta_handler"):
        from lopt.meta.cli import run as run_meta

        return run_meta(args)
    try:
        if args.command == "info":
            return _cmd_info(args)
        if args.command == "weights":
            if args.weights_command == "verify" and len(args.paths) > 2:
                raise UsageError(f"lopt weights verify takes one path, or two for VeLO (RNN and MLP), "
                                 f"got {len(args.paths)}")
            return _cmd_weights(args)
        return _cmd_bench(args)
    except (UsageError, BenchSetupError) as err:
        print(f"lopt {args.command}: error: {err}", file=sys.stderr)
        return 2
    except weights_lib.WeightsError as err:
        print(f"lopt: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - re-raised at once unless a Ctrl-C caused it
        if not _caused_by_interrupt(err):
            raise
        return _interrupted(args)
    except KeyboardInterrupt:
        return _interrupted(args)


def _caused_by_interrupt(err: BaseException) -> bool:
    """Whether a Ctrl-C is behind ``err``: Python re-raises an interrupt that lands in some places (a
    descriptor's ``__set_name__`` while a lazy import such as torch._dynamo's runs) as another error caused by it."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _interrupted(args) -> int:
    """Remove what this run created and say so in one line; exit code 130, as a shell reports SIGINT."""
    # A second interrupt (another Ctrl-C) must not cut the clean-up short; the handler is restored afterwards
    # (main() may run inside another program). Only the main thread may set handlers.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        removed = _remove_created_outputs(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    print(f"lopt {args.command}: interrupted" + (f"; removed {', '.join(removed)}" if removed else ""),
          file=sys.stderr)
    return 130


def _remove_created_outputs(args) -> list:
    """Remove the output files and directories this run created (``args.created``); return what was removed."""
    created = getattr(args, "created", None) or {"directories": [], "files": []}
    removed = []
    for path in created["files"]:
        if path.is_file():
            path.unlink()
            removed.append(str(path))
    for directory in created["directories"]:  # deepest first; only if nothing else was put there
        try:
            directory.rmdir()
            removed.append(str(directory) + "/")
        except OSError:
            pass
    return removed


if __name__ == "__main__":
    sys.exit(main())
