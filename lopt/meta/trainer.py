"""The outer loop: estimators → clipped gradient → AdamW on θ; checkpoints that resume exactly.

A run lives in one directory::

    DIR/config.json, DIR/model.safetensors   the latest meta-weights in PyLO's hub layout
                                             (lopt.SmallFCLOpt(weights="DIR"), or lopt.ELO for an ELO run)
    DIR/best/                                the weights of the best validation so far (same layout)
    DIR/meta_training.json                   the run's record: config, git commit, versions, device,
                                             meta-loss curve, validation curve, chunks, inner steps/s
    DIR/checkpoint.pt                        everything needed to continue exactly: θ, AdamW's state,
                                             every estimator's state (inner parameters, optimizer
                                             state, PES accumulators, unroll positions), RNG states

Running again with the same directory resumes from ``checkpoint.pt``; on the same device and
software the continued run is bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import warnings
from pathlib import Path

import torch

import lopt
from lopt.meta import tasks as tasks_lib
from lopt.meta.batched import BatchedAdamW
from lopt.meta.rules import inner_rule
from lopt.meta.estimators import ESTIMATORS, InnerPopulation
from lopt.meta.metaparams import MetaParamSpace
from lopt.meta.presets import MetaTrainConfig

CHECKPOINT = "checkpoint.pt"
RECORD = "meta_training.json"
FORMAT = "lopt.meta.checkpoint/1"


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "lopt"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _device_generator(device: torch.device, seed: int) -> torch.Generator:
    generator = torch.Generator(device=device) if device.type == "cuda" else torch.Generator()
    return generator.manual_seed(seed)


class MetaTrainer:
    """Meta-trains ``config.optimizer``'s MLP with ``config.estimator`` on ``config.tasks``.

    >>> trainer = MetaTrainer(preset("smoke"), out_dir="run", device="cpu")
    >>> trainer.run(max_minutes=8)      # resumable: MetaTrainer.resume("run").run(...)
    """

    def __init__(self, config: MetaTrainConfig, out_dir=None, device="cpu"):
        self.config = config.resolved()
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        config = self.config
        config.check()
        if config.estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {config.estimator!r}; known: {sorted(ESTIMATORS)}")
        if not config.tasks:
            raise ValueError("meta-training needs at least one task family")
        self.space = MetaParamSpace(inner_rule(config.optimizer).architecture)
        self.families = [tasks_lib.build(spec).to(self.device) for spec in config.tasks]
        estimator = ESTIMATORS[config.estimator]
        self.estimators = [
            estimator(family, self.space, num_tasks=config.num_tasks, std=config.std, truncation=config.truncation,
                      min_unroll=config.min_unroll, max_unroll=config.max_unroll, device=self.device,
                      use_graph=config.cuda_graphs, optimizer_kwargs=self._optimizer_kwargs(config),
                      schedule=config.inner_schedule, lr_range=config.inner_lr_range,
                      **({"clip_loss_diff": config.clip_loss_diff} if config.estimator == "es" else {}))
            for family in self.families]
        self.host_gen = torch.Generator().manual_seed(config.seed)
        self.device_gen = _device_generator(self.device, config.seed + 1)
        self.theta = torch.nn.Parameter(self.space.initial(config.init, config.seed).to(self.device))
        self.outer_opt = torch.optim.AdamW([self.theta], lr=config.lr_at(0), betas=tuple(config.betas),
                                           weight_decay=config.weight_decay)
        self.step = 0
        self.started = False
        self.elapsed = 0.0  # seconds of outer steps, over all chunks
        self.history = {"step": [], "meta_loss": [], "lr": [], "grad_norm": [], "groups": [], "seconds": [],
                        "inner_steps": [], "resets": [], "validation": []}
        self.chunks = []
        self.best = None  # (validation loss, step)
        self.stopped_early = None  # the outer step at which `patience` validations without a new best ended the run
        self._stop = False
        self._validators = [InnerPopulation(family, config.validation_tasks, members=1, device=self.device,
                                            optimizer_kwargs=self._optimizer_kwargs(config),
                                            use_graph=config.cuda_graphs, schedule=config.inner_schedule)
                            for family in self.families]

    @staticmethod
    def _optimizer_kwargs(config) -> dict:
        """The batched inner optimizer's options that the config chooses."""
        options = {"optimizer": config.optimizer, "compiled": bool(config.compile_inner)}
        if config.inner_lr is not None:
            options["lr"] = float(config.inner_lr)
        return options

    # ------------------------------------------------------------------ one outer step
    def _groups(self, step: int) -> list[int]:
        n = len(self.estimators)
        k = n if self.config.groups_per_step in (0, None) else min(n, self.config.groups_per_step)
        return [(step * k + j) % n for j in range(k)]

    def outer_step(self, on_inner_step=None) -> dict:
        for estimator in self.estimators:  # the curriculum's longest unroll, for the instances drawn in this step
            estimator.max_unroll = self.config.max_unroll_at(self.step)
        if not self.started:
            for estimator in self.estimators:
                estimator.start(self.host_gen, self.device_gen)
            self.started = True
        start = time.perf_counter()
        theta = self.theta.detach()
        groups = self._groups(self.step)
        grads, losses, inner_steps, resets = [], [], 0, 0
        for g in groups:
            out = self.estimators[g].estimate(theta, self.host_gen, self.device_gen, on_inner_step)
            grads.append(out["grad"])
            losses.append(out["loss"])
            inner_steps += out["inner_steps"]
            resets += out["resets"]
        grad = torch.stack(grads).mean(0)
        grad = torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
        norm = float(grad.norm())
        if self.config.grad_clip:
            grad = grad * min(1.0, self.config.grad_clip / (norm + 1e-6))
        lr = self.config.lr_at(self.step)
        for group in self.outer_opt.param_groups:
            group["lr"] = lr
        self.theta.grad = grad.to(self.theta.dtype)
        self.outer_opt.step()
        self.theta.grad = None
        seconds = time.perf_counter() - start
        self.elapsed += seconds
        meta_loss = sum(losses) / len(losses)
        h = self.history
        h["step"].append(self.step)
        h["meta_loss"].append(meta_loss)
        h["lr"].append(lr)
        h["grad_norm"].append(norm)
        h["groups"].append(groups)
        h["seconds"].append(seconds)
        h["inner_steps"].append(inner_steps)
        h["resets"].append(resets)
        self.step += 1
        return {"meta_loss": meta_loss, "grad_norm": norm, "lr": lr, "seconds": seconds, "inner_steps": inner_steps}

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self, theta=None) -> float:
        """Mean normalised training loss over ``validation_steps`` steps of ``validation_tasks`` fixed instances
        of every family, trained with θ itself (no perturbation); the instances are the same at every call.
        Under ``inner_schedule`` the lr follows the schedule over the validation run (t from 0 to
        ``validation_steps``), as the weights are trained to be used."""
        config = self.config
        theta = self.theta.detach() if theta is None else theta.to(self.device)
        steps = config.validation_steps or config.max_unroll
        network = self.space.unflatten(theta)
        values = []
        for i, inner in enumerate(self._validators):
            generator = _device_generator(self.device, 777_000 + 31 * i)
            inner.start(generator)
            values.append(float(inner.unroll(network, steps, generator, lengths=steps).mean()))
        return sum(values) / len(values)

    @torch.no_grad()
    def validate_adamw(self, lr: float) -> float:
        """The same measure for AdamW (lr ``lr``, torch's other defaults) on the same instances: a yardstick; under
        ``inner_schedule`` its lr follows the same schedule over the validation run."""
        config = self.config
        steps = config.validation_steps or config.max_unroll
        values = []
        for i, family in enumerate(self.families):
            generator = _device_generator(self.device, 777_000 + 31 * i)
            inner = InnerPopulation(family, config.validation_tasks, members=1, device=self.device,
                                    use_graph=config.cuda_graphs, schedule=config.inner_schedule)
            inner.set_optimizer(BatchedAdamW(family.shapes(), inner.population, self.device, lr=lr))
            inner.start(generator)
            values.append(float(inner.unroll(None, steps, generator, lengths=steps).mean()))
        return sum(values) / len(values)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return _to_cpu({
            "format": FORMAT, "config": self.config.to_dict(), "step": self.step, "started": self.started,
            "elapsed": self.elapsed, "theta": self.theta.detach(), "outer_opt": self.outer_opt.state_dict(),
            "estimators": [e.state_dict() for e in self.estimators] if self.started else None,
            "host_gen": self.host_gen.get_state(), "device_gen": self.device_gen.get_state(),
            "history": self.history, "chunks": self.chunks, "best": self.best, "stopped_early": self.stopped_early,
            "device": str(self.device)})

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != FORMAT:
            raise ValueError(f"not a lopt.meta checkpoint (format {state.get('format')!r}, expected {FORMAT!r})")
        self.step, self.started, self.elapsed = state["step"], state["started"], state["elapsed"]
        with torch.no_grad():
            self.theta.copy_(state["theta"].to(self.device))
        self.outer_opt.load_state_dict(state["outer_opt"])
        if self.started:
            for estimator, est_state in zip(self.estimators, state["estimators"]):
                estimator.load_state_dict(est_state)
        self.host_gen.set_state(state["host_gen"])
        saved_device = torch.device(state.get("device", "cpu"))
        if saved_device.type == self.device.type:
            self.device_gen.set_state(state["device_gen"])
        else:  # another kind of generator: the run continues, with other random draws than on the saved device
            warnings.warn(f"lopt.meta: resuming a run saved on {saved_device} on {self.device}: the device's random "
                          f"stream starts anew (the continuation is not the one {saved_device} would have computed)",
                          RuntimeWarning, stacklevel=2)
            self.device_gen.manual_seed(self.config.seed + 1 + 1_000_003 * self.step)
        self.history, self.chunks, self.best = state["history"], state["chunks"], state["best"]
        self.stopped_early = state.get("stopped_early")

    @classmethod
    def resume(cls, out_dir, device=None) -> "MetaTrainer":
        """The run saved in ``out_dir`` (its config from the checkpoint), ready to continue."""
        path = Path(out_dir) / CHECKPOINT
        state = torch.load(path, map_location="cpu", weights_only=True)
        config = MetaTrainConfig.from_dict(state["config"])
        trainer = cls(config, out_dir, device or state["device"])
        trainer.load_state_dict(state)
        return trainer

    def save(self) -> None:
        """checkpoint.pt (atomically), the weights (latest), the record."""
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.out_dir / (CHECKPOINT + ".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, self.out_dir / CHECKPOINT)
        self.weights(f"lopt meta-train {self.config.preset}, outer step {self.step}").save(self.out_dir)
        self.write_record()

    def weights(self, source: str = "lopt.meta"):
        """θ as :class:`lopt.MetaWeights`."""
        return self.space.to_meta_weights(self.theta.detach(), source)

    def inner_steps_per_second(self, last: int | None = None) -> float | None:
        h = self.history
        steps, seconds = h["inner_steps"][-last:] if last else h["inner_steps"], h["seconds"][-last:] if last else h["seconds"]
        return sum(steps) / sum(seconds) if seconds and sum(seconds) > 0 else None

    def graph_counts(self) -> dict:
        """Population steps of this process run eagerly and replayed from CUDA graphs (estimators only)."""
        steppers = [e.inner.stepper for e in self.estimators if e.inner.stepper is not None]
        return {"eager": sum(s.eager_steps for s in steppers), "replayed": sum(s.graph_steps for s in steppers)}

    def write_record(self) -> None:
        record = {
            "what": "lopt meta-train run record (docs/meta_training.md)",
            "config": self.config.to_dict(),
            "families": [f.describe() for f in self.families],
            "git_commit": _git_commit(), "lopt": lopt.__version__, "torch": torch.__version__,
            "device": str(self.device) + (f" ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda" else ""),
            "outer_steps_done": self.step, "seconds": self.elapsed,
            "inner_steps_per_second": self.inner_steps_per_second(),
            "best_validation": self.best, "stopped_early": self.stopped_early, "chunks": self.chunks,
            "cuda_graph_steps": self.graph_counts(), "history": self.history,
        }
        tmp = self.out_dir / (RECORD + ".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, self.out_dir / RECORD)

    # ------------------------------------------------------------------ the loop
    def _validate_and_keep_best(self) -> float:
        value = self.validate()
        self.history["validation"].append([self.step, value])
        if self.best is None or value < self.best[0]:
            self.best = [value, self.step]
            if self.out_dir is not None:
                self.weights(f"lopt meta-train {self.config.preset}, best validation at outer step {self.step}").save(
                    self.out_dir / "best")
        elif self.config.patience and self._validations_since_best() >= self.config.patience:
            self.stopped_early = self.step
        return value

    def _validations_since_best(self) -> int:
        return sum(1 for step, _ in self.history["validation"] if step > self.best[1])

    @property
    def finished(self) -> bool:
        """All outer steps done, or ended early by ``patience``."""
        return self.step >= self.config.outer_steps or self.stopped_early is not None

    def run(self, max_minutes: float | None = None, progress: bool = True, outer_steps: int | None = None) -> dict:
        """Outer steps until ``config.outer_steps`` (or ``outer_steps`` more) are done or ``max_minutes`` would be
        exceeded; checkpoints on the way (``checkpoint_minutes``) and at the end, also after SIGTERM or a first
        Ctrl-C (which end the chunk after the current outer step). Returns a summary."""
        from tqdm.auto import tqdm

        config = self.config
        target = config.outer_steps if outer_steps is None else min(config.outer_steps, self.step + outer_steps)
        chunk_start, chunk_step = time.perf_counter(), self.step
        last_save = chunk_start
        budget = None if max_minutes is None else max_minutes * 60.0
        previous_handlers = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                previous_handlers[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread
                pass
        self._stop = False
        if self.step == 0 and config.validate_every and not self.history["validation"]:
            self._validate_and_keep_best()
            self.history["validation_adamw"] = {f"{lr:g}": self.validate_adamw(lr) for lr in config.baseline_lrs}
        # (disable=None: drawn only where stderr is a terminal, so a redirected log gets no redrawn frames)
        bar = tqdm(total=config.outer_steps, initial=self.step, disable=None if progress else True, desc="meta-train",
                   unit="step", dynamic_ncols=True)
        ema, step_time, stopped_for = None, None, None
        try:
            while self.step < target and self.stopped_early is None:
                now = time.perf_counter()
                if budget is not None and step_time is not None and (now - chunk_start) + 1.5 * step_time > budget:
                    stopped_for = "time"
                    break
                if self._stop:
                    stopped_for = "signal"
                    break
                out = self.outer_step()
                step_time = out["seconds"] if step_time is None else 0.8 * step_time + 0.2 * out["seconds"]
                ema = out["meta_loss"] if ema is None else 0.95 * ema + 0.05 * out["meta_loss"]
                postfix = {"meta_loss": f"{ema:.4f}", "lr": f"{out['lr']:.2e}"}
                if config.validate_every and self.step % config.validate_every == 0:
                    postfix["val"] = f"{self._validate_and_keep_best():.4f}"
                bar.set_postfix(postfix, refresh=False)
                bar.update(1)
                if time.perf_counter() - last_save > config.checkpoint_minutes * 60.0:
                    self._record_chunk(chunk_step, chunk_start)
                    self.save()
                    self.chunks.pop()
                    last_save = time.perf_counter()
        finally:
            bar.close()
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
        if self.step >= config.outer_steps and config.validate_every and (
                not self.history["validation"] or self.history["validation"][-1][0] != self.step):
            self._validate_and_keep_best()
        self._record_chunk(chunk_step, chunk_start)
        self.save()
        if self.stopped_early is not None:
            stopped_for = (f"no new best validation in {config.patience} validations (best {self.best[0]:.4f} at "
                           f"outer step {self.best[1]}: {self.out_dir / 'best' if self.out_dir else 'best'})")
        return {"step": self.step, "outer_steps": config.outer_steps, "finished": self.finished,
                "stopped_for": stopped_for, "chunk_seconds": time.perf_counter() - chunk_start,
                "inner_steps_per_second": self.inner_steps_per_second(self.step - chunk_step or None),
                "meta_loss_ema": ema, "best": self.best}

    def _record_chunk(self, chunk_step, chunk_start):
        self.chunks.append({"from_step": chunk_step, "to_step": self.step,
                            "seconds": round(time.perf_counter() - chunk_start, 3), "device": str(self.device)})

    def _on_signal(self, signum, frame):
        """SIGTERM or a first Ctrl-C: finish the current outer step, checkpoint, return. A second Ctrl-C: abort."""
        if self._stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self._stop = True
