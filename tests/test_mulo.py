"""lopt.MuLO (docs/mulo.md): μP's groups and learning rates, the step against the float64 oracle of
small_fc_lopt with each tensor's μP lr (spec_small_fc_lopt.py), and what MuLO refuses.

mup itself is not installed here: its package requires torchvision, which pip would install in a
build that replaces the installed torch. The tests attach :class:`InfShape`, a stand-in with mup's
definitions of the two methods MuLO reads (``mup/infshape.py`` of mup 1.0.0), as
``mup.set_base_shapes`` attaches mup's own ``InfShape`` (see :func:`set_base_shapes`).
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import lopt
import spec_small_fc_lopt as spec
from lopt.reference import small_fc_lopt as ref
from test_fused_launches import recorded  # noqa: F401  (the fixture: kernels recorded, not run)
from test_small_fc_reference import random_grad, rel_err

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

UPDATE_RTOL = 1e-5
WEIGHTS = lopt.random_weights("small_fc_lopt", seed=7)
NET = WEIGHTS.tensors["mlp"]


class InfShape:
    """Stand-in for ``mup.infshape.InfShape``: per dimension a base size (None: a finite dimension) and a size.

    ``ninf()`` counts the infinite (width) dimensions; ``width_mult()`` is the last infinite dimension's
    ``size / base`` (for a weight ``(out, in)`` with both infinite, the fan-in's), 1 without one — mup's
    ``InfShape.ninf`` and ``InfShape.width_mult`` (through ``InfShape.main``, the last infinite dimension).
    """

    def __init__(self, shape, base_shape):
        self.dims = list(zip(base_shape, shape))

    def ninf(self) -> int:
        return sum(base is not None for base, _ in self.dims)

    def width_mult(self):
        for base, size in reversed(self.dims):
            if base is not None:
                return size / base
        return 1

    def __repr__(self):
        return f"InfShape({self.dims})"


def set_base_shapes(params, base_shapes):
    """Attach ``p.infshape`` as ``mup.set_base_shapes`` does (``zip_infshape`` with ``fin_if_same=True``: a
    dimension equal to its base size is finite, any other is a width dimension)."""
    for p, base in zip(params, base_shapes):
        p.infshape = InfShape(tuple(p.shape), tuple(None if b == s else b for b, s in zip(base, p.shape)))
    return params


# A 4x-wide model against its base (width 16 → 64), as mup sees it:
#   input weight (64, 10): one width dimension → vector-like;  hidden (64, 64): width_mult 4;
#   a half-width hidden (64, 32) (base (16, 16)): width_mult 2;  a conv kernel (64, 32, 3, 3): 2;
#   biases and norms (64,): vector-like;  readout (10, 64): vector-like;  a 0-d scale: finite.
MODEL = [((64, 10), (16, 10)), ((64,), (16,)), ((64, 64), (16, 16)), ((64, 32), (16, 16)), ((64,), (16,)),
         ((64, 32, 3, 3), (16, 16, 3, 3)), ((10, 64), (10, 16)), ((), ()), ((64, 64), (16, 16))]
EXPECTED_GROUPS = [(4.0, [2, 8]), (2.0, [3, 5]), (1.0, [0, 1, 4, 6, 7])]  # (width_mult, MODEL indices)


def make_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g) * 0.1) for shape, _ in MODEL]
    return set_base_shapes(params, [base for _, base in MODEL])


def by_group(opt, params):
    """[(width_mult, lr, [MODEL indices])] of the optimizer's groups."""
    index = {id(p): i for i, p in enumerate(params)}
    return [(g["width_mult"], g["lr"], [index[id(p)] for p in g["params"]]) for g in opt.param_groups]


# ----------------------------------------------------------------------------------------- groups


def test_matrix_like_parameters_get_lr_over_width_mult_in_groups_of_their_own():
    params = make_model()
    opt = lopt.MuLO(params, lr=0.8, weights=WEIGHTS, backend="naive")
    assert by_group(opt, params) == [(wm, 0.8 / wm if wm != 1 else 0.8, members) for wm, members in EXPECTED_GROUPS]
    assert all(g["weight_decay"] == 0.0 and g["step_mult"] == 0.01 for g in opt.param_groups)


def test_each_group_given_is_split_on_its_own():
    params = make_model()
    opt = lopt.MuLO([{"params": params[:4], "lr": 0.5, "weight_decay": 0.1}, {"params": params[4:]}], weights=WEIGHTS,
                    backend="naive")
    assert by_group(opt, params) == [(4.0, 0.125, [2]), (2.0, 0.25, [3]), (1.0, 0.5, [0, 1]),
                                     (2.0, 0.5, [5]), (4.0, 0.25, [8]), (1.0, 1.0, [4, 6, 7])]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.1, 0.1, 0.0, 0.0, 0.0]
    only_matrices = lopt.MuLO(params[2:4], weights=WEIGHTS, backend="naive")
    assert [g["width_mult"] for g in only_matrices.param_groups] == [4.0, 2.0]  # (no empty vector-like group)


def test_a_parameter_without_infshape_is_an_error_naming_it():
    params = make_model()
    plain = torch.nn.Parameter(torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"MuLO: parameter #3 \(shape \(4, 5\)\) has no infshape\. .*"
                                         r"mup\.set_base_shapes\(model, base_model\)"):
        lopt.MuLO(params[:3] + [plain], weights=WEIGHTS, backend="naive")
    named = [(f"layer{i}.weight", p) for i, p in enumerate(params[:2])] + [("head.weight", plain)]
    with pytest.raises(ValueError, match=r"MuLO: parameter #2 \('head\.weight'\) \(shape \(4, 5\)\) has no infshape"):
        lopt.MuLO(named, weights=WEIGHTS, backend="naive")
    opt = lopt.MuLO(params[:3] + [plain], weights=WEIGHTS, backend="naive", missing_infshape="finite")
    assert [g["width_mult"] for g in opt.param_groups] == [4.0, 1.0] and opt.param_groups[1]["params"][-1] is plain
    with pytest.raises(ValueError, match=r"missing_infshape must be one of \('raise', 'finite'\), got 'ignore'"):
        lopt.MuLO(params, weights=WEIGHTS, missing_infshape="ignore")


def test_more_than_two_width_dimensions_are_refused():
    p = set_base_shapes([torch.nn.Parameter(torch.randn(8, 8, 8))], [(4, 4, 4)])
    with pytest.raises(NotImplementedError, match=r"MuLO: parameter #0 \(shape \(8, 8, 8\)\) has 3 infinite dimensions"):
        lopt.MuLO(p, weights=WEIGHTS, backend="naive")


def test_add_param_group_splits_the_group_and_adds_nothing_on_error():
    params = make_model()
    opt = lopt.MuLO(params[:2], weights=WEIGHTS, backend="naive")
    with pytest.raises(ValueError, match=r"parameter #4 \(shape \(3,\)\) has no infshape"):
        opt.add_param_group({"params": params[2:4] + [torch.nn.Parameter(torch.randn(3))]})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=r"cannot set width_mult"):
        opt.add_param_group({"params": params[2:4], "width_mult": 2.0})
    opt.add_param_group({"params": params[2:4], "lr": 0.4})
    assert by_group(opt, params) == [(1.0, 1.0, [0, 1]), (4.0, 0.1, [2]), (2.0, 0.2, [3])]


def test_a_tensor_lr_is_divided_into_tensors_of_its_own_and_schedulers_keep_the_ratios():
    params = make_model()
    lr = torch.tensor(0.8)
    opt = lopt.MuLO(params, lr=lr, weights=WEIGHTS, backend="naive")
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs[2] is lr and all(torch.is_tensor(x) for x in lrs)
    assert float(lrs[0]) == pytest.approx(0.2) and float(lrs[1]) == pytest.approx(0.4)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for p in params:
        p.grad = torch.randn(p.shape) * 0.01
    opt.step()
    scheduler.step()
    assert [float(g["lr"]) for g in opt.param_groups] == pytest.approx([0.1, 0.2, 0.4])


def test_the_adam_habit_warning_reads_the_lr_given():
    params = make_model()
    wide = set_base_shapes([torch.nn.Parameter(torch.randn(8, 8))], [(1, 1)])  # width_mult 8: lr 1/8 in its group
    with warnings.catch_warnings():
        warnings.simplefilter("error", lopt.AdamHabitWarning)
        lopt.MuLO(params + wide, lr=0.1, weights=WEIGHTS, backend="naive")
    with pytest.warns(lopt.AdamHabitWarning, match=r"param group #0 has lr=0\.001, .*param group #2 has lr=0\.001"):
        lopt.MuLO(params, lr=1e-3, weights=WEIGHTS, backend="naive")


# ----------------------------------------------------------------------------------------- the step


@pytest.mark.parametrize("config", [dict(lr=1.0, weight_decay=0.0), dict(lr=0.5, weight_decay=0.05)])
def test_steps_as_the_oracle_with_each_tensors_mup_lr(config, monkeypatch):
    """4 steps, teacher forced: each tensor's update against small_fc_lopt's float64 oracle with lr / width_mult
    (weight decay included: it multiplies the group's lr)."""
    params = make_model(seed=3)
    opt = lopt.MuLO(params, weights=WEIGHTS, backend="naive", **config)
    width_mults = {id(p): g["width_mult"] for g in opt.param_groups for p in g["params"]}
    captured = []
    original = ref.update_from_mlp

    def capture(direction, magnitude, exp_mult, step_mult):
        captured.append(original(direction, magnitude, exp_mult, step_mult))
        return captured[-1]

    monkeypatch.setattr(ref, "update_from_mlp", capture)
    order = [p for g in opt.param_groups for p in g["params"]]  # (the order the step runs them in)
    gen = torch.Generator().manual_seed(5)
    for t in range(1, 5):
        grads = {id(p): random_grad(tuple(p.shape), gen) for p in params}
        wants = {}
        for p in params:
            shape = tuple(p.shape)
            state = spec.from_pylo_state(opt.state[p], shape) if opt.state[p] else spec.new_state(shape)
            lr = config["lr"] / width_mults[id(p)]
            wants[id(p)] = (lr, spec.step(p.detach(), grads[id(p)], state, t, NET, lr=lr,
                                          weight_decay=config["weight_decay"]))
        for p in params:
            p.grad = grads[id(p)]
        del captured[:]
        opt.step()
        for p, u in zip(order, captured):
            lr, want = wants[id(p)]
            assert rel_err(u.reshape(p.shape), want["u"]) < UPDATE_RTOL, (t, tuple(p.shape))
            bound = UPDATE_RTOL * lr * want["u"].abs().max() + torch.finfo(torch.float32).eps * want["p"].abs()
            assert ((p.detach().double() - want["p"]).abs() <= bound).all(), (t, tuple(p.shape))


def test_a_step_is_small_fc_lopts_with_the_groups_lr_bit_for_bit():
    """MuLO computes nothing of its own: SmallFCLOpt given the same groups by hand steps identically."""
    params, twins = make_model(seed=4), make_model(seed=4)
    opt = lopt.MuLO(params, lr=0.7, weight_decay=0.01, weights=WEIGHTS, backend="naive")
    index = {id(p): i for i, p in enumerate(params)}
    groups = [{"params": [twins[index[id(p)]] for p in g["params"]], "lr": g["lr"]} for g in opt.param_groups]
    twin_opt = lopt.SmallFCLOpt(groups, weight_decay=0.01, weights=WEIGHTS, backend="naive")
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen) * 0.1
            q.grad = p.grad.clone()
        opt.step()
        twin_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twins))


def test_state_dicts_copies_and_pickles_resume_exactly():
    def run(opt, params, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * 0.1
            opt.step()

    straight_params = make_model(seed=9)
    straight = lopt.MuLO(straight_params, weights=WEIGHTS, backend="naive")
    run(straight, straight_params, 2, seed=1)
    saved = copy.deepcopy(straight.state_dict())
    assert [g["width_mult"] for g in saved["param_groups"]] == [4.0, 2.0, 1.0]
    clone = copy.deepcopy(straight)
    pickled = pickle.loads(pickle.dumps(straight))
    resumed_params = make_model(seed=9)
    with torch.no_grad():
        for a, b in zip(resumed_params, straight_params):
            a.copy_(b)
    resumed = lopt.MuLO(resumed_params, weights=WEIGHTS, backend="naive")
    resumed.load_state_dict(saved)
    run(straight, straight_params, 2, seed=2)
    run(resumed, resumed_params, 2, seed=2)
    position = {id(p): i for i, p in enumerate(p for g in straight.param_groups for p in g["params"])}
    for copied in (clone, pickled):
        held = [p for g in copied.param_groups for p in g["params"]]
        copied_params = [held[position[id(p)]] for p in straight_params]  # (in the model's order)
        assert copied._missing_infshape == "raise"
        run(copied, copied_params, 2, seed=2)
        assert all(torch.equal(a, b) for a, b in zip(copied_params, straight_params))
    assert all(torch.equal(a, b) for a, b in zip(resumed_params, straight_params))


def test_small_fc_lopt_and_mulo_refuse_each_others_state_dicts():
    params = make_model()
    mulo = lopt.MuLO(params, weights=WEIGHTS, backend="naive")
    small_fc = lopt.SmallFCLOpt([{"params": g["params"]} for g in mulo.param_groups], weights=WEIGHTS, backend="naive")
    with pytest.raises(ValueError, match=r"this is a state dict of lopt\.SmallFCLOpt, not of MuLO; nothing was changed"):
        mulo.load_state_dict(small_fc.state_dict())
    with pytest.raises(ValueError, match=r"this is a state dict of lopt\.MuLO, not of SmallFCLOpt; nothing was changed"):
        small_fc.load_state_dict(mulo.state_dict())


# ----------------------------------------------------------------------------------------- fused


def test_the_fused_engine_reads_each_tensors_lr_through_its_mulo_group(recorded):
    """On the CPU, SmallFCLOpt's engine with its kernels recorded (test_fused_launches): one group-table row
    per MuLO group holding that group's lr (lr / width_mult), and every tensor's row pointing at its group."""
    from lopt.fused.contract import FIELD, GROUP_VALUES
    from test_fused_launches import engine_for

    params = make_model()
    opt = engine_for("mulo", params, lr=0.8)
    for p in params:
        p.grad = torch.randn(p.shape) * 0.01
    opt.step()
    plan = opt._fused_engine.plan
    assert len(opt.param_groups) == 3 and recorded
    lrs = [float(plan.group_values.host[g, GROUP_VALUES["lr"]]) for g in range(3)]
    assert lrs == [float(torch.tensor(0.8 / 4.0)), float(torch.tensor(0.8 / 2.0)), float(torch.tensor(0.8))]
    groups = plan.layout.static_rows[:, FIELD["TensorMeta"]["group"]].tolist()
    assert groups == [g for g, group in enumerate(opt.param_groups) for _ in group["params"]]


# ----------------------------------------------------------------------------------------- fused (GPU)


@pytest.mark.cuda
def test_fused_steps_like_naive_on_mulos_groups():
    """backend="fused" is SmallFCLOpt's engine on MuLO's groups (each group's lr in its table row)."""
    from fused_helpers import tensor_update_error, update_scale

    def build(backend):
        params = [torch.nn.Parameter(p.detach().cuda()) for p in make_model(seed=11)]
        return lopt.MuLO(set_base_shapes(params, [b for _, b in MODEL]), weights=WEIGHTS, backend=backend), params

    fused, fused_params = build("fused")
    naive, naive_params = build("naive")
    assert fused.backend == "fused" and len(fused.param_groups) == 3
    for step in range(5):
        gen = torch.Generator(device="cuda").manual_seed(20 + step)
        for p, q in zip(fused_params, naive_params):
            p.grad = torch.randn(p.shape, generator=gen, device="cuda") * 0.01
            q.grad = p.grad.clone()
        before = [p.detach().clone() for p in naive_params]
        fused.step()
        naive.step()
        fused_updates = [p.detach() - b for p, b in zip(fused_params, before)]
        naive_updates = [p.detach() - b for p, b in zip(naive_params, before)]
        scale = update_scale(naive_updates)
        for f, n in zip(fused_updates, naive_updates):
            assert tensor_update_error(f, n, scale) < 1e-5, step
        for p, q in zip(fused_params, naive_params):
            p.data.copy_(q.data)
        fused.load_state_dict(naive.state_dict())


def test_construction_warnings_point_at_the_line_that_built_the_optimizer():
    params = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lopt.MuLO(params, lr=1e-3, weights=lopt.random_weights("small_fc_lopt", seed=3))
    for category in (lopt.UntrainedWeightsWarning, lopt.AdamHabitWarning):
        found = [w for w in caught if issubclass(w.category, category)]
        assert len(found) == 1 and found[0].filename == __file__, category
