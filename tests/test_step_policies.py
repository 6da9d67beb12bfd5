"""What every lopt optimizer does around the math (naive backend, CPU): the non-finite policy, AMP's
GradScaler contract, VeLO's ways of receiving the loss, copies and pickles, foreign state dicts,
zero-element parameters, tensor learning rates."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import lopt
from lopt import registry
import spec_small_fc_lopt as spec

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

SMALL_FC_WEIGHTS = lopt.random_weights("small_fc_lopt", seed=2)
VELO_WEIGHTS = lopt.random_weights("velo", seed=3)
SHAPES = [(6, 5), (7,), (), (2, 3, 4)]
OPTIMIZERS = registry.names()


def make(name, params, **kwargs):
    kwargs.setdefault("backend", "naive")
    if name == "velo":
        return lopt.VeLO(params, num_steps=50, weights=VELO_WEIGHTS, **kwargs)
    if name == "small_fc_lopt":
        return lopt.SmallFCLOpt(params, weights=SMALL_FC_WEIGHTS, **kwargs)
    entry = registry.get(name)  # (any other registered optimizer, with its required arguments)
    return entry.build(params, weights=lopt.random_weights(entry.architecture, seed=2), **kwargs)


def make_params(seed, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.3) for s in shapes]


def random_grads(seed, shapes=SHAPES, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in shapes]


def do_step(opt, loss=1.0):
    return opt.step(loss) if opt.requires_loss else opt.step()


def train(name, params, steps, *, seed=0, opt=None, loss_of=lambda step: 2.0 - 0.1 * step, **kwargs):
    opt = opt or make(name, params, **kwargs)
    for step in range(steps):
        for p, g in zip(params, random_grads(seed + step)):
            p.grad = g
        do_step(opt, loss_of(step))
    return opt


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_same(params_a, params_b):
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))


def assert_state_unchanged(opt, params, before):
    before_params, before_state = before
    assert_same(params, before_params)
    after = opt.state_dict()
    for group_after, group_before in zip(after["param_groups"], before_state["param_groups"]):
        for key, value in group_before.items():
            if key == "skipped_steps":
                continue
            assert (torch.equal(group_after[key], value) if torch.is_tensor(value) else group_after[key] == value), key
    for index, values in before_state["state"].items():
        for key, value in values.items():
            assert torch.equal(after["state"][index][key], value), (index, key)


# ------------------------------------------------------------------------------------ non-finite gradients


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("bad, described", [(float("nan"), "NaN"), (float("inf"), "an infinite value"),
                                            (-2.0**64, "a value of magnitude 1.84e\\+19, whose square overflows float32")])
def test_one_bad_gradient_element_skips_the_whole_step(name, bad, described):
    """Default policy: the step changes nothing (parameters, state, counters), is counted, warned about,
    and training continues exactly as if that step had not happened."""
    params, twins = make_params(1), make_params(1)
    opt = train(name, params, 2)
    twin_opt = train(name, twins, 2)
    grads = random_grads(50)
    grads[3][1, 2, 0] = bad  # one element of parameter #3
    for p, g in zip(params, grads):
        p.grad = g
    before = snapshot(opt, params)
    with pytest.warns(RuntimeWarning, match=rf"step skipped because the gradient of parameter #3 \(shape \(2, 3, 4\)\) "
                                            rf"holds {described}.*1 skipped so far"):
        do_step(opt)
    assert_state_unchanged(opt, params, before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.skipped_steps == 1  # (already warned about at the step: no second warning)
    train(name, params, 3, seed=100, opt=opt)
    train(name, twins, 3, seed=100, opt=twin_opt)
    assert_same(params, twins)
    assert opt.state_dict()["param_groups"][0]["skipped_steps"] == 1


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_nonfinite_raise_names_the_parameter_and_changes_nothing(name):
    params = make_params(2)
    opt = train(name, params, 1, nonfinite="raise")
    grads = random_grads(7)
    grads[1][3] = float("nan")
    for p, g in zip(params, grads):
        p.grad = g
    before = snapshot(opt, params)
    with pytest.raises(lopt.NonFiniteGradientError, match=r"step: the gradient of parameter #1 \(shape \(7,\)\) holds "
                                                          r"NaN; nothing was changed \(nonfinite='raise'\)"):
        do_step(opt)
    assert_state_unchanged(opt, params, before)


def test_large_finite_gradients_are_stepped_exactly():
    """Gradients up to just below 2^64 (whose squares fill float32's range) give the float64
    definition's update: no sum, mean or feature overflows (AdamW stays finite there too)."""
    shapes = [(40, 30), (25,)]
    params = make_params(3, shapes)
    opt = make("small_fc_lopt", params)
    g = torch.Generator().manual_seed(4)
    for step, magnitude in enumerate([1e19, 1e15, 1.8e19]):
        grads = [(torch.rand(s, generator=g) * 2 - 1) * magnitude for s in shapes]  # |g| < 2^64
        expected = []
        for p, grad in zip(params, grads):
            state = spec.from_pylo_state(opt.state[p], p.shape) if opt.state[p] else spec.new_state(p.shape)
            expected.append(spec.step(p.detach(), grad, state, step + 1, SMALL_FC_WEIGHTS.tensors["mlp"]))
            p.grad = grad
        before = [p.detach().double().clone() for p in params]
        opt.step()
        for p, b, want in zip(params, before, expected):
            assert torch.isfinite(p).all()
            assert all(torch.isfinite(v).all() for v in opt.state[p].values())
            update = p.detach().double() - b
            error = (update - (want["p"] - b)).norm() / (want["p"] - b).norm()
            assert error < 1e-4, (step, tuple(p.shape), float(error))
    assert opt.skipped_steps == 0


# ------------------------------------------------------------------------------------ AMP


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_grad_scaler_steps_like_an_unscaled_run_and_skips_overflows(name):
    """GradScaler hands its scale and overflow flag to the step (as to fused AdamW): the result is the
    unscaled run's, and an overflowing step changes nothing (and is not counted as a skipped step)."""
    params, twins = make_params(5), make_params(5)
    opt, twin_opt = make(name, params), make(name, twins)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1)
    assert type(opt)._step_supports_amp_scaling is True
    for step in range(4):
        grads = random_grads(20 + step)
        overflow = step == 2
        for p, t, grad in zip(params, twins, grads):
            p.grad = grad * scaler.get_scale()  # (a power of two: exact)
            t.grad = grad.clone()
        if overflow:
            params[0].grad[0, 0] = float("inf")
            before = snapshot(opt, params)
        loss = torch.tensor(1.5 - 0.1 * step)
        scaler.scale(loss)  # (what backward would have scaled; it also starts the scaler)
        scaler.step(opt, loss) if opt.requires_loss else scaler.step(opt)
        scaler.update()
        if overflow:
            assert_state_unchanged(opt, params, before)
            continue
        do_step(twin_opt, loss)
    assert_same(params, twins)
    assert opt.skipped_steps == 0 and scaler.get_scale() < 2.0**12 * 2**4  # the overflow lowered the scale


# ------------------------------------------------------------------------------------ VeLO's loss


def test_velo_accumulated_losses_are_averaged_and_consumed():
    params, twins = make_params(8), make_params(8)
    opt, twin_opt = make("velo", params), make("velo", twins)
    micro_losses = [[1.2, 0.8, 1.0], [0.9, 0.7]]
    for step, losses in enumerate(micro_losses):
        for p, t, g in zip(params, twins, random_grads(30 + step)):
            p.grad, t.grad = g, g.clone()
        for loss in losses:
            opt.accumulate_loss(torch.tensor(loss))
        returned = opt.step()
        assert returned is None
        twin_opt.step(torch.tensor(losses, dtype=torch.float32).sum() / len(losses))
    assert_same(params, twins)
    with pytest.raises(TypeError, match=r"VeLO.step needs the training loss.*accumulate_loss"):
        opt.step()  # consumed: nothing is left for this step


def test_velo_explicit_loss_and_accumulated_losses_conflict():
    params = make_params(9)
    opt = make("velo", params)
    for p, g in zip(params, random_grads(1)):
        p.grad = g
    opt.accumulate_loss(1.0)
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"VeLO.step got a loss, but 1 loss\(es\) were handed over with "
                                         r"accumulate_loss\(\) since the last step"):
        opt.step(2.0)
    assert_state_unchanged(opt, params, before)


def test_velo_closure_by_keyword_and_accumulated_loss_take_precedence():
    """Lightning passes ``closure=``; when the closure hands its loss to accumulate_loss (a callback),
    the accumulated mean is used and the closure's return value only returned."""
    params, twins = make_params(10), make_params(10)
    opt, twin_opt = make("velo", params), make("velo", twins)
    grads = random_grads(11)

    def closure():
        assert torch.is_grad_enabled()
        for p, g in zip(params, grads):
            p.grad = g
        opt.accumulate_loss(torch.tensor(0.25))
        return torch.tensor(7.0)

    assert float(opt.step(closure=closure)) == 7.0
    for t, g in zip(twins, grads):
        t.grad = g.clone()
    twin_opt.step(0.25)
    assert_same(params, twins)
    with pytest.raises(TypeError, match="a loss or a closure, not both"):
        opt.step(1.0, closure=closure)


# ------------------------------------------------------------------------------------ copies, state dicts


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_step_exactly_like_the_original(name, how):
    params = make_params(12)
    opt = train(name, params, 3)
    clone = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    clone_params = [p for group in clone.param_groups for p in group["params"]]
    assert all(c is not p and torch.equal(c, p) for c, p in zip(clone_params, params))
    assert clone.backend == opt.backend and clone.meta_weights.source == opt.meta_weights.source
    train(name, params, 2, seed=40, opt=opt)
    train(name, clone_params, 2, seed=40, opt=clone)
    assert_same(clone_params, params)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_foreign_state_dicts_are_refused_and_change_nothing(name):
    params = make_params(13)
    opt = train(name, params, 2)
    others = {
        "torch.optim.Adam/AdamW": torch.optim.AdamW(make_params(13), lr=1e-3),
        "lopt.VeLO" if name == "small_fc_lopt" else "lopt.SmallFCLOpt":
            make("velo" if name == "small_fc_lopt" else "small_fc_lopt", make_params(13)),
    }
    before = snapshot(opt, params)
    for label, other in others.items():
        _step_foreign(other)
        with pytest.raises(ValueError, match=rf"this is a state dict of {label}, not of {type(opt).__name__}; "
                                             rf"nothing was changed"):
            opt.load_state_dict(other.state_dict())
        assert_state_unchanged(opt, params, before)
    saved = copy.deepcopy(opt.state_dict())  # (state_dict() shares the state's tensors)
    saved["state"][0]["mom"] = saved["state"][0]["mom"][:2]
    with pytest.raises(ValueError, match=r"parameter #0 has shape \(6, 5\) but its saved momentum has shape \(2, 5, 3\)"):
        opt.load_state_dict(saved)
    assert_state_unchanged(opt, params, before)


def _step_foreign(other):
    params = [p for g in other.param_groups for p in g["params"]]
    for p, g in zip(params, random_grads(14)):
        p.grad = g
    other.step(1.0) if getattr(other, "requires_loss", False) else other.step()


# ------------------------------------------------------------------------------------ edge parameters


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero_element_parameters_take_no_part(name):
    """nn.Linear(8, 0) has weight (0, 8) and bias (0,): no state change, and (VeLO) no LSTM row whose
    empty statistics would reach every tensor through the controller's max."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 0))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 8))
    twin[0].load_state_dict(model[0].state_dict())
    opt, twin_opt = make(name, model.parameters()), make(name, twin.parameters())
    for step in range(3):
        grads = random_grads(60 + step, [(8, 4), (8,)])
        model[0].weight.grad, model[0].bias.grad = grads
        model[1].weight.grad, model[1].bias.grad = torch.zeros(0, 8), torch.zeros(0)
        twin[0].weight.grad, twin[0].bias.grad = (g.clone() for g in grads)
        do_step(opt, 1.0 - 0.1 * step)
        do_step(twin_opt, 1.0 - 0.1 * step)
    assert torch.isfinite(model[0].weight).all()
    assert_same(model[0].parameters(), twin[0].parameters())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_tensor_lr_and_weight_decay_follow_a_scheduler(name):
    """lr and weight_decay as 0-d tensors (as torch's capturable optimizers take them): schedulers update
    them in place, and the steps equal those with the same values as Python numbers."""
    params, twins = make_params(15), make_params(15)
    opt = make(name, params, lr=torch.tensor(0.5), weight_decay=torch.tensor(0.01))
    twin_opt = make(name, twins, lr=0.5, weight_decay=0.01)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, twin_opt)]
    lr_tensor = opt.param_groups[0]["lr"]
    for step in range(3):
        for p, t, g in zip(params, twins, random_grads(70 + step)):
            p.grad, t.grad = g, g.clone()
        do_step(opt, 1.0)
        do_step(twin_opt, 1.0)
        for scheduler in schedulers:
            scheduler.step()
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == 0.5 * 0.5**3
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)
