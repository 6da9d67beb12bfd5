"""The reduce phase without processes: every whole-tensor statistic is a sum that parts of the tensor
complete; VeLO's controller is exact on any split of the tensors given the max over all of them;
the packing helper; the ``process_group`` option. (Two real processes: tests/test_distributed.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

import lopt
from lopt import registry
from lopt import distributed
from lopt.distributed import Reducer, SumPacket
from lopt.reference import accumulators as acc
from lopt.reference import small_fc_lopt as small_fc
from lopt.reference import velo as R

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

# Rows of dim 0 as FSDP2 splits 9 rows over 3 processes (3, 3, 3) and over 4 (3, 3, 3, 0): the
# last part is empty.
ROW_SPLITS = {"thirds": [(0, 3), (3, 6), (6, 9)], "with_an_empty_part": [(0, 3), (3, 6), (6, 9), (9, 9)]}


def random(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def parts_sum(fn, tensor, split, *rest):
    """Σ over the row blocks of ``fn(block, *rest blocks)``: what the reduce phase adds up."""
    return sum(fn(tensor[a:b], *(r[a:b] for r in rest)) for a, b in ROW_SPLITS[split])


@pytest.mark.parametrize("split", ROW_SPLITS)
def test_feature_square_sums_of_row_blocks_add_up_to_the_whole_tensor(split):
    features = random((9, 4, 28), 1) * 10.0 ** torch.linspace(-3, 3, 28)
    whole = acc.feature_square_sums(features)
    torch.testing.assert_close(parts_sum(acc.feature_square_sums, features, split), whole, rtol=1e-13, atol=0)
    expected = (features.double() ** 2).sum(dim=(0, 1))
    torch.testing.assert_close(whole, expected, rtol=1e-13, atol=0)
    normalised = acc.normalise_by_square_sums(features, whole, 36)
    torch.testing.assert_close(normalised.double(), features.double() / torch.sqrt(1e-5 + expected / 36),
                               rtol=2e-7, atol=0)


@pytest.mark.parametrize("split", ROW_SPLITS)
def test_adafactor_means_over_a_split_axis_add_up(split):
    """Of R (Σ over d0) and C (Σ over d1), the one over dim 0 is the sum of the blocks' sums; the other
    is made of the blocks' own rows."""
    grad = random((9, 5, 1), 2)
    squares = (grad * grad + 1e-30).double()  # G = g² + 1e-30 in float32, summed in float64
    for dims in [(1, 0), (0, 1)]:  # (d1, d0): d0 = 0, then d1 = 0
        over_dim_0 = 0 if dims[1] == 0 else 1  # adafactor_axis_sums gives (Σ over d0, Σ over d1)
        whole = acc.adafactor_axis_sums(grad, dims)
        blocks = [acc.adafactor_axis_sums(grad[a:b], dims) for a, b in ROW_SPLITS[split]]
        torch.testing.assert_close(sum(block[over_dim_0] for block in blocks), whole[over_dim_0], rtol=1e-13, atol=0)
        torch.testing.assert_close(whole[over_dim_0], squares.sum(0), rtol=1e-13, atol=0)
        assert torch.equal(torch.cat([block[1 - over_dim_0] for block in blocks]), whole[1 - over_dim_0])
        torch.testing.assert_close(whole[1 - over_dim_0], squares.sum(1), rtol=1e-13, atol=0)


def test_row_col_mean_over_a_split_d1_axis_adds_up():
    """For (d1, d0) = (0, 2) the row accumulator keeps axis 0, and its mean over d1 (axis 0) spans the blocks."""
    row = random((9, 2, 3), 3).abs()
    dims = (0, 2)
    whole = acc.row_col_sum(row, dims)
    torch.testing.assert_close(parts_sum(lambda r: acc.row_col_sum(r, dims), row, "with_an_empty_part"), whole,
                               rtol=1e-13, atol=0)
    state = {"fac_vec_row": row, "fac_vec_col": random((9, 2, 3), 4).abs()}
    given = acc.adafactor_factors(state, dims, acc.mean_from_sum(whole, 9))
    assert all(torch.equal(a, b) for a, b in zip(given, acc.adafactor_factors(state, dims)))


@pytest.mark.parametrize("split", ROW_SPLITS)
def test_velo_statistics_from_the_blocks_two_passes_equal_the_whole_tensors(split):
    param, mom, rms = random((9, 4), 5, 0.1), random((9, 4, 3), 6, 0.01), random((9, 4, 1), 7).abs() * 1e-4
    first = parts_sum(R.moment_sums, param, split, mom, rms)
    moments = R.tensor_moments(first, param.numel())
    second = parts_sum(lambda m, v: R.centred_square_sums(m, v, moments), mom, split, rms)
    got = R.statistics_from_sums(moments, second, param.numel())
    want = R.tensor_statistics(param, mom, rms)
    torch.testing.assert_close(got.mean_square_param, want.mean_square_param, rtol=1e-7, atol=0)
    torch.testing.assert_close(got.lstm, want.lstm, rtol=1e-6, atol=0)


def test_gradient_norm_from_the_blocks_clips_like_the_whole_tensor():
    grad = random((9, 6), 8)
    square_sum = parts_sum(small_fc.gradient_square_sum, grad, "with_an_empty_part")
    torch.testing.assert_close(small_fc.clip_gradient_norm(grad, 0.5, square_sum),
                               small_fc.clip_gradient_norm(grad, 0.5), rtol=1e-7, atol=0)
    norm = grad.double().norm()
    torch.testing.assert_close(small_fc.clip_gradient_norm(grad, 0.5).double(), grad.double() * 0.5 / (norm + 1e-6),
                               rtol=1e-6, atol=0)


def test_controller_on_a_split_of_the_tensors_is_exact_given_the_max_over_all():
    """ZeRO: each process runs the controller on its tensors' rows with the max over every process's rows."""
    rnn = {k: v.double() for k, v in lopt.random_weights("velo", seed=3).tensors["rnn"].items()}
    rows = random((7, R.NUM_LSTM_FEATURES), 9).double()
    hidden, cell = random((7, 512), 10).double() * 0.1, random((7, 512), 11).double() * 0.1
    whole = R.controller_step(rows, hidden, cell, rnn)
    parts = [(0, 3), (3, 7), (7, 7)]  # the last process holds no tensor
    shared = torch.stack([R.mixing_max(rows[a:b], rnn) for a, b in parts]).max(dim=0).values
    for a, b in parts:
        out = R.controller_step(rows[a:b], hidden[a:b], cell[a:b], rnn, shared)
        torch.testing.assert_close(out.controls, whole.controls[a:b], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.lr_mult, whole.lr_mult[a:b], rtol=1e-12, atol=1e-12)
    alone = R.controller_step(rows[0:3], hidden[0:3], cell[0:3], rnn)  # without the others' rows: different
    assert not torch.allclose(alone.controls, whole.controls[0:3], rtol=1e-6, atol=0)
    assert torch.equal(R.mixing_max(rows[7:7], rnn), torch.zeros(512, dtype=torch.float64))


# ------------------------------------------------------------------------------------ packing


class TwoIdenticalProcesses(Reducer):
    """A stand-in for a group of two processes holding the same values: a sum doubles them."""

    def __init__(self):
        super().__init__(None)
        self.size = 2

    @property
    def is_identity(self):
        return False

    def sum_(self, buffer):
        self.collectives += 1
        self.bytes_reduced += buffer.numel() * buffer.element_size()
        return buffer.mul_(2)


def test_sum_packet_reduces_every_split_entry_in_one_collective():
    reducer = TwoIdenticalProcesses()
    packet = SumPacket(reducer)
    a, b, c = random((2, 3), 12), random((4,), 13), random((), 14)
    handles = [packet.add(a), packet.add(b, split=False), packet.add(c)]
    with pytest.raises(RuntimeError, match=r"call reduce\(\) before reading a split sum"):
        packet[handles[0]]
    assert torch.equal(packet[handles[1]], b.double())  # complete already: readable, never reduced
    packet.reduce()
    assert reducer.collectives == 1 and reducer.bytes_reduced == 8 * 7
    assert torch.equal(packet[handles[0]], 2 * a.double()) and packet[handles[0]].shape == (2, 3)
    assert torch.equal(packet[handles[1]], b.double())
    assert torch.equal(packet[handles[2]], 2 * c.double()) and packet[handles[2]].shape == ()


def test_one_process_reduces_nothing():
    reducer = Reducer()
    buffer = random((5,), 15).double()
    before = buffer.clone()
    assert reducer.is_identity and reducer.sum_(buffer) is buffer and reducer.max_(buffer) is buffer
    assert torch.equal(reducer.mean_(buffer), before) and reducer.collectives == 0
    packet = SumPacket(reducer)
    handle = packet.add(buffer)  # split, but there is no other process: readable at once
    assert torch.equal(packet[handle], before) and packet.reduce() and reducer.collectives == 0


def test_plain_tensors_have_a_whole_layout():
    assert distributed.shard_layout(torch.zeros(5, 3)) == distributed.ShardLayout((5, 3), 0, 5, False)
    assert distributed.shard_layout(torch.zeros(())) == distributed.ShardLayout((), 0, 1, False)


# ------------------------------------------------------------------------------------ the option


@pytest.mark.parametrize("name", registry.names())
def test_process_group_option_is_validated(name):
    params = [torch.nn.Parameter(random((3, 4), 16))]
    entry = registry.get(name)
    kwargs = dict(entry.required_arguments, weights=lopt.random_weights(entry.architecture, seed=1), backend="naive")
    cls = entry.front_end_class
    if name == "velo":
        kwargs["num_steps"] = 10
    with pytest.raises(TypeError, match=r"process_group must be None \(the default group when torch.distributed is "
                                        r"initialized\), 'local' \(no communication\) or a torch.distributed "
                                        r"ProcessGroup, got 'global'"):
        cls(params, process_group="global", **kwargs)
    opt = cls(params, process_group="local", **kwargs)
    assert opt.reducer.is_identity
    twin = copy.deepcopy(opt)  # 'local' and None are carried by copies and pickles
    assert twin.process_group == "local"


def test_velo_average_loss_must_be_a_bool():
    with pytest.raises(TypeError, match=r"average_loss must be True or False, got 'yes'"):
        lopt.VeLO([torch.nn.Parameter(torch.ones(2))], num_steps=5, weights=lopt.random_weights("velo", seed=1),
                  average_loss="yes")
