"""The pure-Python side of the fused backend, on the CPU: work layout, index geometry, availability."""

import math

import numpy as np
import pytest
import torch

from lopt.fused import launcher
from lopt.fused.plan import AXIS_JOB_FIELDS, TENSOR_FIELDS, TENSOR_POINTER_FIELDS, GroupLayout, factored_geometry
from lopt.reference.small_fc_lopt import factored_dims

SHAPES = [(4, 6), (6, 4), (5, 5), (1, 7), (7, 1), (2, 3, 4), (8, 3, 3, 3), (16, 16, 3, 3), (3, 1, 5, 1), (2, 5, 1, 3, 4),
          (768, 3, 4, 4), (9, 2, 9)]


def factor_indices(shape, dims):
    """R and C entry of every element, computed as cuda_src/lopt_common.cuh's factor_index does."""
    g = factored_geometry(shape, dims)
    rows, cols = [], []
    for e in range(math.prod(shape)):
        i, rest = e % g.inner, e // g.inner
        b, rest = rest % g.b, rest // g.b
        m, rest = rest % g.mid, rest // g.mid
        a, o = rest % g.a, rest // g.a
        without_a = ((o * g.mid + m) * g.b + b) * g.inner + i
        without_b = ((o * g.a + a) * g.mid + m) * g.inner + i
        rows.append(without_a if g.d0_is_a else without_b)
        cols.append(without_b if g.d0_is_a else without_a)
    return torch.tensor(rows), torch.tensor(cols)


@pytest.mark.parametrize("shape", SHAPES)
def test_factor_geometry_matches_axis_means(shape):
    """Summing each element into its (row, col) entry reproduces the means over axes d0 and d1."""
    dims = factored_dims(shape)
    d1, d0 = dims
    values = torch.rand(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.5
    rows, cols = factor_indices(shape, dims)
    row_sums = torch.zeros(math.prod(shape) // shape[d0], dtype=torch.float64).index_add_(0, rows, values.reshape(-1))
    col_sums = torch.zeros(math.prod(shape) // shape[d1], dtype=torch.float64).index_add_(0, cols, values.reshape(-1))
    torch.testing.assert_close(row_sums / shape[d0], values.mean(dim=d0).reshape(-1), rtol=1e-12, atol=0)
    torch.testing.assert_close(col_sums / shape[d1], values.mean(dim=d1).reshape(-1), rtol=1e-12, atol=0)


def test_axis_jobs_cover_each_accumulator_once():
    shapes = SHAPES + [(5,), (), (3,)]
    dims = [factored_dims(s) for s in shapes]
    layout = GroupLayout(shapes, dims, stats_chunk=64, apply_chunk=16)
    jobs = layout.static_jobs
    col = {name: i for i, name in enumerate(AXIS_JOB_FIELDS)}
    assert len(jobs) == 2 * sum(d is not None for d in dims)
    # Each job reduces q*x*i = numel elements into q*i outputs, and its ranges tile the launch.
    for (tensor, dest), job in zip(layout.job_dest, jobs):
        shape, (d1, d0) = shapes[tensor], dims[tensor]
        assert job[col["q"]] * job[col["x"]] * job[col["i"]] == math.prod(shape)
        removed = d0 if dest == "fac_row" else d1
        assert job[col["x"]] == shape[removed] and job[col["num_outputs"]] == math.prod(shape) // shape[removed]
        assert job[col["mode"]] == int(job[col["i"]] == 1)
    starts = jobs[:, col["first_output"]]
    assert list(starts) == list(np.concatenate([[0], np.cumsum(jobs[:, col["num_outputs"]])[:-1]]))
    assert layout.total_axis_outputs == int(jobs[:, col["num_outputs"]].sum())


def test_tensor_rows_ranges_are_contiguous_and_pointers_filled():
    shapes = [(4, 6), (5,), (), (2, 3, 4), (1000, 3)]
    dims = [factored_dims(s) for s in shapes]
    layout = GroupLayout(shapes, dims, stats_chunk=64, apply_chunk=128)
    t = {name: i for i, name in enumerate(TENSOR_FIELDS)}
    rows = layout.static_rows
    for first, count in (("first_stats_chunk", "num_stats_chunks"), ("first_apply_chunk", "num_apply_chunks"),
                         ("first_slab", "num_slabs"), ("first_col_entry", "num_col_entries")):
        assert list(rows[:, t[first]]) == list(np.concatenate([[0], np.cumsum(rows[:, t[count]])[:-1]]))
    assert list(rows[:, t["num_apply_chunks"]]) == [1, 1, 1, 1, math.ceil(3000 / 128)]
    assert list(rows[:, t["factored"]]) == [1, 0, 0, 1, 1]
    pointers = np.arange(len(shapes) * len(TENSOR_POINTER_FIELDS)).reshape(len(shapes), -1) + 1000
    filled = layout.tensor_rows(pointers)
    for column, name in enumerate(TENSOR_POINTER_FIELDS):
        assert list(filled[:, t[name]]) == list(pointers[:, column])
    assert (layout.static_rows[:, t["param"]] == 0).all()  # the static part is not modified


def test_fused_unavailable_reasons(monkeypatch):
    cpu = {torch.device("cpu")}
    assert "no fused kernels for velo" in launcher.fused_unavailable_reason("velo", cpu)
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
