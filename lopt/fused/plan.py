"""Work layout of a fused step over a parameter group, shared by the fused optimizers.

Everything here depends only on the tensors' shapes: per-tensor metadata rows (geometry of the
factored axes, chunk ranges of each pass, offsets into the workspaces) and the Adafactor reduction
jobs. Pointers are filled in per step (:meth:`GroupLayout.tensor_rows`, :meth:`GroupLayout.axis_rows`).
The field lists mirror the structs ``TensorMeta`` (``cuda_src/lopt_common.cuh``) and ``AxisJob``
(``cuda_src/adafactor.cuh``) field for field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TENSOR_FIELDS = (
    "param", "grad", "mom", "rms", "fac_row", "fac_col", "fac_full",
    "numel", "outer", "a", "mid", "b", "inner", "d0_is_a", "factored", "param_dtype", "grad_dtype",
    "first_stats_chunk", "num_stats_chunks", "first_slab", "num_slabs", "first_col_entry", "num_col_entries",
    "row_table", "col_table", "first_apply_chunk", "num_apply_chunks",
)
AXIS_JOB_FIELDS = (
    "src", "dtype", "q", "x", "i", "mode", "first_block", "num_xchunks", "xchunk", "partial_offset", "dest",
    "num_outputs", "first_output", "num_col_blocks",
)
TENSOR_POINTER_FIELDS = ("param", "grad", "mom", "rms", "fac_row", "fac_col", "fac_full", "param_dtype", "grad_dtype")
_T = {name: i for i, name in enumerate(TENSOR_FIELDS)}
_J = {name: i for i, name in enumerate(AXIS_JOB_FIELDS)}

AXIS_THREADS = 256          # adafactor_axis_partials block size
STRIDED_XCHUNK = 64         # rows summed per thread in the strided mode
CONTIGUOUS_XCHUNK = 2048    # elements summed per warp in the contiguous mode
TABLE_THREADS = 256         # adafactor_factor_tables block size


@dataclass(frozen=True)
class FactoredGeometry:
    """A factored tensor as (outer, a, mid, b, inner): a and b are its factored axes in positional order."""

    outer: int
    a: int
    mid: int
    b: int
    inner: int
    d0_is_a: bool


def factored_geometry(shape, dims) -> FactoredGeometry:
    d1, d0 = dims
    first, second = min(d0, d1), max(d0, d1)
    return FactoredGeometry(
        outer=math.prod(shape[:first]), a=shape[first], mid=math.prod(shape[first + 1:second]), b=shape[second],
        inner=math.prod(shape[second + 1:]), d0_is_a=(d0 == first),
    )


class GroupLayout:
    """The shape-dependent part of a fused step for a list of tensors.

    ``shapes[i]`` and ``dims[i]`` (``(d1, d0)`` or ``None``) describe tensor ``i``; ``stats_chunk``
    and ``apply_chunk`` are the elements per block of the statistics and apply passes.
    """

    def __init__(self, shapes, dims, *, stats_chunk: int, apply_chunk: int):
        self.shapes = [tuple(s) for s in shapes]
        self.num_tensors = len(self.shapes)
        rows = np.zeros((self.num_tensors, len(TENSOR_FIELDS)), dtype=np.int64)
        jobs = []
        stats_chunks = slabs = col_entries = row_entries = apply_chunks = 0
        partials = outputs = blocks = 0
        self.job_dest = []  # (tensor index, "fac_row" | "fac_col") per axis job
        for index, (shape, dim) in enumerate(zip(self.shapes, dims)):
            row = rows[index]
            numel = math.prod(shape)
            row[_T["numel"]] = numel
            row[_T["first_stats_chunk"]] = stats_chunks
            row[_T["num_stats_chunks"]] = -(-numel // stats_chunk)
            stats_chunks += row[_T["num_stats_chunks"]]
            row[_T["first_apply_chunk"]] = apply_chunks
            row[_T["num_apply_chunks"]] = -(-numel // apply_chunk)
            apply_chunks += row[_T["num_apply_chunks"]]
            row[_T["first_slab"]] = slabs
            row[_T["first_col_entry"]] = col_entries
            row[_T["row_table"]] = row_entries
            row[_T["col_table"]] = col_entries
            for name in ("outer", "a", "mid", "b", "inner"):
                row[_T[name]] = 1
            if dim is None:
                continue
            g = factored_geometry(shape, dim)
            row[_T["factored"]] = 1
            row[_T["d0_is_a"]] = int(g.d0_is_a)
            for name in ("outer", "a", "mid", "b", "inner"):
                row[_T[name]] = getattr(g, name)
            d1, d0 = dim
            num_row_entries = numel // shape[d0]
            num_col_entries = numel // shape[d1]
            row[_T["num_slabs"]] = num_row_entries // shape[d1]
            row[_T["num_col_entries"]] = num_col_entries
            slabs += row[_T["num_slabs"]]
            col_entries += num_col_entries
            row_entries += num_row_entries
            # Two reductions of g^2: over axis a (output indexed without a) and over axis b.
            sum_over_a = (g.outer, g.a, g.mid * g.b * g.inner, "fac_row" if g.d0_is_a else "fac_col")
            sum_over_b = (g.outer * g.a * g.mid, g.b, g.inner, "fac_col" if g.d0_is_a else "fac_row")
            for q, x, i, dest in (sum_over_a, sum_over_b):
                job = np.zeros(len(AXIS_JOB_FIELDS), dtype=np.int64)
                contiguous = i == 1
                xchunk = CONTIGUOUS_XCHUNK if contiguous else STRIDED_XCHUNK
                num_xchunks = -(-x // xchunk)
                num_outputs = q * i
                if contiguous:
                    num_col_blocks = 0
                    num_blocks = -(-(q * num_xchunks) // (AXIS_THREADS // 32))
                else:
                    num_col_blocks = -(-num_outputs // AXIS_THREADS)
                    num_blocks = num_col_blocks * num_xchunks
                for name, value in (("q", q), ("x", x), ("i", i), ("mode", int(contiguous)), ("first_block", blocks),
                                    ("num_xchunks", num_xchunks), ("xchunk", xchunk), ("partial_offset", partials),
                                    ("num_outputs", num_outputs), ("first_output", outputs),
                                    ("num_col_blocks", num_col_blocks)):
                    job[_J[name]] = value
                jobs.append(job)
                self.job_dest.append((index, dest))
                blocks += num_blocks
                partials += num_xchunks * num_outputs
                outputs += num_outputs
        self.static_rows = rows
        self.static_jobs = np.stack(jobs) if jobs else np.zeros((0, len(AXIS_JOB_FIELDS)), dtype=np.int64)
        self.total_stats_chunks = int(stats_chunks)
        self.total_apply_chunks = int(apply_chunks)
        self.total_slabs = int(slabs)
        self.total_row_entries = int(row_entries)
        self.total_col_entries = int(col_entries)
        self.total_axis_blocks = int(blocks)
        self.total_axis_partials = int(partials)
        self.total_axis_outputs = int(outputs)

    @property
    def num_axis_jobs(self) -> int:
        return len(self.static_jobs)

    def tensor_rows(self, pointers: np.ndarray) -> np.ndarray:
        """Metadata rows with ``pointers`` (num_tensors x len(TENSOR_POINTER_FIELDS)) filled in."""
        rows = self.static_rows.copy()
        for column, name in enumerate(TENSOR_POINTER_FIELDS):
            rows[:, _T[name]] = pointers[:, column]
        return rows

    def axis_rows(self, pointers: np.ndarray) -> np.ndarray:
        """Reduction jobs with source (gradient), its dtype and destination (R or C) pointers filled in."""
        jobs = self.static_jobs.copy()
        for j, (tensor, dest) in enumerate(self.job_dest):
            jobs[j, _J["src"]] = pointers[tensor, TENSOR_POINTER_FIELDS.index("grad")]
            jobs[j, _J["dtype"]] = pointers[tensor, TENSOR_POINTER_FIELDS.index("grad_dtype")]
            jobs[j, _J["dest"]] = pointers[tensor, TENSOR_POINTER_FIELDS.index(dest)]
        return jobs
