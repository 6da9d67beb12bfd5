"""Fused small_fc_lopt: launches ``cuda_src/small_fc_lopt.cu`` for every tensor of every group.

Mirrors ``lopt/reference/small_fc_lopt.py``; one step is six launches, whatever the number of
tensors and groups (with FSDP2's sharded parameters eight, and between them the reduce phase's
collectives: the means over split axes, the row-factor normalisers where d1 is split, the non-finite
flag, the feature sums, and max_grad_norm's Σ g²; ``docs/distributed.md``):

1. ``adafactor_axis_partials``  sums of G = g² + 1e-30 for the factored accumulators (update_accumulators, R/C part);
                                with ``max_grad_norm``, also Σ G over each clipped tensor that is not factored;
                                the non-finite test of every gradient element it reads (a non-finite sum)
2. ``adafactor_finalize``       the means of G; the step's status flags reset; each clipped tensor's clip
                                factor (clip_gradient_norm), which the later passes multiply the gradient by
3. ``adafactor_factor_tables``  R, C updated (in the tables, from the clipped gradient's means) and their
                                factors (adafactor_factors); with precision "fast" also each entry's table
                                features packed as the first layer's BF16 inputs (``plan.row_packed``)
4. ``small_fc_lopt_feature_stats``  per_element_features → sums of squares (normalise_features); the
   non-finite test of every gradient element (the only one for tensors without axis jobs)
5. ``small_fc_lopt_fold``       normaliser scales and time_features folded into the first layer; a kept
   step's R and C written to the state (by extra blocks, commit_blocks)
6. ``small_fc_lopt_apply``      accumulators, features, mlp (tensor cores, float32 accuracy through
   split products: layer 1 a TF32 product plus a BF16 correction product per 8 inputs, layer 2
   three FP16 products per 16; docs/small_fc_lopt.md §3.10), update_from_mlp,
   apply_update; the step counters advance (or a skipped step is counted)

The MLP's geometry is the weights' own (``lopt.network.MLPGeometry``): the kernels are compiled for it
(``kernel_defines``). The published geometry, 39 → 32 → 32 → 2, runs on tensor cores as above; any
other (hidden size 4, 8, 64, ...; more hidden layers) runs in float32 on the CUDA cores, one thread per
element, in both precisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lopt.fused.contract import FIELD
from lopt.fused.engine import FusedEngine, Plan, commit_blocks
from lopt.network import MLPGeometry
from lopt.reference import small_fc_lopt as reference

NUM_FEATURES = reference.NUM_ELEMENT_FEATURES
OPERAND_32x32 = 4 * 4 * 32 * 4  # a 32 x 32 weight matrix as a tensor-core B operand (split_mma.cuh; exact, the larger)
# The geometry whose layers run on tensor cores (the published weights'); any other takes the generic path.
TENSOR_CORE_GEOMETRY = MLPGeometry(inputs=39, hidden=32, hidden_layers=1, outputs=2)
SHARED_FRAGS_FLOATS = OPERAND_32x32 + 32 + 2 * 32 + 2  # layer 2 (operand) + bias, layer 3 + bias
# The kernels' arithmetic per the optimizer's precision: split_mma.cuh's LOPT_SPLIT_MODE (0: split
# products, float32-accurate; 2: one BF16 product per two k-steps).
PRECISION_DEFINES = {"exact": ("LOPT_SPLIT_MODE=0",), "fast": ("LOPT_SPLIT_MODE=2",)}


def kernel_defines(precision: str, geometry: MLPGeometry) -> tuple:
    """What small_fc_lopt.cu is compiled with: the precision, and the network's geometry (kernel traits)."""
    return PRECISION_DEFINES[precision] + geometry.cuda_defines("SFC_MLP")


def folded_floats(geometry: MLPGeometry) -> int:
    """Floats of one tensor's folded first layer (the fold's output; SFC_FOLDED in the kernels): on tensor
    cores its operand, the 6 shared-entry inputs' weights and the feature shifts; else W1' (hidden x 28), b1' and
    the shifts."""
    if geometry == TENSOR_CORE_GEOMETRY:
        return OPERAND_32x32 + 6 * geometry.hidden + 8
    return geometry.hidden * NUM_FEATURES + geometry.hidden + 8


def first_layer_bounds(network: dict, max_count: int) -> torch.Tensor:
    """A bound on each first-layer unit's |h1| (before the ReLU), float64: a normalised feature is at most
    sqrt(count) in magnitude (its square is at most the sum of squares, count times their mean; the time
    features at most 1), so |h1_n| <= sqrt(count) · Σ_k |W1[n, k]| (k over the 28 features) + |b1_n| +
    Σ_j |W1[n, 28 + j]|. ``max_count``: the largest tensor's element count."""
    w1 = network["network.input.weight"].detach().double().cpu().abs()
    b1 = network["network.input.bias"].detach().double().cpu().abs()
    features = w1[:, :NUM_FEATURES].sum(dim=1)
    constant = b1 + w1[:, NUM_FEATURES:].sum(dim=1)
    return math.sqrt(max(int(max_count), 1)) * features + constant


def fp16_exponent(bound: float) -> int:
    """The least e >= 0 with ``bound`` <= 2^15 · 2^e (half FP16's range, the rest a margin for rounding)."""
    return max(0, math.ceil(math.log2(bound / 2.0**15))) if bound > 0 else 0


def layer2_exponent(network: dict, max_count: int) -> int:
    """The e by which the exact mode scales layer 1 down (2^-e) and layer 2 up (2^e), powers of two so
    that nothing rounds differently: layer 2 takes its inputs' high parts in FP16 (``cuda_src/split_mma.cuh``),
    which must stay below 65504. e keeps ``first_layer_bounds`` below 2^15: 0 for tensors of up to 10^8
    elements with weights of torch.nn.Linear's initial scale (Σ_k |W1[n, k]| ~ 4), 3 at 2^31.
    """
    return fp16_exponent(float(first_layer_bounds(network, max_count).max()))


def layer3_exponent(network: dict, max_count: int) -> int:
    """The e by which precision "fast" scales layer 2 down (2^-e) and layer 3 up (2^e): layer 3 takes its
    inputs in FP16 (``output_layer_mma`` in ``cuda_src/small_fc_lopt.cu``). e keeps the bound
    |h2_n| <= Σ_k |W2[n, k]| · first_layer_bounds_k + |b2_n| below 2^15: 1 for GPT-2 medium's largest
    tensor (51 M elements) with weights of torch.nn.Linear's initial scale."""
    w2 = network["network.linear_0.weight"].detach().double().cpu().abs()
    b2 = network["network.linear_0.bias"].detach().double().cpu().abs()
    return fp16_exponent(float((w2 @ first_layer_bounds(network, max_count) + b2).max()))


@dataclass
class SmallFCLOptWork:
    """What a small_fc_lopt plan holds besides the shared accumulate phase's workspaces."""

    stats_partials: torch.Tensor  # per statistics chunk, the 28 features' sums of squares (float64)
    folded: torch.Tensor  # per tensor, the fold's first layer (folded_floats each)
    shared_frags: torch.Tensor  # layers 2 and 3 laid out for the tensor cores (1 float on the generic path)
    tensor_sums: torch.Tensor | None  # sharded parameters: per tensor, the feature sums reduced across processes
    fp16_exponent: int  # the power of two that keeps the FP16 inputs in range (layer2/layer3_exponent)


class SmallFCLOptFused(FusedEngine):
    """The fused engine behind ``SmallFCLOpt(backend="fused")``."""

    SOURCE = "small_fc_lopt.cu"
    KERNELS = ("small_fc_lopt_feature_stats", "small_fc_lopt_fold", "small_fc_lopt_apply")
    APPLY_CHUNK_DEFINE = "SFC_APPLY_CHUNK"

    def __init__(self, optimizer):
        self.mlp = optimizer.meta_weights.tensors["mlp"]
        self.geometry = MLPGeometry.of(self.mlp)
        self.tensor_cores = self.geometry == TENSOR_CORE_GEOMETRY
        super().__init__(optimizer, kernel_defines(optimizer.precision, self.geometry))
        # Precision "fast" on tensor cores reads the table features packed as BF16 inputs (SFC_PACKED_ENTRIES).
        self.packed_entries = optimizer.precision == "fast" and self.tensor_cores
        self.network = self.geometry.pack(self.mlp).to(self.device)
        self.apply_grid = self.persistent_grid("small_fc_lopt_apply")

    def _allocate(self, plan: Plan) -> "SmallFCLOptWork":
        layout = plan.layout
        max_count = int(layout.static_rows[:, FIELD["TensorMeta"]["count"]].max()) if layout.num_tensors else 1
        exponent = layer2_exponent if self.optimizer.precision == "exact" else layer3_exponent
        return SmallFCLOptWork(
            stats_partials=plan.workspace(layout.total_stats_chunks * NUM_FEATURES, torch.float64),
            folded=plan.workspace(layout.num_tensors * folded_floats(self.geometry), torch.float32),
            shared_frags=plan.workspace(SHARED_FRAGS_FLOATS if self.tensor_cores else 1, torch.float32),
            tensor_sums=plan.workspace(layout.num_tensors * NUM_FEATURES, torch.float64) if layout.sharded else None,
            fp16_exponent=exponent(self.mlp, max_count) if self.tensor_cores else 0)  # (generic: float32 throughout)

    def _launch_statistics(self, plan: Plan, flags: dict) -> None:
        layout = plan.layout
        self.launch("small_fc_lopt_feature_stats", layout.total_stats_chunks,
                    tensors=plan.tensor_table.table, gradients=plan.gradients.table, num_tensors=layout.num_tensors,
                    groups=plan.group_table.table, row_factors=plan.row_factors, col_factors=plan.col_factors,
                    clip_factors=plan.clip_factors, **flags, stats_partials=plan.work.stats_partials)

    def _control(self, plan: Plan, flags: dict) -> None:
        """The fold; with sharded parameters in two launches around the reduce of every tensor's
        feature sums (one collective)."""
        layout = plan.layout
        for phase in ((1, 2) if layout.sharded else (0,)):
            self._launch_fold(plan, flags, phase)
            if phase == 1:
                self.optimizer.reducer.sum_(plan.work.tensor_sums)

    def _launch_fold(self, plan: Plan, flags: dict, phase: int) -> None:
        """One block per tensor, then one that lays out layers 2 and 3, then the blocks that commit a
        kept step's R and C (commit_blocks)."""
        layout = plan.layout
        self.launch("small_fc_lopt_fold", layout.num_tensors + 1 + commit_blocks(layout),
                    tensors=plan.tensor_table.table, gradients=plan.gradients.table, num_tensors=layout.num_tensors,
                    groups=plan.group_table.table, stats_partials=plan.work.stats_partials, row_table=plan.row_table,
                    col_table=plan.col_table, network=self.network, clip_factors=plan.clip_factors, **flags,
                    folded=plan.work.folded, shared_frags=plan.work.shared_frags, phase=phase,
                    tensor_sums=plan.work.tensor_sums, fp16_exponent=plan.work.fp16_exponent,
                    total_row_entries=layout.total_row_entries, total_col_entries=layout.total_col_entries,
                    row_packed=plan.row_packed, col_packed=plan.col_packed)

    def _apply(self, plan: Plan, flags: dict) -> None:
        """The apply pass over every chunk, on a persistent grid; it also advances the step counters."""
        layout = plan.layout
        num_chunks = layout.total_apply_chunks
        self.launch("small_fc_lopt_apply", max(1, min(self.apply_grid, num_chunks)),
                    tensors=plan.tensor_table.table, gradients=plan.gradients.table, num_tensors=layout.num_tensors,
                    **self.group_arguments(plan), total_chunks=num_chunks, folded=plan.work.folded,
                    later_layers=plan.work.shared_frags if self.tensor_cores else self.network,
                    row_table=plan.row_table, col_table=plan.col_table, row_factors=plan.row_factors,
                    col_factors=plan.col_factors, row_packed=plan.row_packed, col_packed=plan.col_packed,
                    clip_factors=plan.clip_factors, **flags, skipped_steps=self.skipped_counter())
