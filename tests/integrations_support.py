"""Shared by the framework recipe tests (tests/test_integrations_*.py): a tiny regression task, a VeLO
that records the losses handed to it, and the hand-written training loop every framework's result
is compared with."""

from __future__ import annotations

import contextlib
import copy
import types

import torch

import lopt
from lopt import registry

SMALL_FC_WEIGHTS = lopt.random_weights("small_fc_lopt", seed=11)
VELO_WEIGHTS = lopt.random_weights("velo", seed=12)
CELO2_WEIGHTS = lopt.random_weights("celo2", seed=13)
IN_FEATURES = 5


def make_data(num_samples: int, seed: int = 0):
    """Random regression data (inputs, targets), float32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, IN_FEATURES, generator=g)
    y = torch.randn(num_samples, 1, generator=g)
    return x, y


def make_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def mse(prediction, target):
    return torch.nn.functional.mse_loss(prediction.float(), target)


def record_losses(velo: lopt.VeLO) -> lopt.VeLO:
    """Make ``velo`` record what the training loop hands it (on the instance, so that its class and
    state dicts stay VeLO's): ``velo.fed[t]`` lists the (float64) losses given to ``accumulate_loss``
    before step ``t``; ``velo.explicit[t]`` the loss given to ``step`` itself (None if none)."""
    velo.fed, velo.explicit, pending = [], [], []
    accumulate_loss, step = velo.accumulate_loss, velo.step

    def recording_accumulate_loss(self, loss):
        pending.append(float(torch.as_tensor(loss).double()))
        accumulate_loss(loss)

    def recording_step(self, loss=None, *, closure=None):
        result = step(loss, closure=closure)
        velo.fed.append(list(pending))
        velo.explicit.append(None if loss is None or callable(loss) else float(torch.as_tensor(loss).double()))
        pending.clear()
        return result

    # Bound methods, as torch's LR schedulers expect of optimizer.step.
    velo.accumulate_loss = types.MethodType(recording_accumulate_loss, velo)
    velo.step = types.MethodType(recording_step, velo)
    return velo


def make_optimizer(name: str, params, num_steps: int | None = None, **kwargs):
    kwargs.setdefault("backend", "naive")
    if name == "velo":
        return record_losses(lopt.VeLO(params, num_steps=num_steps, weights=VELO_WEIGHTS, **kwargs))
    if name == "small_fc_lopt":
        return lopt.SmallFCLOpt(params, weights=SMALL_FC_WEIGHTS, **kwargs)
    entry = registry.get(name)  # (any other registered optimizer, with its required arguments)
    return entry.build(params, weights=lopt.random_weights(entry.architecture, seed=2), **kwargs)


def reference_training(model, steps, make_opt, *, autocast_dtype=None, scaler=None, lr_factors=None,
                       gradient_divisor=None, clip_norm=None, grad_norms=None):
    """The hand-written loop: for each step, back-propagate every micro-batch's loss divided by the
    step's number of micro-batches (or by ``gradient_divisor``: Lightning divides by
    accumulate_grad_batches even in an epoch's last, shorter step), then step; VeLO gets the float64
    mean of the micro-batch losses.

    ``steps`` lists each step's micro-batches ``(x, y)``. ``lr_factors[t]`` (optional) multiplies every
    group's initial lr at step ``t`` (a schedule). ``clip_norm``: clip the gradients' total norm before
    each step (after ``scaler.unscale_``, the documented GradScaler recipe); ``grad_norms`` (a list)
    receives each step's norm before clipping. Returns (model, optimizer, per-step micro-batch losses).
    """
    model = copy.deepcopy(model)
    opt = make_opt(model)
    initial_lrs = [group["lr"] for group in opt.param_groups]
    losses_per_step = []
    for t, micro_batches in enumerate(steps):
        if lr_factors is not None:
            for group, lr in zip(opt.param_groups, initial_lrs):
                group["lr"] = lr * lr_factors[t]
        opt.zero_grad()
        losses = []
        for x, y in micro_batches:
            autocast = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
                        else contextlib.nullcontext())
            with autocast:
                loss = mse(model(x), y)
            divided = loss / (gradient_divisor or len(micro_batches))
            (scaler.scale(divided) if scaler is not None else divided).backward()
            losses.append(float(loss.detach().double()))
        losses_per_step.append(losses)
        if clip_norm is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            if grad_norms is not None:
                grad_norms.append(float(norm))
        args = (sum(losses) / len(losses),) if opt.requires_loss else ()
        if scaler is not None:
            scaler.step(opt, *args)
            scaler.update()
        else:
            opt.step(*args)
    return model, opt, losses_per_step


def assert_same_parameters(actual: torch.nn.Module, expected: torch.nn.Module, *, rtol=0.0, atol=0.0):
    actual_params = dict(actual.named_parameters())
    expected_params = dict(expected.named_parameters())
    assert list(actual_params) == list(expected_params)
    for name, p in actual_params.items():
        torch.testing.assert_close(p.detach(), expected_params[name].detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"parameter {name}: {m}")


def assert_fed_means(velo, losses_per_step, *, rtol=1e-6):
    """Every step's loss, as VeLO formed it (mean of what was fed), equals the mean of that step's
    micro-batch losses computed independently (float64)."""
    assert len(velo.fed) == len(losses_per_step), (len(velo.fed), len(losses_per_step))
    for t, (fed, losses) in enumerate(zip(velo.fed, losses_per_step)):
        assert velo.explicit[t] is None, f"step {t} got an explicit loss as well"
        assert len(fed) == len(losses), f"step {t}: {len(fed)} losses fed for {len(losses)} micro-batches"
        expected = sum(losses) / len(losses)
        assert abs(sum(fed) / len(fed) - expected) <= rtol * abs(expected), (t, fed, losses)
