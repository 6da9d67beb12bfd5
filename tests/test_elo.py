"""lopt.ELO and its reference (lopt/reference/elo.py) against the independent float64 oracle (spec_elo.py,
docs/elo.md): the decays, the whole step for every parameter kind (0-d to 5-d, conv kernels, non-contiguous
views), the global gradient clipping, the update rule, and what ELO refuses.

Per-step comparisons are teacher forced, as in test_small_fc_reference.py: the oracle starts each step
from lopt's own float32 state and parameter, so the tolerance (1e-5 relative on the update) measures one
step's rounding. The update ``u`` is captured where the reference hands it to ``apply_update``: with ELO's
lr of 1e-3 the parameter's own float32 rounding would hide it.
"""

from __future__ import annotations

import struct
import warnings
import zlib

import pytest
import torch

import lopt
import spec_elo as spec
from lopt.reference import accumulators as acc
from lopt.reference import elo as ref
from lopt.reference import small_fc_lopt as sfc_ref
from test_small_fc_reference import ALL_KINDS, make_param, random_grad, rel_err

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

UPDATE_RTOL = 1e-5
NET = lopt.random_weights("elo", seed=7).tensors["mlp"]
WEIGHTS = lopt.random_weights("elo", seed=7)

CONFIGS = {
    "defaults": dict(lr=1e-3, weight_decay=0.0),
    "lr_wd": dict(lr=0.02, weight_decay=0.1),
    "big_exp_mult": dict(lr=2e-3, weight_decay=0.01, exp_mult=0.5),
    "other_decays": dict(lr=1e-3, weight_decay=0.0, momentum_decays=(0.5, 0.9, 0.99), rms_decays=(0.99,),
                         adafactor_decays=(0.8, 0.95, 0.999)),
}


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _oracle_options(cfg: dict) -> dict:
    options = dict(lr=cfg["lr"], weight_decay=cfg["weight_decay"], exp_mult=cfg.get("exp_mult", spec.EXP_MULT))
    if "momentum_decays" in cfg:
        options["decays"] = spec.decays_of(cfg["momentum_decays"], cfg["rms_decays"], cfg["adafactor_decays"])
    return options


def _capture_updates(monkeypatch) -> list:
    """Every (pre-update value, u) ELO's reference hands to apply_update, in call order."""
    calls = []
    original = ref.apply_update

    def capture(param, update, lr, weight_decay):
        calls.append((param.detach().clone(), update.detach().clone()))
        return original(param, update, lr, weight_decay)

    monkeypatch.setattr(ref, "apply_update", capture)
    return calls


# ----------------------------------------------------------------------------------------- §2 decays


def test_decays_are_the_given_values_in_float32():
    decays = ref.Decays.from_offsets()
    assert [_bits(float(x)) for x in decays.momentum] == [_bits(x) for x in spec.BETA_M]
    assert [_bits(float(x)) for x in decays.rms] == [_bits(spec.BETA_V)]
    assert [_bits(float(x)) for x in decays.adafactor] == [_bits(x) for x in spec.BETA_F]
    # not small_fc_lopt's mapping of the same numbers taken as offsets
    assert not torch.equal(decays.momentum, sfc_ref.Decays.from_offsets(ref.MOMENTUM_DECAYS).momentum)
    other = ref.Decays.from_offsets((0.5, 0.9, 0.99), (0.99,), (0.8, 0.95, 0.999))
    assert other.momentum.tolist() == [_bits_value(x) for x in (0.5, 0.9, 0.99)]
    assert other.rms.dtype == torch.float32 and other.rms.tolist() == [_bits_value(0.99)]


def _bits_value(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_optimizer_uses_its_groups_decays():
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    opt = lopt.ELO(params, weights=WEIGHTS, backend="naive", momentum_decays=[0.5, 0.9, 0.99])
    assert opt.param_groups[0]["momentum_decays"] == (0.5, 0.9, 0.99)
    assert opt.decays(opt.param_groups[0]).momentum.tolist() == [_bits_value(x) for x in (0.5, 0.9, 0.99)]


@pytest.mark.parametrize("name, value", [("momentum_decays", (0.9, 1.5, 0.999)), ("rms_decays", (-0.1,)),
                                         ("adafactor_decays", (0.9, 0.99, float("nan")))])
def test_decays_outside_the_unit_interval_are_refused(name, value):
    params = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match=rf"ELO: invalid (arguments|param group #0): {name}"):
        lopt.ELO(params, weights=WEIGHTS, backend="naive", **{name: value})
    opt = lopt.ELO(params, weights=WEIGHTS, backend="naive")
    with pytest.raises(ValueError, match=rf"ELO: invalid param group #1: {name}"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], name: value})
    assert len(opt.param_groups) == 1


# ----------------------------------------------------------------------------------------- the whole step


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_reference_step_matches_oracle(kind, config, monkeypatch):
    """elo_step for one tensor, 5 steps: the update, the new parameter and the state against the oracle."""
    cfg = CONFIGS[config]
    gen = torch.Generator().manual_seed(zlib.crc32(f"elo/{kind}/{config}".encode()))
    p, _ = make_param(kind, gen)
    shape = tuple(p.shape)
    decays = ref.Decays.from_offsets(cfg.get("momentum_decays"), cfg.get("rms_decays"), cfg.get("adafactor_decays"))
    state = acc.init_state(shape, ref.factored_dims(shape))
    calls = _capture_updates(monkeypatch)
    for t in range(1, 6):
        g = random_grad(shape, gen, transposed=(t % 2 == 1))
        oracle_state = spec.from_pylo_state(state, shape)
        want = spec.step(p, g, oracle_state, t, NET, **_oracle_options(cfg))
        p_before = p.clone()
        ref.elo_step(p, g, state, t, NET, decays, lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                     exp_mult=cfg.get("exp_mult", spec.EXP_MULT))
        u = calls[-1][1].reshape(shape)
        assert rel_err(u, want["u"]) < UPDATE_RTOL, t
        step = cfg["lr"] * (want["u"].abs().max() + cfg["weight_decay"] * p_before.double().abs().max())
        bound = UPDATE_RTOL * step + torch.finfo(torch.float32).eps * want["p"].abs()
        assert ((p.double() - want["p"]).abs() <= bound).all(), t
        after = spec.to_pylo_state(oracle_state, shape)
        for name, buf in state.items():
            if buf.numel():
                assert rel_err(buf, after[name]) < 2e-6, (name, t)


OPTIMIZER_KINDS = ["0d", "1d", "2d_square_tie", "3d", "4d_conv", "4d_conv_tie", "5d", "nc_transposed",
                   "nc_conv_permuted", "nc_1d_strided"]


@pytest.mark.parametrize("config", ["defaults", "lr_wd", "other_decays"])
def test_optimizer_steps_like_the_oracle(config, monkeypatch):
    """lopt.ELO (naive) over tensors of every kind at once, 4 steps, teacher forced per step."""
    cfg = CONFIGS[config]
    gen = torch.Generator().manual_seed(zlib.crc32(f"elo-optimizer/{config}".encode()))
    made = [make_param(kind, gen) for kind in OPTIMIZER_KINDS]
    params = [p for p, _ in made]
    for p in params:
        p.requires_grad_(True)
    opt = lopt.ELO(params, weights=WEIGHTS, backend="naive", **cfg)
    calls = _capture_updates(monkeypatch)
    for t in range(1, 5):
        grads = [random_grad(tuple(p.shape), gen) for p in params]
        oracles = [spec.from_pylo_state(opt.state[p], tuple(p.shape)) if opt.state[p] else spec.new_state(tuple(p.shape))
                   for p in params]
        wants = [spec.step(p.detach(), g, s, t, NET, **_oracle_options(cfg)) for p, g, s in zip(params, grads, oracles)]
        for p, g in zip(params, grads):
            p.grad = g
        del calls[:]
        opt.step()
        assert opt.param_groups[0]["step"] == t and len(calls) == len(params)
        for p, (_, u), want in zip(params, calls, wants):
            assert rel_err(u.reshape(p.shape), want["u"]) < UPDATE_RTOL, (t, tuple(p.shape))
            bound = UPDATE_RTOL * cfg["lr"] * 10 * want["u"].abs().max() + 2 * torch.finfo(torch.float32).eps * want["p"].abs()
            assert ((p.detach().double() - want["p"]).abs() <= bound).all(), (t, tuple(p.shape))


# ----------------------------------------------------------------------------------------- §3.1 clipping


def test_global_clip_factor():
    total = torch.tensor(25.0, dtype=torch.float64)  # norm 5
    assert float(ref.global_clip_factor(total, 2.0)) == pytest.approx(0.4, rel=1e-7)
    assert ref.global_clip_factor(total, 2.0).dtype == torch.float32
    # no clipping: exactly 1, also where PyLO's clip_norm / max(norm, clip_norm) is 1 - 2^-24 (5.05)
    pylo_quotient = 5.05 / torch.clamp(torch.tensor(5.0), min=5.05)
    assert float(pylo_quotient) == 1 - 2**-24
    for limit in (5.0, 5.05, 7.3):
        assert float(ref.global_clip_factor(total, limit)) == 1.0
    assert float(ref.global_clip_factor(torch.tensor(0.0, dtype=torch.float64), 1.0)) == 1.0


@pytest.mark.parametrize("max_grad_norm", [0.05, 1e3])
def test_max_grad_norm_clips_by_the_norm_of_every_gradient(max_grad_norm, monkeypatch):
    """Two groups, the first clipping, the second not: the first group's gradients are scaled by the global
    factor, whose norm spans the second group's gradients too; the second group's are not scaled."""
    gen = torch.Generator().manual_seed(5)
    shapes_a, shapes_b = [(6, 5), (5,)], [(4, 3, 3), ()]
    params_a = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes_a]
    params_b = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes_b]
    opt = lopt.ELO([{"params": params_a, "max_grad_norm": max_grad_norm}, {"params": params_b}], weights=WEIGHTS,
                   backend="naive")
    calls = _capture_updates(monkeypatch)
    for t in range(1, 4):
        grads = [torch.randn(p.shape, generator=gen) * 0.3 for p in params_a + params_b]
        factor = spec.global_clip_factor(grads, max_grad_norm)
        if max_grad_norm < 1:
            assert factor < 0.5  # (clipping happens)
        else:
            assert factor == 1.0
        clipped = [g * factor for g in grads[:2]] + grads[2:]
        oracles = [spec.from_pylo_state(opt.state[p], tuple(p.shape)) if opt.state[p] else spec.new_state(tuple(p.shape))
                   for p in params_a + params_b]
        wants = [spec.step(p.detach(), g, s, t, NET) for p, g, s in zip(params_a + params_b, clipped, oracles)]
        for p, g in zip(params_a + params_b, grads):
            p.grad = g
        del calls[:]
        opt.step()
        for p, (_, u), want in zip(params_a + params_b, calls, wants):
            assert rel_err(u.reshape(p.shape), want["u"]) < UPDATE_RTOL, (t, tuple(p.shape))
        # the gradients themselves are not modified
        assert all(torch.equal(p.grad, g) for p, g in zip(params_a + params_b, grads))


def test_unclipped_gradients_are_used_exactly():
    """A limit above the global norm leaves every gradient bit for bit as it was: the run equals one without
    max_grad_norm."""
    def run(**kwargs):
        torch.manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(4))]
        opt = lopt.ELO(params, weights=WEIGHTS, backend="naive", **kwargs)
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return params

    for a, b in zip(run(), run(max_grad_norm=0.3 * 1e3)):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------- §3.9 the update


@pytest.mark.parametrize("lr, wd", [(1e-3, 0.0), (0.02, 0.1)])
def test_update_rule_decays_the_pre_update_parameter_inside_the_step(lr, wd):
    gen = torch.Generator().manual_seed(23)
    direction, magnitude = torch.randn(50, generator=gen), torch.randn(50, generator=gen) * 300
    p = torch.randn(50, generator=gen)
    u = sfc_ref.update_from_mlp(direction, magnitude, 0.001, ref.STEP_MULT)
    assert torch.equal(u, direction * torch.exp(magnitude * 0.001))  # step_mult 1 is exact
    new_p = ref.apply_update(p, u, lr, wd)
    assert torch.equal(new_p, p - lr * (u + wd * p) if wd else p - lr * u)  # the float32 operations, in this order
    want = p.double() - lr * (u.double() + wd * p.double())
    assert ((new_p.double() - want).abs() <= torch.finfo(torch.float32).eps * (want.abs() + lr * u.abs())).all()
    if wd:  # small_fc_lopt's rule, (1 - wd·lr)·(p - lr·u), differs by wd·lr²·u: far beyond float32 rounding
        small_fc_rule = (1 - wd * lr) * (p.double() - lr * u.double())
        assert (new_p.double() - small_fc_rule).abs().max() > 20 * torch.finfo(torch.float32).eps * want.abs().max()
    assert torch.equal(ref.apply_update(p, u, torch.tensor(lr), torch.tensor(wd)), new_p)


def test_a_non_finite_parameter_element_stays_in_its_element():
    p = torch.nn.Parameter(torch.randn(6, 5))
    with torch.no_grad():
        p[2, 3] = float("inf")
    opt = lopt.ELO([p], weights=WEIGHTS, backend="naive")
    p.grad = torch.randn(6, 5)
    opt.step()
    finite = torch.ones(6, 5, dtype=torch.bool)
    finite[2, 3] = False
    assert torch.isfinite(p[finite]).all() and not torch.isfinite(p[2, 3])


# ----------------------------------------------------------------------------------------- front-end


def test_lr_1e3_does_not_warn_and_the_fused_engine_is_elos_own():
    params = [torch.nn.Parameter(torch.randn(3, 2))]
    with warnings.catch_warnings():
        warnings.simplefilter("error", lopt.AdamHabitWarning)
        opt = lopt.ELO(params, weights=WEIGHTS)
    assert opt.backend == "naive" and opt.param_groups[0]["lr"] == 1e-3 and "step_mult" not in opt.param_groups[0]
    from lopt.fused.elo import ELOFused
    from lopt.fused.small_fc_lopt import SmallFCLOptFused
    from lopt import registry
    # ELO runs small_fc_lopt's kernels with its update rule and global clipping as kernel/engine traits.
    assert registry.get("elo").fused_engine_class is ELOFused and issubclass(ELOFused, SmallFCLOptFused)
    assert ELOFused.WEIGHT_DECAY_INSIDE_STEP and ELOFused.GLOBAL_CLIPPING
    assert not SmallFCLOptFused.WEIGHT_DECAY_INSIDE_STEP and not SmallFCLOptFused.GLOBAL_CLIPPING


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_fused_global_clipping_and_update_rule_match_naive(precision):
    """The fused ELO against naive ELO over 40 steps from the same state each step: three groups (a low
    limit that clips every step, none, a high one that clips on the larger gradients), weight decay
    inside the step, factored and unfactored tensors, a 0-d one; through GradScaler every other step.
    exact: each step within 1e-5 (small_fc_lopt's bound); fast: within small_fc_lopt's fast bound."""
    from fused_helpers import make_params, random_grads, scaled_twin_step_error, sync_into
    shapes = [(64, 48), (48,), (3, 5, 7), (300, 260), (), (9, 1, 4, 4), (129,), (40, 3)]
    limits = [0.05, None, 4.0]

    def build(params, backend):
        groups = [{"params": params[k::3], "max_grad_norm": limit} for k, limit in enumerate(limits)]
        return lopt.ELO(groups, lr=3e-3, weight_decay=0.05, weights=WEIGHTS, backend=backend, precision=precision)

    fused_params, naive_params = make_params(shapes, seed=21), make_params(shapes, seed=21)
    fused, naive = build(fused_params, "fused"), build(naive_params, "naive")
    assert fused.backend == "fused"
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8, growth_interval=10**6)
    scaler.scale(torch.ones((), device="cuda"))
    bound = 1e-5 if precision == "exact" else 5e-3
    worst, global_clips = 0.0, 0
    for index in range(40):
        grads = [g * (0.2 + 0.15 * (index % 20)) for g in random_grads(fused_params, seed=500 + index)]
        global_clips += float(torch.cat([g.double().reshape(-1) for g in grads]).norm()) > limits[2]
        error = scaled_twin_step_error(fused, fused_params, naive, naive_params, grads,
                                       scaler if index % 2 == 1 else None)
        worst = max(worst, error)
        assert error <= bound, f"step {index}: relative update error {error:.2e}"
        sync_into(naive, naive_params, fused, fused_params)
    assert 5 < global_clips < 35, global_clips  # (the high limit both clips and does not)
    print(f"\n[elo fused {precision}, global max_grad_norm] per-step relative update error, worst: {worst:.2e}")


def test_weights_of_the_other_architecture_are_refused():
    params = [torch.nn.Parameter(torch.randn(3, 2))]
    with pytest.raises(lopt.WeightsError, match=r"these meta-weights are for 'small_fc_lopt', not 'elo'"):
        lopt.ELO(params, weights=lopt.random_weights("small_fc_lopt"), backend="naive")
    with pytest.raises(lopt.WeightsError, match=r"these meta-weights are for 'elo', not 'small_fc_lopt'"):
        lopt.SmallFCLOpt(params, weights=WEIGHTS, backend="naive")
    with pytest.raises(lopt.WeightsError, match=r"registered weights 'small_fc_lopt' are for 'small_fc_lopt', not 'elo'"):
        lopt.ELO(params, weights="small_fc_lopt", backend="naive")


def test_elo_equals_small_fc_lopt_with_its_decays_step_mult_one_and_no_weight_decay():
    """With weight_decay 0 and no clipping, ELO's step is small_fc_lopt's with ELO's decays and step_mult 1:
    the front-ends share everything else (one source of truth), bit for bit."""
    def run(cls, **kwargs):
        torch.manual_seed(8)
        params = [torch.nn.Parameter(torch.randn(s)) for s in [(6, 5), (5,), (), (2, 3, 4)]]
        opt = cls(params, backend="naive", **kwargs)
        gen = torch.Generator().manual_seed(9)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return params

    elo = run(lopt.ELO, weights=WEIGHTS, lr=0.5)
    same_network = lopt.MetaWeights("small_fc_lopt", WEIGHTS.tensors, WEIGHTS.configs, "test", pretrained=False)

    class WithELODecays(lopt.SmallFCLOpt):  # (no offsets map exactly onto ELO's float32 decays: set them)
        def decays(self, group, device=None):
            return ref.Decays.from_offsets()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lopt.UntrainedWeightsWarning)
        small_fc = run(WithELODecays, weights=same_network, lr=0.5, step_mult=1.0)
    for a, b in zip(elo, small_fc):
        assert torch.equal(a, b)


def test_construction_warnings_point_at_the_line_that_built_the_optimizer():
    params = [torch.nn.Parameter(torch.randn(3, 2))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lopt.ELO(params, weights=lopt.random_weights("elo", seed=3))
    untrained = [w for w in caught if issubclass(w.category, lopt.UntrainedWeightsWarning)]
    assert len(untrained) == 1 and untrained[0].filename == __file__
