"""torch.compile(opt.step): after a warm-up, a scheduler-driven run never recompiles, the compiled
step computes what the eager step computes, has no graph break, and skips a step with a non-finite
gradient or a bad tensor lr exactly as the eager step does, deciding on the device (naive backend, CPU).

The learning rate is a 0-d tensor (``lr=torch.tensor(...)``): schedulers update it in place, so
dynamo sees the same tensor every step. The warm-up may compile several times (the step counters
become device tensors in the first compiled step; each parameter shape has its own graphs); after
it, ``torch._dynamo.config.error_on_recompile`` turns any recompilation into an error. Runtime on
a 2-core CPU: about 75 s with a cold inductor cache (its C++ compilation dominates), 40 s with a warm
one; tests that need no inductor use dynamo's ``aot_eager`` backend (or ``eager``).
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import lopt
from integrations_support import SMALL_FC_WEIGHTS, VELO_WEIGHTS
from lopt import registry

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

WARM_UP_STEPS = 3
CHECKED_STEPS = 10
TOTAL_STEPS = WARM_UP_STEPS + CHECKED_STEPS


def make_optimizer(name, params, **options):
    if name == "small_fc_lopt":
        return lopt.SmallFCLOpt(params, lr=torch.tensor(0.8), weight_decay=torch.tensor(0.01),
                                weights=SMALL_FC_WEIGHTS, backend="naive", **options)
    if name == "velo":
        return lopt.VeLO(params, num_steps=TOTAL_STEPS, lr=torch.tensor(1.0), weights=VELO_WEIGHTS, backend="naive",
                         **options)
    entry = registry.get(name)  # (the other naive optimizers: their default lr, as a tensor; untrained weights)
    lr = inspect.signature(entry.front_end_class).parameters["lr"].default
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lopt.UntrainedWeightsWarning)
        return entry.build(params, lr=torch.tensor(lr), weights=lopt.random_weights(entry.architecture, seed=2),
                           backend="naive", **options)


def train(name, compiled, feed, dynamo_backend):
    """TOTAL_STEPS steps of a tiny regression with a cosine schedule; returns per-step parameters.

    ``feed``: how VeLO gets the loss — "accumulate" (``accumulate_loss`` before a bare step) or
    "step" (``step(loss)`` with the loss tensor).
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(TOTAL_STEPS, 16, 6, generator=g), torch.randn(TOTAL_STEPS, 16, 3, generator=g)
    opt = make_optimizer(name, model.parameters())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=TOTAL_STEPS)
    step = torch.compile(opt.step, backend=dynamo_backend) if compiled else opt.step
    torch._dynamo.reset()
    history = []
    for t in range(TOTAL_STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[t]), y[t])
        loss.backward()
        with torch._dynamo.config.patch(error_on_recompile=compiled and t >= WARM_UP_STEPS):
            if name == "small_fc_lopt":
                step()
            elif feed == "accumulate":
                opt.accumulate_loss(loss.detach())
                step()
            else:
                step(loss.detach())
        sched.step()
        history.append((float(opt.param_groups[0]["lr"]), [copy.deepcopy(p.detach()) for p in model.parameters()]))
    return history


def assert_same_history(compiled, eager):
    lrs = [lr for lr, _ in compiled]
    assert lrs == [lr for lr, _ in eager]
    for t, ((_, actual), (_, expected)) in enumerate(zip(compiled, eager)):
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7, msg=lambda m, t=t: f"step {t}: {m}")


def assert_schedule_moved(history):
    lrs = [lr for lr, _ in history]
    assert len(set(lrs)) == TOTAL_STEPS  # the schedule changed lr at every step
    assert not torch.equal(history[-1][1][0], history[0][1][0])  # (training moved the parameters)


def test_compiled_small_fc_lopt_step_follows_a_scheduler_without_recompiling():
    compiled = train("small_fc_lopt", compiled=True, feed=None, dynamo_backend="inductor")
    assert_schedule_moved(compiled)
    assert_same_history(compiled, train("small_fc_lopt", compiled=False, feed=None, dynamo_backend="inductor"))


@pytest.fixture(scope="module")
def velo_runs_with_accumulate_loss():
    """(compiled, eager) histories; building it fails with RecompileError if the compiled step recompiles."""
    return (train("velo", compiled=True, feed="accumulate", dynamo_backend="inductor"),
            train("velo", compiled=False, feed="accumulate", dynamo_backend="inductor"))


def test_compiled_velo_step_with_accumulate_loss_does_not_recompile_for_new_losses(velo_runs_with_accumulate_loss):
    compiled, _ = velo_runs_with_accumulate_loss
    assert_schedule_moved(compiled)


def test_compiled_velo_step_with_accumulate_loss_computes_what_the_eager_step_computes(velo_runs_with_accumulate_loss):
    compiled, eager = velo_runs_with_accumulate_loss
    assert_same_history(compiled, eager)


def test_compiled_velo_step_with_the_loss_tensor_does_not_recompile_for_new_losses():
    # (The guard is dynamo's, whatever the backend: aot_eager keeps this expected failure cheap.)
    train("velo", compiled=True, feed="step", dynamo_backend="aot_eager")


# ------------------------------------------------------------------ a model of several tensors, some steps skipped

# Each naive step of its own (ELO and MuLO step through SmallFCLOpt's _naive_step, with their own hooks).
NAIVE_STEPS = ["small_fc_lopt", "velo", "celo2", "elo_celo2"]
RUN_STEPS = 9
# Steps after the warm-up that the check must skip, and how each is spoiled.
SPOILED = {4: "a NaN gradient element", 6: "a NaN tensor lr", 7: "a negative tensor lr"}
BAD_LR = {"a NaN tensor lr": float("nan"), "a negative tensor lr": -0.5}


class Run:
    """One run of :func:`run_four_tensors`: after each step the parameters and the state dict (``history``);
    the RuntimeWarnings each step gave (``step_warnings``) and those reading ``skipped_steps`` at the end gave
    (``read_warnings``); dynamo's graph breaks so far after each step (``breaks``, reason: count); the
    NonFiniteGradientError that ended it, if one did."""

    def __init__(self):
        self.history, self.step_warnings, self.read_warnings, self.breaks, self.error = [], [], [], [], None


def run_four_tensors(name, compiled, steps=RUN_STEPS, spoiled=SPOILED, dynamo_backend="aot_eager", **options) -> Run:
    """Four tensors of two ranks; the steps in ``spoiled`` get a NaN in one gradient element or a NaN or
    negative tensor lr (set in place, as a scheduler would, and put back after the step). No recompile after
    the warm-up, and a recompile limit of 3 on every frame: nothing is compiled once per tensor
    (``SumPacket.add`` was, up to dynamo's limit of 8, when dynamo gave up on the frames around a host read)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x, y = torch.randn(steps, 8, 6), torch.randn(steps, 8, 3)
    opt = make_optimizer(name, model.parameters(), **options)
    lr = opt.param_groups[0]["lr"]
    good_lr = float(lr)
    # (fullgraph where the check decides on the device: dynamo would raise at any graph break)
    fullgraph = options.get("nonfinite", "skip") == "skip"
    step = torch.compile(opt.step, backend=dynamo_backend, fullgraph=fullgraph) if compiled else opt.step
    torch._dynamo.reset()
    counters.clear()
    run = Run()
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        for t in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[t]), y[t])
            loss.backward()
            how = spoiled.get(t)
            if how == "a NaN gradient element":
                model[0].weight.grad[1, 2] = float("nan")
            elif how is not None:
                lr.fill_(BAD_LR[how])
            with torch._dynamo.config.patch(error_on_recompile=compiled and t >= WARM_UP_STEPS):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        step(loss.detach()) if name == "velo" else step()
                    except lopt.NonFiniteGradientError as err:
                        run.error = err
            lr.fill_(good_lr)
            run.step_warnings.append([str(w.message) for w in caught if w.category is RuntimeWarning])
            run.history.append(([p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())))
            run.breaks.append(dict(counters["graph_break"]))
            if run.error is not None:
                break
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.skipped_steps
    run.read_warnings = [str(w.message) for w in caught if w.category is RuntimeWarning]
    return run


@pytest.fixture(scope="module")
def four_tensor_runs():
    """``runs(name)``: the (compiled, eager) runs of :func:`run_four_tensors`, each computed once."""
    cache = {}

    def runs(name):
        if name not in cache:
            cache[name] = run_four_tensors(name, compiled=True), run_four_tensors(name, compiled=False)
        return cache[name]

    return runs


def assert_step_skipped(history, t, counted=True):
    """Step ``t`` changed nothing, bit for bit (parameters, every state entry, the step counters and every
    other group entry but lr), and counted itself in skipped_steps (``counted``) or not."""
    (params_before, before), (params_after, after) = history[t - 1], history[t]
    assert all(torch.equal(a, b) for a, b in zip(params_after, params_before)), f"step {t} changed a parameter"
    assert after["state"].keys() == before["state"].keys()
    for index, values in before["state"].items():
        for key, value in values.items():
            assert torch.equal(after["state"][index][key], value), (t, index, key)
    for group_after, group_before in zip(after["param_groups"], before["param_groups"]):
        for key, value in group_before.items():
            if key in ("lr", "skipped_steps"):
                continue
            assert torch.equal(group_after[key], value) if torch.is_tensor(value) else group_after[key] == value, key
    assert after["param_groups"][0]["skipped_steps"] == before["param_groups"][0]["skipped_steps"] + counted


def assert_same_steps(compiled: Run, eager: Run):
    """Step by step: the same parameters (to rounding), the same step counters and skipped-steps counts."""
    for t, ((actual, saved), (expected, saved_eager)) in enumerate(zip(compiled.history, eager.history)):
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7, msg=lambda m, t=t: f"step {t}: {m}")
        for key in ("step", "skipped_steps"):
            assert ([group.get(key) for group in saved["param_groups"]]
                    == [group.get(key) for group in saved_eager["param_groups"]]), (t, key)


@pytest.mark.parametrize("name", NAIVE_STEPS)
def test_compiled_step_of_several_tensors_has_no_graph_break_and_compiles_nothing_per_tensor(name, four_tensor_runs):
    """The default policy (nonfinite="skip"): the check decides on the device whether a step is kept, so dynamo
    traces the whole step (nothing is read on the host), skipped steps included, and nothing recompiles after
    the warm-up or nears a recompile limit of 3 (run_four_tensors)."""
    compiled, eager = four_tensor_runs(name)
    assert compiled.breaks[-1] == {}
    assert_same_steps(compiled, eager)


@pytest.mark.parametrize("name", NAIVE_STEPS)
def test_a_compiled_step_with_a_non_finite_gradient_skips_as_the_eager_step_does(name, four_tensor_runs):
    """One NaN gradient element: parameters, state and step counters unchanged bit for bit, skipped_steps
    advanced, as in the eager run; the compiled step warns only when skipped_steps is read (as the fused
    backend, which counts on the device too), the eager one at the step."""
    compiled, eager = four_tensor_runs(name)
    t = next(t for t, how in SPOILED.items() if how == "a NaN gradient element")
    for run in (compiled, eager):
        assert_step_skipped(run.history, t)
    assert_same_steps(compiled, eager)
    assert compiled.step_warnings[t] == []
    assert re.search(r"step skipped because the gradient of parameter #0 \(shape \(5, 6\)\) holds NaN",
                     " ".join(eager.step_warnings[t]))
    assert [re.sub(r"^\w+: ", "", message) for message in compiled.read_warnings] == [
        f"{len(SPOILED)} step(s) were skipped since the last check because a gradient or the loss was not finite, "
        f"or a tensor hyper-parameter (lr, weight decay) was not a finite number >= 0 ({len(SPOILED)} in total)"]
    assert eager.read_warnings == []


@pytest.mark.parametrize("name", NAIVE_STEPS)
def test_a_compiled_step_with_a_nan_or_negative_tensor_lr_skips_as_the_eager_step_does(name, four_tensor_runs):
    """A tensor lr holding NaN or a negative value (the eager step skips it: tests/test_reliability.py): the
    compiled step skips it too, bit for bit, without recompiling (the lr is the same tensor, changed in place),
    and the next step with a good lr steps again."""
    compiled, eager = four_tensor_runs(name)
    for t, how in SPOILED.items():
        if how not in BAD_LR:
            continue
        for run in (compiled, eager):
            assert_step_skipped(run.history, t)
        assert compiled.step_warnings[t] == []
        assert re.search(rf"param group #0's lr is a tensor holding {BAD_LR[how]!r}", " ".join(eager.step_warnings[t]))
    last = max(SPOILED)
    assert last + 1 < RUN_STEPS and not torch.equal(compiled.history[last + 1][0][0], compiled.history[last][0][0])
    assert_same_steps(compiled, eager)


def test_compiled_step_with_nonfinite_raise_breaks_the_graph_once_and_raises():
    """nonfinite="raise" needs the decision on the host, to raise before anything changes: there the compiled
    step keeps the check's one host read (Tensor.tolist), its one graph break, and raises as the eager step
    (whose message, written on the host once the step fails, reads more). (Graph breaks are dynamo's: its
    "eager" backend suffices.)"""
    t = 4
    run = run_four_tensors("small_fc_lopt", compiled=True, steps=t + 1, spoiled={t: "a NaN gradient element"},
                           dynamo_backend="eager", nonfinite="raise")
    breaks = run.breaks[t - 1]
    assert len(breaks) == 1 and "tolist" in next(iter(breaks)), breaks
    assert re.search(r"the gradient of parameter #0 \(shape \(5, 6\)\) holds NaN; nothing was changed "
                     r"\(nonfinite='raise'\)", str(run.error))
    assert len(run.history) == t + 1
    assert_step_skipped(run.history, t, counted=False)
