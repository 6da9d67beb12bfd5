"""lopt.SmallFCLOpt (naive backend) as a torch.optim optimizer: groups, skipped params, errors, dtypes,
state_dict resume, lr schedulers, max_grad_norm, backend choice, and a small training run.

Updates are checked against the independent float64 oracle (spec_small_fc_lopt), teacher forced:
each step the oracle starts from the optimizer's own float32 state and parameter.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import lopt
import spec_small_fc_lopt as spec
from lopt import SmallFCLOpt

# Tiny tensors: one intra-op thread is fastest and avoids spin-waiting on a busy 2-core machine.
pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

WEIGHTS = lopt.random_weights("small_fc_lopt", seed=1)
NET = WEIGHTS.tensors["mlp"]
UPDATE_RTOL = 1e-5
STATE_KEYS = {"mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v"}




def make(params, **kwargs) -> SmallFCLOpt:
    kwargs.setdefault("weights", WEIGHTS)
    kwargs.setdefault("backend", "naive")
    return SmallFCLOpt(params, **kwargs)


def leaf(shape, gen, scale=0.05, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).requires_grad_()


def rand_grad(shape, gen, scale=None) -> torch.Tensor:
    if scale is None:
        scale = 10.0 ** (torch.rand((), generator=gen).item() * 3 - 2)
    g = torch.randn(shape, generator=gen) * scale
    assert (g != 0).all()
    return g


def oracle_for(opt: SmallFCLOpt, p: torch.Tensor, grad, t: int, *, lr, weight_decay, **kwargs) -> dict:
    """The oracle's step for ``p`` from the optimizer's current state (fresh if it has none)."""
    shape = tuple(p.shape)
    state = spec.from_pylo_state(opt.state[p], shape) if p in opt.state and opt.state[p] else spec.new_state(shape)
    return spec.step(p.detach(), grad, state, t, NET, lr=lr, weight_decay=weight_decay, **kwargs)


def assert_matches_oracle(p: torch.Tensor, want: dict, lr: float) -> None:
    """p (after the step) is the oracle's new parameter, up to the update tolerance and p's own rounding."""
    ulp = torch.finfo(p.dtype).eps * want["p"].abs()
    bound = UPDATE_RTOL * lr * want["u"].abs().max() + ulp
    err = (p.detach().double() - want["p"]).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3e}, bound {bound.max().item():.3e}"


def differs_from(p: torch.Tensor, other: dict, lr: float) -> bool:
    return (p.detach().double() - other["p"]).abs().max().item() > 100 * UPDATE_RTOL * lr * other["u"].abs().max().item()


# ----------------------------------------------------------------------------------------- every rank


def test_whole_update_through_the_optimizer_for_every_rank():
    gen = torch.Generator().manual_seed(0)
    shapes = [(), (1,), (9,), (4, 6), (6, 4), (5, 5), (1, 7), (7, 1), (2, 3, 4), (3, 1, 5), (8, 3, 3, 3),
              (4, 4, 3, 3), (6, 6, 1, 1), (2, 3, 2, 3, 2)]
    params = [leaf(s, gen) for s in shapes]
    transposed = (torch.randn(7, 5, generator=gen) * 0.05).t().requires_grad_()  # non-contiguous leaf
    sliced_base = torch.randn(4, 12, generator=gen) * 0.05
    sliced_base_before = sliced_base.clone()
    sliced = sliced_base[:, ::3].requires_grad_()
    channels_last = (torch.randn(8, 4, 3, 3, generator=gen) * 0.05).to(memory_format=torch.channels_last).requires_grad_()
    params += [transposed, sliced, channels_last]
    assert transposed.is_leaf and not transposed.is_contiguous() and not sliced.is_contiguous()
    assert not channels_last.is_contiguous()
    opt = make(params, lr=0.5, weight_decay=0.02)
    for t in range(1, 6):
        grads = [rand_grad(p.shape, gen) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        wants = [oracle_for(opt, p, g, t, lr=0.5, weight_decay=0.02) for p, g in zip(params, grads)]
        opt.step()
        assert opt.param_groups[0]["step"] == t
        for p, want in zip(params, wants):
            assert_matches_oracle(p, want, 0.5)
            state = opt.state[p]
            assert set(state) == STATE_KEYS and all(v.dtype == torch.float32 for v in state.values())
            assert tuple(state["mom"].shape) == tuple(p.shape) + (3,)
    # the slice was updated in place: the columns outside it are untouched
    untouched = torch.ones(4, 12, dtype=torch.bool)
    untouched[:, ::3] = False
    assert torch.equal(sliced_base[untouched], sliced_base_before[untouched])
    assert not torch.equal(sliced_base[:, ::3], sliced_base_before[:, ::3])
    assert not sliced.is_contiguous() and not transposed.is_contiguous()


# ----------------------------------------------------------------------------------------- groups


def test_param_groups_use_their_own_lr_and_weight_decay():
    gen = torch.Generator().manual_seed(1)
    a, b, c, d = leaf((4, 6), gen), leaf((5,), gen), leaf((3, 3, 2), gen), leaf((), gen)
    opt = make([{"params": [a, b], "lr": 0.5, "weight_decay": 0.1}, {"params": [c, d]}], lr=2.0, weight_decay=0.0)
    settings = {id(a): (0.5, 0.1), id(b): (0.5, 0.1), id(c): (2.0, 0.0), id(d): (2.0, 0.0)}
    for t in range(1, 5):
        grads = {id(p): rand_grad(p.shape, gen) for p in (a, b, c, d)}
        wants, others = {}, {}
        for p in (a, b, c, d):
            p.grad = grads[id(p)]
            lr, wd = settings[id(p)]
            wants[id(p)] = oracle_for(opt, p, p.grad, t, lr=lr, weight_decay=wd)
            other_lr, other_wd = (2.0, 0.0) if lr == 0.5 else (0.5, 0.1)
            others[id(p)] = oracle_for(opt, p, p.grad, t, lr=other_lr, weight_decay=other_wd)
        opt.step()
        for p in (a, b, c, d):
            lr = settings[id(p)][0]
            assert_matches_oracle(p, wants[id(p)], lr)
            assert differs_from(p, others[id(p)], lr)
        assert [g["step"] for g in opt.param_groups] == [t, t]
        assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.5, 0.1), (2.0, 0.0)]


def test_params_without_grad_are_skipped_and_the_group_counter_still_advances():
    gen = torch.Generator().manual_seed(2)
    a, b, c = leaf((4, 6), gen), leaf((3, 5), gen), leaf((7,), gen)
    b_before, c_before = b.detach().clone(), c.detach().clone()
    opt = make([{"params": [a, b]}, {"params": [c]}])
    for t in range(1, 4):
        a.grad = rand_grad(a.shape, gen)
        opt.step()
        assert torch.equal(b, b_before) and torch.equal(c, c_before)
        assert b not in opt.state and c not in opt.state  # no state created for grad-less params
        assert [g["step"] for g in opt.param_groups] == [t, t]  # both groups count every step()
    # b's first gradient arrives at step 4: fresh state, but the group's t = 4 (time features τ = 3)
    a.grad, b.grad = None, rand_grad(b.shape, gen)
    want = oracle_for(opt, b, b.grad, 4, lr=1.0, weight_decay=0.0)
    as_if_first = oracle_for(opt, b, b.grad, 1, lr=1.0, weight_decay=0.0)
    a_before = a.detach().clone()
    opt.step()
    assert_matches_oracle(b, want, 1.0)
    assert differs_from(b, as_if_first, 1.0)
    assert torch.equal(a, a_before)
    assert set(opt.state[b]) == STATE_KEYS and c not in opt.state
    assert [g["step"] for g in opt.param_groups] == [4, 4]


def test_step_with_closure_returns_its_loss():
    gen = torch.Generator().manual_seed(3)
    w = leaf((3, 4), gen)
    x = torch.randn(5, 4, generator=gen)
    opt = make([w])

    def closure():
        opt.zero_grad()
        loss = (x @ w.T).pow(2).sum()
        loss.backward()
        return loss

    expected = (x @ w.detach().T).pow(2).sum()
    loss = opt.step(closure)
    assert torch.equal(loss.detach(), expected)
    assert opt.param_groups[0]["step"] == 1 and set(opt.state[w]) == STATE_KEYS


# ----------------------------------------------------------------------------------------- errors


def test_sparse_gradients_are_rejected_and_nothing_changes():
    gen = torch.Generator().manual_seed(4)
    dense = leaf((3, 4), gen)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = make([dense, emb.weight])
    dense.grad = rand_grad(dense.shape, gen)
    opt.step()  # step 1: dense only
    dense.grad = rand_grad(dense.shape, gen)
    emb(torch.tensor([1, 3, 3])).sum().backward()
    assert emb.weight.grad.is_sparse
    params_before = [dense.detach().clone(), emb.weight.detach().clone()]
    state_before = {key: value.clone() for key, value in opt.state[dense].items()}
    with pytest.raises(RuntimeError, match=r"does not support sparse gradients \(parameter #1, shape \(10, 4\)\).*sparse=False"):
        opt.step()
    assert torch.equal(dense, params_before[0]) and torch.equal(emb.weight, params_before[1])
    assert opt.param_groups[0]["step"] == 1
    assert set(opt.state) == {dense} and emb.weight not in opt.state
    for key, value in state_before.items():
        assert torch.equal(opt.state[dense][key], value), key


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.int32])
def test_unsupported_parameter_dtypes_are_rejected(dtype):
    good = torch.zeros(3, requires_grad=True)
    bad = torch.ones(2, 2, dtype=dtype)
    pattern = rf"SmallFCLOpt: parameter #1 has dtype {dtype}; supported are float32, bfloat16 and float16.*model\.float\(\)"
    with pytest.raises(TypeError, match=pattern):
        make([good, bad])


def test_unsupported_dtype_added_later_is_rejected_by_add_param_group():
    gen = torch.Generator().manual_seed(10)
    good = leaf((3,), gen)
    opt = make([good])
    late = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match=r"SmallFCLOpt: parameter #1 has dtype torch\.float64; supported are"):
        opt.add_param_group({"params": [late]})
    assert len(opt.param_groups) == 1  # nothing was added


BAD_HYPERPARAMETERS = [
    ({"lr": -0.1}, ValueError, r"lr must be a finite number >= 0\.0, got -0\.1"),
    ({"lr": float("inf")}, ValueError, r"lr must be a finite number >= 0\.0, got inf"),
    ({"lr": float("nan")}, ValueError, r"lr must be a finite number >= 0\.0, got nan"),
    ({"lr": "0.1"}, TypeError, r"lr must be a finite number >= 0\.0, got '0\.1' of type str"),
    ({"lr": torch.tensor([0.1, 0.2])}, ValueError, r"lr as a tensor must be a 0-d floating-point tensor"),
    ({"lr": torch.tensor(-1.0)}, ValueError, r"lr must be a finite number >= 0\.0, got -1\.0"),
    ({"weight_decay": -0.01}, ValueError, r"weight_decay must be a finite number >= 0\.0, got -0\.01"),
    ({"max_grad_norm": 0}, ValueError, r"max_grad_norm must be a finite number > 0 or None, got 0"),
    ({"max_grad_norm": -1.0}, ValueError, r"max_grad_norm must be a finite number > 0 or None, got -1\.0"),
    ({"exp_mult": float("nan")}, ValueError, r"exp_mult must be a finite number"),
    ({"momentum_decays": (0.1, 0.2)}, ValueError, r"momentum_decays needs 3 finite meta-learned offsets"),
    ({"rms_decays": (0.1, 0.2, 0.3)}, ValueError, r"rms_decays needs 1 finite meta-learned offsets"),
]


@pytest.mark.parametrize("bad, error, message", BAD_HYPERPARAMETERS)
def test_invalid_hyperparameters_are_rejected_wherever_they_come_from(bad, error, message):
    """Constructor, a param-group dict, add_param_group and a loaded state dict are all validated, and a
    rejected group changes nothing."""
    gen = torch.Generator().manual_seed(3)
    p, q = leaf((3,), gen), leaf((2, 2), gen)
    with pytest.raises(error, match=r"SmallFCLOpt: invalid arguments: " + message):
        make([p], **bad)
    with pytest.raises(error, match=r"SmallFCLOpt: invalid param group #1: " + message):
        make([{"params": [p]}, {"params": [q], **bad}])
    opt = make([p])
    with pytest.raises(error, match=r"SmallFCLOpt: invalid param group #1: " + message):
        opt.add_param_group({"params": [q], **bad})
    assert len(opt.param_groups) == 1
    saved = make([p]).state_dict()
    saved["param_groups"][0].update(bad)
    before = opt.state_dict()
    with pytest.raises(error, match=r"SmallFCLOpt: invalid saved param group #0: " + message):
        opt.load_state_dict(saved)
    assert opt.state_dict()["param_groups"] == before["param_groups"]


def test_hyperparameters_changed_after_construction_are_checked_at_step():
    gen = torch.Generator().manual_seed(4)
    p = leaf((5,), gen)
    opt = make([p])
    p.grad = rand_grad((5,), gen)
    before = p.detach().clone()
    opt.param_groups[0]["lr"] = -0.5  # e.g. a buggy scheduler
    with pytest.raises(ValueError, match=r"SmallFCLOpt\.step: param group lr is -0\.5; it must be a finite number >= 0"):
        opt.step()
    assert torch.equal(p, before) and not opt.state


def test_invalid_constructor_arguments_are_rejected():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'naive', 'fused'\), got 'cuda'"):
        make(p, backend="cuda")
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('skip', 'raise'\), got 'ignore'"):
        make(p, nonfinite="ignore")
    with pytest.raises(ValueError, match=r"precision must be one of \('exact', 'fast'\), got 'bf16' \('exact': "
                                         r"float32-accurate MLP products; 'fast': BF16 products in the fused backend\)"):
        make(p, precision="bf16")


def test_precision_fast_changes_nothing_in_the_naive_backend():
    """precision='fast' is the fused backend's arithmetic; the naive backend stays the float32 reference, so
    both precisions take bit-identical naive steps. The choice is fixed at construction and survives copies."""
    shapes = [(), (7,), (6, 5), (2, 3, 4)]
    runs = {}
    for precision in ("exact", "fast"):
        g = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(1))) for s in shapes]
        opt = make(params, precision=precision)
        assert opt.precision == precision
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        runs[precision] = [p.detach().clone() for p in params]
        assert copy.deepcopy(opt).precision == precision
        with pytest.raises(AttributeError):
            opt.precision = "exact"
    assert all(torch.equal(a, b) for a, b in zip(runs["exact"], runs["fast"]))


def test_backend_choice_on_cpu():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(RuntimeError, match=r"(?s)SmallFCLOpt\(backend='fused'\) cannot run: .*(CUDA|cuda|fused).*naive"):
        make(p, backend="fused")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto on CPU picks naive quietly
        warnings.filterwarnings("ignore", category=lopt.UntrainedWeightsWarning)  # (random weights on purpose)
        opt = make(p, backend="auto")
    assert opt.backend == "naive" and opt.backend_reason
    assert make(p).backend == "naive"
    assert "backend='naive'" in repr(opt)


# ----------------------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_use_float32_math_and_state(dtype):
    """Each step equals the float32 optimizer on the upcast parameter and gradient, rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(), (5,), (6, 4), (2, 3, 2, 2)]
    low = [leaf(s, gen, scale=0.5, dtype=dtype) for s in shapes]
    shadow = [torch.zeros(s, requires_grad=True) for s in shapes]
    kwargs = dict(lr=0.5, weight_decay=0.01)
    opt_low, opt_f32 = make(low, **kwargs), make(shadow, **kwargs)
    for t in range(1, 6):
        wants = []
        for p, s in zip(low, shadow):
            with torch.no_grad():
                s.copy_(p.float())  # teacher forcing: same starting point and state
            if p in opt_low.state:
                opt_f32.state[s] = {k: v.clone() for k, v in opt_low.state[p].items()}
            p.grad = rand_grad(p.shape, gen).to(dtype)
            s.grad = p.grad.float()
            wants.append(oracle_for(opt_low, p, p.grad, t, **kwargs))
        opt_low.step()
        opt_f32.step()
        for p, s, want in zip(low, shadow, wants):
            assert p.dtype == dtype
            assert torch.equal(p.detach(), s.detach().to(dtype)), "not the float32 result rounded to the dtype"
            for key, buf in opt_low.state[p].items():
                assert buf.dtype == torch.float32, key
                assert torch.equal(buf, opt_f32.state[s][key]), key
            # and within one rounding of the float64 oracle
            bound = torch.finfo(dtype).eps * want["p"].abs() + 2 * UPDATE_RTOL * 0.5 * want["u"].abs().max()
            assert ((p.detach().double() - want["p"]).abs() <= bound).all()


# ----------------------------------------------------------------------------------------- state_dict

RESUME_SHAPES = [(), (7,), (4, 6), (5, 5), (2, 3, 4), (4, 4, 3, 3)]
TOTAL_STEPS, SAVE_AT = 8, 3


def _resume_setup(dtype, seed=6):
    gen = torch.Generator().manual_seed(seed)
    init = [(torch.randn(s, generator=gen) * 0.3).to(dtype) for s in RESUME_SHAPES]
    grads = [[rand_grad(s, gen).to(dtype) for s in RESUME_SHAPES] for _ in range(TOTAL_STEPS)]
    return init, grads


def _new_run(init):
    params = [t.clone().requires_grad_() for t in init]
    groups = [{"params": params[:3], "lr": 0.7, "weight_decay": 0.05}, {"params": params[3:]}]
    return params, make(groups, lr=1.3, max_grad_norm=5.0)


def _run_steps(params, opt, grads, steps):
    for t in steps:
        for i, (p, g) in enumerate(zip(params, grads[t])):
            p.grad = None if (i == 1 and t < 5) else g.clone()  # param #1 starts late: lazily created state
        opt.step()


@pytest.mark.parametrize("via_file", [False, True], ids=["in_memory", "torch_save_file"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_from_state_dict_is_bit_identical(dtype, via_file, tmp_path):
    init, grads = _resume_setup(dtype)
    straight, opt = _new_run(init)
    _run_steps(straight, opt, grads, range(TOTAL_STEPS))

    first, opt_a = _new_run(init)
    _run_steps(first, opt_a, grads, range(SAVE_AT))
    checkpoint = {"params": [p.detach().clone() for p in first], "optimizer": opt_a.state_dict()}
    if via_file:
        torch.save(checkpoint, tmp_path / "ckpt.pt")
        checkpoint = torch.load(tmp_path / "ckpt.pt")
    else:
        checkpoint = copy.deepcopy(checkpoint)
    assert [g["step"] for g in checkpoint["optimizer"]["param_groups"]] == [SAVE_AT, SAVE_AT]
    del first, opt_a

    resumed, opt_b = _new_run(checkpoint["params"])
    opt_b.load_state_dict(checkpoint["optimizer"])
    for p in resumed:
        for buf in opt_b.state[p].values() if p in opt_b.state else ():
            assert buf.dtype == torch.float32  # not cast to the parameter's dtype by torch
    assert resumed[1] not in opt_b.state  # no state yet for the late parameter
    _run_steps(resumed, opt_b, grads, range(SAVE_AT, TOTAL_STEPS))

    for p, q in zip(straight, resumed):
        assert p.dtype == q.dtype == dtype
        assert torch.equal(p, q)
    for p, q in zip(straight, resumed):
        for key in STATE_KEYS:
            assert torch.equal(opt.state[p][key], opt_b.state[q][key]), key
    assert [g["step"] for g in opt_b.param_groups] == [TOTAL_STEPS, TOTAL_STEPS]
    assert [(g["lr"], g["weight_decay"]) for g in opt_b.param_groups] == [(0.7, 0.05), (1.3, 0.0)]


def test_state_dict_is_portable():
    init, grads = _resume_setup(torch.float32)
    params, opt = _new_run(init)
    _run_steps(params, opt, grads, range(2))
    sd = opt.state_dict()
    assert all(type(g["step"]) is int for g in sd["param_groups"])
    assert set(sd["state"]) == {0, 2, 3, 4, 5}  # param #1 has had no gradient yet
    assert set(sd["state"][2]) == STATE_KEYS


# ----------------------------------------------------------------------------------------- lr schedulers


def test_step_lr_scales_the_update():
    gen = torch.Generator().manual_seed(7)
    w, b = leaf((6, 4), gen), leaf((4,), gen)
    opt = make([w, b], lr=1.0, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    seen = []
    for t in range(1, 7):
        lr = opt.param_groups[0]["lr"]
        seen.append(lr)
        w.grad, b.grad = rand_grad(w.shape, gen), rand_grad(b.shape, gen)
        wants = [oracle_for(opt, p, p.grad, t, lr=lr, weight_decay=0.1) for p in (w, b)]
        at_base_lr = oracle_for(opt, w, w.grad, t, lr=1.0, weight_decay=0.1)
        opt.step()
        sched.step()
        for p, want in zip((w, b), wants):
            assert_matches_oracle(p, want, lr)
        if lr != 1.0:
            assert differs_from(w, at_base_lr, lr)
    assert seen == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]


def test_lambda_lr_zero_freezes_the_parameter_but_not_the_state():
    gen = torch.Generator().manual_seed(8)
    w = leaf((3, 5), gen)
    opt = make([w], lr=2.0, weight_decay=0.3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lambda epoch: 0.0 if epoch == 0 else 0.25)
    assert opt.param_groups[0]["lr"] == 0.0
    w_before = w.detach().clone()
    w.grad = rand_grad(w.shape, gen)
    opt.step()
    sched.step()
    assert torch.equal(w, w_before)  # lr 0: no update and no weight decay
    assert opt.state[w]["mom"].abs().sum() > 0  # the accumulators still saw the gradient
    assert opt.param_groups[0]["lr"] == 0.5
    w.grad = rand_grad(w.shape, gen)
    want = oracle_for(opt, w, w.grad, 2, lr=0.5, weight_decay=0.3)
    opt.step()
    assert_matches_oracle(w, want, 0.5)


# ----------------------------------------------------------------------------------------- max_grad_norm


def test_max_grad_norm_clips_each_tensor_separately():
    gen = torch.Generator().manual_seed(9)
    big, small = leaf((4, 6), gen), leaf((7,), gen)
    opt = make([big, small], max_grad_norm=1e-3)
    for t in range(1, 4):
        big.grad = rand_grad(big.shape, gen, scale=1.0)  # norm ≈ 5 → clipped to 1e-3
        small.grad = rand_grad(small.shape, gen, scale=1e-5)  # norm ≈ 3e-5 → untouched
        grads_before = [big.grad.clone(), small.grad.clone()]
        norm = torch.linalg.vector_norm(big.grad.double()).item()
        assert norm > 1 and torch.linalg.vector_norm(small.grad).item() < 1e-3
        want_big = oracle_for(opt, big, big.grad.double() * (1e-3 / (norm + 1e-6)), t, lr=1.0, weight_decay=0.0)
        unclipped = oracle_for(opt, big, big.grad, t, lr=1.0, weight_decay=0.0)
        want_small = oracle_for(opt, small, small.grad, t, lr=1.0, weight_decay=0.0)
        opt.step()
        assert_matches_oracle(big, want_big, 1.0)
        assert differs_from(big, unclipped, 1.0)
        assert_matches_oracle(small, want_small, 1.0)
        assert torch.equal(big.grad, grads_before[0]) and torch.equal(small.grad, grads_before[1])  # grads not modified


# ----------------------------------------------------------------------------------------- training


def _train(seed: int = 0, steps: int = 200):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(128, 8, generator=gen)
    y = torch.sin(x @ torch.randn(8, 1, generator=gen))
    init = [p.detach().clone() for p in model.parameters()]
    opt = SmallFCLOpt(model.parameters(), weights=lopt.random_weights("small_fc_lopt", seed=seed))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], init, opt


def test_small_training_run_is_deterministic_and_finite():
    losses_a, params_a, init, opt = _train()
    losses_b, params_b, _, _ = _train()
    assert opt.backend == "naive" and opt.param_groups[0]["step"] == 200
    assert losses_a == losses_b
    assert all(torch.equal(p, q) for p, q in zip(params_a, params_b))
    assert all(torch.isfinite(torch.tensor(losses_a)))
    assert all(torch.isfinite(p).all() for p in params_a)
    assert all(not torch.equal(p, q) for p, q in zip(params_a, init))  # every tensor moved
    losses_c, _, _, _ = _train(seed=1, steps=5)
    assert losses_c != losses_a[:5]  # and the seed matters
