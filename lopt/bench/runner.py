"""Runs a benchmark plan: every parameter set (or model) × optimizer × contender, then the yardstick ratios."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lopt import registry
from lopt import weights as weights_lib
from lopt.bench.contenders import (LEARNED_CONTENDERS, TIMING_NUM_STEPS, adamw_backend, availability,
                                   make_contender, muon_unavailable_reason, short_reason)
from lopt.bench.measure import (GRADIENT_SETS, IterationWorkload, StepWorkload, Unavailable, gradient_sets,
                                measure_contender, mlp_gmacs_per_s, warmup_steps)
from lopt.bench.models import build_model
from lopt.optimizers.celo2 import param_groups_for
from lopt.param_sets import build_parameters, embedding_flags, param_set_numel


@dataclass
class BenchPlan:
    mode: str  # "step" or "iteration"
    optimizers: list  # learned optimizer names
    param_sets: list  # parameter sets (step mode) or models (iteration mode)
    contenders: list  # selected contenders, in CONTENDERS order
    device: torch.device
    weights: dict  # optimizer name -> MetaWeights
    steps: int = 10
    warmup: int = 2
    dtype: torch.dtype = torch.float32  # step mode's parameter dtype
    same_grads: bool = False
    cooldown_ms: float = 0.0  # idle time before each timed step or iteration
    batch_size: int | None = None  # iteration mode (None: the model's default)
    seq_len: int | None = None
    show_progress: bool = True
    availability: dict = field(default_factory=dict)  # optimizer -> {contender: reason or None}


def resolve_bench_weights(optimizer_name: str, weights_arg, require_pretrained: bool, say=print):
    """The weights to benchmark with: ``weights_arg``, else the registered ones, else weights that ship with lopt
    for the architecture (they train offline, so ``--curves`` shows training), else random (timing only)."""
    entry = registry.get(optimizer_name)
    architecture = entry.architecture
    if weights_arg is not None:
        return weights_lib.load_weights(weights_arg, architecture)
    try:
        return weights_lib.load_weights(entry.default_weights, architecture)
    except weights_lib.WeightsError as err:
        if require_pretrained:
            raise
        reason = str(err).split(":")[0]
        shipped = weights_lib.shipped_weights(architecture)
        if shipped:
            say(f"pretrained weights unavailable ({reason}): using {shipped[0]!r}, lopt's own weights shipped with it")
            return weights_lib.load_weights(shipped[0], architecture)
        say(f"pretrained weights unavailable ({reason}): using untrained weights — timing only")
        return weights_lib.random_weights(architecture)


def make_progress_factory(enabled: bool):
    """``make(total, description)`` -> a tqdm bar on stderr, drawn only where stderr is a terminal (a log file or
    CI's pipe would get every redrawn frame), or none at all when progress bars are off."""
    from tqdm import tqdm

    def make(total: int, description: str):
        # (disable=None: tqdm's own test, off where its stream is not a terminal)
        return tqdm(total=total, desc=description, unit="step", leave=False, disable=None if enabled else True)

    return make


def probe_availability(plan: BenchPlan) -> dict:
    """``{optimizer: {contender: reason or None}}``, asked of each optimizer before any timing."""
    return {name: availability(name, plan.contenders, plan.weights[name], plan.device) for name in plan.optimizers}


def runnable(plan: BenchPlan) -> list:
    """The (optimizer, contender) pairs that will run; the yardsticks as ("adamw", "adamw"), ("muon", "muon")."""
    pairs = [("adamw", "adamw")] if "adamw" in plan.contenders else []
    if "muon" in plan.contenders and muon_unavailable_reason() is None:
        pairs.append(("muon", "muon"))
    for name in plan.optimizers:
        pairs += [(name, c) for c in LEARNED_CONTENDERS if plan.availability[name][c] is None]
    return pairs


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _step_workload(plan: BenchPlan, param_set: str):
    params = build_parameters(param_set, plan.device, plan.dtype)
    sets = gradient_sets(params, 1 if plan.same_grads else GRADIENT_SETS)
    return StepWorkload(params, sets, plan.device), params


def model_embedding_flags(module: torch.nn.Module, params) -> list:
    """Per parameter: whether ``lopt.param_groups_for(module)`` puts it in the ``is_embedding`` group."""
    routed = {id(p) for group in param_groups_for(module) if group.get("is_embedding") for p in group["params"]}
    return [id(p) in routed for p in params]


class _ModelCache:
    """One model per name for iteration mode, reset to its initial parameters before each contender."""

    def __init__(self, plan: BenchPlan):
        self.plan, self.name, self.model, self.initial, self.batch = plan, None, None, None, None

    def get(self, name: str):
        if name != self.name:
            self.model = self.initial = self.batch = None
            _free(self.plan.device)
            self.model = build_model(name, self.plan.device, batch_size=self.plan.batch_size, seq_len=self.plan.seq_len)
            self.initial = [p.detach().clone() for p in self.model.parameters()]
            self.batch = self.model.random_batch()
            self.name = name
        with torch.no_grad():
            for p, value in zip(self.model.parameters(), self.initial):
                p.copy_(value)
                p.grad = None
        return self.model


def run_benchmarks(plan: BenchPlan, say=print) -> tuple[list, list]:
    """Measure every runnable contender; (results, unavailable). ``plan.availability`` must be probed."""
    make_progress = make_progress_factory(plan.show_progress)
    results, unavailable = [], []
    models = _ModelCache(plan) if plan.mode == "iteration" else None
    for param_set in plan.param_sets:
        for name in plan.optimizers:
            for contender, reason in plan.availability[name].items():
                if reason is not None:
                    unavailable.append(Unavailable(name, contender, param_set, plan.mode, reason))
        if "muon" in plan.contenders and muon_unavailable_reason() is not None:
            unavailable.append(Unavailable("muon", "muon", param_set, plan.mode, muon_unavailable_reason()))
        for optimizer_name, contender_name in runnable(plan):
            if plan.mode == "iteration":
                model = models.get(param_set)
                workload, params = IterationWorkload(model, models.batch, plan.device), model.parameters()
                embeddings = model_embedding_flags(model.module, params)
            else:
                workload, params = _step_workload(plan, param_set)
                embeddings = embedding_flags(param_set)
            _free(plan.device)
            baseline = torch.cuda.memory_allocated(plan.device) if plan.device.type == "cuda" else None
            weights = plan.weights.get(optimizer_name)
            label = f"{optimizer_name} {contender_name} {param_set}" if optimizer_name != "adamw" else \
                f"adamw ({adamw_backend(plan.device)}) {param_set}"
            bar = make_progress(plan.steps + warmup_steps(contender_name, plan.warmup), label)
            try:
                contender = make_contender(optimizer_name, contender_name, params, weights, plan.device,
                                           embeddings=embeddings)
                result = measure_contender(workload, contender, weights=weights, param_set=param_set,
                                           mode=plan.mode, steps=plan.steps, warmup=plan.warmup,
                                           baseline_bytes=baseline, progress=bar, num_steps=TIMING_NUM_STEPS,
                                           cooldown_ms=plan.cooldown_ms)
            except Exception as err:
                if contender_name != "naive+compile":
                    raise
                # torch.compile can fail on a platform (no compiler, unsupported Python): report, go on.
                reason = f"failed under torch.compile: {type(err).__name__}: {short_reason(err)}"
                unavailable.append(Unavailable(optimizer_name, contender_name, param_set, plan.mode, reason))
                say(f"{label}: {reason}")
                continue
            finally:
                bar.close()
                contender = workload = params = None
                _free(plan.device)
            if plan.mode == "step":
                result.gmacs_per_s = mlp_gmacs_per_s(optimizer_name, param_set_numel(param_set), result.ms_per_step)
            results.append(result)
    add_overheads(results)
    return results, unavailable


def add_overheads(results: list) -> None:
    """``overhead_vs_adamw``: 100·(t / t_adamw − 1) against the AdamW row of the same parameter set and mode."""
    adamw = {(r.param_set, r.mode): r.ms_per_step for r in results if r.optimizer == "adamw"}
    for r in results:
        reference = adamw.get((r.param_set, r.mode))
        if reference:
            r.overhead_vs_adamw = 100.0 * (r.ms_per_step / reference - 1.0)
