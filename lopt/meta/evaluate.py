"""``lopt meta-eval``: meta-weights against AdamW on a frozen held-out suite.

The suite ``heldout-v1`` was fixed in code (and in docs/meta_training.md) before any meta-training
run, and none of its tasks is a training task: other data sets (breast_cancer, wine), another
architecture (a digits CNN, a character-level transformer on the source of Python's ``argparse``),
networks 8–16× wider and 7–8 layers deep, and horizons of 5,000 steps (5× the ``mulo`` preset's
longest unroll).

For every task, each optimizer trains the same instances (initial parameters and data order fixed by
the seed):

* the learned optimizer (``SmallFCLOpt(weights=WEIGHTS)``, lr 1, no weight decay; or ``ELO(weights=WEIGHTS)``
  at its defaults, for ELO's weights) on seeds 2–6;
* AdamW at torch's defaults (lr 1e-3, weight decay 0.01) on seeds 2–6;
* AdamW with a tuned learning rate: 13 log-spaced values from 10^-4.5 to 10^-0.5, each on seeds 0–1;
  the one with the lowest mean final training loss (a diverged run counts as +inf) is then run on
  seeds 2–6.

A protocol variant (``schedule="cosine"``, ``lopt meta-eval --schedule cosine``) runs every one of these with
its lr multiplied at step t by a schedule over the horizon (:data:`SCHEDULES`): the learned optimizer, the
sweep (so the tuned lr is chosen under the schedule), AdamW at 1e-3 and at the tuned lr. The constant lr
stays the suite's protocol; a variant's results are reported beside it, keyed and kept apart.

Reported per task and optimizer: the final training loss (mean of the last 5% of steps, at least 10),
the held-out loss at the end, the divergence rate (a run diverges when its final training loss is
not finite or exceeds 1.5·L0, the normaliser's cap), as mean ± std over the 5 seeds; a markdown
table and a plot of the training curves (mean over seeds).

All runs of one optimizer on one task train together as one population (lopt.meta.batched): the
learned optimizer's step is ``SmallFCLOpt``'s or ``ELO``'s (tests/test_meta_batched.py), AdamW's is
``torch.optim.AdamW``'s with one learning rate per member.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lopt import weights as weights_lib
from lopt.meta import tasks as tasks_lib
from lopt.meta.batched import BatchedAdamW
from lopt.meta.rules import batched_optimizer, inner_rule
from lopt.meta.members import BACKENDS as MEMBER_BACKENDS
from lopt.meta.members import MemberOptimizers
from lopt.meta.schedules import SCHEDULES  # (the table of lr schedules, shared with meta-training)
from lopt.meta.stepper import PopulationStepper


@dataclass(frozen=True)
class EvalTask:
    name: str
    spec: dict
    quick_spec: dict
    what: str


SUITES = {
    "heldout-v1": [
        EvalTask("breast_cancer_mlp", {"task": "mlp", "dataset": "breast_cancer", "hidden": [64, 64], "batch_size": 64},
                 {"task": "mlp", "dataset": "breast_cancer", "hidden": [16], "batch_size": 32},
                 "breast_cancer (30 features, 2 classes), MLP 64-64"),
        EvalTask("wine_mlp", {"task": "mlp", "dataset": "wine", "hidden": [64, 64], "batch_size": 32},
                 {"task": "mlp", "dataset": "wine", "hidden": [16], "batch_size": 16},
                 "wine (13 features, 3 classes), MLP 64-64"),
        EvalTask("digits_cnn", {"task": "cnn", "dataset": "digits", "channels": [16, 32], "batch_size": 64},
                 {"task": "cnn", "dataset": "digits", "channels": [4], "batch_size": 16},
                 "digits 8x8, CNN 3x3 conv 16-32, global average pool, linear"),
        EvalTask("digits_mlp_256x6", {"task": "mlp", "dataset": "digits", "hidden": [256] * 6, "batch_size": 64},
                 {"task": "mlp", "dataset": "digits", "hidden": [32] * 2, "batch_size": 16},
                 "digits, MLP 6 hidden layers of 256 (8x wider than training, 7 layers)"),
        EvalTask("mnist1d_mlp_512x7", {"task": "mlp", "dataset": "mnist1d", "hidden": [512] * 7, "batch_size": 64},
                 {"task": "mlp", "dataset": "mnist1d", "hidden": [32] * 2, "batch_size": 16},
                 "mnist1d, MLP 7 hidden layers of 512 (16x wider than training, 8 layers)"),
        EvalTask("teacher_student_deep", {"task": "teacher_student", "in_dim": 32, "out_dim": 8,
                                          "teacher_hidden": [64, 64, 64], "student_hidden": [256] * 6, "batch_size": 64},
                 {"task": "teacher_student", "in_dim": 8, "out_dim": 2, "teacher_hidden": [16],
                  "student_hidden": [16, 16], "batch_size": 16},
                 "teacher-student regression 32->8, student 6 hidden layers of 256"),
        EvalTask("char_transformer", {"task": "char_transformer", "module": "argparse", "width": 64, "layers": 2,
                                      "heads": 4, "context": 64, "batch_size": 32},
                 {"task": "char_transformer", "module": "argparse", "width": 16, "layers": 1, "heads": 2,
                  "context": 16, "batch_size": 4},
                 "character-level transformer (2 layers, width 64, context 64) on argparse.py's source"),
    ],
}

HORIZON = 5000
ADAMW_LRS = tuple(10 ** (-4.5 + i * (4.0 / 12)) for i in range(13))
TUNE_SEEDS = (0, 1)
REPORT_SEEDS = (2, 3, 4, 5, 6)
QUICK = {"horizon": 30, "lrs": (1e-3, 1e-2, 1e-1), "tune_seeds": (0,), "report_seeds": (1, 2)}
CURVE_POINTS = 200


@dataclass
class EvalSettings:
    suite: str = "heldout-v1"
    horizon: int = HORIZON
    lrs: tuple = ADAMW_LRS
    tune_seeds: tuple = TUNE_SEEDS
    report_seeds: tuple = REPORT_SEEDS
    quick: bool = False
    tasks: tuple | None = None  # a subset of the suite's task names
    cuda_graphs: bool = True
    learned_lr: float | None = None  # the learned optimizer's lr; None: its class's default (the suite's protocol)
    # None: the learned optimizer's step batched over the seeds (rules.batched_optimizer, the protocol's records); a
    # backend ("auto", "naive", "fused"): one torch.optim optimizer per seed (lopt.meta.members)
    learned_backend: str | None = None
    # a name of SCHEDULES: every optimizer's lr (AdamW's sweep included) multiplied by it at every step
    schedule: str = "constant"

    @classmethod
    def make(cls, quick=False, horizon=None, tasks=None, suite="heldout-v1", learned_lr=None, learned_backend=None,
             schedule="constant"):
        if learned_lr is not None and not (math.isfinite(learned_lr) and learned_lr > 0):
            raise ValueError(f"learned_lr={learned_lr!r}: the learned optimizer's lr must be a finite number > 0")
        if learned_backend is not None and learned_backend not in MEMBER_BACKENDS:
            raise ValueError(f"learned_backend={learned_backend!r}: choose one of {', '.join(MEMBER_BACKENDS)} (or "
                             f"None, the batched step)")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if quick:
            settings = cls(suite=suite, horizon=QUICK["horizon"], lrs=QUICK["lrs"], tune_seeds=QUICK["tune_seeds"],
                           report_seeds=QUICK["report_seeds"], quick=True, tasks=tasks, learned_lr=learned_lr,
                           learned_backend=learned_backend, schedule=schedule)
        else:
            settings = cls(suite=suite, tasks=tasks, learned_lr=learned_lr, learned_backend=learned_backend,
                           schedule=schedule)
        if horizon is not None:
            settings.horizon = int(horizon)
        return settings

    def task_list(self) -> list[EvalTask]:
        if self.suite not in SUITES:
            raise ValueError(f"unknown suite {self.suite!r}; known: {sorted(SUITES)}")
        suite = SUITES[self.suite]
        if self.tasks is None:
            return list(suite)
        names = {t.name for t in suite}
        unknown = [n for n in self.tasks if n not in names]
        if unknown:
            raise ValueError(f"unknown tasks {unknown} in suite {self.suite}; known: {sorted(names)}")
        return [t for t in suite if t.name in self.tasks]

    def key(self) -> dict:
        key = {"suite": self.suite, "horizon": self.horizon, "lrs": list(self.lrs), "tune_seeds": list(self.tune_seeds),
               "report_seeds": list(self.report_seeds), "quick": self.quick}
        if self.learned_lr is not None:  # (the key of runs kept at the default stays as it was)
            key["learned_lr"] = self.learned_lr
        if self.learned_backend is not None:  # (likewise for the batched step)
            key["learned_backend"] = self.learned_backend
        if self.schedule != "constant":  # (likewise for the constant protocol; a variant's AdamW runs are its own)
            key["schedule"] = self.schedule
        return key


def load_eval_weights(source, optimizer: str = "small_fc_lopt") -> weights_lib.MetaWeights:
    """``optimizer``'s weights: ``random`` (lopt.random_weights, seed 0: a yardstick), or anything
    ``lopt.load_weights`` takes."""
    architecture = inner_rule(optimizer).architecture
    if source == "random":
        return weights_lib.random_weights(architecture, seed=0)
    return weights_lib.load_weights(source, architecture)


def weights_digest(meta_weights) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(meta_weights.tensors["mlp"].items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _seed_generator(device, seed):
    generator = torch.Generator(device=device) if torch.device(device).type == "cuda" else torch.Generator()
    return generator.manual_seed(1_000_003 * (seed + 1))


def scheduled_lr(optimizer, device) -> torch.Tensor:
    """The tensor a schedule writes: ``optimizer.lr``, which every population optimizer's step reads in place
    (the batched learned steps, BatchedAdamW, MemberOptimizers' shared lr). It must be a floating-point tensor on
    ``device``: a number is baked into a captured CUDA graph (and is no object to write into), and a CPU tensor
    beside CUDA parameters is read on the host when a kernel is launched, so a graph would keep its first value."""
    lr = getattr(optimizer, "lr", None)
    name = type(optimizer).__name__
    if not (torch.is_tensor(lr) and lr.is_floating_point()):
        raise TypeError(f"a scheduled run writes the optimizer's lr in place each step, so {name}.lr must be a "
                        f"floating-point tensor its step reads (0-d, or one per member); got {lr!r}. Construct "
                        f"{name} with lr=torch.tensor(LR, device=DEVICE)")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # ("cuda" is the current device: compare indices)
        device = torch.device("cuda", torch.cuda.current_device())
    if lr.device != device:
        raise ValueError(f"a scheduled run needs {name}.lr on the population's device {torch.device(device)}, got a "
                         f"tensor on {lr.device} (a captured CUDA graph would keep its first value)")
    return lr


def train_population(family, optimizer, member_seeds, horizon, device, on_step=None, use_graph=True,
                     lr_schedule=None) -> dict:
    """Train one member per entry of ``member_seeds`` for ``horizon`` steps with ``optimizer`` (a batched
    optimizer over ``len(member_seeds)`` members). A seed fixes its instance (initial parameters, data
    order) whatever else trains beside it. Returns training losses (horizon, P), held-out losses (P,)
    and the final parameters. On CUDA the steps replay a captured graph (``use_graph``).

    ``lr_schedule``: a name of :data:`SCHEDULES` (None: "constant"). Other than constant, the optimizer's lr
    (:func:`scheduled_lr`, a tensor) is multiplied at step t by ``SCHEDULES[lr_schedule](t, horizon)``, written
    in place before the step, and set back to its value as given after the run."""
    if lr_schedule is not None and lr_schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule={lr_schedule!r}: choose one of {', '.join(SCHEDULES)} (or None)")
    device = torch.device(device)
    multiplier = None if lr_schedule in (None, "constant") else SCHEDULES[lr_schedule]
    if multiplier is not None:
        lr = scheduled_lr(optimizer, device)
        base = lr.clone()
    seeds = sorted(set(member_seeds))
    rows = torch.tensor([seeds.index(s) for s in member_seeds], device=device)
    generators = [_seed_generator(device, s) for s in seeds]
    insts = [family.sample_instances(1, g) for g in generators]
    params = [family.init_params(1, inst, g) for inst, g in zip(insts, generators)]
    params = [torch.cat(ps).index_select(0, rows) for ps in zip(*params)]
    inst = {k: torch.cat([i[k] for i in insts]).index_select(0, rows) for k in insts[0]}

    def pick(parts):
        """Per-seed batches (a list over seeds) → one batch per member."""
        if torch.is_tensor(parts[0]):
            return torch.cat(parts).index_select(0, rows)
        return type(parts[0])(pick(list(p)) for p in zip(*parts))

    stepper = PopulationStepper(family, optimizer, params, optimizer.init_state(), inst, pick, use_graph)
    losses = torch.empty(horizon, len(member_seeds), device=device)
    network = getattr(optimizer, "network", None)
    for t in range(horizon):
        if multiplier is not None:
            # in place and outside the step: a CUDA graph captured from the step reads this storage at every replay
            torch.mul(base, multiplier(t, horizon), out=lr)
        losses[t] = stepper.step(network, [family.sample_batch(i, g) for i, g in zip(insts, generators)])
        if on_step is not None:
            on_step()
    if multiplier is not None:
        lr.copy_(base)
    generator = torch.Generator(device=device) if device.type == "cuda" else torch.Generator()
    heldout = family.heldout_loss(params, inst, generator.manual_seed(99))
    return {"train": losses.cpu(), "heldout": heldout.cpu(), "params": params,
            "graph_steps": stepper.graph_steps, "eager_steps": stepper.eager_steps}


def _summaries(family, result, horizon) -> list[dict]:
    tail = max(10, horizon // 20)
    train, heldout = result["train"], result["heldout"]
    out = []
    for m in range(train.shape[1]):
        final = float(train[-tail:, m].mean())
        diverged = not math.isfinite(final) or final > family.max_loss
        out.append({"final_train": final, "heldout": float(heldout[m]), "diverged": diverged})
    return out


def _curve(train: torch.Tensor) -> list:
    """The mean over members of the training loss, averaged into at most CURVE_POINTS windows: [[step, loss], ...]."""
    horizon = train.shape[0]
    width = max(1, horizon // CURVE_POINTS)
    points = []
    for start in range(0, horizon, width):
        window = train[start:start + width].mean(1)
        value = float(window.mean())
        points.append([start + len(window), value if math.isfinite(value) else None])
    return points


def _aggregate(runs: list[dict]) -> dict:
    finals = [r["final_train"] for r in runs]
    heldouts = [r["heldout"] for r in runs]

    def stats(values):
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            return {"mean": None, "std": None}
        return {"mean": statistics.mean(finite), "std": statistics.pstdev(finite) if len(finite) > 1 else 0.0}

    return {"final_train": stats(finals), "heldout": stats(heldouts),
            "divergence_rate": sum(r["diverged"] for r in runs) / len(runs), "runs": runs}


def _save_atomically(obj, path: Path) -> None:
    """torch.save to a temporary file, then rename it over ``path``: an interrupted save leaves the old file."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def baseline_path(directory, task: EvalTask, settings: EvalSettings, name: str, device, extra=None) -> Path:
    """Where an AdamW run of ``task`` is kept in a baselines directory: named by a digest of everything that
    decides it — the task and its spec, the settings but the learned optimizer's lr, the run (its learning
    rates), the device (a GPU's name) and torch's version — so a run is reused only where it would come out the
    same."""
    device = torch.device(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    settings_key = {k: v for k, v in settings.key().items() if k not in ("learned_lr", "learned_backend")}
    identity = {"task": task.name, "spec": task.quick_spec if settings.quick else task.spec, "settings": settings_key,
                "run": name, "extra": extra or {}, "device": where, "torch": torch.__version__}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory) / f"{task.name}-{name}-{digest}.pt"


def evaluate_task(task: EvalTask, meta_weights, settings: EvalSettings, device, done: dict | None = None,
                  save=None, progress=None, deadline=None, optimizer: str = "small_fc_lopt", baselines=None,
                  log=None) -> dict:
    """One task: the AdamW sweep, then the learned optimizer (``optimizer``'s step with ``meta_weights``), AdamW
    at 1e-3 and AdamW at the tuned lr. ``done`` holds runs finished earlier (resume); ``save(result)`` is called
    after every run. ``baselines``: a directory where the AdamW runs, which do not depend on the weights, are
    kept and taken from (:func:`baseline_path`), so that several weight sets share them. ``log(line)``: one line
    per run trained here (its time, final training loss and divergences), so that a log shows what finished
    even when the process is stopped before the table."""
    spec = task.quick_spec if settings.quick else task.spec
    family = tasks_lib.build(spec).to(device)
    shapes = family.shapes()
    result = dict(done or {})
    result.update({"task": task.name, "what": task.what, "spec": spec, "family": family.describe(),
                   "horizon": settings.horizon})
    scheduled = settings.schedule != "constant"
    if scheduled:  # (a constant-protocol result stays as it was)
        result["schedule"] = settings.schedule
    result.setdefault("runs", {})
    runs = result["runs"]
    horizon = settings.horizon

    def step_hook():
        if progress is not None:
            progress.update(1)

    def finish(name, optimizer, seeds, extra=None):
        kept = None if baselines is None or name == "learned" else baseline_path(baselines, task, settings, name,
                                                                                  device, extra)
        if name not in runs and kept is not None and kept.exists():
            runs[name] = torch.load(kept, weights_only=True)
        if name in runs:
            if progress is not None:
                progress.update(horizon)
            return
        if deadline is not None and time.perf_counter() > deadline:
            raise TimeoutError
        start = time.perf_counter()
        out = train_population(family, optimizer, seeds, horizon, device, step_hook, settings.cuda_graphs,
                               lr_schedule=settings.schedule)
        summaries = _summaries(family, out, horizon)
        entry = {"seconds": round(time.perf_counter() - start, 2), "seeds": list(seeds),
                 "members": len(seeds), "summaries": summaries, "train_curves": out["train"],
                 "cuda_graph_steps": out["graph_steps"]}
        entry.update(extra or {})
        if scheduled:
            entry["schedule"] = settings.schedule
        if getattr(optimizer, "backends", None):  # MemberOptimizers: what backend="auto" resolved to, per seed
            entry["backends"] = optimizer.backends
        runs[name] = entry
        if log is not None:
            finals = [m["final_train"] for m in summaries]
            log(f"{task.name}: {name} done in {entry['seconds']:.1f} s, final training loss "
                f"{statistics.fmean(finals):.4g} (mean of {len(finals)}), {sum(m['diverged'] for m in summaries)} "
                f"diverged")
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            _save_atomically(entry, kept)
        if save is not None:
            save(result)

    def adamw_lr(lr, members):
        """A number for the constant protocol (its records stay as they were); a schedule writes a tensor in place."""
        return torch.full((members,), lr, device=device) if scheduled else lr

    # 1. the AdamW sweep on the tuning seeds
    sweep_seeds = [s for _ in settings.lrs for s in settings.tune_seeds]
    sweep_lrs = torch.tensor([lr for lr in settings.lrs for _ in settings.tune_seeds], device=device)
    finish("adamw_sweep", BatchedAdamW(shapes, len(sweep_seeds), device, lr=sweep_lrs), sweep_seeds,
           {"lrs": [float(lr) for lr in settings.lrs for _ in settings.tune_seeds]})
    sweep = runs["adamw_sweep"]
    by_lr = {}
    for lr, summary in zip(sweep["lrs"], sweep["summaries"]):
        value = math.inf if summary["diverged"] else summary["final_train"]
        by_lr.setdefault(lr, []).append(value)
    scores = {lr: sum(v) / len(v) for lr, v in by_lr.items()}
    best_lr = min(scores, key=lambda lr: (scores[lr], lr))
    result["sweep"] = {f"{lr:.3g}": (None if math.isinf(s) else s) for lr, s in scores.items()}
    result["tuned_lr"] = best_lr

    seeds = list(settings.report_seeds)
    # the lr as given, recorded as a number (a scheduled run's tensor is float32 and ends the run as given)
    learned_lr = inner_rule(optimizer).defaults["lr"] if settings.learned_lr is None else settings.learned_lr
    # scheduled: one 0-d tensor on the device, shared by the members, that the step reads in place
    lr_arg = torch.tensor(float(learned_lr), device=device) if scheduled else settings.learned_lr
    if settings.learned_backend is None:
        learned = batched_optimizer(shapes, len(seeds), device, optimizer=optimizer, lr=lr_arg)
        learned.network = {k: v.to(device) for k, v in meta_weights.tensors["mlp"].items()}
        extra = {}
    else:
        learned = MemberOptimizers(len(seeds), optimizer=optimizer, weights=meta_weights, lr=lr_arg,
                                   backend=settings.learned_backend)
        extra = {"backend": settings.learned_backend}
    finish("learned", learned, seeds, {"lr": float(learned_lr), "optimizer": optimizer, **extra})
    finish("adamw_default", BatchedAdamW(shapes, len(seeds), device, lr=adamw_lr(1e-3, len(seeds))), seeds,
           {"lr": 1e-3})
    finish("adamw_tuned", BatchedAdamW(shapes, len(seeds), device, lr=adamw_lr(best_lr, len(seeds))), seeds,
           {"lr": best_lr})
    result["summary"] = {name: _aggregate(runs[name]["summaries"]) for name in ("learned", "adamw_tuned", "adamw_default")}
    result["curves"] = {name: _curve(runs[name]["train_curves"]) for name in ("learned", "adamw_tuned", "adamw_default")}
    return result


def _fmt(stats, digits=3):
    if stats["mean"] is None:
        return "—"
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def markdown_table(results: list[dict], header: str = "") -> str:
    lines = [header] if header else []
    lines += ["| task | horizon | optimizer | final train loss | held-out loss | diverged |",
              "|---|---:|---|---:|---:|---:|"]
    names = {"learned": "learned", "adamw_tuned": "AdamW tuned", "adamw_default": "AdamW 1e-3"}
    for r in results:
        schedule = f", {r['schedule']}" if r.get("schedule") else ""  # (a row says its protocol, pasted anywhere)
        for key in ("learned", "adamw_tuned", "adamw_default"):
            s = r["summary"][key]
            label = names[key]
            if key == "learned":  # (runs kept before the lr was recorded are small_fc_lopt's, at lr 1)
                run = r["runs"]["learned"]
                label += (f" (lr {run.get('lr', 1.0):g}"
                          + (f", {'/'.join(sorted(set(run['backends'])))} step" if run.get("backends") else "")
                          + f"{schedule})")
            elif key == "adamw_tuned":
                label += f" (lr {r['tuned_lr']:.2g}{schedule})"
            elif schedule:
                label += f" ({r['schedule']})"
            lines.append(f"| {r['task']} | {r['horizon']} | {label} | {_fmt(s['final_train'])} | {_fmt(s['heldout'])} | "
                         f"{s['divergence_rate']:.0%} |")
    return "\n".join(lines) + "\n"


def plot_curves(results: list[dict], path) -> bool:
    """One panel per task: the mean training loss of each optimizer. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    columns = min(4, len(results))
    rows = -(-len(results) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for ax, r in zip(axes.flat, results):
        for key, label in (("learned", "learned"), ("adamw_tuned", f"AdamW {r['tuned_lr']:.2g}"),
                           ("adamw_default", "AdamW 1e-3")):
            points = [(s, v) for s, v in r["curves"][key] if v is not None]
            if points:
                ax.plot(*zip(*points), label=label)
        ax.set_title(r["task"] + (f" ({r['schedule']} lr)" if r.get("schedule") else ""), fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _jsonable(obj):
    if torch.is_tensor(obj):
        return None  # raw curves stay out of the JSON (the per-run summaries and the averaged curves stay)
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items() if not torch.is_tensor(v)}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def run_suite(weights_source, out_dir=None, device="cpu", settings: EvalSettings | None = None, progress=True,
              max_minutes=None, optimizer: str = "small_fc_lopt", baselines=None) -> dict:
    """Evaluate ``weights_source``, run by ``optimizer`` (a name of ``rules.TRAINABLE``), on the suite; results (and
    resumable per-task state) in ``out_dir``; the AdamW runs shared through ``baselines`` (a directory) if given."""
    from tqdm.auto import tqdm

    settings = settings or EvalSettings()
    device = torch.device(device)
    meta_weights = load_eval_weights(weights_source, optimizer)
    digest = weights_digest(meta_weights)
    out = None if out_dir is None else Path(out_dir)
    if out is not None:
        (out / "tasks").mkdir(parents=True, exist_ok=True)
    task_list = settings.task_list()
    bar = tqdm(total=len(task_list) * 4 * settings.horizon, disable=None if progress else True, desc="meta-eval",
               unit="step", dynamic_ncols=True)
    deadline = None if max_minutes is None else time.perf_counter() + max_minutes * 60

    def log(line):  # (above the progress bar when there is one; stderr, so stdout stays the table)
        if progress:
            tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    results, stopped = [], False
    key = {"weights_sha": digest, **settings.key()}
    if optimizer != "small_fc_lopt":  # (the key of runs kept before ELO could be evaluated stays as it was)
        key["optimizer"] = optimizer
    try:
        for task in task_list:
            partial_path = None if out is None else out / "tasks" / f"{task.name}.pt"
            done = None
            if partial_path is not None and partial_path.exists():
                saved = torch.load(partial_path, weights_only=True)
                if saved.get("key") == key:
                    done = saved["result"]

            def save(result, partial_path=partial_path):
                if partial_path is not None:
                    _save_atomically({"key": key, "result": result}, partial_path)

            bar.set_postfix({"task": task.name}, refresh=False)
            try:
                result = evaluate_task(task, meta_weights, settings, device, done, save, bar, deadline, optimizer,
                                       baselines, log)
            except TimeoutError:
                stopped = True
                break
            save(result)
            results.append(result)
    finally:
        bar.close()
    report = {"what": "lopt meta-eval results (docs/meta_training.md)", "weights": str(weights_source),
              "optimizer": optimizer,
              "weights_source": meta_weights.source, "weights_sha": digest, "device": str(device),
              "torch": torch.__version__, "settings": settings.key(), "complete": not stopped and
              len(results) == len(task_list), "tasks": [_jsonable(r) for r in results]}
    schedule = ""
    if settings.schedule != "constant":  # (the constant protocol's header stays as it was)
        formula = " ".join(SCHEDULES[settings.schedule].__doc__.split()).rstrip(".")
        schedule = (f" {settings.schedule.capitalize()} schedule: every optimizer's lr (the learned one's, AdamW's, "
                    f"the sweep's) is multiplied at step t by {formula}; AdamW's lr is tuned under it.")
    header = (f"Meta-weights `{weights_source}` (sha {digest}, run by {inner_rule(optimizer).front_end.__name__}) on "
              f"suite {settings.suite}"
              f"{' (quick mode)' if settings.quick else ''}: mean ± std over seeds {list(settings.report_seeds)}; "
              f"AdamW's lr tuned over {len(settings.lrs)} values on seeds {list(settings.tune_seeds)}.{schedule}\n")
    report["markdown"] = markdown_table(results, header) if results else header
    if out is not None:
        (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "results.md").write_text(report["markdown"])
        if results:
            report["plot"] = str(out / "curves.png") if plot_curves(results, out / "curves.png") else None
    return report
