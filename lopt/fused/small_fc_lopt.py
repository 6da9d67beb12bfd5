"""Fused small_fc_lopt: launches ``cuda_src/small_fc_lopt.cu`` for every tensor of every group.

Mirrors ``lopt/reference/small_fc_lopt.py``; one step is six launches, whatever the number of
tensors and groups (in the exact mode on 60 million elements or more, steps 4–6 run per part of the
tensors, the statistics and fold of each part on a side stream beside the apply pass of the ones
before: ``_pipeline``; seven where the fast check launches step 4 in two parts: the summed tensors'
chunks before it checks the other gradients, ``FusedEngine._statistics_early``; with FSDP2's sharded
parameters eight, and between them the reduce phase's collectives: the means over split axes, the
row-factor normalisers where d1 is split, the non-finite flag, the feature sums, and max_grad_norm's
Σ g²; ``docs/distributed.md``):

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
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from lopt.fused import launcher
from lopt.fused.contract import FIELD
from lopt.fused.engine import STATS_THREADS, FusedEngine, Plan, commit_blocks
from lopt.reference import small_fc_lopt as reference

NUM_FEATURES = reference.NUM_ELEMENT_FEATURES
FOLD_THREADS = 256
OPERAND_32x32 = 4 * 4 * 32 * 4  # a 32 x 32 weight matrix as a tensor-core B operand (split_mma.cuh; exact, the larger)
FOLDED_FLOATS = OPERAND_32x32 + 6 * 32 + 8  # per tensor: the folded first layer (operand, its bias on two constant inputs), its 6 slow inputs, the feature shifts
SHARED_FRAGS_FLOATS = OPERAND_32x32 + 32 + 2 * 32 + 2  # layer 2 (operand) + bias, layer 3 + bias
NETWORK_TENSORS = ("network.input.weight", "network.input.bias", "network.linear_0.weight", "network.linear_0.bias",
                   "network.output.weight", "network.output.bias")


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


def pack_network(network: dict) -> torch.Tensor:
    """W1, b1, W2, b2, W3, b3 (PyTorch out x in layout), float32, as small_fc_lopt.cu reads them."""
    return torch.cat([network[name].detach().cpu().to(torch.float32).reshape(-1) for name in NETWORK_TENSORS])


class SmallFCLOptFused(FusedEngine):
    """The fused engine behind ``SmallFCLOpt(backend="fused")``."""

    SOURCE = "small_fc_lopt.cu"
    KERNELS = ("small_fc_lopt_feature_stats", "small_fc_lopt_fold", "small_fc_lopt_apply")
    APPLY_CHUNK = 128  # one element per thread of a 4-warp block
    APPLY_THREADS = 128

    # The kernels' arithmetic per the optimizer's precision: split_mma.cuh's LOPT_SPLIT_MODE (0: split
    # products, float32-accurate; 2: one BF16 product per two k-steps).
    PRECISION_DEFINES = {"exact": (), "fast": ("LOPT_SPLIT_MODE=2",)}

    def __init__(self, optimizer, defines: tuple = ()):
        super().__init__(optimizer, (*self.PRECISION_DEFINES[optimizer.precision], *defines))
        # Whether the apply pass reads the packed table features (the kernels' SFC_PACKED_ENTRIES, on with
        # precision "fast" unless a define says otherwise).
        self.packed_entries = ("SFC_PACKED_ENTRIES=0" not in defines) and optimizer.precision == "fast"
        self.mlp = optimizer.meta_weights.tensors["mlp"]
        self.network = pack_network(self.mlp).to(self.device)
        self.apply_grid = self.persistent_grid("small_fc_lopt_apply", self.APPLY_THREADS)
        # The parts of a step's statistics and apply passes (_parts_for): by the tensors' size, or as an
        # engine define SFC_PIPELINE_PARTS=k says (k = 1: one pass each; for measurements and tests).
        forced = [int(d.split("=", 1)[1]) for d in defines if d.startswith("SFC_PIPELINE_PARTS=")]
        self.forced_parts = forced[-1] if forced else None
        self._side_stream, self._part_events = None, []

    def _allocate(self, plan: Plan) -> None:
        layout = plan.layout
        plan.stats_partials = plan.workspace(layout.total_stats_chunks * NUM_FEATURES, torch.float64)
        plan.folded = plan.workspace(layout.num_tensors * FOLDED_FLOATS, torch.float32)
        plan.shared_frags = plan.workspace(SHARED_FRAGS_FLOATS, torch.float32)
        plan.tensor_sums = plan.workspace(layout.num_tensors * NUM_FEATURES, torch.float64) if layout.sharded else None
        plan.pipeline_parts = None  # (how many, the parts): made by _parts when the step runs in parts
        if self.packed_entries:  # (int32 words: a uint4 per entry)
            plan.row_packed = plan.workspace(layout.total_row_entries * 4, torch.int32)
            plan.col_packed = plan.workspace(layout.total_col_entries * 4, torch.int32)
        max_count = int(layout.static_rows[:, FIELD["TensorMeta"]["count"]].max()) if layout.num_tensors else 1
        exponent = layer2_exponent if self.optimizer.precision == "exact" else layer3_exponent
        plan.fp16_exponent = exponent(self.mlp, max_count)

    def _launch_statistics(self, plan: Plan, flags: tuple, first_chunk: int, num_chunks: int) -> None:
        ptr, layout = launcher.pointer, plan.layout
        self.launch("small_fc_lopt_feature_stats", num_chunks, STATS_THREADS,
                    (ptr(plan.tensor_table.table), ptr(plan.gradients.table), np.int32(layout.num_tensors),
                     ptr(plan.stats_ranges.table), np.int64(first_chunk), ptr(plan.group_table.table),
                     ptr(plan.row_factors), ptr(plan.col_factors), ptr(plan.clip_factors), *flags,
                     ptr(plan.stats_partials)))

    def _control(self, plan: Plan, flags: tuple) -> None:
        """The fold; with sharded parameters in two launches around the reduce of every tensor's
        feature sums (one collective). With the statistics and apply passes in parts, the fold of each
        part goes with its statistics (``_pipeline``)."""
        if self._pipelined(plan):
            self._pipeline(plan, flags)
            return
        layout = plan.layout
        for phase in ((1, 2) if layout.sharded else (0,)):
            self._launch_fold(plan, flags, phase, 0, layout.num_tensors, 1 + commit_blocks(layout))
            if phase == 1:
                self.optimizer.reducer.sum_(plan.tensor_sums)

    def _apply(self, plan: Plan, flags: tuple) -> None:
        if not self._pipelined(plan):
            self._launch_apply(plan, flags, 0, plan.layout.total_apply_chunks, finish=True)

    def _launch_fold(self, plan: Plan, flags: tuple, phase: int, first_tensor: int, num_tensors: int,
                     extra_blocks: int) -> None:
        """The fold of tensors [first_tensor, first_tensor + num_tensors), with ``extra_blocks`` after
        them: layers 2 and 3 laid out, then a kept step's R and C committed (1 + commit_blocks, or 0)."""
        ptr, layout = launcher.pointer, plan.layout
        self.launch("small_fc_lopt_fold", num_tensors + extra_blocks, FOLD_THREADS,
                    (ptr(plan.tensor_table.table), ptr(plan.gradients.table), np.int32(layout.num_tensors),
                     ptr(plan.group_table.table), ptr(plan.stats_partials), ptr(plan.row_table),
                     ptr(plan.col_table), ptr(self.network), ptr(plan.clip_factors), *flags, ptr(plan.folded), ptr(plan.shared_frags), np.int32(phase),
                     ptr(plan.tensor_sums), np.int32(plan.fp16_exponent), np.int64(layout.total_row_entries),
                     np.int64(layout.total_col_entries), ptr(plan.row_packed), ptr(plan.col_packed),
                     np.int32(first_tensor), np.int32(num_tensors)))

    def _launch_apply(self, plan: Plan, flags: tuple, first_chunk: int, num_chunks: int, finish: bool) -> None:
        """The apply pass over chunks [first_chunk, first_chunk + num_chunks); ``finish``: this launch
        advances the step counters (the step's last)."""
        ptr, layout = launcher.pointer, plan.layout
        self.launch("small_fc_lopt_apply", max(1, min(self.apply_grid, num_chunks)), self.APPLY_THREADS,
                    (ptr(plan.tensor_table.table), ptr(plan.gradients.table), np.int32(layout.num_tensors),
                     *self.group_arguments(plan), np.int64(num_chunks), ptr(plan.folded),
                     ptr(plan.shared_frags), ptr(plan.row_table), ptr(plan.col_table), ptr(plan.row_factors),
                     ptr(plan.col_factors), ptr(plan.row_packed), ptr(plan.col_packed), ptr(plan.clip_factors), *flags,
                     self.skipped_counter(), np.int64(first_chunk), np.int32(finish)))

    # -------------------------------------------------- statistics and apply in parts
    # The apply pass of the exact mode is bound by its arithmetic and the statistics pass by memory, and
    # a tensor's apply needs only its own statistics. So with the tensors in parts, part j's statistics
    # and fold run on a side stream while the apply pass of the parts before it runs (H100, GPT-2 medium
    # exact, unthrottled: 18.23 ms against 18.71 in 8 parts; ViT-B/16 4.79 against 4.92 in 4; the fast
    # mode's apply pass keeps DRAM and L1 too busy to gain: benchmarks/RESULTS.md). A part's apply pass
    # must not start before every gradient of the step is checked, or a non-finite element in a later
    # part would leave the step half applied: the axis pass checks every gradient of a tensor with axis
    # jobs (adafactor_axis_partials; the finalize makes its flag the step's), and the first part's
    # statistics launch also takes every other tensor's chunks.

    PIPELINE_MIN_ELEMENTS = 60_000_000  # below this, one pass each (few parts gain nothing, measured)
    PIPELINE_PART_ELEMENTS = 20_000_000  # elements per part, at most PIPELINE_MAX_PARTS parts
    PIPELINE_MAX_PARTS = 8  # (GPT-2 medium: 8 parts 18.22 ms, 12 18.25, 16 18.28, 4 18.37, 2 18.72)

    def _parts_for(self, plan: Plan) -> int:
        """How many parts this step's statistics and apply passes run in (1: one pass each)."""
        if self.forced_parts is not None:
            parts = self.forced_parts
        elif self.optimizer.precision != "exact":
            return 1
        else:
            numel = plan.layout.total_elements
            parts = 1 if numel < self.PIPELINE_MIN_ELEMENTS else min(self.PIPELINE_MAX_PARTS,
                                                                       numel // self.PIPELINE_PART_ELEMENTS)
        # (Sharded tensors reduce their sums across processes between the passes; nonfinite="raise"
        # reads the check's flag on the host before any apply launch: one pass each.)
        if plan.layout.sharded or self.optimizer.nonfinite == "raise":
            return 1
        return max(1, min(parts, plan.layout.num_tensors))

    def _pipelined(self, plan: Plan) -> bool:
        return self._parts_for(plan) > 1

    def _statistics_early(self, plan: Plan, *args) -> None:
        if not self._pipelined(plan):
            super()._statistics_early(plan, *args)

    def _statistics(self, plan: Plan, flags: tuple) -> None:
        if not self._pipelined(plan):
            super()._statistics(plan, flags)

    def _parts(self, plan: Plan) -> list:
        """The step's parts (``_parts_for`` of them), each (first_tensor, num_tensors, (first_apply_chunk,
        num_apply_chunks), [(first_stats_chunk, num_stats_chunks)]): contiguous tensors of about equal size;
        the first part's statistics also cover every tensor without axis jobs (whose gradients the axis
        pass does not check). Kept with the plan."""
        k = self._parts_for(plan)
        if plan.pipeline_parts is not None and plan.pipeline_parts[0] == k:
            return plan.pipeline_parts[1]
        layout, t = plan.layout, FIELD["TensorMeta"]
        rows, n = layout.static_rows, layout.num_tensors
        numel = rows[:, t["numel"]].astype(np.float64)
        total = float(layout.total_elements)
        bounds, running = [0], 0.0
        for r in range(n - 1):
            running += numel[r]
            if len(bounds) < k and running >= total * len(bounds) / k:
                bounds.append(r + 1)
        bounds.append(n)
        sources = set(layout.job_tensor)

        def stats_range(members):
            first = min(int(rows[r, t["first_stats_chunk"]]) for r in members)
            end = max(int(rows[r, t["first_stats_chunk"]] + rows[r, t["num_stats_chunks"]]) for r in members)
            return first, end - first

        unchecked = [r for r in range(n) if r not in sources]  # (contiguous after the sources: _order_statistics)
        parts = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            checked = [r for r in range(a, b) if r in sources]
            stats = [stats_range(checked)] if checked else []
            if not parts and unchecked:
                stats.append(stats_range(unchecked))
            apply_first = int(rows[a, t["first_apply_chunk"]])
            apply_end = int(rows[b - 1, t["first_apply_chunk"]] + rows[b - 1, t["num_apply_chunks"]])
            parts.append((a, b - a, (apply_first, apply_end - apply_first), stats))
        plan.pipeline_parts = (k, parts)
        return parts

    def _pipeline(self, plan: Plan, flags: tuple) -> None:
        """The statistics, fold and apply passes in parts: statistics and fold of each on a side stream,
        each part's apply pass on the step's stream once its fold is done (events; capturable in a CUDA
        graph). The first fold also lays out layers 2 and 3 and commits R and C; the last apply launch
        advances the step counters, after every fold has read them. (Without CUDA, as the launch tests
        run the engine, the same launches in order on one stream.)"""
        parts = self._parts(plan)
        on_device = self.device.type == "cuda"
        if on_device:
            main = torch.cuda.current_stream(self.device)
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
            while len(self._part_events) < len(parts):
                self._part_events.append(torch.cuda.Event())
            self._side_stream.wait_stream(main)
        with torch.cuda.stream(self._side_stream) if on_device else contextlib.nullcontext():
            for index, (first_tensor, num_tensors, _, stats) in enumerate(parts):
                for first_chunk, num_chunks in stats:
                    self._launch_statistics(plan, flags, first_chunk, num_chunks)
                self._launch_fold(plan, flags, 0, first_tensor, num_tensors,
                                  1 + commit_blocks(plan.layout) if index == 0 else 0)
                if on_device:
                    self._part_events[index].record(self._side_stream)
        for index, (_, _, (first_chunk, num_chunks), _) in enumerate(parts):
            if on_device:
                main.wait_event(self._part_events[index])
            self._launch_apply(plan, flags, first_chunk, num_chunks, finish=index == len(parts) - 1)
        if on_device:
            main.wait_stream(self._side_stream)
