"""Meta-training configurations: :class:`MetaTrainConfig` and the named presets.

* ``mulo`` — μLO's recipe for small_fc_lopt (Thérien et al., "μLO: compute-efficient meta-
  generalization of learned optimizers"): 5,000 AdamW outer steps, learning rate warmed up linearly
  over 100 steps to 3e-3 then cosine-decayed to 1e-3, gradient clipping, truncated PES with
  truncation 50, 8 perturbations (antithetic pairs), σ 0.01, unrolls of at most 1,000 steps; on
  lopt's offline MLP tasks (digits, mnist1d, teacher–student).
* ``celo`` — Celo's recipe (Moudgil et al., "Celo: training versatile learned optimizers on a
  compute diet"): 8×8 image tasks with a 32-unit MLP at batch 64, the weight-rescale augmentation
  (one global factor log-uniform in [1e-3, 1e3]), truncated PES with truncation 50, 8 tasks × 2
  antithetic, σ 0.01, AdamW at 3e-4; digits is the only 8×8 image data set available offline, so
  mnist1d joins it.
* ``deep`` — lopt's own continuation of its shipped weights (``lopt-small_fc-tiny``) toward long horizons and
  deeper networks: ``mulo``'s families and two deeper MLPs, unrolls grown by a curriculum from 1,000 to 5,000
  steps, 32 pairs per family, AdamW at a constant 3e-4 (docs/meta_training.md §7 says what led to it).
* ``digits-cpu`` — a few minutes on a laptop CPU: PES on the digits MLP alone, short unrolls.
* ``smoke`` — a few-second CPU configuration for tests and for trying the tools.

What is lopt's own choice rather than the recipes' (the task suite, the unroll range of ``celo``,
the clipping threshold, round-robin task groups) is said in docs/meta_training.md.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import torch


def _positive_number(value) -> bool:
    """A finite number above 0 (not a bool, not a string)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


@dataclass
class MetaTrainConfig:
    preset: str = "custom"
    optimizer: str = "small_fc_lopt"       # whose step the tasks train with: a name of lopt.meta.rules.TRAINABLE
    estimator: str = "pes"                 # "pes" (truncated PES) or "es" (full-length antithetic ES)
    tasks: list = field(default_factory=list)  # task-family specs ({"task": ..., ...}, lopt.meta.tasks.build)
    groups_per_step: int = 1                # task families estimated per outer step (round robin); 0 = all
    num_tasks: int = 8                      # instances per family = antithetic pairs (population 2·num_tasks)
    std: float = 0.01
    truncation: int = 50
    min_unroll: int = 100
    max_unroll: int = 1000
    clip_loss_diff: float | None = None     # ES only
    curriculum_from: int | None = None      # the longest unroll at outer step 0; it grows log-linearly to
    curriculum_steps: int = 0               # max_unroll over this many outer steps (0 or None: no curriculum)
    outer_steps: int = 5000
    lr: float = 3e-3                        # peak outer learning rate
    final_lr: float = 1e-3                  # cosine schedule's end
    warmup_steps: int = 100
    schedule: str = "cosine"                # "cosine" (linear warmup, cosine to final_lr) or "constant"
    betas: tuple = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0           # global 2-norm of the outer gradient; None: no clipping
    init: str = "random"                    # "random" (lopt.random_weights(seed)) or a weights source
    seed: int = 0
    validate_every: int = 250               # outer steps between validations (0: never)
    validation_tasks: int = 4               # fixed instances per family for validation
    validation_steps: int | None = None     # default: max_unroll
    patience: int = 0                       # end the run after this many validations without a new best (0: never)
    baseline_lrs: tuple = (1e-3, 1e-2)      # AdamW yardsticks on the validation instances (once, at step 0)
    checkpoint_minutes: float = 2.0         # a checkpoint at least this often
    cuda_graphs: bool = True                # on CUDA, replay each population step from a captured graph
    compile_inner: bool = False             # the batched optimizer's step through torch.compile (fused kernels)
    # the inner lr's schedule over each unroll (a name of lopt.meta.schedules.SCHEDULES): the learned optimizer's lr
    # at step t of an unroll of length L is its lr times SCHEDULES[inner_schedule](t, L); validation's too
    inner_schedule: str = "constant"
    # the learned optimizer's lr in the inner unrolls (and validation); None: its class's default (SmallFCLOpt 1,
    # ELO and CELO2 1e-3). CELO2's step has unit RMS per matrix, so its lr alone sets how far a step goes
    inner_lr: float | None = None
    # (low, high): every task instance of the unrolls draws its learned lr log-uniformly from this range whenever it
    # is drawn (both members of an antithetic pair share it), so that the weights learn to act at the lr a user
    # gives them; validation keeps inner_lr (or the default). None: every unroll at inner_lr
    inner_lr_range: tuple | None = None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["betas"] = list(self.betas)
        out["baseline_lrs"] = list(self.baseline_lrs)
        # (records and checkpoints of runs without these options stay as they were)
        if self.inner_schedule == "constant":
            del out["inner_schedule"]
        if self.inner_lr is None:
            del out["inner_lr"]
        if self.inner_lr_range is None:
            del out["inner_lr_range"]
        else:
            out["inner_lr_range"] = list(self.inner_lr_range)
        return out

    @classmethod
    def from_dict(cls, values: dict) -> "MetaTrainConfig":
        values = dict(values)
        if "architecture" in values:  # (records written before ELO could be meta-trained: the optimizer's name)
            values.setdefault("optimizer", values.pop("architecture"))
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown meta-training options {sorted(unknown)}")
        for key in ("betas", "baseline_lrs", "inner_lr_range"):
            if values.get(key) is not None:
                values[key] = tuple(values[key])
        return cls(**values)

    def lr_at(self, step: int) -> float:
        """The outer learning rate of outer step ``step`` (0-based)."""
        if self.schedule == "constant":
            return self.lr * min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else self.lr
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.outer_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.final_lr + (self.lr - self.final_lr) * 0.5 * (1 + math.cos(math.pi * progress))

    def max_unroll_at(self, step: int) -> int:
        """The longest unroll a new instance may draw at outer step ``step`` (0-based): ``max_unroll``, or under a
        curriculum ``curriculum_from · (max_unroll / curriculum_from)^(step / curriculum_steps)``, rounded, until
        it reaches ``max_unroll``."""
        if self.curriculum_from is None or not self.curriculum_steps:
            return self.max_unroll
        progress = min(1.0, step / self.curriculum_steps)
        return int(round(math.exp(math.log(self.curriculum_from)
                                  + progress * (math.log(self.max_unroll) - math.log(self.curriculum_from)))))

    def check(self) -> None:
        """Raise ValueError naming the first option whose value cannot run."""
        from lopt.meta.rules import inner_rule
        from lopt.meta.schedules import SCHEDULES

        inner_rule(self.optimizer)
        if self.inner_lr is not None and not _positive_number(self.inner_lr):
            raise ValueError(f"inner_lr={self.inner_lr!r}: the learned optimizer's lr must be a positive number "
                             "(leave it out for its class's default)")
        bounds = self.inner_lr_range
        if bounds is not None and not (isinstance(bounds, (tuple, list)) and len(bounds) == 2
                                       and all(map(_positive_number, bounds)) and bounds[0] <= bounds[1]):
            raise ValueError(f"inner_lr_range={bounds!r}: give [low, high], two positive numbers with low <= high "
                             "(each instance's learned lr is drawn log-uniformly between them)")
        if self.inner_schedule not in SCHEDULES:
            raise ValueError(f"inner_schedule={self.inner_schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if not 1 <= self.min_unroll <= self.max_unroll:
            raise ValueError(f"min_unroll={self.min_unroll} and max_unroll={self.max_unroll}: an unroll range needs "
                             "1 <= min_unroll <= max_unroll")
        if self.curriculum_from is not None and not self.min_unroll <= self.curriculum_from <= self.max_unroll:
            raise ValueError(f"curriculum_from={self.curriculum_from} lies outside [min_unroll, max_unroll] = "
                             f"[{self.min_unroll}, {self.max_unroll}]: the curriculum starts its longest unroll there "
                             "and grows it to max_unroll")
        if self.curriculum_steps is not None and self.curriculum_steps < 0:
            raise ValueError(f"curriculum_steps={self.curriculum_steps}: give the outer steps the curriculum takes "
                             "(0: none)")
        if self.curriculum_from is None and self.curriculum_steps:
            raise ValueError(f"curriculum_steps={self.curriculum_steps} without curriculum_from: set the longest "
                             "unroll of outer step 0 (curriculum_from) too, or curriculum_steps=0")
        if self.patience < 0 or (self.patience and not self.validate_every):
            raise ValueError(f"patience={self.patience} with validate_every={self.validate_every}: patience counts "
                             "validations, so it needs validate_every > 0 (and is >= 0; 0 = never stop early)")

    def resolved(self) -> "MetaTrainConfig":
        """A copy whose randomly sized task families (``"student_hidden": "random"``) are drawn from the seed."""
        out = copy.deepcopy(self)
        generator = torch.Generator().manual_seed(10_000 + self.seed)
        for spec in out.tasks:
            if spec.get("student_hidden") == "random":
                depth = int(torch.randint(1, 4, (), generator=generator))
                spec["student_hidden"] = [int(2 ** torch.randint(3, 7, (), generator=generator)) for _ in range(depth)]
        return out


MLP_TASKS = [
    {"task": "mlp", "dataset": "digits", "hidden": [32], "batch_size": 64},
    {"task": "mlp", "dataset": "mnist1d", "hidden": [32, 32], "batch_size": 64},
    {"task": "teacher_student", "in_dim": 16, "out_dim": 4, "teacher_hidden": [32, 32], "student_hidden": "random",
     "batch_size": 64},
]

# Deeper than the training tasks above and narrower than the held-out suite's (lopt.meta.evaluate: 6-7 layers of
# 256-512): on the CPU, a family of 4 x 64 in the mix improved the shipped weights on 3-6 layer stacks of 64-256
# where longer unrolls alone made them worse (docs/meta_training.md §7).
DEEP_MLP_TASKS = [
    {"task": "mlp", "dataset": "mnist1d", "hidden": [64, 64, 64, 64], "batch_size": 64},
    {"task": "mlp", "dataset": "digits", "hidden": [128, 128, 128], "batch_size": 64},
]

PRESETS = {
    "mulo": MetaTrainConfig(
        preset="mulo", estimator="pes", tasks=copy.deepcopy(MLP_TASKS), num_tasks=8, std=0.01, truncation=50,
        min_unroll=100, max_unroll=1000, outer_steps=5000, lr=3e-3, final_lr=1e-3, warmup_steps=100,
        schedule="cosine", grad_clip=1.0, validate_every=500, validation_tasks=4),
    "celo": MetaTrainConfig(
        preset="celo", estimator="pes",
        tasks=[{"task": "mlp", "dataset": "digits", "hidden": [32], "batch_size": 64, "rescale": [1e-3, 1e3]},
               {"task": "mlp", "dataset": "mnist1d", "hidden": [32], "batch_size": 64, "rescale": [1e-3, 1e3]}],
        num_tasks=8, std=0.01, truncation=50, min_unroll=100, max_unroll=2000, outer_steps=5000, lr=3e-4,
        final_lr=3e-4, warmup_steps=0, schedule="constant", grad_clip=1.0, validate_every=500, validation_tasks=4),
    "deep": MetaTrainConfig(
        preset="deep", estimator="pes", init="lopt-small_fc-tiny",
        tasks=copy.deepcopy(MLP_TASKS) + copy.deepcopy(DEEP_MLP_TASKS), num_tasks=32, std=0.01, truncation=50,
        min_unroll=100, max_unroll=5000, curriculum_from=1000, curriculum_steps=1500, outer_steps=3000, lr=3e-4,
        final_lr=3e-4, warmup_steps=0, schedule="constant", grad_clip=1.0, validate_every=500, validation_tasks=4,
        patience=3),
    "digits-cpu": MetaTrainConfig(
        preset="digits-cpu", estimator="pes", tasks=[{"task": "mlp", "dataset": "digits", "hidden": [32], "batch_size": 64}],
        num_tasks=4, std=0.01, truncation=20, min_unroll=50, max_unroll=200, outer_steps=300, lr=1e-2, final_lr=1e-2,
        warmup_steps=0, schedule="constant", grad_clip=None, validate_every=50, validation_tasks=4,
        validation_steps=200, checkpoint_minutes=1.0),
    "smoke": MetaTrainConfig(
        preset="smoke", estimator="pes",
        tasks=[{"task": "logreg", "dim": 8, "classes": 3, "separation": 3.0, "batch_size": 32}],
        num_tasks=4, std=0.01, truncation=10, min_unroll=20, max_unroll=60, outer_steps=40, lr=1e-2, final_lr=1e-2,
        warmup_steps=0, schedule="constant", grad_clip=None, validate_every=20, validation_tasks=4,
        validation_steps=40, checkpoint_minutes=1.0),
}


def preset(name: str, **overrides) -> MetaTrainConfig:
    """A copy of a named preset with ``overrides`` applied (None values ignored)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    config = copy.deepcopy(PRESETS[name])
    for key, value in overrides.items():
        if value is None:
            continue
        if not hasattr(config, key):
            raise ValueError(f"unknown meta-training option {key!r}")
        setattr(config, key, value)
    return config
