"""Recipes without glue (docs/integrations.md): accelerate, and plain loops with torch.amp.GradScaler
and gradient accumulation, on CPU. Each is compared with the hand-written loop of integrations_support."""

from __future__ import annotations

import pytest
import torch

import lopt
from lopt import registry
from integrations_support import (
    VELO_WEIGHTS, assert_fed_means, assert_same_parameters, make_data, make_net, make_optimizer, mse,
    reference_training)

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

BATCH = 4
ACCUMULATION = 2


def micro_batches(num_samples=16):
    x, y = make_data(num_samples, seed=9)
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, num_samples, BATCH)]


def grouped(batches, accumulation=ACCUMULATION):
    return [batches[i:i + accumulation] for i in range(0, len(batches), accumulation)]


@pytest.mark.parametrize("name", registry.names())
def test_accelerate_with_gradient_accumulation(name):
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[test]')")
    batches = micro_batches()
    model = make_net(seed=4)
    initial = make_net(seed=4)
    opt = make_optimizer(name, model.parameters(), num_steps=len(batches) // ACCUMULATION)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    prepared_model, prepared_opt = accelerator.prepare(model, opt)
    losses = []
    for x, y in batches:
        with accelerator.accumulate(prepared_model):
            loss = mse(prepared_model(x), y)
            accelerator.backward(loss)  # (divides by gradient_accumulation_steps itself)
            if name == "velo":
                opt.accumulate_loss(loss.detach())  # the undivided micro-batch loss
            prepared_opt.step()  # steps only on the accumulation boundary
            prepared_opt.zero_grad()
        losses.append(float(loss.detach().double()))

    steps = grouped(batches)
    expected, _, _ = reference_training(
        initial, steps, lambda m: make_optimizer(name, m.parameters(), num_steps=len(steps)))
    assert_same_parameters(model, expected, rtol=1e-6, atol=1e-8)
    if name == "velo":
        assert_fed_means(opt, grouped(losses))


def test_accelerate_prepares_a_velo_subclass():
    """accelerate's prepare() moves optimizer state with a state_dict round trip through load_state_dict."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[test]')")

    class LoggingVeLO(lopt.VeLO):
        pass

    model = make_net(seed=4)
    opt = LoggingVeLO(model.parameters(), num_steps=4, weights=VELO_WEIGHTS, backend="naive")
    prepared = accelerate.Accelerator(cpu=True).prepare(opt)
    assert prepared.optimizer is opt


@pytest.mark.parametrize("name", registry.names())
def test_plain_loop_with_grad_scaler_fp16_autocast_and_accumulation(name):
    """The loop of docs/integrations.md: scaler.scale(loss / k).backward() per micro-batch, VeLO fed with
    accumulate_loss, scaler.step(opt) — against the same loop where VeLO gets the mean loss in step()."""
    batches = micro_batches()
    steps = grouped(batches)
    model = make_net(seed=4)
    initial = make_net(seed=4)
    opt = make_optimizer(name, model.parameters(), num_steps=len(steps))
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for step_batches in steps:
        for x, y in step_batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse(model(x), y)
            scaler.scale(loss / len(step_batches)).backward()
            if name == "velo":
                opt.accumulate_loss(loss.detach())
            losses.append(float(loss.detach().double()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    expected, _, _ = reference_training(
        initial, steps, lambda m: make_optimizer(name, m.parameters(), num_steps=len(steps)),
        autocast_dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"))
    assert_same_parameters(model, expected, rtol=1e-6, atol=1e-8)
    if name == "velo":
        assert_fed_means(opt, grouped(losses))


def test_grad_scaler_overflow_skips_the_step_and_drops_its_losses():
    """A step whose gradients overflow changes nothing, and the losses handed over for it are consumed:
    the run equals the hand-written loop that never saw that step's micro-batches."""
    steps = grouped(micro_batches(num_samples=32))
    model = make_net(seed=4)
    initial = make_net(seed=4)
    opt = make_optimizer("velo", model.parameters(), num_steps=len(steps))
    scaler = torch.amp.GradScaler("cpu")
    for t, step_batches in enumerate(steps):
        for x, y in step_batches:
            loss = mse(model(x), y)
            scaler.scale(loss / len(step_batches)).backward()
            opt.accumulate_loss(loss.detach())
        if t == 0:
            model[0].weight.grad[0, 0] = float("inf")  # an fp16-style overflow
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if t == 0:
            assert scaler.get_scale() == scale / 2  # the scaler saw the overflow and backed off
            assert opt.param_groups[0]["step"] == 0 and int(opt.param_groups[0]["loss_count"]) == 0
    assert [len(fed) for fed in opt.fed] == [2, 2, 2, 2]

    expected, _, _ = reference_training(
        initial, steps[1:], lambda m: make_optimizer("velo", m.parameters(), num_steps=len(steps)))
    assert_same_parameters(model, expected, rtol=1e-6, atol=1e-8)
