"""torch.compile(opt.step): after a warm-up, a scheduler-driven run never recompiles, and the compiled
step computes what the eager step computes (naive backend, CPU).

The learning rate is a 0-d tensor (``lr=torch.tensor(...)``): schedulers update it in place, so
dynamo sees the same tensor every step. The warm-up may compile several times (the step counter
becomes a dynamic int on its first change; each parameter shape has its own graphs); after it,
``torch._dynamo.config.error_on_recompile`` turns any recompilation into an error. Runtime: about a
minute in all on one CPU core with a cold inductor cache (its C++ compilation dominates).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

import lopt
from integrations_support import SMALL_FC_WEIGHTS, VELO_WEIGHTS

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

WARM_UP_STEPS = 3
CHECKED_STEPS = 10
TOTAL_STEPS = WARM_UP_STEPS + CHECKED_STEPS


def make_optimizer(name, params):
    if name == "small_fc_lopt":
        return lopt.SmallFCLOpt(params, lr=torch.tensor(0.8), weight_decay=torch.tensor(0.01),
                                weights=SMALL_FC_WEIGHTS, backend="naive")
    return lopt.VeLO(params, num_steps=TOTAL_STEPS, lr=torch.tensor(1.0), weights=VELO_WEIGHTS, backend="naive")


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


@pytest.mark.parametrize("name", ["small_fc_lopt", "velo"])
def test_compiled_step_of_several_tensors_breaks_the_graph_once_and_compiles_nothing_per_tensor(name):
    """Four tensors of two ranks. The compiled step has one graph break, the check's host read (the naive
    backend decides on the host whether a step is skipped, as the eager step does; nothing else is read), and
    no function is compiled per tensor: SumPacket.add was, once per call, up to dynamo's recompile limit of 8,
    when dynamo gave up on the frames around the read. Here a limit of 3 fails the test if anything nears it."""
    from torch._dynamo.utils import counters

    def run(compiled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        x, y = torch.randn(5, 8, 6), torch.randn(5, 8, 3)
        opt = make_optimizer(name, model.parameters())
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        torch._dynamo.reset()
        counters.clear()
        with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
            for t in range(5):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x[t]), y[t])
                loss.backward()
                with torch._dynamo.config.patch(error_on_recompile=compiled and t >= WARM_UP_STEPS):
                    step(loss.detach()) if name == "velo" else step()
        return [p.detach().clone() for p in model.parameters()], dict(counters["graph_break"])

    compiled, breaks = run(compiled=True)
    assert len(breaks) == 1 and "tolist" in next(iter(breaks)), breaks  # one reason: the host read
    eager, _ = run(compiled=False)
    for a, e in zip(compiled, eager):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)
