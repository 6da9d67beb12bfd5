"""Issue #42, "Nothing lost, round two": the optimizer front-ends' handling of bad or unusual input
(naive backend, CPU). Every test here failed before its fix.

* a non-finite parameter or state element stays in its element (whole-tensor statistics leave it out);
* a tensor lr / weight decay is checked at every step: shape, dtype and device on the host before
  anything changes, its value (NaN, ±inf, negative) in the non-finite check;
* the optimizer's math is float32 inside ``torch.autocast``;
* VeLO refuses a horizon its float32 loss buffer cannot represent;
* state dicts are validated before anything changes (never-stepped foreign optimizers, every state
  entry's shape and dtype, step counters);
* expanded, meta-device and set-given parameters are refused at construction; named parameters work;
* group values changed after construction are re-checked at each step; a Python loss beyond float32
  follows the non-finite policy; accumulated losses survive a raised step;
* errors carry torch.optim's own wording; Adam-habit learning rates and silent VeLO traps warn.
"""

from __future__ import annotations

import copy
import math
import re
import warnings

import numpy as np
import pytest
import torch

import lopt
import spec_small_fc_lopt as spec
import spec_velo
from lopt.reference import velo as velo_reference

pytestmark = [pytest.mark.usefixtures("single_intra_op_thread"),
              pytest.mark.filterwarnings("ignore::lopt.UntrainedWeightsWarning")]

SMALL_FC_WEIGHTS = lopt.random_weights("small_fc_lopt", seed=2)
VELO_WEIGHTS = lopt.random_weights("velo", seed=3)
SHAPES = [(6, 5), (7,), (), (2, 3, 4)]
OPTIMIZERS = ["small_fc_lopt", "velo"]
NUM_STEPS = 50


def make(name, params, **kwargs):
    kwargs.setdefault("backend", "naive")
    if name == "velo":
        return lopt.VeLO(params, num_steps=kwargs.pop("num_steps", NUM_STEPS), weights=VELO_WEIGHTS, **kwargs)
    return lopt.SmallFCLOpt(params, weights=SMALL_FC_WEIGHTS, **kwargs)


def make_params(seed, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.3) for s in shapes]


def random_grads(seed, shapes=SHAPES, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in shapes]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def do_step(opt, loss=1.0):
    return opt.step(loss) if opt.requires_loss else opt.step()


def train(name, params, steps, *, seed=0, opt=None, **kwargs):
    opt = opt or make(name, params, **kwargs)
    for step in range(steps):
        set_grads(params, random_grads(seed + step, [tuple(p.shape) for p in params]))
        do_step(opt, 2.0 - 0.1 * step)
    return opt


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def same(a, b) -> bool:
    """Equal values, NaN where the other is NaN."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all()) \
        if a.is_floating_point() else torch.equal(a, b)


def assert_unchanged(opt, params, before):
    """Parameters, every state tensor and every param-group value (counters included) as before."""
    before_params, before_state = before
    assert all(same(p.detach(), b) for p, b in zip(params, before_params))
    after = opt.state_dict()
    assert len(after["param_groups"]) == len(before_state["param_groups"])
    for group_after, group_before in zip(after["param_groups"], before_state["param_groups"]):
        assert set(group_after) == set(group_before)
        for key, value in group_before.items():
            if key == "skipped_steps":
                continue  # (a skipped step counts itself; the tests check the count)
            assert (same(group_after[key], value) if torch.is_tensor(value) else group_after[key] == value), key
    assert set(after["state"]) == set(before_state["state"])
    for index, values in before_state["state"].items():
        assert set(after["state"][index]) == set(values)
        for key, value in values.items():
            assert same(after["state"][index][key], value), (index, key)


def torch_error(call):
    """The message torch.optim gives for the same mistake (the phrase lopt's message must contain)."""
    with pytest.raises(Exception) as info:
        call()
    return str(info.value)


# ------------------------------------------------------------------------ 1. non-finite parameters stay put


def finite(x):
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))


def small_fc_oracle_step(p, g, state, t, net, lr=1.0):
    """One small_fc_lopt step in float64 (docs/small_fc_lopt.md) whose normaliser leaves non-finite
    feature values out of the mean over the tensor (written from the spec's pieces, not lopt's)."""
    p, g = p.double(), g.double()
    spec.accumulate(state, g)
    raw = spec.features(g, p, state)
    flat = finite(raw).reshape(-1, raw.shape[-1])
    normed = raw / torch.sqrt(1e-5 + (flat * flat).mean(dim=0))
    x = torch.cat([normed, spec.time_features(t).expand(tuple(p.shape) + (11,))], dim=-1)
    direction, magnitude = spec.mlp(x, net)
    return p - lr * direction * torch.exp(spec.EXP_MULT * magnitude) * spec.STEP_MULT


@pytest.fixture
def finite_statistics_velo_spec(monkeypatch):
    """tests/spec_velo.py with every sum over a tensor's elements leaving out non-finite terms."""
    original_lstm_features = spec_velo.spec_lstm_features

    def lstm_features(p, m, v, t, num_steps, loss_feats, original_shape):
        return original_lstm_features(finite(p), m, v, t, num_steps, loss_feats, original_shape)

    def normalise(features):
        n = features[0].numel()
        return torch.stack([x / torch.sqrt(1e-5 + (finite(x) ** 2).sum() / n) for x in features])

    def new_param(p, direction, magnitude, lam, lr, weight_decay, exp_mult=0.001, step_mult=0.001):
        scale = math.sqrt(float((finite(p) ** 2).sum()) / p.numel() + 1e-9)
        return p - lr * (lam * scale * direction * torch.exp(exp_mult * magnitude) * step_mult)

    monkeypatch.setattr(spec_velo, "spec_lstm_features", lstm_features)
    monkeypatch.setattr(spec_velo, "spec_normalise", normalise)
    monkeypatch.setattr(spec_velo, "spec_new_param", new_param)
    return spec_velo


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_small_fc_a_non_finite_parameter_element_stays_in_its_element(bad):
    """An embedding row no batch touches holds one NaN (or inf): gradients and loss stay finite. AdamW
    damages that element only; so does small_fc_lopt (the per-feature normaliser leaves the element out of
    its tensor's mean), and every other element steps as the float64 definition says."""
    params = make_params(1)
    with torch.no_grad():
        params[0][2, 3] = bad
    opt = make("small_fc_lopt", params)
    states = [spec.new_state(tuple(p.shape) or (1,)) for p in params]
    for t in range(1, 4):
        grads = random_grads(10 + t)
        grads[0][2, :] = 0.0  # (the row no batch touches)
        expected = [small_fc_oracle_step(p.detach().reshape(g.shape or (1,)), g.reshape(g.shape or (1,)), state, t,
                                         SMALL_FC_WEIGHTS.tensors["mlp"]).reshape(g.shape)
                    for p, g, state in zip(params, grads, states)]
        before = [p.detach().double().clone() for p in params]
        set_grads(params, grads)
        opt.step()
        for p, b, want in zip(params, before, expected):
            keep = torch.isfinite(want)
            assert torch.equal(torch.isfinite(p), keep)  # the same elements finite: all but [2, 3] of tensor 0
            update, want_update = (p.detach().double() - b)[keep], (want - b)[keep]
            assert (update - want_update).norm() <= 1e-5 * want_update.norm() + 1e-7 * b[keep].norm()
    assert int((~torch.isfinite(params[0])).sum()) == 1 and not torch.isfinite(params[0][2, 3])
    assert all(torch.isfinite(p).all() for p in params[1:])
    assert all(torch.isfinite(v).all() for p in params for v in opt.state[p].values())
    assert opt.skipped_steps == 0


def test_velo_a_nan_parameter_element_stays_in_its_element(finite_statistics_velo_spec):
    """VeLO used to turn every tensor and its LSTM state NaN (mean p² feeds the LSTM input, whose max
    over tensors reaches all of them), then skip every step. Now the NaN stays in its element and the
    step follows the float64 definition whose sums leave non-finite terms out."""
    spec_v = finite_statistics_velo_spec
    params = make_params(2)
    with torch.no_grad():
        params[3][1, 0, 2] = float("nan")
    opt = make("velo", params)
    oracle = spec_v.SpecVeLO([dict(params=[p.detach().double().clone() for p in params], lr=1.0, weight_decay=0.0)],
                             num_steps=NUM_STEPS, weights=VELO_WEIGHTS.tensors)
    for step in range(4):
        grads = random_grads(20 + step)
        grads[3][1, 0, :] = 0.0
        loss = 2.0 - 0.1 * step
        before = [p.detach().double().clone() for p in params]
        oracle_before = [x.clone() for x in oracle.groups[0]["params"]]
        set_grads(params, grads)
        opt.step(loss)
        oracle.step(grads, spec_v.as_float32(loss))
        for p, b, after, ob in zip(params, before, oracle.groups[0]["params"], oracle_before):
            keep = torch.isfinite(after)
            assert torch.equal(torch.isfinite(p), keep)
            update, expected = (p.detach().double() - b)[keep], (after - ob)[keep]
            assert (update - expected).norm() <= 1e-4 * expected.norm() + 1e-7 * after[keep].norm(), step
    assert int(sum((~torch.isfinite(p)).sum() for p in params)) == 1 and torch.isnan(params[3][1, 0, 2])
    for p in params:
        assert all(torch.isfinite(v).all() for v in opt.state[p].values())  # LSTM rows included
    assert all(torch.isfinite(opt.param_groups[0][key]).all() for key in ("loss_means", "loss_running_min"))
    assert opt.skipped_steps == 0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_non_finite_state_entry_stays_in_the_elements_that_read_it(name):
    """A NaN momentum entry (state edited or loaded from outside) reaches only its own element."""
    params = make_params(3)
    opt = train(name, params, 2)
    opt.state[params[0]]["mom"][4, 1, 2] = float("nan")
    train(name, params, 3, seed=30, opt=opt)
    assert int((~torch.isfinite(params[0])).sum()) == 1 and not torch.isfinite(params[0][4, 1])
    assert all(torch.isfinite(p).all() for p in params[1:])
    for p in params:
        for key, value in opt.state[p].items():
            bad = int((~torch.isfinite(value)).sum())
            assert bad == (1 if (p is params[0] and key == "mom") else 0), key
    assert opt.skipped_steps == 0


def test_small_fc_a_non_finite_row_accumulator_stays_in_its_row():
    """A factored tensor's row accumulator entry R[j] is read by the elements of its row only; its mean
    over the rows (the row factor's normaliser) leaves it out."""
    params = make_params(4, [(6, 5)])
    opt = train("small_fc_lopt", params, 2)
    row = opt.state[params[0]]["fac_vec_row"]  # (5, 3): d0 is axis 0 (size 6), so R[j] feeds column j
    assert row.shape == (5, 3)
    row[3, 0] = float("nan")
    train("small_fc_lopt", params, 2, seed=40, opt=opt)
    assert torch.isfinite(params[0]).all(dim=0).tolist() == [True, True, True, False, True]
    assert not torch.isfinite(params[0][:, 3]).any()
    assert torch.isfinite(opt.state[params[0]]["fac_vec_col"]).all()


# ------------------------------------------------------------------------ 2. tensor lr and weight decay at step time


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("key", ["lr", "weight_decay"])
@pytest.mark.parametrize("bad, message", [
    (lambda: torch.full((4, 1), 0.5), r"is a tensor of shape \(4, 1\).*must be a 0-d floating-point tensor \(Tensor "
                                      r"{key} must be 1-element\)\. Nothing was changed"),
    (lambda: torch.tensor([0.5]), r"is a tensor of shape \(1,\)"),
    (lambda: torch.tensor(1, dtype=torch.int64), r"is a tensor of shape \(\) and dtype torch\.int64"),
])
def test_a_malformed_tensor_hyperparameter_is_refused_before_anything_changes(name, key, bad, message):
    """A (4, 1) lr used to crash after parameter 0 had been updated and the counter advanced."""
    params = make_params(5)
    opt = train(name, params, 2)
    opt.param_groups[0][key] = bad()
    set_grads(params, random_grads(51))
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=rf"{type(opt).__name__}\.step: param group {key} " + message.format(key=key)):
        do_step(opt)
    assert_unchanged(opt, params, before)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("key", ["lr", "weight_decay"])
@pytest.mark.parametrize("value", [float("nan"), -0.5, float("inf")])
def test_a_bad_tensor_hyperparameter_value_follows_the_nonfinite_policy(name, key, value):
    """A NaN tensor lr used to turn the model NaN with skipped_steps == 0, a negative one to step uphill
    (a float one is refused). Its value is checked in the non-finite check, without another host read."""
    params = make_params(6)
    opt = train(name, params, 2)
    opt.param_groups[0][key] = torch.tensor(value)
    set_grads(params, random_grads(61))
    before = snapshot(opt, params)
    described = re.escape(f"param group #0's {key} is a tensor holding {value!r} (it must be a finite number >= 0)")
    with pytest.warns(RuntimeWarning, match=rf"step skipped because {described}.*1 skipped so far"):
        do_step(opt)
    assert_unchanged(opt, params, before)
    assert opt.skipped_steps == 1
    opt.nonfinite = "raise"
    with pytest.raises(lopt.NonFiniteGradientError, match=rf"step: {described}; nothing was changed"):
        do_step(opt)
    assert_unchanged(opt, params, before)
    opt.param_groups[0][key] = torch.tensor(0.5 if key == "lr" else 0.01)
    do_step(opt)  # a good value steps again
    assert not torch.equal(params[0], before[0][0])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_second_group_with_a_bad_tensor_lr_skips_the_whole_step(name):
    params = make_params(7)
    opt = make(name, [{"params": params[:2]}, {"params": params[2:], "lr": torch.tensor(1.0)}])
    train(name, params, 1, opt=opt)
    opt.param_groups[1]["lr"].fill_(float("nan"))  # (in place, as a scheduler would)
    set_grads(params, random_grads(71))
    before = snapshot(opt, params)
    with pytest.warns(RuntimeWarning, match=r"param group #1's lr is a tensor holding nan"):
        do_step(opt)
    assert_unchanged(opt, params, before)


# ------------------------------------------------------------------------ 3. autocast


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_step_inside_autocast_computes_in_float32(name, dtype):
    """step() inside torch.autocast used to run the learned networks in bf16/fp16 (updates off by 2e-3 to
    1.5e-2). The math is float32 whatever the ambient autocast: bit-identical to a step outside it. A
    closure still runs the model under the caller's autocast."""
    params, twins = make_params(8), make_params(8)
    opt, twin_opt = make(name, params), make(name, twins)
    seen = []
    for step in range(3):
        grads = random_grads(80 + step)

        def closure():
            seen.append(torch.is_autocast_enabled("cpu"))
            set_grads(params, grads)
            return torch.tensor(2.0 - 0.1 * step)

        with torch.autocast("cpu", dtype=dtype):
            opt.step(closure)
        set_grads(twins, grads)
        twin_opt.step(closure=lambda: torch.tensor(2.0 - 0.1 * step))
    assert seen == [True, True, True]
    for p, t in zip(params, twins):
        assert torch.equal(p, t)


# ------------------------------------------------------------------------ 4. VeLO's horizon


def test_velo_max_num_steps_is_where_the_float32_loss_decay_reaches_one():
    """The slowest loss timescale is num_steps itself, and exp(-1/N) = 1 - 1/N + ... rounds to 1.0 in
    float32 once 1/N falls below half the spacing of float32 just below 1 (2^-25): N near 2^25. lopt's
    bound is that crossing as its own float32 chain (logspace, then exp) places it, to the unit: every decay
    is below 1 up to the bound, and one step beyond it the slowest timescale's correctly rounded decay is 1.
    (torch's float32 exp on the CPU is not correctly rounded everywhere: with AVX-512 kernels it gives the
    float just below 1 there, one ulp low, and reaches 1 a little later: the bound is then conservative.)"""
    limit = velo_reference.MAX_NUM_STEPS
    assert np.float32(math.exp(-1 / (2**25 * 1.001))) == 1 and np.float32(math.exp(-1 / (2**25 * 0.999))) < 1
    assert abs(limit - 2**25) <= 4
    assert (velo_reference.loss_buffer_decays(limit) < 1).all()
    assert all((velo_reference.loss_buffer_decays(n) < 1).all() for n in (1, 10, 150_000, 10**7, limit - 1))
    beyond = limit + 1
    slowest = velo_reference.loss_buffer_timescales(beyond)[-1].item()
    assert np.float32(math.exp(-1 / slowest)) == 1
    assert velo_reference.loss_buffer_decays(beyond)[-1].item() in (1.0, float(np.nextafter(np.float32(1), 0)))


def test_velo_refuses_a_horizon_its_loss_buffer_cannot_represent():
    """num_steps=4e7 used to turn everything NaN after one step, with only a warning implying it worked."""
    params = make_params(9)
    message = (r"num_steps=40000000 is longer than VeLO's loss buffer can represent: its slowest timescale's decay "
               r"exp\(-1/num_steps\) rounds to 1\.0 in float32 beyond num_steps=33554434.*gradient accumulation")
    with pytest.raises(ValueError, match=message):
        make("velo", params, num_steps=40_000_000)
    with pytest.warns(UserWarning, match=r"meta-trained on runs of up to 150000 steps"):
        opt = make("velo", params, num_steps=velo_reference.MAX_NUM_STEPS)
    train("velo", params, 3, opt=opt)
    assert opt.skipped_steps == 0
    assert all(torch.isfinite(p).all() for p in params)
    assert all(torch.isfinite(opt.param_groups[0][k]).all() for k in ("loss_means", "loss_running_min"))
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["num_steps"] = 40_000_000
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"VeLO\.load_state_dict: the saved num_steps=40000000 is longer"):
        opt.load_state_dict(saved)
    assert_unchanged(opt, params, before)
    opt.param_groups[0]["num_steps"] = 40_000_000  # changed by hand: refused at the step
    set_grads(params, random_grads(91))
    with pytest.raises(ValueError, match=r"VeLO\.step: the first param group's num_steps=40000000 is longer"):
        opt.step(1.0)


# ------------------------------------------------------------------------ 5, 6. state dicts


FOREIGN = {
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "torch.optim.Adam/AdamW", "betas"),
    "adam_amsgrad": (lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True), "torch.optim.Adam/AdamW", "amsgrad"),
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "torch.optim.SGD", "momentum"),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("foreign", list(FOREIGN))
def test_a_never_stepped_foreign_state_dict_is_refused_before_anything_changes(name, foreign):
    """A never-stepped AdamW or SGD has no per-parameter state: loading its state dict used to raise a bare
    KeyError after torch had replaced the param groups. Its groups tell it apart."""
    build, label, key = FOREIGN[foreign]
    params = make_params(10)
    opt = train(name, params, 2)
    other = build(make_params(10))
    assert other.state_dict()["state"] == {}
    before = snapshot(opt, params)
    groups_before = [dict(group) for group in opt.param_groups]
    with pytest.raises(ValueError, match=rf"load_state_dict: this is a state dict of {re.escape(label)}, not of "
                                         rf"{type(opt).__name__}: its param group #0 lacks \[.*'exp_mult'.*\] and "
                                         rf"has \[.*'{key}'.*\]; nothing was changed"):
        opt.load_state_dict(other.state_dict())
    assert_unchanged(opt, params, before)
    assert all(set(group) == set(was) for group, was in zip(opt.param_groups, groups_before))
    train(name, params, 1, opt=opt)  # still steps


def state_entry_cases(name):
    keys = ["mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v"]
    if name == "velo":
        keys += ["lstm_hidden", "lstm_cell"]
    return [(name, key) for key in keys]


@pytest.mark.parametrize("name, key", state_entry_cases("small_fc_lopt") + state_entry_cases("velo"))
def test_every_saved_state_entry_is_shape_and_dtype_checked(name, key):
    """Only the momentum used to be checked; a wrong rms, Adafactor or LSTM entry loaded and failed (or
    computed garbage) later. Parameter 0 is (6, 5): factored, so fac_vec_v is empty; parameter 1, (7,),
    has fac_vec_v and empty row/col vectors."""
    params = make_params(11)
    opt = train(name, params, 2)
    index = 1 if key == "fac_vec_v" else 0
    good = opt.state_dict()
    expected = tuple(good["state"][index][key].shape)
    label = "momentum" if key == "mom" else repr(key)
    before = snapshot(opt, params)
    wrong_shape = copy.deepcopy(good)
    value = wrong_shape["state"][index][key]
    wrong_shape["state"][index][key] = torch.zeros((expected[0] + 1,) + expected[1:]) if value.dim() else torch.zeros(2)
    with pytest.raises(ValueError, match=rf"parameter #{index} has shape {re.escape(str(tuple(params[index].shape)))} "
                                         rf"but its saved {re.escape(label)} has shape .* \(expected "
                                         rf"{re.escape(str(expected))}\); nothing was changed"):
        opt.load_state_dict(wrong_shape)
    assert_unchanged(opt, params, before)
    wrong_dtype = copy.deepcopy(good)
    wrong_dtype["state"][index][key] = torch.zeros(expected, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"the saved {re.escape(label)} of parameter #{index} is a tensor of dtype "
                                         rf"torch\.int32; it must be a floating-point tensor"):
        opt.load_state_dict(wrong_dtype)
    assert_unchanged(opt, params, before)
    opt.load_state_dict(copy.deepcopy(good))  # the good one still loads


@pytest.mark.parametrize("key, bad, message", [
    ("loss_means", torch.zeros(9), r"the saved 'loss_means' is a tensor of shape \(9,\)"),
    ("loss_running_min", torch.zeros(10, dtype=torch.int64), r"the saved 'loss_running_min' is a tensor of shape "
                                                             r"\(10,\) and dtype torch\.int64"),
    ("loss_count", torch.tensor([3]), r"the saved 'loss_count' is a tensor of shape \(1,\)"),
    ("loss_count", -2, r"the saved 'loss_count' is -2\.0; it must be an int >= 0"),
    ("loss_count", 2.5, r"the saved 'loss_count' is 2\.5"),
])
def test_velo_saved_loss_buffer_is_checked(key, bad, message):
    params = make_params(12)
    opt = train("velo", params, 2)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0][key] = bad
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"VeLO\.load_state_dict: " + message):
        opt.load_state_dict(saved)
    assert_unchanged(opt, params, before)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("bad", [-5, 2.5, "3", True, torch.tensor(-1), torch.tensor(2.5)])
def test_a_malformed_group_step_is_refused(name, bad):
    """A group step of -5, 2.5 or "3" used to be accepted, from a state dict or by a direct edit."""
    params = make_params(13)
    opt = train(name, params, 2)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["step"] = bad
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"load_state_dict: saved param group #0's step must be an int >= 0.*; "
                                         r"nothing was changed"):
        opt.load_state_dict(saved)
    assert_unchanged(opt, params, before)
    if torch.is_tensor(bad) and not bad.is_floating_point():
        return  # (a 0-d integer tensor is a device counter to the step: its value is not read on the host)
    opt.param_groups[0]["step"] = bad
    set_grads(params, random_grads(131))
    with pytest.raises(ValueError, match=rf"{type(opt).__name__}\.step: param group step is .*it must be an int >= 0"):
        do_step(opt)
    opt.param_groups[0]["step"] = 2
    assert_unchanged(opt, params, before)


# ------------------------------------------------------------------------ 7, 8, 9. parameters


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_expanded_parameters_are_refused_at_construction_and_in_add_param_group(name):
    """An expanded (stride-0) parameter used to fail half-way through a step."""
    expanded = torch.nn.Parameter(torch.randn(3).expand(4, 3))
    message = (r"parameter #1 \(shape \(4, 3\), strides \(0, 1\)\) is an expanded or overlapping view: more than one "
               r"element of it refers to a single memory location")
    assert "more than one element of the written-to tensor refers to a single memory location" in torch_error(
        lambda: expanded.detach().add_(1.0))  # (torch's own wording for writing into such a tensor)
    with pytest.raises(ValueError, match=message):
        make(name, [make_params(14)[0], expanded])
    params = make_params(14)
    opt = make(name, params)
    with pytest.raises(ValueError, match=r"parameter #4 \(shape \(4, 3\), strides \(0, 1\)\) is an expanded"):
        opt.add_param_group({"params": [expanded]})
    assert len(opt.param_groups) == 1
    # Views that do not overlap are fine: transposed, sliced, channels-last.
    fine = [torch.nn.Parameter(torch.randn(8, 6).t()), torch.nn.Parameter(torch.randn(8, 6)[::2, 1:]),
            torch.nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))]
    train(name, fine, 2, opt=make(name, fine))
    assert all(torch.isfinite(p).all() for p in fine)


def test_an_interleaved_non_overlapping_layout_is_accepted():
    """Strides (3, 2) on sizes (2, 2) address 0, 2, 3, 5: no overlap, though the strides do not nest."""
    storage = torch.randn(6)
    p = torch.nn.Parameter(storage.as_strided((2, 2), (3, 2)))
    make("small_fc_lopt", [p])
    q = torch.nn.Parameter(storage.as_strided((2, 2), (1, 1)))  # 0, 1, 1, 2: overlaps
    with pytest.raises(ValueError, match=r"is an expanded or overlapping view"):
        make("small_fc_lopt", [q])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_named_parameters_work_and_state_dicts_carry_their_names(name):
    """VeLO(model.named_parameters()) used to raise AttributeError. Named parameters step exactly like
    unnamed ones, torch's param_names are saved and restored, and parameter checks name them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    twin = copy.deepcopy(model)
    opt, twin_opt = make(name, model.named_parameters()), make(name, twin.parameters())
    shapes = [tuple(p.shape) for p in model.parameters()]
    for step in range(3):
        grads = random_grads(140 + step, shapes)
        set_grads(model.parameters(), grads)
        set_grads(twin.parameters(), grads)
        do_step(opt, 1.0 - 0.1 * step)
        do_step(twin_opt, 1.0 - 0.1 * step)
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), twin.parameters()))
    saved = opt.state_dict()
    assert saved["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    resumed_model = copy.deepcopy(model)
    resumed = make(name, resumed_model.named_parameters())
    resumed.load_state_dict(copy.deepcopy(saved))
    assert resumed.param_groups[0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    grads = random_grads(150, shapes)
    set_grads(model.parameters(), grads)
    set_grads(resumed_model.parameters(), grads)
    do_step(opt, 0.5)
    do_step(resumed, 0.5)
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), resumed_model.parameters()))
    double = torch.nn.Linear(2, 2).double()
    with pytest.raises(TypeError, match=r"parameter #0 \('weight'\) has dtype torch\.float64"):
        make(name, double.named_parameters())
    with pytest.raises(TypeError, match=r"parameter #4 \('extra'\) has dtype torch\.float64"):
        opt.add_param_group({"params": [("extra", torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)))]})


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_meta_device_parameters_are_refused(name):
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"parameter #0 \(shape \(2, 3\)\) is on the meta device: it has no data to "
                                         r"optimize\. Materialize the model first"):
        make(name, model.parameters())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_set_of_parameters_is_refused_with_torchs_message(name):
    params = make_params(15)
    phrase = torch_error(lambda: torch.optim.SGD([{"params": set(params)}], lr=0.1))
    assert "ordered collections" in phrase
    with pytest.raises(TypeError, match=re.escape(phrase)):
        make(name, set(params))
    with pytest.raises(TypeError, match=re.escape(phrase)):
        make(name, [{"params": set(params)}])
    opt = make(name, params[:2])
    with pytest.raises(TypeError, match=re.escape(phrase)):
        opt.add_param_group({"params": set(params[2:])})
    assert len(opt.param_groups) == 1


GROUP_EDITS = [
    ("exp_mult", float("nan"), r"exp_mult is nan \(param group #0\); it must be a finite number"),
    ("step_mult", float("inf"), r"step_mult is inf \(param group #0\); it must be a finite number"),
    ("step_mult", "0.01", r"step_mult is '0\.01' \(param group #0\); it must be a finite number"),
    ("momentum_decays", (0.1, 0.2), r"momentum_decays is \(0\.1, 0\.2\) \(param group #0\); it needs 3 finite"),
    ("rms_decays", [float("nan")], r"rms_decays is \[nan\] \(param group #0\); it needs 1 finite"),
    ("weight_decay", -0.1, r"weight_decay is -0\.1; it must be a finite number >= 0 \(or a 0-d tensor\) \(Invalid "
                           r"weight_decay value: -0\.1\)"),
]


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("key, value, message", GROUP_EDITS)
def test_group_values_changed_after_construction_are_rechecked_at_each_step(name, key, value, message):
    params = make_params(16)
    opt = train(name, params, 2)
    set_grads(params, random_grads(161))
    good = opt.param_groups[0][key]
    before = snapshot(opt, params)
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=rf"{type(opt).__name__}\.step: param group {message}.*Nothing was changed"):
        do_step(opt)
    opt.param_groups[0][key] = good
    assert_unchanged(opt, params, before)


def test_small_fc_max_grad_norm_changed_after_construction_is_rechecked():
    params = make_params(17)
    opt = train("small_fc_lopt", params, 1, max_grad_norm=1.0)
    for bad in (-1.0, 0.0, float("nan"), "1"):
        opt.param_groups[0]["max_grad_norm"] = bad
        set_grads(params, random_grads(171))
        before = [p.detach().clone() for p in params]
        with pytest.raises(ValueError, match=r"SmallFCLOpt\.step: param group max_grad_norm is .* it must be a finite "
                                             r"number > 0 or None\. Nothing was changed"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert opt.param_groups[0]["step"] == 1


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_list_of_decay_offsets_set_after_construction_steps_as_its_tuple(name):
    """Documented behaviour: a list of valid offsets is stored as the tuple it stands for (it used to fail
    half-way through the step, its decays cache needing a hashable key)."""
    params, twins = make_params(18), make_params(18)
    opt, twin_opt = train(name, params, 1), train(name, twins, 1)
    offsets = [0.05, -0.02, 0.01]
    opt.param_groups[0]["momentum_decays"] = list(offsets)
    twin_opt.param_groups[0]["momentum_decays"] = tuple(offsets)
    train(name, params, 2, seed=180, opt=opt)
    train(name, twins, 2, seed=180, opt=twin_opt)
    assert opt.param_groups[0]["momentum_decays"] == tuple(offsets)
    assert all(torch.equal(p, t) for p, t in zip(params, twins))


@pytest.mark.parametrize("loss", [1e39, -1e39, 3.5e38])
def test_velo_a_python_loss_beyond_float32_follows_the_nonfinite_policy(loss):
    """A Python float that overflows float32 used to raise a RuntimeError from a float32 conversion."""
    params = make_params(19)
    opt = train("velo", params, 2)
    set_grads(params, random_grads(191))
    before = snapshot(opt, params)
    with pytest.warns(RuntimeWarning, match=r"step skipped because the loss is not finite \(-?inf\)"):
        opt.step(loss)
    assert_unchanged(opt, params, before)
    opt.accumulate_loss(loss)
    with pytest.warns(RuntimeWarning, match=r"step skipped because the loss is not finite"):
        opt.step()
    assert_unchanged(opt, params, before)
    assert opt.skipped_steps == 2


def test_velo_a_python_loss_that_rounds_to_float32s_largest_value_is_stepped():
    """Just below the overflow threshold, a Python float rounds to float32's largest finite value: a step."""
    params = make_params(19)
    opt = train("velo", params, 2)
    set_grads(params, random_grads(192))
    before = [p.detach().clone() for p in params]
    opt.step(float(np.nextafter(2.0**128 - 2.0**103, 0)))
    assert opt.skipped_steps == 0 and opt.param_groups[0]["step"] == 3
    assert not torch.equal(params[0], before[0])


def test_velo_accumulated_losses_survive_a_raised_step():
    """nonfinite="raise" says "nothing was changed": the losses handed to accumulate_loss are kept too, so
    the retried step uses them (they used to be dropped, and the retry had no loss)."""
    params, twins = make_params(20), make_params(20)
    opt, twin_opt = train("velo", params, 1, nonfinite="raise"), train("velo", twins, 1)
    grads = random_grads(200)
    bad = [g.clone() for g in grads]
    bad[0][1, 1] = float("nan")
    for loss in (1.25, 0.75):
        opt.accumulate_loss(torch.tensor(loss))
    set_grads(params, bad)
    with pytest.raises(lopt.NonFiniteGradientError, match="nothing was changed"):
        opt.step()
    set_grads(params, grads)
    opt.step()  # the accumulated mean, 1.0
    set_grads(twins, grads)
    twin_opt.step(1.0)
    assert all(torch.equal(p, t) for p, t in zip(params, twins))
    with pytest.raises(TypeError, match=r"VeLO\.step needs the training loss"):
        opt.step()  # consumed by the step that ran


# ------------------------------------------------------------------------ 11. torch.optim's wording


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_errors_carry_torch_optims_wording(name):
    """Where torch.optim has a canonical message, lopt's includes its phrase (taken from torch itself)."""
    p = torch.nn.Parameter(torch.randn(3))
    cases = [
        (lambda: torch.optim.Adam(p), lambda: make(name, p), "params argument given to the optimizer should be an "
                                                                "iterable of Tensors or dicts"),
        (lambda: torch.optim.Adam([]), lambda: make(name, []), "optimizer got an empty parameter list"),
        (lambda: torch.optim.Adam([p], lr=torch.tensor([[0.1], [0.2]])),
         lambda: make(name, [p], lr=torch.tensor([[0.1], [0.2]])), "Tensor lr must be 1-element"),
        (lambda: torch.optim.Adam([p], lr=-1.0), lambda: make(name, [p], lr=-1.0), "Invalid learning rate: -1.0"),
        (lambda: torch.optim.AdamW([p], weight_decay=-1.0), lambda: make(name, [p], weight_decay=-1.0),
         "Invalid weight_decay value: -1.0"),
    ]
    for torch_call, lopt_call, phrase in cases:
        assert phrase in torch_error(torch_call)
        assert phrase in torch_error(lopt_call), phrase
    q = torch.nn.Parameter(torch.randn(2))
    opt = make(name, [p])
    two_groups = make(name, [{"params": [p]}, {"params": [q]}]).state_dict()
    phrase = "loaded state dict has a different number of parameter groups"
    assert phrase in torch_error(lambda: torch.optim.SGD([p], lr=0.1).load_state_dict(
        torch.optim.SGD([{"params": [p]}, {"params": [q]}], lr=0.1).state_dict()))
    assert phrase in torch_error(lambda: opt.load_state_dict(two_groups))
    phrase = "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
    assert phrase in torch_error(lambda: torch.optim.SGD([p], lr=0.1).load_state_dict(
        torch.optim.SGD([p, q], lr=0.1).state_dict()))
    assert phrase in torch_error(lambda: opt.load_state_dict(make(name, [p, q]).state_dict()))


# ------------------------------------------------------------------------ friction: habits and silent traps


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_adam_learning_rate_warns_once_at_construction(name):
    params = make_params(21)
    with pytest.warns(lopt.AdamHabitWarning, match=r"lr=0\.001, which looks like an Adam learning rate.*lr=1\.0 is "
                                                   r"the step they were trained for") as record:
        make(name, params, lr=1e-3)
    assert len([w for w in record if issubclass(w.category, lopt.AdamHabitWarning)]) == 1
    assert issubclass(lopt.AdamHabitWarning, UserWarning)
    with pytest.warns(lopt.AdamHabitWarning, match=r"param group #1 has lr=0\.0003"):
        make(name, [{"params": params[:2]}, {"params": params[2:], "lr": torch.tensor(3e-4)}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=lopt.UntrainedWeightsWarning)
        make(name, params)  # lr=1.0
        make(name, params, lr=0.05)  # a deliberate scaling of the learned step
        make(name, [{"params": params[:2]}, {"params": params[2:], "lr": 0.0}])  # a frozen group
        warnings.filterwarnings("ignore", category=lopt.AdamHabitWarning)
        make(name, params, lr=1e-3)  # silenced by its class


def test_velo_warns_when_a_resume_keeps_a_different_num_steps():
    params = make_params(22)
    saved = copy.deepcopy(train("velo", params, 2).state_dict())
    opt = make("velo", make_params(22), num_steps=200)
    with pytest.warns(UserWarning, match=r"the checkpoint was saved with num_steps=50 and is resumed with that "
                                         r"horizon, not with this optimizer's num_steps=200.*"
                                         r"opt\.param_groups\[0\]\['num_steps'\] = 200"):
        opt.load_state_dict(saved)
    assert opt.num_steps == 50
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=lopt.UntrainedWeightsWarning)
        make("velo", make_params(22)).load_state_dict(copy.deepcopy(saved))  # the same horizon: silent
    opt.param_groups[0]["num_steps"] = 200  # the documented way to change the horizon
    train("velo", [p for g in opt.param_groups for p in g["params"]], 1, opt=opt)
    assert opt.state_dict()["param_groups"][0]["num_steps"] == 200


def test_velo_warns_once_about_lightnings_closure_with_accumulation_and_no_callback():
    """Without VeLOLossCallback, Lightning's closure hands VeLO the last micro-batch's loss divided by
    accumulate_grad_batches: VeLO stepped on half the loss, silently."""
    L = pytest.importorskip("lightning.pytorch")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return make("velo", self.parameters(), num_steps=4)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g))

    def fit(accumulation):
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
                            accumulate_grad_batches=accumulation)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=2))
        return [str(w.message) for w in record if "VeLO.step got Lightning's closure" in str(w.message)]

    warned = fit(2)
    assert len(warned) == 1 and "accumulate_grad_batches=2" in warned[0] and "VeLOLossCallback" in warned[0]
    assert fit(1) == []
