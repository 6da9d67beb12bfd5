"""lopt.reference.velo, stage by stage, against the float64 oracle written from the spec (spec_velo.py)."""

import math

import pytest
import torch

import lopt
from lopt.reference import velo as R
from lopt.reference.accumulators import init_state

import spec_velo as S

# Tiny tensors: one intra-op thread is fastest and avoids spin-waiting on a busy 2-core machine.
pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

SHAPES = [(), (1,), (7,), (4, 6), (6, 4), (5, 5), (1, 7), (7, 1), (2, 3, 4), (3, 5, 5), (4, 4, 4), (8, 3, 3, 3),
          (6, 6, 3, 3), (1, 1, 5, 5), (2, 1, 3, 1), (3, 2, 1, 2, 2), (2, 2, 2, 2, 2, 2)]




@pytest.fixture(scope="module")
def meta():
    return lopt.random_weights("velo", seed=11).tensors


def generator(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------ §3.2 loss buffer


def test_loss_decays_follow_the_documented_halflives():
    decays = R.loss_buffer_decays(10000)
    halflives = [10, 21.544348, 46.41589, 100, 215.44347, 464.15887, 1000, 2154.4346, 4641.589, 10000]
    assert decays.dtype == torch.float32 and decays.shape == (10,)
    torch.testing.assert_close(decays, torch.tensor([math.exp(-1 / h) for h in halflives], dtype=torch.float32),
                               rtol=0, atol=2e-7)


def test_loss_buffer_starts_empty():
    buffer = R.init_loss_buffer(500)
    assert torch.equal(buffer.means, torch.zeros(10))
    assert torch.equal(buffer.running_min, torch.full((10,), 999999995904.0))
    assert buffer.count.dtype == torch.int32 and int(buffer.count) == 0


@pytest.mark.parametrize("num_steps", [7, 300, 10000])
def test_loss_buffer_and_features_match_the_oracle(num_steps):
    g = generator(num_steps)
    losses = [3.0 + 0.5 * float(torch.randn((), generator=g)) - 0.1 * i for i in range(25)]
    losses[6] = 40.0  # a spike: clipped to twice the running maximum
    losses[12] = -1.5  # losses may be negative
    buffer, oracle = R.init_loss_buffer(num_steps), S.SpecLossBuffer(num_steps)
    for i, loss in enumerate(losses):
        buffer = R.update_loss_buffer(buffer, torch.tensor(loss, dtype=torch.float32))
        oracle.update(S.as_float32(loss))
        features = R.loss_features(buffer)
        assert int(buffer.count) == oracle.n == i + 1
        # Bias-corrected means μ/(1 − δ^n) (in ρ, and in the spike clip 2|A| that feeds μ): for δ near 1,
        # float32's 1 − δ^n is only good to ~1e-4 relative.
        torch.testing.assert_close(buffer.means.double(), torch.tensor(oracle.mu, dtype=torch.float64), rtol=5e-4, atol=1e-6)
        torch.testing.assert_close(buffer.running_min.double(), torch.tensor(oracle.rho, dtype=torch.float64),
                                   rtol=5e-4, atol=1e-6)
        # Features divide differences of those means: the slowest ones lose a few more digits.
        torch.testing.assert_close(features.double(), torch.tensor(oracle.features(), dtype=torch.float64),
                                   rtol=0, atol=2e-3)
        if i < 2:
            assert torch.equal(features, torch.zeros(9))
    assert features.abs().max() > 0.05  # the comparison was not between zeros


def test_first_loss_is_its_own_maximum_and_spikes_are_clipped():
    buffer = R.update_loss_buffer(R.init_loss_buffer(100), torch.tensor(1.0))
    torch.testing.assert_close(buffer.means, 1 - buffer.decays)  # μ = (1 − δ)·ℓ: nothing clipped
    after_spike = R.update_loss_buffer(buffer, torch.tensor(100.0))
    # A = max_j μ_j/(1 − δ_j²) over the previous means, so the spike enters as 2·|A|.
    approx_max = torch.max(buffer.means / (1 - buffer.decays ** 2))
    torch.testing.assert_close(after_spike.means, buffer.means * buffer.decays + 2 * approx_max * (1 - buffer.decays))


# ------------------------------------------------------------------------------------ §3.3 factored dims


@pytest.mark.parametrize("shape, dims", [
    ((7,), None), ((), None), ((4, 6), (0, 1)), ((6, 4), (1, 0)), ((5, 5), (1, 0)), ((4, 4, 4), (2, 1)),
    ((3, 5, 5), (2, 1)), ((1, 1, 5, 5), (3, 2)), ((64, 64, 3, 3), (0, 1)), ((8, 3, 3, 3), (3, 0)),
    ((1, 7), (0, 1)), ((2, 3, 4), (1, 2)),
])
def test_factored_dims_spec_examples(shape, dims):
    assert R.factored_dims(shape) == dims


def test_factored_dims_agree_with_the_oracle_for_every_small_shape():
    import itertools

    for rank in range(2, 6):
        for shape in itertools.product((1, 2, 3), repeat=rank):
            assert R.factored_dims(shape) == S.spec_factored_dims(shape), shape


# ------------------------------------------------------------------------------------ §3.4 LSTM inputs


def random_old_state(shape, g):
    """Random (non-zero) momentum S+(3,) and rms S+(1,) with a non-zero momentum mean."""
    s = R.work_shape(shape)
    mom = torch.randn(s + (3,), generator=g) * torch.tensor([0.3, 0.05, 0.01]) + 0.02
    rms = torch.rand(s + (1,), generator=g) * 1e-2 + 1e-4
    return mom, rms


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_lstm_input_features_match_the_oracle(shape, meta):
    g = generator(len(shape) * 7 + sum(shape))
    s = R.work_shape(shape)
    param = torch.randn(s, generator=g) * 0.3
    mom, rms = random_old_state(shape, g)
    loss_feats = torch.rand(9, generator=g) * 2 - 1
    steps_taken, num_steps = 13, 40
    constants = R.rank_one_hot_table()
    fraction = R.fraction_features(steps_taken, num_steps, torch.tensor(R.FRACTION_TIMESCALES))
    row = R.lstm_input_features(fraction[None], loss_feats, R.tensor_statistics(param, mom, rms).lstm[None],
                                constants[min(R.tensor_rank(shape), 5)][None])
    expected = S.spec_lstm_features(param.double(), mom.double().movedim(-1, 0), rms.double()[..., 0], steps_taken,
                                    num_steps, loss_feats.double().tolist(), shape)
    assert row.shape == (1, R.NUM_LSTM_FEATURES) and row.dtype == torch.float32
    torch.testing.assert_close(row[0].double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=2e-5)


def test_var_rms_is_taken_around_the_momentum_mean():
    """The original's bug, kept: a constant v has zero variance, but var_v is (ṽ − μ_m,k)²."""
    param = torch.ones(4, 5)  # ν = 1
    mom = torch.zeros(4, 5, 3) + torch.tensor([0.1, 0.2, 0.4])
    rms = torch.full((4, 5, 1), 0.05)
    stats = R.tensor_statistics(param, mom, rms)
    torch.testing.assert_close(stats.lstm, torch.tensor([0.05, 0, 0, 0, 0.05 ** 2, 0.15 ** 2, 0.35 ** 2]))
    assert stats.mean_square_param.dtype == torch.float32 and float(stats.mean_square_param) == 1.0


def test_rank_encoding_counts_axes_longer_than_one():
    table = R.rank_one_hot_table()
    for shape, rank in [((), 0), ((1,), 0), ((5,), 1), ((1, 5), 1), ((3, 1, 5), 2), ((2, 2, 2, 2), 4),
                        ((2, 2, 2, 2, 2), 5), ((2, 2, 2, 2, 2, 2), 6)]:
        assert R.tensor_rank(shape) == rank
        expected = torch.zeros(5)
        if rank < 5:
            expected[rank] = 1
        assert torch.equal(table[min(rank, 5)], expected), shape


def test_fraction_features_keep_saturating_past_num_steps():
    timescales = torch.tensor(R.FRACTION_TIMESCALES)
    at_end = R.fraction_features(100, 100, timescales)
    past = R.fraction_features(250, 100, timescales)
    torch.testing.assert_close(past, torch.tanh(10 * (2.5 - timescales)))
    assert torch.all(past >= at_end) and past.min() > 0.9999
    torch.testing.assert_close(at_end[-1], torch.tanh(torch.tensor(-1.0)))  # 1.0 − 1.1: not yet saturated


# ------------------------------------------------------------------------------------ §3.5 controller


def random_controller_inputs(rows, meta, g):
    inputs = torch.randn(rows, 30, generator=g)
    hidden = meta["rnn"]["lstm_init_state.0"].expand(rows, -1) + 0.3 * torch.randn(rows, 512, generator=g)
    cell = meta["rnn"]["lstm_init_state.1"].expand(rows, -1) + 0.3 * torch.randn(rows, 512, generator=g)
    return inputs, hidden, cell


def test_controller_matches_the_oracle(meta):
    inputs, hidden, cell = random_controller_inputs(9, meta, generator(3))
    out = R.controller_step(inputs, hidden, cell, meta["rnn"])
    controls, lam, new_hidden, new_cell = S.spec_controller(inputs.double(), hidden.double(), cell.double(), meta["rnn"])
    assert out.controls.shape == (9, 256) and out.lr_mult.shape == (9,) and out.hidden.shape == out.cell.shape == (9, 512)
    torch.testing.assert_close(out.hidden.double(), new_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.cell.double(), new_cell, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.controls.double(), controls, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.lr_mult.double(), lam, rtol=1e-5, atol=1e-6)


def test_lstm_cell_gate_order_and_forget_bias():
    """Gates i, g, f, o in that order, with +1 on the forget pre-activation."""
    z = torch.tensor([[0.3, -1.2, 0.7, 2.0]])  # i, g, f, o for a hidden size of 1
    weight = torch.zeros(4, 2)
    h, c = R.lstm_cell(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([[0.5]]), weight, z[0])
    sig = torch.sigmoid
    expected_c = sig(torch.tensor(0.7 + 1)) * 0.5 + sig(torch.tensor(0.3)) * torch.tanh(torch.tensor(-1.2))
    torch.testing.assert_close(c[0, 0], expected_c)
    torch.testing.assert_close(h[0, 0], sig(torch.tensor(2.0)) * torch.tanh(expected_c))


def test_controller_is_one_batched_multiply_per_layer(meta, monkeypatch):
    calls = []
    linear = torch.nn.functional.linear

    def counting_linear(x, w, b=None):
        calls.append(tuple(x.shape))
        return linear(x, w, b)

    monkeypatch.setattr(R.F, "linear", counting_linear)
    for rows in (1, 40):
        calls.clear()
        R.controller_step(*random_controller_inputs(rows, meta, generator(rows)), meta["rnn"])
        # mix_layer2, final_mix_layer, lstm, rnn_to_controls, step_size: each over all rows at once
        assert calls == [(rows, 30), (rows, 30), (rows, 1024), (rows, 512), (rows, 512)]


def test_tensors_interact_only_through_the_mixing_max(meta):
    inputs, hidden, cell = random_controller_inputs(6, meta, generator(8))
    out = R.controller_step(inputs, hidden, cell, meta["rnn"])
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    permuted = R.controller_step(inputs[order], hidden[order], cell[order], meta["rnn"])
    torch.testing.assert_close(permuted.controls, out.controls[order])
    torch.testing.assert_close(permuted.lr_mult, out.lr_mult[order])
    alone = R.controller_step(inputs[:1], hidden[:1], cell[:1], meta["rnn"])
    assert not torch.allclose(alone.controls, out.controls[:1])  # the max over all tensors matters


# ------------------------------------------------------------------------------------ §3.8 weight generation


def test_weight_generation_matches_the_oracle(meta):
    controls = torch.randn(3, 256, generator=generator(4))
    generated = R.generate_mlp_weights(controls, meta["mlp"])
    expected_shapes = {"input_weight": (4, 30), "input_bias": (4,), "hidden_weight": (4, 4), "hidden_bias": (4,),
                       "output_weight": (3, 4), "output_bias": (3,)}
    for row in range(3):
        oracle = S.spec_generate(controls[row].double(), meta["mlp"])
        for role, tensor_name in R.MLP_CANDIDATE_TENSORS.items():
            value = getattr(generated, role)[row]
            assert value.shape == expected_shapes[role]
            torch.testing.assert_close(value.double(), oracle[tensor_name], rtol=1e-4, atol=1e-5)
            assert oracle[tensor_name].abs().max() > 0.05


# ------------------------------------------------------------------------------------ §3.3, §3.6–3.9 apply


def warmed_state(shape, g, decays, steps=2):
    """Accumulators after a few random gradients (so that no feature is trivially zero)."""
    s = R.work_shape(shape)
    state = {k: (v.view(s + v.shape[-1:]) if v.numel() and not shape else v)
             for k, v in init_state(shape, R.factored_dims(shape)).items()}
    history = [torch.randn(s, generator=g) * 0.1 for _ in range(steps)]
    for grad in history:
        R.update_accumulators(state, grad.unsqueeze(-1), decays, R.factored_dims(shape))
    return state, history


def oracle_state(shape, history, rnn):
    state = S.spec_init_state(shape, rnn)
    s = R.work_shape(shape)
    for grad in history:
        S.spec_update_and_features(torch.zeros(s, dtype=torch.float64), grad.double(), state, S.spec_factored_dims(shape))
    return state


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_per_element_update_matches_the_oracle(shape, meta):
    g = generator(100 + len(shape) * 13 + sum(shape))
    decays = R.Decays.from_offsets()
    dims = R.factored_dims(shape)
    s = R.work_shape(shape)
    param = torch.randn(s, generator=g) * 0.5
    grad = R.clip_gradient(torch.randn(s, generator=g) * 0.05)
    state, history = warmed_state(shape, g, decays)
    control = torch.randn(1, 256, generator=g) * 0.5
    lr_mult = torch.tensor(0.8)
    mlp = R.generate_mlp_weights(control, meta["mlp"]).select(0)

    # lopt, stage by stage (apply_stage is checked to be exactly this composition below)
    work = {k: v.clone() for k, v in state.items()}
    R.update_accumulators(work, grad.unsqueeze(-1), decays, dims)
    features = R.normalise_features(R.per_element_features(grad.unsqueeze(-1), param.unsqueeze(-1), work, dims))
    direction, magnitude = R.per_element_mlp(features, mlp)
    scale = R.param_scale(R.tensor_statistics(param, state["mom"], state["rms"]).mean_square_param)
    torch.testing.assert_close(scale.double(), (param.double() ** 2).mean().add(1e-9).sqrt(), rtol=1e-6, atol=0)
    update = R.velo_update(direction, magnitude, lr_mult, scale, 0.001, 0.001)

    ostate = oracle_state(shape, history, meta["rnn"])
    raw = S.spec_update_and_features(param.double(), grad.double(), ostate, S.spec_factored_dims(shape))
    ofeatures = S.spec_normalise(raw)
    odirection, omagnitude = S.spec_mlp(ofeatures, S.spec_generate(control[0].double(), meta["mlp"]))
    oupdate = param.double() - S.spec_new_param(param.double(), odirection, omagnitude, 0.8, lr=1.0, weight_decay=0.0)

    assert features.shape == s + (30,)
    torch.testing.assert_close(features.movedim(-1, 0).double(), ofeatures, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(work["mom"].movedim(-1, 0).double(), ostate["m"], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(work["rms"][..., 0].double(), ostate["v"], rtol=1e-5, atol=1e-12)
    if dims is None:
        torch.testing.assert_close(work["fac_vec_v"].movedim(-1, 0).double(), ostate["V"], rtol=1e-5, atol=1e-12)
    else:
        torch.testing.assert_close(work["fac_vec_row"].movedim(-1, 0).double(), ostate["R"], rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(work["fac_vec_col"].movedim(-1, 0).double(), ostate["C"], rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(update.double(), oupdate, rtol=1e-4, atol=1e-4 * float(oupdate.abs().max()))
    assert oupdate.abs().max() > 0

    again = {k: v.clone() for k, v in state.items()}
    new_param = R.apply_stage(param, grad, again, dims, decays, mlp, lr_mult, scale, lr=1.0, weight_decay=0.0,
                              exp_mult=0.001, step_mult=0.001)
    assert torch.equal(new_param, param - update)
    assert all(torch.equal(again[k], work[k]) for k in work)


def test_weight_decay_is_decoupled_and_applied_to_the_updated_param():
    param, update = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.25])
    torch.testing.assert_close(R.apply_update(param, update, lr=0.5, weight_decay=0.1),
                               (param - 0.5 * update) * (1 - 0.1 * 0.5))
    torch.testing.assert_close(R.apply_update(param, update, lr=0.5, weight_decay=0.0), param - 0.5 * update)


def test_non_factored_factored_momentum_has_no_epsilon(meta):
    state = init_state((5,), None)
    grad = torch.tensor([1e-4, -2e-3, 3e-2, 0.5, -1.0]).unsqueeze(-1)
    R.update_accumulators(state, grad, R.Decays.from_offsets(), None)
    features = R.per_element_features(grad, torch.zeros(5, 1), state, None)
    torch.testing.assert_close(features[..., 27:30], state["mom"] * state["fac_vec_v"] ** -0.5)
    names = R.ELEMENT_FEATURE_NAMES
    assert len(names) == 30 and names[:3] == ("grad", "clipped_grad", "param") and names[14] == "grad_times_rsqrt_rms"
    torch.testing.assert_close(features[..., 1], grad[..., 0].clamp(-0.1, 0.1))


def test_a_scalar_is_the_one_element_vector_of_the_jax_definition(meta):
    g = generator(9)
    decays = R.Decays.from_offsets()
    mlp = R.generate_mlp_weights(torch.randn(1, 256, generator=g), meta["mlp"]).select(0)
    results = []
    for shape in ((), (1,)):
        state = {k: (v.view((1,) + v.shape[-1:]) if v.numel() and not shape else v)
                 for k, v in init_state(shape, R.factored_dims(shape)).items()}
        param, grad = torch.tensor([0.7]), torch.tensor([-0.03])
        stats = R.tensor_statistics(param, state["mom"], state["rms"])
        new = R.apply_stage(param, grad, state, R.factored_dims(shape), decays, mlp, torch.tensor(0.5),
                            R.param_scale(stats.mean_square_param), lr=1.0, weight_decay=0.0, exp_mult=0.001,
                            step_mult=0.001)
        results.append((stats.lstm, new, state["mom"].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not torch.equal(results[0][1], torch.tensor([0.7]))


def test_decays_are_velos_without_offsets():
    decays = R.Decays.from_offsets()
    assert decays.momentum.tolist() == torch.tensor([0.9, 0.99, 0.999]).tolist()
    assert decays.rms.tolist() == torch.tensor([0.999]).tolist()
    assert decays.adafactor.tolist() == torch.tensor([0.9, 0.99, 0.999]).tolist()
