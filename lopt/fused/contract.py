"""The Python↔CUDA contract of the fused backends, written once.

The kernels read per-tensor, per-job and per-group metadata as rows of int64 fields (apex
``multi_tensor_apply`` style: one launch covers every tensor). This module is the only place that
lists those fields and their order, and the block sizes and buffer widths both sides depend on:

* :data:`STRUCTS` — each struct's fields, in order (all int64);
* :data:`CONSTANTS` — block sizes, chunk lengths, table widths;
* :func:`cuda_header` — the C++ text of both, which the launcher hands to the compiler as the
  header ``lopt_contract.cuh`` (NVRTC at run time; nvcc in the CPU tests), so a field the kernels
  read that Python does not write (or the reverse, in a different order) cannot compile or drift.

``python -m lopt.fused.contract`` prints the header.
"""

from __future__ import annotations

import numpy as np

HEADER_NAME = "lopt_contract.cuh"

STRUCTS: dict = {
    # One row per tensor of a fused step (all parameter groups together). A factored tensor (rank
    # >= 2) is viewed as (outer, a, mid, b, inner), a and b its two factored axes in memory order;
    # d0 (the larger) is a when d0_is_a.
    "TensorMeta": (
        # Device pointers. `grad` is not uploaded with the table: the gradients' addresses change every
        # step and come from the step's gradient array (one int64 per row), which the kernels read
        # into this field (tensor_row in common.cuh).
        "param", "grad", "mom", "rms", "fac_row", "fac_col", "fac_full",
        "numel", "outer", "a", "mid", "b", "inner", "d0_is_a", "factored", "param_dtype", "grad_dtype",
        "b_reciprocal",  # ceil(2^64 / b) as int64 bits (0 for b = 1): the kernels divide indices by b with it
        "plain_index",  # 1: a factored matrix (outer = mid = inner = 1) of fewer than 2^32 elements
        "group",  # row of the GroupMeta table
        "first_stats_chunk", "num_stats_chunks",  # statistics pass: chunks of LOPT_STATS_CHUNK elements
        "first_slab", "num_slabs",  # factor tables: slabs of R (one row_col_mean each)
        "first_col_entry", "num_col_entries",  # factor tables: entries of C
        "row_table", "col_table",  # first entry of the tensor's R / C in the factor tables
        "row_means", "col_means",  # first entry of its R / C means in the axis-means workspace
        "first_apply_chunk", "num_apply_chunks",  # apply pass: chunks of the optimizer's apply chunk
        # Sharded parameters (FSDP2, Shard(0)): the row is this process's rows of the tensor; what spans
        # the whole tensor uses these (on one process: numel, the length of d1, -1).
        "count",  # elements of the whole tensor (the normalisers' divisor)
        "row_col_divisor",  # length of axis d1 of the whole tensor (row_col_mean's divisor)
        "row_col_sums",  # where axis d1 is split: first of this tensor's slab sums (3 per slab) in the
        #                  buffer reduced across processes between the two factor-table launches; else -1
    ),
    # One Adafactor reduction: means[first_output + q*i_len + i] = Σ_x G[(q*X + x)*I + i] / divisor, G = g² + 1e-30
    # (divisor: X, or the whole tensor's length of the axis where it is split among processes).
    # mode 0 ("strided", I > 1): a thread per output column, a block covers 256 columns x one x-chunk;
    # mode 1 ("contiguous", I == 1): a warp per (q, x-chunk), 8 per block. `tensor`: the row of the
    # source gradient (its address in the step's gradient array), `dtype` its dtype.
    "AxisJob": (
        "tensor", "dtype", "q", "x", "i", "mode", "first_block", "num_xchunks", "xchunk", "partial_offset",
        "num_outputs", "first_output", "num_col_blocks", "divisor",
    ),
    # max_grad_norm (small_fc_lopt), one row per clipped tensor: Σ g² of the tensor is the sum of the
    # axis pass's partials [partial_offset, partial_offset + num_partials) (less numel·1e-30, as they
    # are sums of G); adafactor_finalize turns it into the tensor's clip factor.
    "NormJob": ("tensor", "partial_offset", "num_partials"),
    # VeLO's per-tensor extras, one row per TensorMeta row: the tensor's LSTM state (float32, 512 each)
    # and its rank class (0..4: axes longer than 1; 5: five or more, the all-zero one-hot).
    "VeloTensor": ("lstm_hidden", "lstm_cell", "rank_class"),
    # CELO2's per-tensor extras, one row per TensorMeta row (lopt.fused.celo2). `kind`: which branch steps
    # the tensor (CELO2_LEARNED: the kernels' learned branch; CELO2_ADAM_OWN / CELO2_ADAM_SHARED: the AdamW
    # branch on its own moments / on the shared accumulators; CELO2_SLICED: a tensor of several small slices
    # of its last two axes, stepped slice by slice in one pass (celo2_slices); CELO2_ELSEWHERE: stepped outside
    # the kernels, which only check its gradient). A learned tensor's proposed step goes to the step buffer at
    # step_offset + e for its element e (memory order: its Newton–Schulz stack holds the matrix as it lies
    # in memory), and its final step (after Newton–Schulz: the orthogonalised stack; else the step itself)
    # is read at `result` + e, of dtype `result_dtype` (float32, or bfloat16 for precision="fast").
    # `inputs`: 30, or 15 without the factored groups. `mlp_chunk`: a learned tensor's first chunk in the MLP
    # pass's walk (ChunkWalk), where celo2_normalise finds the blocks that walked it. `direct_work`: for
    # precision="fast", where the MLP pass writes a matrix's proposed step itself, in bfloat16, as Newton–Schulz's
    # input (the workspace at step_offset; 0: the step buffer), and `ns_matrix` the row of its first polynomial's
    # coefficients (celo2_normalise, celo2_first_polynomial).
    "Celo2Tensor": ("kind", "exp_avg", "exp_avg_sq", "adam_step", "step_offset", "result", "result_dtype", "inputs",
                    "mlp_chunk", "direct_work", "ns_matrix"),
    # A persistent pass's walk over the apply chunks of some of the tensors only (walk_chunks_of in
    # accumulators.cuh; lopt.fused.engine.Walk): a row per tensor, in row order, its chunks numbered from
    # `first_chunk` in the walk's own space, which the grid splits evenly. (CELO2's MLP and apply passes walk its
    # learned tensors, its AdamW pass its AdamW ones.)
    "ChunkWalk": ("first_chunk", "tensor"),
    # CELO2's sliced tensors (celo2_slices), in row order: each one's slices (of `rows` x `cols` elements, its last
    # two axes) numbered from `first_slice`; slice s's element (r, c) lies at memory index
    # (s / inner)·outer_stride + (s % inner)·inner_stride + r·row_stride + c·col_stride (lopt.fused.celo2.slice_walk_row).
    "SliceWalk": ("first_slice", "tensor", "rows", "cols", "inner", "outer_stride", "inner_stride", "row_stride",
                  "col_stride"),
    # One row per parameter group (also groups without a tensor in this step: their counters advance).
    "GroupMeta": (
        "values",  # float block of GROUP_VALUE_FLOATS (decays, exp_mult, step_mult, host lr/weight decay)
        "lr", "weight_decay",  # pointers to float32: a user's CUDA tensor, or the block's slot
        "step",  # int64 step counter (steps taken so far)
    ),
}

# Float slots of a group's value block.
GROUP_VALUES = {
    "decays": 0,  # 16 floats: the Decays struct of accumulators.cuh
    "exp_mult": 16, "step_mult": 17, "lr": 18, "weight_decay": 19, "max_grad_norm": 20,
}
GROUP_VALUE_FLOATS = 24
# CELO2's per-group values (float64 slots: the AdamW betas enter the bias corrections in float64, as in the
# reference), one block of CELO2_GROUP_DOUBLES per group (lopt.fused.celo2).
CELO2_GROUP_VALUES = {
    "grad_clip_value": 0, "rms_mult": 1, "param_scale_mult": 2, "adam_lr": 3, "adam_lr_mult": 4,
    "adam_lr_on_device": 5, "adam_weight_decay": 6, "adam_beta1": 7, "adam_beta2": 8, "adam_eps": 9,
    "ns_eps": 10, "ns_a": 11, "ns_b": 12, "ns_c": 13, "ns_steps": 14, "orthogonalize": 15,
}
CELO2_GROUP_DOUBLES = 16

CONSTANTS: dict = {
    "STATS_THREADS": 256,
    "STATS_PER_THREAD": 32,
    "AXIS_THREADS": 256,
    "STRIDED_XCHUNK": 64,  # rows summed per thread in the strided mode (at least; plan.MAX_STRIDED_XCHUNKS)
    "CONTIGUOUS_XCHUNK": 2048,  # elements summed per warp in the contiguous mode
    "TABLE_THREADS": 256,
    "TABLE_FLOATS": 12,  # per factor-table entry: {acc[3], pad}, {factor[3], pad}, {rsqrt(acc + 1e-8)[3], pad}
    "DECAYS_FLOATS": 16,
    "GROUP_VALUE_FLOATS": GROUP_VALUE_FLOATS,
    "FINALIZE_THREADS": 256,
    # velo_lstm: a block computes VELO_LSTM_ROWS tensors x VELO_LSTM_UNITS hidden units (all four gates)
    "VELO_LSTM_ROWS": 32,
    "VELO_LSTM_UNITS": 32,
    "VELO_LSTM_THREADS": 256,
    # velo_statistics' sums per chunk besides the 30 features': Σp², then Σ(m_k − s_k), Σ(m_k − s_k)² and
    # the count of finite m_k (3 each), then Σ(v − s_v), Σ(v − s_v)² and the count of finite v
    "VELO_LSTM_SUMS": 13,
    # Step status flags (int32): a non-finite or overflowing gradient was seen in this step
    # (STATUS_NONFINITE); the same seen by the axis pass, which adafactor_finalize moves into
    # STATUS_NONFINITE when it resets the flags (STATUS_AXIS_NONFINITE).
    "STATUS_INTS": 4,
    "STATUS_NONFINITE": 0,
    "STATUS_AXIS_NONFINITE": 1,
    # CELO2: the statistics per chunk (the 30 features' sums of squares, then Σp²) and the tensors' kinds
    "CELO2_SUMS": 31,
    "CELO2_LEARNED": 0,
    "CELO2_ADAM_OWN": 1,
    "CELO2_ADAM_SHARED": 2,
    "CELO2_ELSEWHERE": 3,
    "CELO2_SLICED": 4,
    "CELO2_SLICE_MAX": 49,  # elements of a slice celo2_slices takes, 7 x 7 (larger ones are stepped elsewhere)
}
CONSTANTS["STATS_CHUNK"] = CONSTANTS["STATS_THREADS"] * CONSTANTS["STATS_PER_THREAD"]

FIELD = {name: {field: index for index, field in enumerate(fields)} for name, fields in STRUCTS.items()}


def empty_rows(struct: str, count: int) -> np.ndarray:
    """``count`` zeroed int64 rows of ``struct``."""
    return np.zeros((count, len(STRUCTS[struct])), dtype=np.int64)


def column(struct: str, field: str) -> int:
    return FIELD[struct][field]


def cuda_header() -> str:
    """The C++ definitions of :data:`STRUCTS` and :data:`CONSTANTS` (``lopt_contract.cuh``)."""
    lines = ["// Generated from lopt/fused/contract.py: edit that file, not this text.", "#pragma once", ""]
    for name, value in CONSTANTS.items():
        lines.append(f"#define LOPT_{name} {value}")
    for name, slot in GROUP_VALUES.items():
        lines.append(f"#define LOPT_GROUP_{name.upper()} {slot}")
    for name, slot in CELO2_GROUP_VALUES.items():
        lines.append(f"#define LOPT_CELO2_GROUP_{name.upper()} {slot}")
    lines.append(f"#define LOPT_CELO2_GROUP_DOUBLES {CELO2_GROUP_DOUBLES}")
    lines.append("")
    for struct, fields in STRUCTS.items():
        lines.append(f"struct {struct} {{")
        lines.append("  long long " + ", ".join(fields) + ";")
        lines.append("};")
        lines.append(f"static_assert(sizeof({struct}) == {8 * len(fields)}, \"{struct} must be {len(fields)} int64 fields\");")
        for index, field in enumerate(fields):
            lines.append(f"#define LOPT_{struct.upper()}_{field.upper()} {index}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(cuda_header())
