"""Work layout of a fused step over the tensors of every parameter group, shared by the fused optimizers.

Everything here depends only on the tensors' shapes (in memory order), their factored axes and their
groups: per-tensor metadata rows (geometry of the factored axes, chunk ranges of each pass, offsets
into the workspaces) and the Adafactor reduction jobs. Pointers and dtypes are filled in per plan
(:meth:`GroupLayout.tensor_rows`, :meth:`GroupLayout.axis_rows`); the gradients' addresses, new every
step, are not in these tables but in an array of their own (``Plan.gradients``), indexed by row.
Field names and block sizes come from :mod:`lopt.fused.contract`, the one description both sides
compile against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lopt.fused.contract import CONSTANTS, FIELD, empty_rows

TENSOR_FIELD = FIELD["TensorMeta"]
AXIS_JOB_FIELD = FIELD["AxisJob"]
NORM_JOB_FIELD = FIELD["NormJob"]
TENSOR_POINTER_FIELDS = ("param", "mom", "rms", "fac_row", "fac_col", "fac_full", "param_dtype", "grad_dtype")

AXIS_THREADS = CONSTANTS["AXIS_THREADS"]
STRIDED_XCHUNK = CONSTANTS["STRIDED_XCHUNK"]
CONTIGUOUS_XCHUNK = CONSTANTS["CONTIGUOUS_XCHUNK"]
TABLE_THREADS = CONSTANTS["TABLE_THREADS"]
# At most this many partial sums per output in the strided mode: adafactor_finalize sums an output's
# partials in one thread, so a long axis (GPT-2's 50257-row embedding: 786 chunks of 64 rows) would
# leave a few blocks summing long after the others; its chunks grow instead.
MAX_STRIDED_XCHUNKS = 64
STATS_CHUNK = CONSTANTS["STATS_CHUNK"]


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


def division_reciprocal(divisor: int) -> int:
    """ceil(2^64 / divisor) as the bits of an int64 (0 for a divisor of 1). For n < 2^32 and divisor < 2^32
    the high 64 bits of n · ceil(2^64 / divisor) are exactly n // divisor (the excess over n / divisor is
    below n / 2^64 < 1 / divisor), so the kernels split an element index into its factored coordinates
    with two multiplications instead of a division sequence (divide_by_reciprocal, common.cuh)."""
    if divisor < 1:
        raise ValueError(f"divisor {divisor} is not positive")
    if divisor == 1 or divisor >= 2**32:  # (a tensor with b >= 2^32 has more elements than 32-bit indices reach:
        return 0                         # the kernels divide its indices in 64 bits, without the reciprocal)
    reciprocal = (2**64 - 1) // divisor + 1
    return reciprocal - 2**64 if reciprocal >= 2**63 else reciprocal


class GroupLayout:
    """The shape-dependent part of a fused step for a list of tensors.

    ``shapes[i]`` (in memory order), ``dims[i]`` (``(d1, d0)`` in the same order, or ``None``) and
    ``groups[i]`` (the row of its parameter group) describe tensor ``i``; ``apply_chunk`` is the
    number of elements per block-iteration of the optimizer's apply pass; ``clipped[i]`` (optional)
    says that tensor ``i``'s gradient is clipped to a 2-norm (``max_grad_norm``), which needs its Σ g².
    ``global_rows[i]`` (optional; None for a whole tensor) is the length of axis 0 of the whole tensor
    when ``shapes[i]`` is only this process's rows of it (FSDP2's ``Shard(0)``; axis 0 must then be
    outermost in memory): sums over that axis are partial until reduced across processes, and the
    layout says where they are (``split_outputs``, ``row_col_sums``, the norm jobs), alike in every
    process.
    """

    def __init__(self, shapes, dims, groups, *, apply_chunk: int, stats_chunk: int = STATS_CHUNK, clipped=None,
                 global_rows=None):
        self.shapes = [tuple(s) for s in shapes]
        self.num_tensors = len(self.shapes)
        clipped = [False] * self.num_tensors if clipped is None else [bool(c) for c in clipped]
        global_rows = [None] * self.num_tensors if global_rows is None else list(global_rows)
        rows = empty_rows("TensorMeta", self.num_tensors)
        self._jobs = []
        self.job_tensor = []  # the tensor of each axis job
        self.total_axis_blocks = self.total_axis_partials = self.total_axis_outputs = 0
        slabs = col_entries = row_entries = apply_chunks = stats_chunks = split_slab_sums = 0
        reductions = []  # (tensor, q, x, i, divisor, which means, split)
        for index, (shape, dim, group) in enumerate(zip(self.shapes, dims, groups)):
            row = rows[index]
            numel = math.prod(shape)
            split = global_rows[index] is not None
            row[TENSOR_FIELD["numel"]] = numel
            row[TENSOR_FIELD["count"]] = global_rows[index] * math.prod(shape[1:]) if split else numel
            row[TENSOR_FIELD["group"]] = group
            row[TENSOR_FIELD["first_stats_chunk"]] = stats_chunks
            row[TENSOR_FIELD["num_stats_chunks"]] = -(-numel // stats_chunk)
            stats_chunks += row[TENSOR_FIELD["num_stats_chunks"]]
            row[TENSOR_FIELD["first_apply_chunk"]] = apply_chunks
            row[TENSOR_FIELD["num_apply_chunks"]] = -(-numel // apply_chunk)
            apply_chunks += row[TENSOR_FIELD["num_apply_chunks"]]
            row[TENSOR_FIELD["first_slab"]] = slabs
            row[TENSOR_FIELD["first_col_entry"]] = col_entries
            row[TENSOR_FIELD["row_table"]] = row_entries
            row[TENSOR_FIELD["col_table"]] = col_entries
            row[TENSOR_FIELD["row_col_sums"]] = -1
            for name in ("outer", "a", "mid", "b", "inner"):
                row[TENSOR_FIELD[name]] = 1
            if dim is None:
                continue
            g = factored_geometry(shape, dim)
            row[TENSOR_FIELD["factored"]] = 1
            row[TENSOR_FIELD["d0_is_a"]] = int(g.d0_is_a)
            for name in ("outer", "a", "mid", "b", "inner"):
                row[TENSOR_FIELD[name]] = getattr(g, name)
            row[TENSOR_FIELD["b_reciprocal"]] = division_reciprocal(g.b)
            row[TENSOR_FIELD["plain_index"]] = int(g.outer == g.mid == g.inner == 1 and numel < 2**32)
            d1, d0 = dim
            # A split tensor's axis 0 is one of its factored axes (then it is axis a, with outer = 1) or
            # neither (then every sum over a factored axis is complete in this process).
            split_a = split and min(d0, d1) == 0
            length_a = global_rows[index] if split_a else g.a
            slab_count = g.outer * g.mid * g.inner  # entries of R sharing all but the d1 coordinate
            num_row_entries = slab_count * shape[d1]
            num_col_entries = slab_count * shape[d0]
            row[TENSOR_FIELD["num_slabs"]] = slab_count
            row[TENSOR_FIELD["num_col_entries"]] = num_col_entries
            row[TENSOR_FIELD["row_col_divisor"]] = length_a if (split_a and d1 == 0) else shape[d1]
            if split_a and d1 == 0:  # row_col_mean sums R over the split axis
                row[TENSOR_FIELD["row_col_sums"]] = split_slab_sums
                split_slab_sums += 3 * slab_count
            slabs += slab_count
            col_entries += num_col_entries
            row_entries += num_row_entries
            # Two reductions of G: over axis a (output indexed without a) and over axis b. Their
            # outputs (the means of G) are R's and C's entries in order, so a job's first output is
            # where its accumulator's means start.
            reductions.append((index, g.outer, g.a, g.mid * g.b * g.inner, length_a,
                               "row_means" if g.d0_is_a else "col_means", split_a))
            reductions.append((index, g.outer * g.a * g.mid, g.b, g.inner, g.b,
                               "col_means" if g.d0_is_a else "row_means", False))
        # The reductions over a split axis first: their means, partial in each process, are then one
        # range of the axis-means workspace, [0, split_outputs), laid out alike in every process.
        factored_jobs = {}  # tensor -> its two Adafactor jobs' (partial_offset, num_partials)
        for tensor, q, x, i, divisor, means, _ in sorted(reductions, key=lambda r: not r[-1]):
            rows[tensor][TENSOR_FIELD[means]] = self.total_axis_outputs
            factored_jobs.setdefault(tensor, []).append(self._add_axis_job(tensor, q, x, i, divisor=divisor))
        self.split_outputs = sum(q * i for _, q, _, i, _, _, split in reductions if split)
        self.split_slab_sums = int(split_slab_sums)
        self.num_mean_jobs = len(self._jobs)
        # max_grad_norm needs Σ g² of each clipped tensor before the statistics pass: a factored
        # tensor's is the sum of either of its Adafactor jobs' partials (the one with fewer is taken);
        # any other tensor gets a job of its own, one sum over all its elements, after the Adafactor
        # jobs (its partials are not means: finalize leaves them to the norm blocks).
        norm_jobs = []
        for index in (i for i, c in enumerate(clipped) if c):
            if index in factored_jobs:
                offset, count = min(factored_jobs[index], key=lambda job: job[1])
            else:
                offset, count = self._add_axis_job(index, 1, math.prod(self.shapes[index]), 1, divisor=None)
            norm_jobs.append((index, offset, count))
        self.static_norm_jobs = empty_rows("NormJob", len(norm_jobs))
        for row, values in zip(self.static_norm_jobs, norm_jobs):
            row[[NORM_JOB_FIELD["tensor"], NORM_JOB_FIELD["partial_offset"], NORM_JOB_FIELD["num_partials"]]] = values
        self.static_rows = rows
        self.static_jobs = np.stack(self._jobs) if self._jobs else empty_rows("AxisJob", 0)
        del self._jobs
        self.total_stats_chunks = int(stats_chunks)
        self.total_apply_chunks = int(apply_chunks)
        self.total_elements = int(rows[:, TENSOR_FIELD["numel"]].sum()) if self.num_tensors else 0
        self.total_slabs = int(slabs)
        self.total_row_entries = int(row_entries)
        self.total_col_entries = int(col_entries)
        self.split_tensors = [r is not None for r in global_rows]  # (split among processes: partial sums)
        self.sharded = any(self.split_tensors)

    def _add_axis_job(self, tensor: int, q: int, x: int, i: int, *, divisor) -> tuple[int, int]:
        """Appends the reduction of ``(q, x, i)`` over x; returns its (partial_offset, num_partials).
        ``divisor``: its q·i sums divided by it become means in the axis-means workspace (None: only
        partials, for a norm)."""
        job = np.zeros(len(AXIS_JOB_FIELD), dtype=np.int64)
        contiguous = i == 1
        xchunk = CONTIGUOUS_XCHUNK if contiguous else max(STRIDED_XCHUNK, -(-x // MAX_STRIDED_XCHUNKS))
        num_xchunks = -(-x // xchunk)
        num_outputs = q * i
        if contiguous:
            num_col_blocks = 0
            num_blocks = -(-(q * num_xchunks) // (AXIS_THREADS // 32))
        else:
            num_col_blocks = -(-num_outputs // AXIS_THREADS)
            num_blocks = num_col_blocks * num_xchunks
        for name, value in (("tensor", tensor), ("q", q), ("x", x), ("i", i), ("mode", int(contiguous)),
                            ("first_block", self.total_axis_blocks), ("num_xchunks", num_xchunks), ("xchunk", xchunk),
                            ("partial_offset", self.total_axis_partials), ("num_outputs", num_outputs),
                            ("first_output", self.total_axis_outputs), ("num_col_blocks", num_col_blocks),
                            ("divisor", divisor or 0)):
            job[AXIS_JOB_FIELD[name]] = value
        self._jobs.append(job)
        self.job_tensor.append(tensor)
        placed = (self.total_axis_partials, num_xchunks * num_outputs)
        self.total_axis_blocks += num_blocks
        self.total_axis_partials += num_xchunks * num_outputs
        if divisor is not None:
            self.total_axis_outputs += num_outputs
        return placed

    @property
    def num_axis_jobs(self) -> int:
        """Jobs of the axis pass: the Adafactor means' (``num_mean_jobs``, first), then max_grad_norm's."""
        return len(self.static_jobs)

    @property
    def num_norm_jobs(self) -> int:
        return len(self.static_norm_jobs)

    def tensor_rows(self, pointers: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Metadata rows with ``pointers`` (num_tensors x len(TENSOR_POINTER_FIELDS)) filled in (into
        ``out``, a copy of ``static_rows``, if given)."""
        rows = self.static_rows.copy() if out is None else out
        rows[:, [TENSOR_FIELD[name] for name in TENSOR_POINTER_FIELDS]] = pointers
        return rows

    def axis_rows(self, pointers: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Reduction jobs with their source gradient's dtype filled in from ``pointers`` (into ``out``, a
        copy of ``static_jobs``, if given); the source's address is read from the gradient array."""
        jobs = self.static_jobs.copy() if out is None else out
        if len(jobs):
            jobs[:, AXIS_JOB_FIELD["dtype"]] = pointers[np.asarray(self.job_tensor), TENSOR_POINTER_FIELDS.index("grad_dtype")]
        return jobs
