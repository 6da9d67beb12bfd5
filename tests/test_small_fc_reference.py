"""lopt's float32 small_fc_lopt reference math against the independent float64 oracle (spec_small_fc_lopt).

Every stage of docs/small_fc_lopt.md (§2 decays, §3.3 factored dims, §1.1 state, §3.2 accumulators, §3.5
features, §3.6 normalisation, §3.7 time features, §3.8 MLP, §3.9 update) and the whole step, for
every parameter rank. Per-step comparisons are "teacher forced": the oracle starts each step from
lopt's own float32 state and parameter, so the tolerance measures one step's rounding, not drift.

Run with ``-s`` to see the largest relative update error per rank (printed when the module's
whole-step tests are done, by the ``update_error_report`` fixture).
"""

from __future__ import annotations

import math
import re
import struct
import zlib
from pathlib import Path

import pytest
import torch

import lopt
import spec_small_fc_lopt as spec
from lopt.reference import accumulators as acc
from lopt.reference import small_fc_lopt as ref

# Tiny tensors: one intra-op thread is fastest and avoids spin-waiting on a busy 2-core machine.
pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

UPDATE_RTOL = 1e-5  # the brief: relative error of the update vs the float64 oracle
NET = lopt.random_weights("small_fc_lopt", seed=7).tensors["mlp"]
DECAYS = ref.Decays.from_offsets()

SHAPES = {
    "0d": (),
    "1d": (7,),
    "1d_len1": (1,),
    "2d_wide": (4, 6),
    "2d_tall": (6, 4),
    "2d_square_tie": (5, 5),
    "2d_1xn": (1, 7),
    "2d_nx1": (7, 1),
    "2d_1x1": (1, 1),
    "2d_large": (48, 80),
    "3d": (2, 3, 4),
    "3d_tie": (4, 4, 4),
    "3d_size1": (3, 1, 5),
    "4d_conv": (8, 3, 3, 3),
    "4d_conv_tie": (4, 4, 3, 3),
    "4d_conv_tie_large": (16, 16, 3, 3),
    "4d_pointwise_tie": (6, 6, 1, 1),
    "4d_tie_2211": (2, 2, 1, 1),
    "5d": (2, 3, 2, 3, 2),
}




def rank_label(shape) -> str:
    return f"{len(shape)}-d"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want| (float64)."""
    got = got.detach().to(torch.float64)
    want = want.detach().to(torch.float64)
    scale = want.abs().max().item()
    assert scale > 0, "reference value is all zeros: the test would prove nothing"
    return (got - want).abs().max().item() / scale


@pytest.fixture(scope="module")
def update_error_report():
    """Collects the largest relative update error per rank; prints them once the module's tests are done (-s).

    Only a report: every test asserts its own errors, so none depends on another having run.
    """
    largest: dict = {}

    def record(shape, err: float) -> None:
        key = rank_label(shape)
        largest[key] = max(largest.get(key, 0.0), err)

    yield record
    if largest:
        print("\nmax relative update error vs the float64 oracle: "
              + ", ".join(f"{k}: {v:.2e}" for k, v in sorted(largest.items())))


def make_param(kind: str, gen: torch.Generator):
    """(param, base): a parameter of the given SHAPES key, or a non-contiguous view ("nc_*")."""
    if kind == "nc_transposed":
        base = torch.randn(6, 4, generator=gen) * 0.05
        return base.t(), base  # (4, 6), strides (1, 4)
    if kind == "nc_slice":
        base = torch.randn(5, 12, generator=gen) * 0.05
        return base[:, 1::3], base  # (5, 4), columns 1, 4, 7, 10
    if kind == "nc_conv_permuted":
        base = torch.randn(3, 3, 4, 8, generator=gen) * 0.05
        return base.permute(3, 2, 0, 1), base  # (8, 4, 3, 3)
    if kind == "nc_1d_strided":
        base = torch.randn(14, generator=gen) * 0.05
        return base[::2], base
    p = torch.randn(SHAPES[kind], generator=gen) * 0.05
    return p, p


def random_grad(shape, gen: torch.Generator, *, transposed: bool = False) -> torch.Tensor:
    """A random gradient (never zero) with a random overall scale between 1e-3 and 10."""
    scale = 10.0 ** (torch.rand((), generator=gen).item() * 4 - 3)
    if transposed and len(shape) == 2:
        g = (torch.randn(shape[::-1], generator=gen) * scale).t()
    else:
        g = torch.randn(shape, generator=gen) * scale
    assert (g != 0).all()
    return g


ALL_KINDS = list(SHAPES) + ["nc_transposed", "nc_slice", "nc_conv_permuted", "nc_1d_strided"]


# ----------------------------------------------------------------------------------------- §2


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def test_effective_decays_are_the_spec_float32_bit_patterns():
    got = {
        "momentum": [_bits(float(x)) for x in DECAYS.momentum],
        "rms": [_bits(float(x)) for x in DECAYS.rms],
        "adafactor": [_bits(float(x)) for x in DECAYS.adafactor],
    }
    assert got == {
        "momentum": list(spec.MOMENTUM_DECAY_BITS),
        "rms": list(spec.RMS_DECAY_BITS),
        "adafactor": list(spec.ADAFACTOR_DECAY_BITS),
    }
    assert all(t.dtype == torch.float32 for t in (DECAYS.momentum, DECAYS.rms, DECAYS.adafactor))
    # The bit patterns of §2 are what the float32 chain gives (our own evaluation of §2) ...
    for initial, offsets, bits in ((acc.MOMENTUM_DECAYS, ref.MOMENTUM_DECAY_OFFSETS, spec.MOMENTUM_DECAY_BITS),
                                   (acc.RMS_DECAYS, ref.RMS_DECAY_OFFSETS, spec.RMS_DECAY_BITS),
                                   (acc.ADAFACTOR_DECAYS, ref.ADAFACTOR_DECAY_OFFSETS, spec.ADAFACTOR_DECAY_BITS)):
        assert [_bits(spec.float32_decay_chain(b, o)) for b, o in zip(initial, offsets)] == list(bits)
    # ... and not what float64 rounded once gives (2 ulp off for the first momentum decay, §2).
    f64 = 1 - math.exp(10 * (math.log(1 - 0.9) / 10 + 0.15216392))
    assert _bits(f64) == 0x3F0AC24F != spec.MOMENTUM_DECAY_BITS[0]


def test_documented_decays_and_weight_shapes_are_what_lopt_uses():
    """docs/small_fc_lopt.md's §2 table (bits) and §4 table (tensor shapes) against the code and the registry."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "small_fc_lopt.md").read_text()
    section2 = doc[doc.index("## 2. Decays"):doc.index("## 3. One step")]
    table = "\n".join(line for line in section2.splitlines() if line.startswith("|"))
    documented_bits = [int(b, 16) for b in re.findall(r"`(0x[0-9a-f]{8})`", table)]
    assert documented_bits == list(spec.MOMENTUM_DECAY_BITS + spec.RMS_DECAY_BITS + spec.ADAFACTOR_DECAY_BITS)
    assert documented_bits == [_bits(float(x)) for x in torch.cat([DECAYS.momentum, DECAYS.rms, DECAYS.adafactor])]
    section4 = doc[doc.index("## 4. The meta-weights"):doc.index("## 5.")]
    documented_shapes = {name: tuple(int(n) for n in dims.split(",") if n.strip())
                         for name, dims in re.findall(r"\| `(network\.[a-z_0-9.]+)` \| \(([0-9, ]+)\) \|", section4)}
    assert documented_shapes == lopt.weights.architecture("small_fc_lopt").components["mlp"].tensors


def test_effective_decays_are_clipped_to_unit_interval():
    decays = ref.Decays.from_offsets(momentum_offsets=(5.0, 0.0, -5.0), rms_offsets=(0.0,),
                                     adafactor_offsets=(0.0, 0.0, 0.0))
    # offset +5: 1 − exp(ln(0.1) + 50) < 0 → 0; offset −5: 1 − 0.1·e^−50 rounds to 1 (in range already)
    assert decays.momentum[0].item() == 0.0
    assert decays.momentum[2].item() == 1.0
    assert decays.momentum[1].item() == pytest.approx(0.99, rel=1e-6)
    assert decays.adafactor.tolist() == pytest.approx([0.9, 0.99, 0.999], rel=1e-5)


# ----------------------------------------------------------------------------------------- §3.3, §1.1

FACTORED_DIMS_TABLE = [
    ((), None), ((7,), None), ((1,), None),
    ((4, 6), (0, 1)), ((6, 4), (1, 0)), ((5, 5), (0, 1)), ((1, 7), (0, 1)), ((7, 1), (1, 0)), ((1, 1), (0, 1)),
    ((2, 3, 4), (1, 2)), ((4, 4, 4), (1, 2)), ((3, 1, 5), (0, 2)),
    ((8, 3, 3, 3), (3, 0)), ((64, 64, 3, 3), (0, 1)), ((16, 16, 3, 3), (0, 1)), ((256, 256, 1, 1), (0, 1)),
    ((2, 2, 1, 1), (0, 1)), ((768, 3, 16, 16), (3, 0)), ((2, 3, 2, 3, 2), (1, 3)),
]


@pytest.mark.parametrize("shape,expected", FACTORED_DIMS_TABLE, ids=[str(s) for s, _ in FACTORED_DIMS_TABLE])
def test_factored_dims_follow_the_stable_tie_rule(shape, expected):
    assert spec.factored_axes(shape) == expected  # the oracle agrees with the tables of §1.1/§3.3 ...
    assert ref.factored_dims(shape) == expected  # ... and so does lopt (never numpy's argsort)


def test_factored_dims_agree_with_oracle_for_every_small_shape():
    import itertools

    for rank in (2, 3, 4):
        for shape in itertools.product(range(1, 5), repeat=rank):
            assert ref.factored_dims(shape) == spec.factored_axes(shape), shape


STATE_SHAPE_TABLE = [
    # S, mom, rms, row, col, v   (docs/small_fc_lopt.md §1.1)
    ((), (3,), (1,), (0,), (0,), (3,)),
    ((7,), (7, 3), (7, 1), (0,), (0,), (7, 3)),
    ((4, 6), (4, 6, 3), (4, 6, 1), (4, 3), (6, 3), (0,)),
    ((6, 4), (6, 4, 3), (6, 4, 1), (4, 3), (6, 3), (0,)),
    ((5, 5), (5, 5, 3), (5, 5, 1), (5, 3), (5, 3), (0,)),
    ((1, 7), (1, 7, 3), (1, 7, 1), (1, 3), (7, 3), (0,)),
    ((2, 3, 4), (2, 3, 4, 3), (2, 3, 4, 1), (2, 3, 3), (2, 4, 3), (0,)),
    ((8, 3, 3, 3), (8, 3, 3, 3, 3), (8, 3, 3, 3, 1), (3, 3, 3, 3), (8, 3, 3, 3), (0,)),
    ((4, 4, 3, 3), (4, 4, 3, 3, 3), (4, 4, 3, 3, 1), (4, 3, 3, 3), (4, 3, 3, 3), (0,)),
]


@pytest.mark.parametrize("shape,mom,rms,row,col,full", STATE_SHAPE_TABLE, ids=[str(r[0]) for r in STATE_SHAPE_TABLE])
def test_init_state_shapes_dtype_and_zeros(shape, mom, rms, row, col, full):
    state = acc.init_state(shape, ref.factored_dims(shape))
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "mom": mom, "rms": rms, "fac_vec_row": row, "fac_vec_col": col, "fac_vec_v": full}
    for buf in state.values():
        assert buf.dtype == torch.float32
        assert not buf.any()
    # and the oracle's own layout converts to the same shapes
    converted = spec.to_pylo_state(spec.new_state(shape), shape)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in state.items()}


# ----------------------------------------------------------------------------------------- §3.2


def _run_reference_step(p, g, state, t, *, lr=1.0, weight_decay=0.0, exp_mult=spec.EXP_MULT,
                        step_mult=spec.STEP_MULT, monkeypatch=None):
    """lopt's reference step; returns the float32 update u it formed (captured, not recomputed)."""
    captured = {}
    original = ref.update_from_mlp

    def capture(*args, **kwargs):
        captured["u"] = original(*args, **kwargs)
        return captured["u"]

    monkeypatch.setattr(ref, "update_from_mlp", capture)
    ref.small_fc_lopt_step(p, g, state, t, NET, DECAYS, lr=lr, weight_decay=weight_decay,
                           exp_mult=exp_mult, step_mult=step_mult)
    monkeypatch.setattr(ref, "update_from_mlp", original)
    return captured["u"].reshape(p.shape)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_accumulators_match_oracle_over_several_steps(kind, monkeypatch):
    """Free-running: lopt's state after each of 6 steps vs the oracle's float64 accumulators."""
    gen = torch.Generator().manual_seed(11)
    p, _ = make_param(kind, gen)
    shape = tuple(p.shape)
    state = acc.init_state(shape, ref.factored_dims(shape))
    oracle = spec.new_state(shape)
    magnitude = spec.new_state(shape)  # the same EMAs of |g|: the scale of the momentum's rounding error
    for t in range(1, 7):
        g = random_grad(shape, gen, transposed=(t % 2 == 0))
        _run_reference_step(p, g, state, t, monkeypatch=monkeypatch)
        spec.accumulate(oracle, g)
        spec.accumulate(magnitude, g.abs())
        want = spec.to_pylo_state(oracle, shape)
        scale = spec.to_pylo_state(magnitude, shape)
        for name, buf in state.items():
            assert buf.dtype == torch.float32 and tuple(buf.shape) == tuple(want[name].shape), name
            if buf.numel():
                for k in range(buf.shape[-1]):
                    # momentum can cancel (g changes sign and scale): measure against the EMA of |g|
                    err = (buf[..., k].double() - want[name][..., k]).abs().max().item()
                    assert err < 2e-6 * scale[name][..., k].abs().max().item(), (name, k, t)


def test_accumulator_primitives_match_their_formulas():
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(4, 6, 1, generator=gen)
    mom = torch.randn(4, 6, 3, generator=gen)
    expected = DECAYS.momentum.double() * mom.double() + (1 - DECAYS.momentum.double()) * g.double()
    acc.update_momentum(mom, g, DECAYS.momentum)
    assert rel_err(mom, expected) < 1e-7
    rms = torch.rand(4, 6, 1, generator=gen)
    expected = DECAYS.rms.double() * rms.double() + (1 - DECAYS.rms.double()) * g.double() ** 2  # no epsilon
    acc.update_rms(rms, g, DECAYS.rms)
    assert rel_err(rms, expected) < 1e-7
    # 1e-30 enters the Adafactor accumulators only: a tiny gradient shows it
    tiny = torch.full((3, 1), 1e-20)
    state = acc.init_state((3,), None)
    acc.update_adafactor(state, tiny, DECAYS.adafactor, None)
    assert rel_err(state["fac_vec_v"], (1 - DECAYS.adafactor.double()) * (1e-40 + 1e-30)) < 1e-6


# ----------------------------------------------------------------------------------------- §3.5


def _work_view(shape, state):
    """The view small_fc_lopt_step uses: a 0-d parameter is the 1-element vector of JAX."""
    if shape:
        return state, shape
    return {k: (v.view((1,) + v.shape[-1:]) if v.numel() else v) for k, v in state.items()}, (1,)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_all_28_features_in_order_match_oracle(kind, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    p, _ = make_param(kind, gen)
    shape = tuple(p.shape)
    state = acc.init_state(shape, ref.factored_dims(shape))
    for t in range(1, 4):  # a few steps of history, then check the features of step 4
        _run_reference_step(p, random_grad(shape, gen), state, t, monkeypatch=monkeypatch)
    g = random_grad(shape, gen)
    oracle_state = spec.from_pylo_state(state, shape)
    spec.accumulate(oracle_state, g)
    want = spec.features(g, p, oracle_state)  # S + (28,)

    view, work = _work_view(shape, state)
    grad_b = g.reshape(work + (1,))
    param_b = p.reshape(work + (1,))
    dims = ref.factored_dims(shape)
    ref.update_accumulators(view, grad_b, DECAYS, dims)
    got = ref.per_element_features(grad_b, param_b, view, dims).reshape(shape + (28,))

    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got[..., 0], g) and torch.equal(got[..., 1], p)  # g then p, bit-exact
    worst = max(rel_err(got[..., j], want[..., j]) for j in range(28))
    assert worst < 1e-5, [round(rel_err(got[..., j], want[..., j]), 9) for j in range(28)]
    assert len(ref.FEATURE_NAMES) == 28 and ref.FEATURE_NAMES[:2] == ["grad", "param"]


def test_row_and_col_features_follow_the_factored_axes():
    """For (4,6): row R (mean over d0=1) is constant along axis 1, col C (mean over d1=0) along axis 0."""
    gen = torch.Generator().manual_seed(8)
    g = torch.randn(4, 6, 1, generator=gen)
    p = torch.randn(4, 6, 1, generator=gen)
    dims = ref.factored_dims((4, 6))
    state = acc.init_state((4, 6), dims)
    ref.update_accumulators(state, g, DECAYS, dims)
    f = ref.per_element_features(g, p, state, dims)
    g2 = g[..., 0].double() ** 2 + 1e-30
    for k in range(3):
        row = (1 - DECAYS.adafactor[k].double()) * g2.mean(dim=1, keepdim=True).expand(4, 6)
        col = (1 - DECAYS.adafactor[k].double()) * g2.mean(dim=0, keepdim=True).expand(4, 6)
        assert rel_err(f[..., 13 + k], row) < 1e-6
        assert rel_err(f[..., 16 + k], col) < 1e-6


# ----------------------------------------------------------------------------------------- §3.6


@pytest.mark.parametrize("shape", [(1,), (9,), (4, 6), (2, 3, 4), (3, 1, 2, 2)])
def test_normalisation_is_per_feature_column_over_all_elements(shape):
    gen = torch.Generator().manual_seed(13)
    scales = 10.0 ** torch.linspace(-4, 3, 28)
    feats = torch.randn(shape + (28,), generator=gen) * scales
    got = ref.normalise_features(feats)
    want = spec.normalise(feats.double())
    assert rel_err(got, want) < 1e-6
    for j in range(28):
        assert rel_err(got[..., j], want[..., j]) < 1e-6


def test_zero_d_parameter_is_normalised_per_feature(monkeypatch):
    """Decision 3: a scalar's features are each normalised by themselves (JAX), not by one shared value (PyLO naive)."""
    gen = torch.Generator().manual_seed(17)
    p = torch.tensor(0.3)
    state = acc.init_state((), None)
    for t in range(1, 5):
        g = random_grad((), gen)
        oracle = spec.from_pylo_state(state, ())
        naive = spec.clone_state(oracle)
        want = spec.step(p, g, oracle, t, NET)
        naive_update = spec.step(p, g, naive, t, NET, naive_rank0=True)["u"]
        got = _run_reference_step(p, g, state, t, monkeypatch=monkeypatch)
        assert rel_err(got, want["u"]) < UPDATE_RTOL
        assert rel_err(naive_update, want["u"]) > 1e-3  # the two rules are far apart: the test can tell
        # each normalised feature of a scalar is x/sqrt(1e-5 + x²)
        x = want["features"]
        assert torch.allclose(want["normalised"], x / torch.sqrt(1e-5 + x * x), rtol=1e-12, atol=0)
    assert tuple(state["mom"].shape) == (3,) and tuple(state["rms"].shape) == (1,) and tuple(state["fac_vec_v"].shape) == (3,)


# ----------------------------------------------------------------------------------------- §3.7


def test_time_features():
    for t in (1, 2, 3, 11, 101, 1001, 30001, 100001, 10**6):
        got = ref.time_features(t)
        assert got.dtype == torch.float32 and got.shape == (11,)
        assert (got.double() - spec.time_features(t)).abs().max().item() < 3e-7, t
    assert torch.allclose(ref.time_features(1).double(), torch.full((11,), math.tanh(-1.0), dtype=torch.float64), atol=1e-7)
    # τ = t − 1: step 2 sees τ = 1, so the first timescale (T = 1) gives tanh(0) = 0
    assert ref.time_features(2)[0].item() == 0.0


# ----------------------------------------------------------------------------------------- §3.8, §3.9


def test_mlp_matches_oracle_and_output_rows():
    gen = torch.Generator().manual_seed(19)
    x = torch.randn(3, 5, 39, generator=gen) * 2
    direction, magnitude = ref.mlp(x, NET)
    want_d, want_m = spec.mlp(x.double(), NET)
    assert direction.shape == magnitude.shape == (3, 5)
    assert rel_err(direction, want_d) < 1e-6 and rel_err(magnitude, want_m) < 1e-6
    # row 0 of the output layer is the direction, row 1 the magnitude
    shifted = dict(NET)
    shifted["network.output.bias"] = NET["network.output.bias"] + torch.tensor([0.0, 1.0])
    d2, m2 = ref.mlp(x, shifted)
    assert torch.equal(d2, direction)
    assert torch.allclose(m2, magnitude + 1.0, atol=1e-6)


@pytest.mark.parametrize("hidden, layers", [(4, 1), (8, 2), (16, 3), (64, 1), (32, 3)])
def test_other_mlp_geometries_step_as_the_oracle(hidden, layers):
    """Weights of another geometry (their config's hidden_size and hidden_layers) run the MLP they describe:
    SmallFCLOpt (naive) steps a matrix, a vector and a conv kernel as the float64 oracle does (4 steps)."""
    weights = lopt.random_weights("small_fc_lopt", seed=hidden * 10 + layers, hidden_size=hidden, hidden_layers=layers)
    net = weights.tensors["mlp"]
    assert net["network.input.weight"].shape == (hidden, 39)
    assert sum(name.endswith(".weight") for name in net) == layers + 2
    gen = torch.Generator().manual_seed(hidden + 100 * layers)
    shapes = [(9, 6), (7,), (4, 3, 3, 3)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes]
    opt = lopt.SmallFCLOpt(params, weights=weights, backend="naive", lr=0.5)
    states = [spec.new_state(s) for s in shapes]
    for t in range(1, 5):
        grads = [random_grad(s, gen) for s in shapes]
        wants = [spec.step(p.detach(), g, st, t, net, lr=0.5) for p, g, st in zip(params, grads, states)]
        before = [p.detach().double().clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for p, b, want in zip(params, before, wants):
            got = (b - p.detach().double()) / 0.5
            assert rel_err(got, want["u"]) < UPDATE_RTOL, (hidden, layers, t, tuple(p.shape))


@pytest.mark.parametrize("lr,wd", [(1.0, 0.0), (0.3, 0.0), (0.7, 0.2)])
def test_update_formula_and_decoupled_weight_decay(lr, wd):
    gen = torch.Generator().manual_seed(23)
    direction = torch.randn(50, generator=gen)
    magnitude = torch.randn(50, generator=gen) * 300  # exp_mult·magnitude matters
    p = torch.randn(50, generator=gen)
    u = ref.update_from_mlp(direction, magnitude, 0.001, 0.01)
    u_want = direction.double() * torch.exp(0.001 * magnitude.double()) * 0.01
    assert rel_err(u, u_want) < 1e-6
    p_before, u_before = p.clone(), u.clone()
    new_p = ref.apply_update(p, u, lr, wd)
    # apply_update returns a new tensor and leaves its inputs as they were (the caller copies the result back)
    assert new_p.data_ptr() != p.data_ptr() and new_p.data_ptr() != u.data_ptr()
    assert torch.equal(p, p_before) and torch.equal(u, u_before)
    want = (1 - wd * lr) * (p.double() - lr * u.double())  # weight decay on the already-updated p
    assert rel_err(new_p, want) < 1e-6
    if wd:
        wrong = p.double() - lr * u.double() - wd * lr * p.double()  # decay of the old p: a different rule
        assert (new_p.double() - wrong).abs().max().item() > 100 * (new_p.double() - want).abs().max().item()


# ----------------------------------------------------------------------------------------- whole step

CONFIGS = {
    "defaults": dict(lr=1.0, weight_decay=0.0),
    "lr_wd": dict(lr=0.3, weight_decay=0.05),
    "big_exp_mult": dict(lr=2.0, weight_decay=0.01, exp_mult=0.5, step_mult=0.02),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_whole_step_matches_oracle(kind, config, monkeypatch, update_error_report):
    """6 steps with random gradients; each step's update, state and new parameter vs the oracle."""
    cfg = dict(lr=1.0, weight_decay=0.0, exp_mult=spec.EXP_MULT, step_mult=spec.STEP_MULT) | CONFIGS[config]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{config}".encode()))
    p, base = make_param(kind, gen)
    shape = tuple(p.shape)
    base_before = base.clone()
    state = acc.init_state(shape, ref.factored_dims(shape))
    for t in range(1, 7):
        g = random_grad(shape, gen, transposed=(t % 2 == 1))
        oracle_state = spec.from_pylo_state(state, shape)
        want = spec.step(p, g, oracle_state, t, NET, **cfg)
        p_before = p.clone()
        u = _run_reference_step(p, g, state, t, monkeypatch=monkeypatch, **cfg)
        err = rel_err(u, want["u"])
        update_error_report(shape, err)
        assert err < UPDATE_RTOL, (t, err)
        # the new parameter: the oracle's, up to the update tolerance and float32 rounding of p
        ulp = torch.finfo(torch.float32).eps * want["p"].abs()
        bound = UPDATE_RTOL * cfg["lr"] * want["u"].abs().max() + ulp
        assert ((p.double() - want["p"]).abs() <= bound).all(), t
        assert not torch.equal(p, p_before)
        # the state after the step is the oracle's
        after = spec.to_pylo_state(oracle_state, shape)
        for name, buf in state.items():
            if buf.numel():
                assert rel_err(buf, after[name]) < 2e-6, (name, t)
    # a non-contiguous parameter is updated in place, through its view; the rest of the storage is untouched
    if kind == "nc_slice":
        untouched = torch.ones_like(base, dtype=torch.bool)
        untouched[:, 1::3] = False
        assert torch.equal(base[untouched], base_before[untouched])
        assert not torch.equal(base[:, 1::3], base_before[:, 1::3])
    if kind.startswith("nc_"):
        assert not p.is_contiguous()
        assert not torch.equal(base, base_before)  # the update went into the viewed storage


@pytest.mark.parametrize("shape", [(5, 5), (4, 4, 3, 3), (4, 4, 4), (6, 6, 1, 1)])
def test_tied_axes_assignment_changes_the_update(shape, monkeypatch):
    """The tie tests are not vacuous: swapping the roles of d0 and d1 moves the update far beyond the tolerance."""
    gen = torch.Generator().manual_seed(29)
    p = torch.randn(shape, generator=gen) * 0.05
    state = acc.init_state(shape, ref.factored_dims(shape))
    stable_axes = spec.factored_axes
    swapped_axes = lambda s: tuple(reversed(stable_axes(s))) if len(s) >= 2 else None  # noqa: E731
    oracle = spec.new_state(shape)
    monkeypatch.setattr(spec, "factored_axes", swapped_axes)
    swapped = spec.new_state(shape)
    monkeypatch.setattr(spec, "factored_axes", stable_axes)
    for t in range(1, 4):
        g = random_grad(shape, gen)
        want = spec.step(p, g, oracle, t, NET)
        monkeypatch.setattr(spec, "factored_axes", swapped_axes)
        other = spec.step(p, g, swapped, t, NET)
        monkeypatch.setattr(spec, "factored_axes", stable_axes)
        got = _run_reference_step(p, g, state, t, monkeypatch=monkeypatch)
        assert rel_err(got, want["u"]) < UPDATE_RTOL
        assert rel_err(other["u"], want["u"]) > 1e-3
