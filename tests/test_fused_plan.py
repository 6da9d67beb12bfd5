"""The pure-Python side of the fused backend, on the CPU: work layout, index geometry, availability."""

import math

import numpy as np
import pytest
import torch

from lopt.fused import contract, launcher
from lopt.fused.engine import arranged, memory_order
from lopt.fused.plan import TENSOR_POINTER_FIELDS, GroupLayout
from lopt.reference.small_fc_lopt import factored_dims

SHAPES = [(4, 6), (6, 4), (5, 5), (1, 7), (7, 1), (2, 3, 4), (8, 3, 3, 3), (16, 16, 3, 3), (3, 1, 5, 1), (2, 5, 1, 3, 4),
          (768, 3, 4, 4), (9, 2, 9)]


def test_axis_jobs_cover_each_accumulator_once():
    shapes = SHAPES + [(5,), (), (3,)]
    dims = [factored_dims(s) for s in shapes]
    layout = GroupLayout(shapes, dims, [i % 2 for i in range(len(shapes))], stats_chunk=64, apply_chunk=16)
    jobs = layout.static_jobs
    col = contract.FIELD["AxisJob"]
    t = contract.FIELD["TensorMeta"]
    assert len(jobs) == 2 * sum(d is not None for d in dims)
    # Each job reduces q*x*i = numel elements into q*i outputs (the means of one accumulator, in its
    # entry order), and its ranges tile the launch.
    for tensor, job in zip(layout.job_tensor, jobs):
        shape, (d1, d0) = shapes[tensor], dims[tensor]
        row = layout.static_rows[tensor]
        assert job[col["q"]] * job[col["x"]] * job[col["i"]] == math.prod(shape)
        dest = "row_means" if job[col["first_output"]] == row[t["row_means"]] else "col_means"
        assert job[col["first_output"]] == row[t[dest]]
        removed = d0 if dest == "row_means" else d1
        assert job[col["x"]] == shape[removed] and job[col["num_outputs"]] == math.prod(shape) // shape[removed]
        assert job[col["mode"]] == int(job[col["i"]] == 1)
    starts = jobs[:, col["first_output"]]
    assert list(starts) == list(np.concatenate([[0], np.cumsum(jobs[:, col["num_outputs"]])[:-1]]))
    assert layout.total_axis_outputs == int(jobs[:, col["num_outputs"]].sum())
    assert list(layout.static_rows[:, t["group"]]) == [i % 2 for i in range(len(shapes))]


def test_tensor_rows_ranges_are_contiguous_and_pointers_filled():
    shapes = [(4, 6), (5,), (), (2, 3, 4), (1000, 3)]
    dims = [factored_dims(s) for s in shapes]
    layout = GroupLayout(shapes, dims, [0] * len(shapes), stats_chunk=64, apply_chunk=128)
    t = contract.FIELD["TensorMeta"]
    rows = layout.static_rows
    for first, count in (("first_apply_chunk", "num_apply_chunks"), ("first_slab", "num_slabs"),
                         ("first_col_entry", "num_col_entries")):
        assert list(rows[:, t[first]]) == list(np.concatenate([[0], np.cumsum(rows[:, t[count]])[:-1]]))
    # The statistics pass's chunks: each tensor's contiguous, in row order (the kernels search the tensor
    # table by first_stats_chunk), whichever tensors have axis jobs or are clipped.
    for clipped in (None, [False, True, False, False, False]):
        layout = GroupLayout(shapes, dims, [0] * len(shapes), stats_chunk=64, apply_chunk=128, clipped=clipped)
        rows = layout.static_rows
        assert list(rows[:, t["first_stats_chunk"]]) == list(np.concatenate([[0], np.cumsum(rows[:, t["num_stats_chunks"]])[:-1]]))
        assert layout.total_stats_chunks == rows[:, t["num_stats_chunks"]].sum()
        assert list(rows[:, t["num_stats_chunks"]]) == [1, 1, 1, 1, math.ceil(3000 / 64)]
    assert list(rows[:, t["num_apply_chunks"]]) == [1, 1, 1, 1, math.ceil(3000 / 128)]
    assert list(rows[:, t["factored"]]) == [1, 0, 0, 1, 1]
    pointers = np.arange(len(shapes) * len(TENSOR_POINTER_FIELDS)).reshape(len(shapes), -1) + 1000
    filled = layout.tensor_rows(pointers)
    for column, name in enumerate(TENSOR_POINTER_FIELDS):
        assert list(filled[:, t[name]]) == list(pointers[:, column])
    assert (layout.static_rows[:, t["param"]] == 0).all()  # the static part is not modified


def test_fused_unavailable_reasons(monkeypatch):
    cpu = {torch.device("cpu")}
    assert "no fused kernels for adam" in launcher.fused_unavailable_reason("adam", cpu)
    assert launcher.fused_unavailable_reason("small_fc_lopt", set()) == "the optimizer has no parameters"
    assert "not all on a CUDA device" in launcher.fused_unavailable_reason("small_fc_lopt", cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device" in launcher.fused_unavailable_reason("small_fc_lopt", {torch.device("cuda", 0)})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 0))
    assert "compute capability >= 8.0" in launcher.fused_unavailable_reason("small_fc_lopt", {torch.device("cuda", 0)})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(launcher, "cupy_or_none", lambda: None)
    assert "CuPy is not installed" in launcher.fused_unavailable_reason("small_fc_lopt", {torch.device("cuda", 0)})


@pytest.mark.parametrize("capability, nvrtc_max, expected", [
    ((8, 0), 121, "sm_80"), ((8, 6), 121, "sm_86"), ((8, 9), 121, "sm_89"),
    ((9, 0), 121, "sm_90"),
    ((10, 0), 121, "sm_100"), ((12, 0), 121, "sm_120"),
    ((10, 0), 90, "compute_90"),  # newer than this NVRTC: PTX, compiled by the driver
])
def test_nvrtc_architecture(capability, nvrtc_max, expected):
    assert launcher.nvrtc_architecture(capability, nvrtc_max) == expected


def test_backend_choice_without_cuda(monkeypatch):
    import lopt

    weights = lopt.random_weights("small_fc_lopt")
    params = [torch.nn.Parameter(torch.randn(3, 3))]
    assert lopt.SmallFCLOpt(params, weights=weights).backend == "naive"
    with pytest.raises(RuntimeError, match=r"backend='fused'\) cannot run: the parameters are not all on a CUDA device"):
        lopt.SmallFCLOpt(params, weights=weights, backend="fused")
    with pytest.raises(ValueError, match="backend must be one of"):
        lopt.SmallFCLOpt(params, weights=weights, backend="cuda")


def test_auto_warns_once_and_uses_naive_when_fused_cannot_start(monkeypatch):
    """CUDA parameters but no working fused backend: one warning saying why, then the naive backend."""
    import lopt
    from lopt.optimizers import base

    monkeypatch.setattr(launcher, "fused_unavailable_reason", lambda arch, devices: "CuPy is not installed (test)")
    monkeypatch.setattr(base.LearnedOptimizer, "_param_devices", lambda self: {torch.device("cuda", 0)})
    params = [torch.nn.Parameter(torch.randn(3, 3))]
    with pytest.warns(RuntimeWarning, match="using the naive backend because CuPy is not installed"):
        opt = lopt.SmallFCLOpt(params, weights=lopt.random_weights("small_fc_lopt"))
    assert opt.backend == "naive" and "CuPy" in opt.backend_reason


def test_contract_header_declares_every_struct_and_constant():
    header = contract.cuda_header()
    for struct, fields in contract.STRUCTS.items():
        assert f"struct {struct} {{" in header and f"sizeof({struct}) == {8 * len(fields)}" in header
        for index, field in enumerate(fields):
            assert f"#define LOPT_{struct.upper()}_{field.upper()} {index}\n" in header
    for name, value in contract.CONSTANTS.items():
        assert f"#define LOPT_{name} {value}\n" in header
    assert contract.CONSTANTS["STATS_CHUNK"] == contract.CONSTANTS["STATS_THREADS"] * contract.CONSTANTS["STATS_PER_THREAD"]


@pytest.mark.parametrize("make, order", [
    (lambda: torch.randn(2, 3, 4, 5), (0, 1, 2, 3)),
    (lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), (0, 2, 3, 1)),
    (lambda: torch.randn(5, 7).t(), (1, 0)),
    (lambda: torch.randn(3, 1, 4).permute(2, 0, 1), (0, 1, 2)),  # size-1 axes: any stride
    (lambda: torch.randn(()), ()),
])
def test_memory_order_of_dense_layouts(make, order):
    t = make()
    got = memory_order(t)
    assert t.permute(got).is_contiguous()
    if t.dim() and 1 not in t.shape:
        assert got == order


def test_views_with_gaps_are_not_dense():
    assert memory_order(torch.randn(6, 8)[:, ::2]) is None
    assert memory_order(torch.randn(4, 4)[1:3, 1:3]) is None
    assert memory_order(torch.randn(4, 1).expand(4, 3)) is None  # overlapping


def test_arranged_keeps_values_and_takes_the_memory_order():
    t = torch.randn(2, 3, 4, 5)
    out = arranged(t, (0, 2, 3, 1))
    assert torch.equal(out, t) and out.permute(0, 2, 3, 1).is_contiguous() and out.shape == t.shape
    assert arranged(out, (0, 2, 3, 1)) is out  # already in that order: no copy


def emulated_axis_partials(layout: GroupLayout, squares: list) -> np.ndarray:
    """What adafactor_axis_partials writes (float64), from each tensor's G in memory order."""
    col = contract.FIELD["AxisJob"]
    partials = np.full(layout.total_axis_partials, np.nan)
    for tensor, job in zip(layout.job_tensor, layout.static_jobs):
        q, x, i, xchunk = (int(job[col[name]]) for name in ("q", "x", "i", "xchunk"))
        values = squares[tensor].reshape(q, x, i)
        for chunk in range(int(job[col["num_xchunks"]])):
            sums = values[:, chunk * xchunk:(chunk + 1) * xchunk, :].sum(axis=1).reshape(-1)  # output q*i + i
            start = int(job[col["partial_offset"]]) + chunk * q * i
            partials[start:start + q * i] = sums
    return partials


def test_norm_jobs_sum_each_clipped_tensors_squares_once():
    """max_grad_norm: a clipped tensor's Σ G is the sum of one partial range of the axis pass: one of
    its Adafactor jobs' (factored) or a job of its own (any other), which adds no means."""
    shapes = [(300, 5), (7,), (), (2, 3, 4), (5000,), (4, 6), (9, 2, 9)]
    dims = [factored_dims(s) for s in shapes]
    clipped = [True, True, False, True, True, False, True]
    plain = GroupLayout(shapes, dims, [0] * len(shapes), apply_chunk=128)
    layout = GroupLayout(shapes, dims, [0] * len(shapes), apply_chunk=128, clipped=clipped)
    # The Adafactor part of the layout is unchanged; the norm jobs come after it.
    assert layout.num_mean_jobs == plain.num_axis_jobs
    assert np.array_equal(layout.static_jobs[:layout.num_mean_jobs], plain.static_jobs)
    assert layout.total_axis_outputs == plain.total_axis_outputs
    own = [t for t, c in enumerate(clipped) if c and dims[t] is None]
    assert layout.job_tensor[layout.num_mean_jobs:] == own
    rng = np.random.default_rng(0)
    squares = [rng.random(math.prod(s) or 1) for s in shapes]
    partials = emulated_axis_partials(layout, squares)
    assert not np.isnan(partials).any()
    n = contract.FIELD["NormJob"]
    jobs = layout.static_norm_jobs
    assert list(jobs[:, n["tensor"]]) == [t for t, c in enumerate(clipped) if c]
    for job in jobs:
        start, count = int(job[n["partial_offset"]]), int(job[n["num_partials"]])
        assert partials[start:start + count].sum() == pytest.approx(squares[job[n["tensor"]]].sum(), rel=1e-12)
    # A factored tensor takes the job with fewer partials: for (300, 5), the sum over its 300 rows (5
    # columns x 5 chunks of 64 rows), not the one over its columns (300 rows x 1 chunk).
    assert jobs[0][n["num_partials"]] == 25


def emulated_means(layout: GroupLayout, partials: np.ndarray) -> np.ndarray:
    """What adafactor_finalize writes: each output's partials summed in chunk order, / the job's divisor."""
    col = contract.FIELD["AxisJob"]
    means = np.full(layout.total_axis_outputs, np.nan)
    for job in layout.static_jobs[:layout.num_mean_jobs]:
        outputs, first, offset = (int(job[col[n]]) for n in ("num_outputs", "first_output", "partial_offset"))
        num_xchunks = int(job[col["num_xchunks"]])
        chunks = partials[offset:offset + num_xchunks * outputs].reshape(num_xchunks, outputs)
        means[first:first + outputs] = chunks.sum(axis=0) / job[col["divisor"]]
    return means


def test_a_long_strided_axis_is_summed_in_at_most_max_strided_xchunks_chunks():
    """adafactor_finalize sums each output's partials in one thread, so the strided mode's chunks grow
    with a long axis (GPT-2's 50257-row embedding) to keep at most MAX_STRIDED_XCHUNKS partials per
    output; short axes keep STRIDED_XCHUNK rows per chunk. The chunk sums still give the means."""
    from lopt.fused.plan import MAX_STRIDED_XCHUNKS, STRIDED_XCHUNK

    shapes = [(50257, 3), (4096, 5), (300, 7)]
    dims = [factored_dims(s) for s in shapes]
    layout = GroupLayout(shapes, dims, [0] * len(shapes), apply_chunk=128)
    col = contract.FIELD["AxisJob"]
    strided = [job for job in layout.static_jobs if job[col["mode"]] == 0]
    assert [(int(job[col["x"]]), int(job[col["xchunk"]]), int(job[col["num_xchunks"]])) for job in strided] == [
        (50257, 786, 64), (4096, STRIDED_XCHUNK, 64), (300, STRIDED_XCHUNK, 5)]
    assert all(job[col["num_xchunks"]] <= MAX_STRIDED_XCHUNKS for job in strided)
    rng = np.random.default_rng(1)
    squares = [rng.random(math.prod(s)) for s in shapes]
    means = emulated_means(layout, emulated_axis_partials(layout, squares))
    for tensor, job in zip(layout.job_tensor, layout.static_jobs):
        q, x, i = (int(job[col[name]]) for name in ("q", "x", "i"))
        first, outputs = int(job[col["first_output"]]), int(job[col["num_outputs"]])
        expected = squares[tensor].reshape(q, x, i).mean(axis=1).reshape(-1)
        np.testing.assert_allclose(means[first:first + outputs], expected, rtol=1e-12)


def test_sharded_layouts_agree_across_processes_and_their_reduced_means_are_the_whole_tensors():
    """FSDP2's Shard(0) over 2 processes (uneven, and one empty shard): every range the reduce phase
    sums (the means over the split axis, the row-factor normalisers' slab sums, the norm jobs) has the
    same place and size in both processes, and the summed partial means are the unsharded means."""
    shapes = [(7, 5), (5, 9), (3, 4, 5, 6), (11,), (1, 8), (9, 2, 9)]
    dims = [factored_dims(s) for s in shapes]
    t = contract.FIELD["TensorMeta"]

    def rows_of(n, rank):  # torch.chunk's split
        chunk = -(-n // 2)
        start = min(rank * chunk, n)
        return start, min(chunk, n - start)

    whole = GroupLayout(shapes, dims, [0] * len(shapes), apply_chunk=128, clipped=[True] * len(shapes))
    rng = np.random.default_rng(1)
    squares = [rng.random(math.prod(s)).reshape(s) for s in shapes]
    full_means = emulated_means(whole, emulated_axis_partials(whole, [s.reshape(-1) for s in squares]))
    layouts, means, norm_sums = [], [], []
    for rank in range(2):
        local_shapes = [(rows_of(s[0], rank)[1],) + s[1:] for s in shapes]
        layout = GroupLayout(local_shapes, dims, [0] * len(shapes), apply_chunk=128, clipped=[True] * len(shapes),
                             global_rows=[s[0] for s in shapes])
        local = [sq[rows_of(s[0], rank)[0]:][:rows_of(s[0], rank)[1]].reshape(-1) for sq, s in zip(squares, shapes)]
        partials = emulated_axis_partials(layout, local)
        layouts.append(layout)
        means.append(emulated_means(layout, partials))
        n = contract.FIELD["NormJob"]
        norm_sums.append([partials[j[n["partial_offset"]]:j[n["partial_offset"]] + j[n["num_partials"]]].sum()
                          for j in layout.static_norm_jobs])
    a, b = layouts
    assert a.sharded and a.split_outputs == b.split_outputs > 0 and a.split_slab_sums == b.split_slab_sums > 0
    assert list(a.static_rows[:, t["row_col_sums"]]) == list(b.static_rows[:, t["row_col_sums"]])
    assert list(a.static_rows[:, t["count"]]) == [math.prod(s) for s in shapes] == list(b.static_rows[:, t["count"]])
    assert a.num_norm_jobs == b.num_norm_jobs == len(shapes)
    np.testing.assert_allclose(np.add(*norm_sums), [s.sum() for s in squares], rtol=1e-12)
    reduced = means[0][:a.split_outputs] + means[1][:b.split_outputs]
    for index, dim in enumerate(dims):
        if dim is None or 0 not in dim:
            continue
        which = "row_means" if dim[1] == 0 else "col_means"  # the accumulator that lacks axis 0
        count = math.prod(shapes[index]) // shapes[index][0]
        start, full_start = int(a.static_rows[index][t[which]]), int(whole.static_rows[index][t[which]])
        assert start == int(b.static_rows[index][t[which]]) and start + count <= a.split_outputs
        np.testing.assert_allclose(reduced[start:start + count], full_means[full_start:full_start + count], rtol=1e-12)
    # Where d1 is axis 0, row_col_mean divides by the whole axis; elsewhere by the local one.
    assert a.static_rows[1][t["row_col_divisor"]] == 5 and a.static_rows[1][t["row_col_sums"]] >= 0
    assert a.static_rows[0][t["row_col_sums"]] == -1


def high_64_bits_as_the_kernels_form_them(n: int, reciprocal_bits: int) -> int:
    """divide_by_reciprocal (common.cuh) step by step: n · r_hi + umulhi(n, r_lo), then its high 32 bits,
    each product in the width the GPU computes it in."""
    r = reciprocal_bits % 2**64
    if r == 0:
        return n
    r_hi, r_lo = r >> 32, r % 2**32
    total = n * r_hi + ((n * r_lo) >> 32)
    assert total < 2**64  # (the kernels' 64-bit sum does not wrap)
    return total >> 32


def test_division_by_reciprocal_is_exact_for_32_bit_indices():
    from lopt.fused.plan import division_reciprocal

    rng = np.random.default_rng(0)
    divisors = ([1, 2, 3, 5, 7, 129, 1000, 1024, 4096, 50257, 2**16 + 1, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1]
                + [int(d) for d in rng.integers(2, 2**32, 200)])
    for divisor in divisors:
        reciprocal = division_reciprocal(divisor)
        assert -2**63 <= reciprocal < 2**63
        quotients = [int(q) for q in rng.integers(0, 2**32 // divisor + 1, 20)]
        # Numerators where the quotient changes (multiples of the divisor and one less), and the largest.
        numerators = {q * divisor + delta for q in quotients for delta in (-1, 0, 1, divisor - 1)} | {2**32 - 1, 0}
        for n in sorted(m for m in numerators if 0 <= m < 2**32):
            assert high_64_bits_as_the_kernels_form_them(n, reciprocal) == n // divisor, (n, divisor)
    assert division_reciprocal(1) == 0 and division_reciprocal(2) == -2**63
    assert division_reciprocal(3) == 6148914691236517206  # ceil(2^64 / 3)
    assert division_reciprocal(2**32) == 0  # (such a tensor's indices divide in 64 bits)
    with pytest.raises(ValueError, match="divisor 0 is not positive"):
        division_reciprocal(0)


def test_plain_matrices_take_the_reciprocal_index_path():
    """The kernels split a factored element index with b_reciprocal only where plain_index is set: a matrix
    (no other axis longer than 1 around its factored axes) of fewer than 2^32 elements."""
    from lopt.fused.plan import division_reciprocal

    shapes = [(300, 129), (129, 300), (7, 1), (8, 3, 3, 3), (3, 1, 5, 1), (1, 7), (5,), (2**16, 2**16)]
    dims = [factored_dims(s) for s in shapes]
    layout = GroupLayout(shapes, dims, [0] * len(shapes), stats_chunk=64, apply_chunk=16)
    t = contract.FIELD["TensorMeta"]
    for shape, row in zip(shapes, layout.static_rows):
        geometry = {name: int(row[t[name]]) for name in ("outer", "mid", "inner", "b")}
        plain = geometry["outer"] == geometry["mid"] == geometry["inner"] == 1 and math.prod(shape) < 2**32
        assert int(row[t["plain_index"]]) == (plain and int(row[t["factored"]]) == 1), shape
        assert int(row[t["b_reciprocal"]]) == division_reciprocal(geometry["b"]), shape
    # ((3, 1, 5, 1) factors its axes 0 and 2, and the axes of length 1 around them change no index.)
    assert [int(row[t["plain_index"]]) for row in layout.static_rows] == [1, 1, 1, 0, 1, 1, 0, 0]


@pytest.mark.parametrize("count, expected", [(1, 0), (1000, 0), (2**28, 4), (2**31, 5)])
def test_layer2_exponent_keeps_the_first_layers_bound_within_half_fp16_range(count, expected):
    """layer2_exponent: the least e with sqrt(count)·Σ|W1 features| + |b1| + Σ|W1 time| <= 2^15·2^e."""
    from lopt.fused.small_fc_lopt import layer2_exponent

    w1 = torch.full((32, 39), 0.5)
    w1[3, :28] = -0.6  # the largest unit: sum 16.8 over the features
    network = {"network.input.weight": w1, "network.input.bias": torch.full((32,), -0.25)}
    bound = math.sqrt(count) * 16.8 + 0.25 + 11 * 0.5  # written from the docstring's bound
    assert layer2_exponent(network, count) == expected
    assert bound <= 2.0**15 * 2.0**expected and (expected == 0 or bound > 2.0**15 * 2.0 ** (expected - 1))


@pytest.mark.parametrize("count, expected", [(1, 0), (1000, 0), (2**20, 3), (2**31, 8)])
def test_layer3_exponent_keeps_the_second_layers_bound_within_half_fp16_range(count, expected):
    """layer3_exponent: the least e with max_n Σ_k |W2[n, k]|·B1_k + |b2_n| <= 2^15·2^e, B1_k the first
    layer's bound (sqrt(count)·Σ|W1 features| + |b1| + Σ|W1 time|)."""
    from lopt.fused.small_fc_lopt import layer3_exponent

    w1 = torch.full((32, 39), 0.5)
    w1[3, :28] = -0.6  # unit 3's features: 16.8 where the others' are 14
    w2 = torch.full((32, 32), -0.25)
    w2[7, 3] = 2.0  # unit 7 of layer 2 weighs unit 3 of layer 1 most
    network = {"network.input.weight": w1, "network.input.bias": torch.full((32,), -0.25),
               "network.linear_0.weight": w2, "network.linear_0.bias": torch.full((32,), 3.0)}
    b1 = [math.sqrt(count) * (16.8 if k == 3 else 14.0) + 0.25 + 11 * 0.5 for k in range(32)]
    bound = 2.0 * b1[3] + sum(0.25 * b1[k] for k in range(32) if k != 3) + 3.0  # unit 7, from the docstring's bound
    assert layer3_exponent(network, count) == expected
    assert bound <= 2.0**15 * 2.0**expected and (expected == 0 or bound > 2.0**15 * 2.0 ** (expected - 1))
