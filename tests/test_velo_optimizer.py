"""lopt.VeLO: whole steps against the float64 oracle, and the torch.optim front-end's contract."""

import copy
import io
import warnings

import numpy as np
import pytest
import torch

import lopt
from lopt import VeLO
from lopt import registry
from lopt.reference import velo as R
from lopt.weights import WeightsError

import spec_velo as S
from hub_cache import hub_layout_files

# Tiny tensors: one intra-op thread is fastest and avoids spin-waiting on a busy 2-core machine.
pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

EPS32 = 2.0 ** -23
R_STATE_KEYS = ("mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v", "lstm_hidden", "lstm_cell")




@pytest.fixture(scope="module")
def meta():
    return lopt.random_weights("velo", seed=5)


@pytest.fixture(scope="module")
def weight_dirs(meta, tmp_path_factory):
    root = tmp_path_factory.mktemp("velo_weights")
    rnn, mlp = meta.save({"rnn": root / "rnn", "mlp": root / "mlp"})
    return rnn, mlp


def make_params(shapes, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in shapes]


def random_grads(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 10.0 ** -(i % 3) for i, s in enumerate(shapes)]


def set_grads(params, grads):
    for p, grad in zip(params, grads):
        p.grad = None if grad is None else grad.to(p.dtype).clone()


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_state_dicts_equal(a, b, ignore=()):
    """Bit-for-bit equal state dicts (tensor entries compared with torch.equal), but for the ``ignore`` group keys."""
    assert len(a["param_groups"]) == len(b["param_groups"])
    for x, y in zip(a["param_groups"], b["param_groups"]):
        assert x.keys() == y.keys()
        for key in x:
            if key in ignore:
                continue
            if torch.is_tensor(x[key]):
                assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key
            else:
                assert x[key] == y[key], key
    assert a["state"].keys() == b["state"].keys()
    for index in a["state"]:
        assert a["state"][index].keys() == b["state"][index].keys()
        for key, value in a["state"][index].items():
            assert value.dtype == b["state"][index][key].dtype and torch.equal(value, b["state"][index][key]), (index, key)


# ------------------------------------------------------------------------------------ whole steps vs the oracle

ORACLE_SHAPES = [(), (1,), (7,), (4, 6), (6, 4), (5, 5), (1, 7), (7, 1), (2, 3, 4), (3, 5, 5), (4, 4, 4),
                 (8, 3, 3, 3), (6, 6, 3, 3), (1, 1, 5, 5), (2, 1, 3, 1), (3, 2, 1, 2, 2)]


@pytest.mark.parametrize("multipliers", [{}, {"exp_mult": 0.3, "step_mult": 0.5}], ids=["defaults", "large_steps"])
def test_whole_steps_match_the_oracle_for_every_rank(meta, multipliers):
    """Six steps with a varying loss, two groups with their own lr/weight decay, and a tensor that
    misses its gradient on one step. With the default multipliers VeLO's updates are ~1e-6..1e-5
    of |p|, below what a float32 parameter resolves well (its ulp is ~1e-7 of |p|): the bound is
    1e-4 of the update plus one ulp of the parameter, and the large-step run checks the updates
    themselves to 1e-4."""
    shapes = ORACLE_SHAPES
    params = make_params(shapes, seed=1)
    split = 9
    groups = [{"lr": 1.0, "weight_decay": 0.0}, {"lr": 0.6, "weight_decay": 0.05}]
    opt = VeLO([dict(groups[0], params=params[:split]), dict(groups[1], params=params[split:])],
               num_steps=20, weights=meta, **multipliers)
    oracle = S.SpecVeLO([
        dict(groups[0], params=[p.detach().double().clone() for p in params[:split]], **multipliers),
        dict(groups[1], params=[p.detach().double().clone() for p in params[split:]], **multipliers),
    ], num_steps=20, weights=meta.tensors)
    g = torch.Generator().manual_seed(2)
    for step in range(6):
        grads = random_grads(shapes, seed=10 + step)
        if step == 3:
            grads[4] = None  # (6, 4) has no gradient this step
        loss = 3.0 + float(torch.randn((), generator=g)) - 0.2 * step
        before = [p.detach().double().clone() for p in params]
        oracle_before = [x.clone() for group in oracle.groups for x in group["params"]]
        set_grads(params, grads)
        opt.step(loss)
        oracle.step(grads, S.as_float32(loss))
        oracle_after = [x for group in oracle.groups for x in group["params"]]
        for index, (p, b, oa, ob) in enumerate(zip(params, before, oracle_after, oracle_before)):
            update, expected = p.detach().double() - b, oa - ob
            bound = 1e-4 * expected.norm() + EPS32 * oa.norm()
            assert (update - expected).norm() <= bound, (step, shapes[index])
            if grads[index] is None:
                assert torch.equal(update, torch.zeros_like(update))
            elif multipliers:
                assert expected.norm() > 100 * EPS32 * oa.norm()  # a real update, far above rounding
        # The per-tensor LSTM state follows the oracle too.
        rows = [(gi, pi) for gi, group in enumerate(oracle.groups) for pi in range(len(group["params"]))]
        for p, (gi, pi) in zip(params, rows):
            torch.testing.assert_close(opt.state[p]["lstm_hidden"].double(), oracle.state[gi][pi]["h"], rtol=1e-4, atol=1e-5)
    assert opt.param_groups[0]["step"] == opt.param_groups[1]["step"] == 6


def test_rank_five_and_up_run_with_the_all_zero_rank_encoding(meta, monkeypatch):
    rows = []
    original = R.lstm_input_features
    monkeypatch.setattr(R, "lstm_input_features", lambda *a: rows.append(original(*a)) or rows[-1])
    params = make_params([(2, 2, 2, 2, 2), (2, 2, 2, 2, 2, 2), (2, 1, 2, 2, 2)], seed=3)
    opt = VeLO(params, num_steps=10, weights=meta)
    set_grads(params, random_grads([p.shape for p in params], seed=4))
    before = [p.detach().clone() for p in params]
    opt.step(1.0)
    rank_block = rows[0][:, 19:24]
    assert torch.equal(rank_block, torch.tensor([[0.0] * 5, [0.0] * 5, [0, 0, 0, 0, 1.0]]))
    assert all(not torch.equal(p, b) and torch.isfinite(p).all() for p, b in zip(params, before))


def test_scalar_parameter_steps_like_a_one_element_vector(meta):
    results = []
    for shape in ((), (1,)):
        params = make_params([shape, (3, 4)], seed=6)
        opt = VeLO(params, num_steps=10, weights=meta)
        for step in range(3):
            set_grads(params, random_grads([shape, (3, 4)], seed=step))
            opt.step(2.0 - 0.1 * step)
        results.append([p.detach().reshape(-1).clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_tensors_without_gradient_get_no_lstm_row_and_no_state_change(meta):
    shapes = [(4, 3), (5,), (2, 2, 2)]
    with_frozen = make_params(shapes, seed=7)
    without = [torch.nn.Parameter(p.detach().clone()) for p in with_frozen[:2]]
    opt_a = VeLO(with_frozen, num_steps=10, weights=meta)
    opt_b = VeLO(without, num_steps=10, weights=meta)
    frozen_state = copy.deepcopy(opt_a.state[with_frozen[2]])
    frozen_value = with_frozen[2].detach().clone()
    for step in range(3):
        grads = random_grads(shapes, seed=20 + step)
        set_grads(with_frozen, grads[:2] + [None])
        set_grads(without, grads[:2])
        opt_a.step(1.5)
        opt_b.step(1.5)
    # The frozen tensor neither moved nor took part in the mixing max of the others.
    assert torch.equal(with_frozen[2], frozen_value)
    assert all(torch.equal(frozen_state[k], opt_a.state[with_frozen[2]][k]) for k in frozen_state)
    assert all(torch.equal(a, b) for a, b in zip(with_frozen[:2], without))


def test_parameters_that_never_required_grad_get_state_only_when_they_get_a_gradient(meta):
    trained, frozen = make_params([(3, 3), (4,)], seed=8)
    frozen.requires_grad_(False)
    opt = VeLO([trained, frozen], num_steps=10, weights=meta)
    assert frozen not in opt.state and set(opt.state[trained]) == set(R_STATE_KEYS)
    trained.grad = torch.randn(3, 3)
    opt.step(1.0)
    assert frozen not in opt.state



def test_a_step_with_no_gradients_only_advances_the_loss_buffer_and_counters(meta):
    params = make_params([(3, 2)], seed=9)
    opt = VeLO(params, num_steps=10, weights=meta)
    before = params[0].detach().clone()
    opt.step(2.5)
    assert torch.equal(params[0], before)
    assert opt.param_groups[0]["step"] == 1 and int(opt.param_groups[0]["loss_count"]) == 1
    torch.testing.assert_close(opt.param_groups[0]["loss_means"], 2.5 * (1 - R.loss_buffer_decays(10)))


# ------------------------------------------------------------------------------------ state, dtypes, groups


def test_state_shapes_and_dtypes(meta):
    shapes = [(), (5,), (4, 6), (5, 5), (2, 3, 4)]
    params = make_params(shapes, seed=10)
    opt = VeLO(params, num_steps=10, weights=meta)
    expected_rc = {(): None, (5,): None, (4, 6): ((4, 3), (6, 3)), (5, 5): ((5, 3), (5, 3)), (2, 3, 4): ((2, 3, 3), (2, 4, 3))}
    for p, shape in zip(params, shapes):
        state = opt.state[p]
        assert all(v.dtype == torch.float32 for v in state.values())
        assert state["mom"].shape == shape + (3,) and state["rms"].shape == shape + (1,)
        assert state["lstm_hidden"].shape == state["lstm_cell"].shape == (512,)
        torch.testing.assert_close(state["lstm_hidden"], meta.tensors["rnn"]["lstm_init_state.0"][0])
        if expected_rc[shape] is None:
            assert state["fac_vec_v"].shape == shape + (3,) and state["fac_vec_row"].numel() == 0
        else:
            assert (state["fac_vec_row"].shape, state["fac_vec_col"].shape) == expected_rc[shape]
            assert state["fac_vec_v"].numel() == 0
    first = opt.param_groups[0]
    assert first["num_steps"] == 10 and opt.num_steps == 10 and first["step"] == 0
    assert first["loss_means"].shape == first["loss_running_min"].shape == (10,)
    assert first["loss_count"].dtype == torch.int32 and first["skipped_steps"] == 0 and opt.skipped_steps == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_keep_their_dtype_with_float32_state(meta, dtype):
    shapes = [(6, 5), (7,), ()]
    low = make_params(shapes, seed=11, dtype=dtype)
    full = [torch.nn.Parameter(p.detach().float().clone()) for p in low]
    opt_low, opt_full = VeLO(low, num_steps=10, weights=meta), VeLO(full, num_steps=10, weights=meta)
    for step in range(3):
        grads = random_grads(shapes, seed=30 + step)
        set_grads(low, grads)
        set_grads(full, [g.to(dtype).float() for g in grads])
        # keep the float32 run on the same (rounded) parameters, so only the update math is compared
        for pl, pf in zip(low, full):
            pf.data.copy_(pl.data.float())
        before = [p.detach().float().clone() for p in low]
        opt_low.step(1.0)
        opt_full.step(1.0)
        for pl, pf, b in zip(low, full, before):
            assert pl.dtype == dtype
            # the low-precision result is the float32 result rounded to the parameter's dtype
            assert torch.equal(pl.detach(), pf.detach().to(dtype))
    for p in low:
        assert all(v.dtype == torch.float32 for v in opt_low.state[p].values())
    # float32 state for a low-precision param equals the float32 run's state (same gradients)
    torch.testing.assert_close(opt_low.state[low[0]]["mom"], opt_full.state[full[0]]["mom"], rtol=0, atol=0)


def test_param_groups_have_their_own_lr_and_weight_decay(meta):
    shapes = [(4, 5), (6,)]
    a, b = make_params(shapes, seed=12), make_params(shapes, seed=12)
    opt_a = VeLO([{"params": [a[0]]}, {"params": [a[1]], "lr": 0.0}], num_steps=10, weights=meta)
    opt_b = VeLO([{"params": [b[0]]}, {"params": [b[1]], "lr": 0.5, "weight_decay": 0.2}], num_steps=10, weights=meta)
    grads = random_grads(shapes, seed=13)
    set_grads(a, grads)
    set_grads(b, grads)
    start = a[1].detach().clone()
    opt_a.step(1.0)
    opt_b.step(1.0)
    assert torch.equal(a[1], start)  # lr = 0: frozen, but its accumulators still advanced
    assert opt_a.state[a[1]]["mom"].abs().sum() > 0
    assert torch.equal(a[0], b[0])  # the other group is unaffected by the second group's settings
    # the second group: p ← (p − 0.5·u)(1 − 0.2·0.5) with u the lr = 1 update of the same state
    c = make_params(shapes, seed=12)
    opt_c = VeLO([{"params": [c[0]]}, {"params": [c[1]]}], num_steps=10, weights=meta)
    set_grads(c, grads)
    opt_c.step(1.0)
    u = start - c[1].detach()
    torch.testing.assert_close(b[1].detach(), (start - 0.5 * u) * (1 - 0.1), rtol=0, atol=4 * EPS32)


def test_groups_added_later_and_lr_schedulers(meta):
    first, later = make_params([(4, 3)], seed=23), make_params([(5,), ()], seed=24)
    opt = VeLO(first, num_steps=10, weights=meta)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    set_grads(first, random_grads([(4, 3)], seed=3))
    opt.step(1.0)
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.5
    opt.add_param_group({"params": later, "weight_decay": 0.1})
    assert "loss_means" not in opt.param_groups[1]  # the optimizer-wide state stays in the first group
    before = [p.detach().clone() for p in later]
    set_grads(first + later, random_grads([(4, 3), (5,), ()], seed=4))
    opt.step(0.9)
    assert all(not torch.equal(p, b) for p, b in zip(later, before))
    assert opt.param_groups[1]["step"] == 1 and opt.param_groups[0]["step"] == 2
    assert set(opt.state[later[0]]) == set(R_STATE_KEYS)


def test_channels_last_parameters_keep_their_layout(meta):
    g = torch.Generator().manual_seed(25)
    base, grad = torch.randn(8, 4, 3, 3, generator=g), torch.randn(8, 4, 3, 3, generator=g)
    dense = torch.nn.Parameter(base.clone())
    strided = torch.nn.Parameter(base.clone().to(memory_format=torch.channels_last))
    opt_dense, opt_strided = VeLO([dense], num_steps=10, weights=meta), VeLO([strided], num_steps=10, weights=meta)
    dense.grad, strided.grad = grad.clone(), grad.clone().to(memory_format=torch.channels_last)
    opt_dense.step(1.0)
    opt_strided.step(1.0)
    assert strided.is_contiguous(memory_format=torch.channels_last)
    # same math; only the order of the float32 reductions over the tensor differs
    torch.testing.assert_close(strided.detach(), dense.detach(), rtol=0, atol=4 * EPS32)
    assert not torch.equal(dense.detach(), base)


# ------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_from_a_state_dict_is_bit_identical(meta, dtype):
    shapes = [(5, 4), (3,), (), (2, 3, 2)]

    def build(params):
        return VeLO([{"params": params[:2]}, {"params": params[2:], "lr": 0.7, "weight_decay": 0.01}], num_steps=8,
                    weights=meta)

    straight = make_params(shapes, seed=14, dtype=dtype)
    opt = build(straight)
    losses = [2.0, 1.7, 1.9, 1.4, 1.5, 1.2, 1.1]
    saved = None
    for step, loss in enumerate(losses):
        if step == 4:
            buffer = io.BytesIO()
            torch.save({"params": [p.detach().clone() for p in straight], "opt": opt.state_dict()}, buffer)
            saved = buffer.getvalue()
        set_grads(straight, random_grads(shapes, seed=40 + step))
        opt.step(loss)

    checkpoint = torch.load(io.BytesIO(saved), weights_only=True)
    resumed = [torch.nn.Parameter(t.clone()) for t in checkpoint["params"]]
    opt2 = build(resumed)
    opt2.load_state_dict(checkpoint["opt"])
    assert int(opt2.param_groups[0]["loss_count"]) == 4 and opt2.param_groups[1]["step"] == 4
    for step in range(4, len(losses)):
        set_grads(resumed, random_grads(shapes, seed=40 + step))
        opt2.step(losses[step])
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    assert_state_dicts_equal(opt.state_dict(), opt2.state_dict())
    assert all(v.dtype == torch.float32 for v in opt2.state[resumed[0]].values())


def test_state_dict_taken_earlier_is_not_changed_by_later_steps(meta):
    params = make_params([(3, 3)], seed=15)
    opt = VeLO(params, num_steps=8, weights=meta)
    set_grads(params, random_grads([(3, 3)], seed=1))
    opt.step(1.0)
    state = opt.state_dict()
    means = state["param_groups"][0]["loss_means"].clone()
    opt.step(3.0)
    assert torch.equal(state["param_groups"][0]["loss_means"], means)


def test_loading_a_foreign_state_dict_fails_clearly(meta):
    params = make_params([(3, 3)], seed=16)
    opt = VeLO(params, num_steps=8, weights=meta)
    adam = torch.optim.Adam(params)
    with pytest.raises(ValueError, match=r"this is a state dict of torch\.optim\.Adam/AdamW, not of VeLO: its param "
                                         r"group #0 lacks \['exp_mult'"):
        opt.load_state_dict(adam.state_dict())


def test_loaded_num_steps_wins_over_the_constructor(meta):
    params = make_params([(3, 3)], seed=17)
    saved = VeLO(params, num_steps=500, weights=meta).state_dict()
    opt = VeLO(params, num_steps=8, weights=meta)
    with pytest.warns(UserWarning, match=r"saved with num_steps=500 and is resumed with that horizon"):
        opt.load_state_dict(saved)
    assert opt.num_steps == 500
    set_grads(params, random_grads([(3, 3)], seed=2))
    opt.step(1.0)
    torch.testing.assert_close(opt.param_groups[0]["loss_means"], 1.0 - R.loss_buffer_decays(500))


# ------------------------------------------------------------------------------------ num_steps, lr, backend


@pytest.mark.parametrize("bad, error, message", [
    (0, ValueError, "num_steps must be a positive int .* got 0"),
    (-5, ValueError, "got -5"),
    (1e4, TypeError, r"got 10000.0 of type float; e.g. num_steps=int\(1e4\)"),
    (True, TypeError, "got True"),
    ("100", TypeError, "of type str"),
    (None, TypeError, "of type NoneType"),
])
def test_num_steps_is_validated(meta, bad, error, message):
    with pytest.raises(error, match=message):
        VeLO(make_params([(2,)], seed=0), num_steps=bad, weights=meta)


def test_num_steps_is_required(meta):
    with pytest.raises(TypeError, match="num_steps"):
        VeLO(make_params([(2,)], seed=0), weights=meta)


def test_num_steps_accepts_integer_types_and_warns_beyond_the_design_horizon(meta):
    assert VeLO(make_params([(2,)], seed=0), num_steps=np.int64(300), weights=meta).num_steps == 300
    with pytest.warns(UserWarning, match="meta-trained on runs of up to 150000 steps; num_steps=200000"):
        VeLO(make_params([(2,)], seed=0), num_steps=200_000, weights=meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=lopt.UntrainedWeightsWarning)  # (random weights on purpose)
        VeLO(make_params([(2,)], seed=0), num_steps=150_000, weights=meta)


def test_defaults_and_registration(meta):
    opt = VeLO(make_params([(2,)], seed=0), num_steps=10, weights=meta)
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["exp_mult"], group["step_mult"]) == (1.0, 0.0, 0.001, 0.001)
    assert VeLO.requires_loss is True and VeLO.architecture == "velo"
    assert registry.get("velo").front_end_class is VeLO and lopt.VeLO is VeLO
    assert opt.backend == "naive"
    with pytest.raises(RuntimeError, match=r"VeLO\(backend='fused'\) cannot run: "):
        VeLO(make_params([(2,)], seed=0), num_steps=10, weights=meta, backend="fused")
    with pytest.raises(ValueError, match=r"VeLO: invalid arguments: lr must be a finite number >= 0\.0, got -1\.0"):
        VeLO(make_params([(2,)], seed=0), num_steps=10, weights=meta, lr=-1.0)
    with pytest.raises(ValueError, match=r"weight_decay must be a finite number >= 0\.0, got -0\.1"):
        VeLO(make_params([(2,)], seed=0), num_steps=10, weights=meta, weight_decay=-0.1)
    with pytest.raises(TypeError, match="parameter #0 has dtype torch.float64"):
        VeLO([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))], num_steps=10, weights=meta)


def test_running_past_num_steps_keeps_saturating(meta, monkeypatch):
    rows = []
    original = R.lstm_input_features
    monkeypatch.setattr(R, "lstm_input_features", lambda *a: rows.append(original(*a)) or rows[-1])
    params = make_params([(4, 3)], seed=18)
    opt = VeLO(params, num_steps=3, weights=meta)
    for step in range(7):
        set_grads(params, random_grads([(4, 3)], seed=50 + step))
        opt.step(2.0 - 0.1 * step)
    timescales = torch.tensor(R.FRACTION_TIMESCALES)
    for t, row in enumerate(rows):
        torch.testing.assert_close(row[0, :9], torch.tanh((t / 3 - timescales) * 10))
    assert rows[6][0, :9].min() > 0.9999 and opt.param_groups[0]["step"] == 7
    assert torch.isfinite(params[0]).all()


# ------------------------------------------------------------------------------------ the loss


def test_loss_as_float_zero_d_tensor_one_element_tensor_int_and_closure_agree(meta):
    results = []
    for kind in ("float", "tensor", "one_element", "closure", "numpy"):
        params = make_params([(4, 3)], seed=19)
        opt = VeLO(params, num_steps=10, weights=meta)
        for step in range(3):
            value = 1.25 - 0.25 * step
            if kind == "closure":
                def closure(value=value, step=step):
                    assert torch.is_grad_enabled()  # step() re-enables autograd for the closure
                    loss = (params[0] * 0).sum() + value
                    params[0].grad = random_grads([(4, 3)], seed=60 + step)[0]
                    return loss
                returned = opt.step(closure)
                assert float(returned.detach()) == value
                continue
            set_grads(params, [random_grads([(4, 3)], seed=60 + step)[0]])
            loss = {"float": value, "tensor": torch.tensor(value), "one_element": torch.tensor([value]),
                    "numpy": np.float32(value)}[kind]
            assert opt.step(loss) is loss
        results.append(params[0].detach().clone())
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_an_integer_loss_is_a_loss(meta):
    params = make_params([(3,)], seed=0)
    opt = VeLO(params, num_steps=10, weights=meta)
    opt.step(2)
    torch.testing.assert_close(opt.param_groups[0]["loss_means"], 2 * (1 - R.loss_buffer_decays(10)))


@pytest.mark.parametrize("loss, error, message", [
    (None, TypeError, r"VeLO.step needs the training loss: call opt.step\(loss\).*accumulate_loss"),
    ("1.0", TypeError, "needs the training loss.*got str"),
    (True, TypeError, "got bool"),
    (torch.tensor([1.0, 2.0]), ValueError, r"scalar training loss, got a tensor of shape \(2,\); reduce it first"),
    (torch.tensor(True), TypeError, "real-valued loss"),
    (lambda: None, TypeError, "needs the training loss"),
])
def test_bad_losses_raise_and_change_nothing(meta, loss, error, message):
    shapes = [(4, 3), (5,)]
    params = make_params(shapes, seed=20)
    opt = VeLO(params, num_steps=10, weights=meta)
    set_grads(params, random_grads(shapes, seed=1))
    opt.step(1.0)
    set_grads(params, random_grads(shapes, seed=2))
    before_params, before_state = snapshot(opt, params)
    with pytest.raises(error, match=message):
        opt.step(loss)
    assert all(torch.equal(p, b) for p, b in zip(params, before_params))
    assert_state_dicts_equal(opt.state_dict(), before_state)
    opt.step(1.0)  # and the optimizer still works
    assert opt.param_groups[0]["step"] == 2


def assert_unchanged(opt, params, before_params, before_state):
    assert all(torch.equal(p, b) for p, b in zip(params, before_params))
    assert_state_dicts_equal(opt.state_dict(), before_state, ignore=("skipped_steps",))


@pytest.mark.parametrize("bad_loss", [float("nan"), float("inf"), torch.tensor(float("-inf")), torch.tensor([float("nan")])])
def test_a_non_finite_loss_skips_the_whole_step(meta, bad_loss):
    """Default policy: parameters, accumulators, LSTM state, loss buffer and step counters stay as they
    were; the skip is counted and warned about; the next good step equals an uninterrupted run's."""
    shapes = [(4, 3), (5,), ()]
    params, twins = make_params(shapes, seed=21), make_params(shapes, seed=21)
    opt, twin_opt = VeLO(params, num_steps=10, weights=meta), VeLO(twins, num_steps=10, weights=meta)
    for step, loss in enumerate([1.0, 0.9, bad_loss, 0.8]):
        grads = random_grads(shapes, seed=70 + step)
        set_grads(params, grads)
        if step == 2:
            before_params, before_state = snapshot(opt, params)
            with pytest.warns(RuntimeWarning, match=r"VeLO: step skipped because the loss is not finite"):
                opt.step(loss)
            assert_unchanged(opt, params, before_params, before_state)
            continue
        opt.step(loss)
        set_grads(twins, grads)
        twin_opt.step(loss)
    assert all(torch.equal(p, t) for p, t in zip(params, twins))
    assert opt.skipped_steps == 1 and opt.param_groups[0]["step"] == 3 == twin_opt.param_groups[0]["step"]


def test_a_non_finite_loss_raises_under_nonfinite_raise(meta):
    shapes = [(4, 3), (5,)]
    params = make_params(shapes, seed=22)
    opt = VeLO(params, num_steps=10, weights=meta, nonfinite="raise")
    set_grads(params, random_grads(shapes, seed=3))
    before_params, before_state = snapshot(opt, params)
    with pytest.raises(lopt.NonFiniteGradientError, match=r"VeLO\.step: the loss is not finite \(nan\); nothing was changed"):
        opt.step(float("nan"))
    assert_unchanged(opt, params, before_params, before_state)
    assert opt.skipped_steps == 0


# ------------------------------------------------------------------------------------ weights


def test_registered_weights_load_from_the_hub_cache(meta, weight_dirs, offline_hub):
    rnn_dir, mlp_dir = weight_dirs
    offline_hub.add("Pauljanson002/VeLO_RNN", hub_layout_files(rnn_dir))
    offline_hub.add("Pauljanson002/VeLO_MLP", hub_layout_files(mlp_dir))
    opt = VeLO(make_params([(3, 3)], seed=0), num_steps=10)  # weights="velo" by default
    assert opt.meta_weights.source.startswith("velo (Pauljanson002/VeLO_RNN@main, Pauljanson002/VeLO_MLP@main)")
    for component in ("rnn", "mlp"):
        for name, tensor in meta.tensors[component].items():
            assert torch.equal(opt.meta_weights.tensors[component][name], tensor)


def test_registered_weights_missing_from_an_offline_cache(offline_hub):
    with pytest.raises(WeightsError, match=r"cannot get config.json of 'velo' from the Hugging Face hub repo "
                                           r"Pauljanson002/VeLO_RNN@main: HF_HUB_OFFLINE is set"):
        VeLO(make_params([(3, 3)], seed=0), num_steps=10)


def test_a_pair_or_dict_of_local_directories(meta, weight_dirs):
    rnn_dir, mlp_dir = weight_dirs
    for weights in ((str(rnn_dir), str(mlp_dir)), {"mlp": mlp_dir, "rnn": rnn_dir}):
        opt = VeLO(make_params([(3, 3)], seed=0), num_steps=10, weights=weights)
        assert torch.equal(opt.meta_weights.tensors["rnn"]["lstm.linear.weight"], meta.tensors["rnn"]["lstm.linear.weight"])


def test_pylo_scratch_buffers_in_the_mlp_file_are_ignored(meta, weight_dirs, tmp_path):
    from safetensors.torch import save_file

    rnn_dir, mlp_dir = weight_dirs
    tensors = dict(meta.tensors["mlp"])
    # what PyLO's VeLOMLP.save_pretrained writes besides the candidates (overwritten every step)
    tensors.update({"input_weights": torch.randn(4, 30), "input_bias": torch.zeros(4), "hidden_weights.0": torch.randn(4, 4),
                    "hidden_bias.0": torch.zeros(4), "output_weights": torch.randn(3, 4), "output_bias": torch.zeros(3)})
    (tmp_path / "config.json").write_text((mlp_dir / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    opt = VeLO(make_params([(3, 3)], seed=0), num_steps=10, weights=(rnn_dir, tmp_path))
    assert set(opt.meta_weights.tensors["mlp"]) == set(R.MLP_CANDIDATE_TENSORS.values())


def test_wrong_tensor_names_and_shapes_are_reported(meta, weight_dirs, tmp_path):
    from safetensors.torch import save_file

    rnn_dir, mlp_dir = weight_dirs
    renamed = dict(meta.tensors["rnn"])
    renamed["lstm.weight"] = renamed.pop("lstm.linear.weight")
    (tmp_path / "names").mkdir()
    save_file(renamed, str(tmp_path / "names" / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"does not hold the rnn network lopt expects: missing \['lstm.linear.weight'\]; "
                                           r"unexpected \['lstm.weight'\]"):
        VeLO(make_params([(3, 3)], seed=0), num_steps=10, weights=(tmp_path / "names", mlp_dir))
    reshaped = dict(meta.tensors["mlp"])
    reshaped["input_weights_"] = torch.zeros(128, 4, 30)
    (tmp_path / "shapes").mkdir()
    save_file(reshaped, str(tmp_path / "shapes" / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"tensor input_weights_ has shape \(128, 4, 30\), expected \(256, 4, 30\)"):
        VeLO(make_params([(3, 3)], seed=0), num_steps=10, weights=(rnn_dir, tmp_path / "shapes"))


def test_one_directory_for_two_networks_is_an_error(weight_dirs):
    with pytest.raises(WeightsError, match=r"velo has 2 networks \(rnn, mlp\): pass a registered name \(one of \['velo'\]\)"):
        VeLO(make_params([(3, 3)], seed=0), num_steps=10, weights=str(weight_dirs[0]))
    with pytest.raises(WeightsError, match=r"weights for velo needs 2 entries, one per network \['rnn', 'mlp'\]; got 1"):
        VeLO(make_params([(3, 3)], seed=0), num_steps=10, weights=(weight_dirs[0],))


def test_a_config_for_another_network_is_rejected(meta, weight_dirs, tmp_path):
    rnn_dir, mlp_dir = weight_dirs
    meta.save({"rnn": tmp_path / "rnn", "mlp": tmp_path / "mlp"})
    (tmp_path / "rnn" / "config.json").write_text('{"input_size": 30, "lstm_hidden_size": 256, "param_inits": 256}')
    with pytest.raises(WeightsError, match=r"describes a different network: lstm_hidden_size=256 \(lopt needs 512\)"):
        VeLO(make_params([(3, 3)], seed=0), num_steps=10, weights=(tmp_path / "rnn", mlp_dir))


# ------------------------------------------------------------------------------------ training


def tiny_regression_run(meta, steps=25):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    opt = VeLO(model.parameters(), num_steps=steps, weights=meta, weight_decay=1e-4)
    losses = []
    for _ in range(steps):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        losses.append(float(opt.step(closure).detach()))
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_small_training_run_is_deterministic_and_finite(meta):
    losses_a, params_a = tiny_regression_run(meta)
    losses_b, params_b = tiny_regression_run(meta)
    assert losses_a == losses_b and all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    assert all(np.isfinite(losses_a)) and all(torch.isfinite(p).all() for p in params_a)
    assert losses_a[-1] != losses_a[0]  # the model moved


# ------------------------------------------------------------------------------------ CUDA (run with -m cuda)


@pytest.mark.cuda
def test_naive_on_cuda_matches_cpu(meta):
    """The naive backend on a GPU computes what it computes on the CPU (the fused backend is tested
    against it in tests/test_fused.py)."""
    shapes = [(32, 16), (16,), (), (4, 4, 3, 3)]
    cpu_params = make_params(shapes, seed=22)
    gpu_params = [torch.nn.Parameter(p.detach().cuda()) for p in cpu_params]
    opt_cpu = VeLO(cpu_params, num_steps=10, weights=meta)
    opt_gpu = VeLO(gpu_params, num_steps=10, weights=meta, backend="naive")
    for step in range(4):
        grads = random_grads(shapes, seed=80 + step)
        set_grads(cpu_params, grads)
        set_grads(gpu_params, [g.cuda() for g in grads])
        loss = torch.tensor(1.0 - 0.1 * step)
        opt_cpu.step(loss)
        opt_gpu.step(loss.cuda())
    for a, b in zip(cpu_params, gpu_params):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-5, atol=1e-6)
