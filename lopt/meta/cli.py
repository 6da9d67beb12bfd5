"""``lopt meta-train`` and ``lopt meta-eval`` (registered in lopt/cli.py by :func:`add_commands`).

Nothing heavy is imported until a command runs, so ``lopt --help`` stays fast and needs neither
scikit-learn nor matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CONFIG_OPTIONS = {  # command-line option -> MetaTrainConfig field
    "estimator": "estimator", "outer_steps": "outer_steps", "seed": "seed", "init": "init", "num_tasks": "num_tasks",
    "truncation": "truncation", "min_unroll": "min_unroll", "max_unroll": "max_unroll", "std": "std", "lr": "lr",
    "optimizer": "optimizer", "inner_schedule": "inner_schedule",
}


class MetaUsageError(Exception):
    """A bad combination of options (one line, exit code 2)."""


def _positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _assignment(text):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (VALUE in JSON), got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def add_commands(sub) -> None:
    """Add ``meta-train`` and ``meta-eval`` to an argparse subparsers object."""
    from lopt.meta.presets import PRESETS  # light (no torch work, no scikit-learn)
    from lopt.meta.schedules import SCHEDULES  # light too (math and torch, which is imported already)

    train = sub.add_parser("meta-train", help="meta-train small_fc_lopt's (or ELO's) MLP (truncated PES or ES) in "
                                              "resumable chunks",
                           description="Meta-train a learned optimizer. Rerun the same command with the same --out to "
                                       "resume a run from its checkpoint (docs/meta_training.md).")
    train.add_argument("--preset", default="mulo", choices=sorted(PRESETS),
                       help="recipe: mulo (μLO: PES, 5000 AdamW steps 3e-3→1e-3), celo (Celo: PES, rescale "
                            "augmentation, AdamW 3e-4), deep (lopt's: lopt-small_fc-tiny continued toward 5000-step "
                            "unrolls and deeper MLPs), smoke (seconds on a CPU). Default mulo")
    train.add_argument("--out", required=True, metavar="DIR",
                       help="run directory: weights (config.json + model.safetensors), meta_training.json, checkpoint.pt")
    train.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    train.add_argument("--max-minutes", type=_positive_float, default=None, metavar="M",
                       help="stop (checkpointed) before this many minutes of this chunk; rerun to continue")
    train.add_argument("--optimizer", default=None, metavar="NAME",
                       help="whose step the tasks train with, and so whose weights come out: small_fc_lopt (default; "
                            "lopt.SmallFCLOpt), elo (lopt.ELO), celo2 (lopt.CELO2) or elo_celo2 (lopt.ELO_CELO2)")
    train.add_argument("--estimator", default=None, choices=["pes", "es"], help="override the preset's estimator")
    train.add_argument("--outer-steps", type=_positive_int, default=None, metavar="N", help="override the preset's")
    train.add_argument("--seed", type=int, default=None)
    train.add_argument("--init", default=None, metavar="WEIGHTS",
                       help="start from these meta-weights (a directory, .safetensors file or name) instead of random")
    train.add_argument("--num-tasks", type=_positive_int, default=None, metavar="N",
                       help="task instances (antithetic pairs) per family")
    train.add_argument("--truncation", type=_positive_int, default=None, metavar="T")
    train.add_argument("--min-unroll", type=_positive_int, default=None, metavar="N")
    train.add_argument("--max-unroll", type=_positive_int, default=None, metavar="N")
    train.add_argument("--std", type=_positive_float, default=None, help="perturbation std σ")
    train.add_argument("--lr", type=_positive_float, default=None, help="peak outer learning rate")
    train.add_argument("--inner-schedule", default=None, choices=list(SCHEDULES),
                       help="the learned optimizer's lr over each inner unroll: constant (default, every preset's) or "
                            "cosine (its lr times 0.5*(1 + cos(pi*t/L)) at step t of an unroll of L steps, validation "
                            "and its AdamW yardsticks likewise over the validation steps)")
    train.add_argument("--set", dest="assignments", action="append", type=_assignment, default=[], metavar="KEY=VALUE",
                       help="any other MetaTrainConfig field, VALUE as JSON (e.g. --set grad_clip=null, "
                            "--set 'tasks=[{\"task\": \"logreg\"}]'); repeatable")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(meta_handler=cmd_meta_train)

    evaluate = sub.add_parser("meta-eval", help="meta-weights against AdamW (tuned and 1e-3) on the frozen held-out suite",
                              description="Train the held-out suite's tasks with the learned optimizer and with AdamW; "
                                          "report final training and held-out losses, divergence, a table and a plot.")
    evaluate.add_argument("weights", metavar="WEIGHTS",
                          help="a directory (config.json + model.safetensors, e.g. a meta-train --out), a "
                               ".safetensors file, a registered name, or 'random'")
    evaluate.add_argument("--out", default=None, metavar="DIR",
                          help="write results.json, results.md, curves.png (default for a directory: "
                               "WEIGHTS/eval[-quick][-SCHEDULE][-lrLR][-BACKEND], a suffix for each option given "
                               "that is not the protocol's default); finished runs are kept, so a rerun resumes")
    evaluate.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    evaluate.add_argument("--optimizer", default=None, metavar="NAME",
                          help="the optimizer that runs WEIGHTS: small_fc_lopt, elo, celo2 or elo_celo2 (default: a "
                               "meta-train run's own, a registered weight set's, else small_fc_lopt)")
    evaluate.add_argument("--learned-lr", type=_positive_float, default=None, metavar="LR",
                          help="run the learned optimizer at this lr instead of its default (SmallFCLOpt 1, ELO and "
                               "CELO2 1e-3: the suite's protocol); default --out WEIGHTS/eval-lrLR")
    evaluate.add_argument("--learned-backend", default=None, choices=["auto", "naive", "fused"],
                          help="step the learned optimizer as users do, one lopt optimizer per seed with this backend "
                               "(auto: the fused step on a GPU), instead of the batched step the "
                               "suite's records used (within float32 rounding of it); default --out "
                               "WEIGHTS/eval-BACKEND")
    evaluate.add_argument("--schedule", default="constant", choices=list(SCHEDULES),
                          help="the lr schedule of every optimizer: constant (the suite's protocol, default) or cosine "
                               "(a protocol variant: the learned optimizer's lr, AdamW's and its sweep's each "
                               "multiplied by 0.5*(1 + cos(pi*t/horizon)) at step t, decaying to 0 over the horizon; "
                               "AdamW's lr is tuned under it); default --out WEIGHTS/eval-cosine")
    evaluate.add_argument("--baselines", default=None, metavar="DIR",
                          help="keep the AdamW runs here and take them from here: they do not depend on the weights, so "
                               "evaluations of several weight sets that name the same DIR run them once")
    evaluate.add_argument("--quick", action="store_true",
                          help="tiny versions of the tasks, 30 steps, 3 AdamW lrs, 1+2 seeds (for tests)")
    evaluate.add_argument("--horizon", type=_positive_int, default=None, metavar="N", help="steps per run (default 5000)")
    evaluate.add_argument("--tasks", default=None, metavar="NAME[,NAME]", help="a subset of the suite")
    evaluate.add_argument("--max-minutes", type=_positive_float, default=None, metavar="M",
                          help="start no run after M minutes; rerun to continue")
    evaluate.add_argument("--quiet", action="store_true", help="no progress bar")
    evaluate.set_defaults(meta_handler=cmd_meta_eval)


def _device(name):
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise MetaUsageError("--device cuda: no CUDA device is available to PyTorch")
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _overrides(args) -> dict:
    overrides = {field: getattr(args, option) for option, field in CONFIG_OPTIONS.items()
                 if getattr(args, option) is not None}
    for key, value in args.assignments:
        overrides[key] = value
    return overrides


def cmd_meta_train(args) -> int:
    from lopt.meta.rules import inner_rule
    from lopt.meta.data import MissingDependency
    from lopt.meta.presets import MetaTrainConfig, preset
    from lopt.meta.trainer import CHECKPOINT, MetaTrainer

    out = Path(args.out)
    device = _device(args.device)
    overrides = _overrides(args)
    try:
        if (out / CHECKPOINT).exists():
            trainer = MetaTrainer.resume(out, device)
            saved = trainer.config
            if saved.preset != args.preset:
                raise MetaUsageError(f"{out} holds a {saved.preset!r} run; pass --preset {saved.preset} to resume it, or a "
                                     f"new --out")
            requested = preset(args.preset, **overrides).resolved()
            differs = [k for k in overrides if getattr(requested, k) != getattr(saved, k)]
            if differs:
                raise MetaUsageError(f"{out} holds a run with other settings ({', '.join(differs)}); resume it with the "
                                     f"options it was started with (see {out}/meta_training.json), or use a new --out")
            print(f"resuming {out} at outer step {trainer.step}/{saved.outer_steps} on {device}", file=sys.stderr)
        else:
            config = preset(args.preset, **overrides)
            MetaTrainConfig.from_dict(config.to_dict())  # (validates the fields)
            trainer = MetaTrainer(config, out, device)
            print(f"meta-training {config.preset} ({config.estimator}, {config.outer_steps} outer steps) on {device} "
                  f"into {out}", file=sys.stderr)
        summary = trainer.run(max_minutes=args.max_minutes, progress=not args.quiet)
    except (MissingDependency, ValueError) as err:
        raise MetaUsageError(str(err)) from None
    rate = summary["inner_steps_per_second"]
    if summary["finished"]:
        state = f"finished early: {summary['stopped_for']}" if trainer.stopped_early is not None else "finished"
    else:
        state = f"stopped ({summary['stopped_for'] or 'steps'}): rerun the same command to continue"
    print(f"outer step {summary['step']}/{summary['outer_steps']}, {state}; this chunk {summary['chunk_seconds'] / 60:.1f} min, "
          f"{rate:,.0f} inner steps/s (members x inner steps / s); best validation {summary['best']}")
    best = f", best validation's: {out / 'best'}" if (out / "best").is_dir() else ""
    front_end = inner_rule(trainer.config.optimizer).front_end.__name__
    print(f"weights: {out} (lopt.{front_end}(weights={str(out)!r})){best}, record: {out / 'meta_training.json'}")
    return 0


def _trained_with(weights: str) -> tuple[str, str] | None:
    """(optimizer, where it is said) for weights whose optimizer is known: a meta-train run directory or its
    ``best/`` (the run's record), a registered weight set (the optimizer whose default it is, else its
    architecture: ELO-CELO2's weights share CELO2's architecture); else None."""
    from lopt import registry
    from lopt import weights as weights_lib

    path = Path(weights)
    for record in (path / "meta_training.json", path.parent / "meta_training.json" if path.name == "best" else None):
        if record is not None and record.is_file():
            config = json.loads(record.read_text()).get("config", {})
            name = config.get("optimizer", config.get("architecture"))
            if name:
                return name, str(record)
    registered = weights_lib.registered_weights().get(weights) if not path.exists() else None
    if registered is not None:
        default_of = [name for name in registry.names() if registry.get(name).default_weights == weights]
        if len(default_of) > 1 and registered.architecture in default_of:  # small_fc_lopt's (and MuLO's)
            default_of = [registered.architecture]
        name = default_of[0] if len(default_of) == 1 else registered.architecture
        return name, f"the registered weight set {weights!r}"
    return None


def _eval_optimizer(args) -> str:
    known = _trained_with(args.weights)
    if args.optimizer is None:
        return known[0] if known is not None else "small_fc_lopt"
    if known is not None and known[0] != args.optimizer:
        raise MetaUsageError(f"--optimizer {args.optimizer}: {args.weights} was meta-trained for {known[0]} ({known[1]} "
                             f"says so); another optimizer's step would not compute what they were trained for. Leave "
                             f"--optimizer out, or pass --optimizer {known[0]}")
    return args.optimizer


def cmd_meta_eval(args) -> int:
    from lopt.meta.data import MissingDependency
    from lopt.meta.evaluate import EvalSettings, run_suite

    device = _device(args.device)
    out = args.out
    if out is None and Path(args.weights).is_dir():
        out = Path(args.weights) / ("eval" + ("-quick" if args.quick else "")
                                    + (f"-{args.schedule}" if args.schedule != "constant" else "")
                                    + (f"-lr{args.learned_lr:g}" if args.learned_lr is not None else "")
                                    + (f"-{args.learned_backend}" if args.learned_backend is not None else ""))
    tasks = None if args.tasks is None else tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    try:
        optimizer = _eval_optimizer(args)
        settings = EvalSettings.make(quick=args.quick, horizon=args.horizon, tasks=tasks, learned_lr=args.learned_lr,
                                     learned_backend=args.learned_backend, schedule=args.schedule)
        settings.task_list()
        report = run_suite(args.weights, out, device, settings, progress=not args.quiet, max_minutes=args.max_minutes,
                           optimizer=optimizer, baselines=args.baselines)
    except (MissingDependency, ValueError) as err:
        raise MetaUsageError(str(err)) from None
    print(report["markdown"])
    if out is not None:
        print(f"results: {Path(out) / 'results.json'}, {Path(out) / 'results.md'}"
              + (f", plot: {report['plot']}" if report.get("plot") else ""))
    if not report["complete"]:
        print("incomplete (--max-minutes): rerun the same command to continue", file=sys.stderr)
    return 0


def run(args) -> int:
    """Entry point for lopt/cli.py: run the handler, usage errors as one line with exit code 2."""
    try:
        return args.meta_handler(args)
    except MetaUsageError as err:
        print(f"lopt {args.command}: error: {err}", file=sys.stderr)
        return 2
