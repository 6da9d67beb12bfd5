"""Fused VeLO: launches ``cuda_src/velo.cu`` for every tensor of every group.

Mirrors ``lopt/reference/velo.py`` phase by phase; one step is ten launches, whatever the number
of tensors and groups:

1–3. ``adafactor_axis_partials``, ``adafactor_finalize``, ``adafactor_factor_tables``  accumulate
     (the gradient clipped to ±1000, as clip_gradient)
4.   ``velo_statistics``      per_element_features → sums of squares, and tensor_statistics' sums of the
     pre-update parameter and the old accumulators; the non-finite test of every gradient element
5.   ``velo_tensor_control``  normalise_features' scales, the loss buffer and loss_features, fraction_features,
     lstm_input_features; a kept step's R and C written to the state (by extra blocks, commit_blocks)
6.   ``velo_mix``             mix_tensor_inputs (the max over every tensor's row)
7.   ``velo_lstm``            lstm_cell for all tensors (float64)
8.   ``velo_heads``           controller_heads, generate_mlp_weights, the normalisation folded into the first
     layer; a kept step's LSTM state written
9.   ``velo_table_contributions``  the factor-table features' share of the first layer, per table entry
     (the same for every element sharing the entry)
10.  ``velo_apply``           update_accumulators, per_element_features, per_element_mlp, velo_update,
     apply_update; the loss buffer and step counters advance (or a skipped step is counted)

With FSDP2's sharded parameters a step is twelve launches at most: ``adafactor_factor_tables`` runs
in two where a row factor's mean spans the split axis, and ``velo_tensor_control`` always in two,
around the reduce of every tensor's sums (its 30 feature sums of squares and the LSTM statistics'
sums, as plain Σx and Σx² of the old momentum and rms). Between the passes the reduce phase's
collectives complete what each process holds only part of (``docs/distributed.md``): the means
over split axes, the row-factor normalisers, the non-finite flag and those per-tensor sums. The
LSTM inputs computed from the totals are the same in every process, so the controller (mix, LSTM,
heads) runs replicated and needs no collective of its own.

A step never synchronises with the host: the loss is read on the device (a CUDA tensor, or the
losses handed to ``accumulate_loss``), or passed by value (a Python number), and a non-finite loss
or gradient turns every write into a no-op on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lopt import weights
from lopt.fused import launcher
from lopt.fused.contract import CONSTANTS, FIELD, empty_rows
from lopt.fused.engine import FusedEngine, Plan, commit_blocks
from lopt.network import MLPGeometry
from lopt.reference import velo as reference

NUM_FEATURES = reference.NUM_ELEMENT_FEATURES
# The per-element MLP the controller generates for each tensor (30 -> 4 -> 4 -> 3 in the published weights), as
# the registered architecture's "mlp" network describes it; velo.cu is specialised to it through network_defines.
_MLP_CONFIG = weights.architecture("velo").components["mlp"].config
GENERATED_MLP = MLPGeometry.from_config(_MLP_CONFIG, outputs=_MLP_CONFIG["output_size"])
LSTM_SUMS = CONSTANTS["VELO_LSTM_SUMS"]
STATS_PER_CHUNK = NUM_FEATURES + LSTM_SUMS  # VELO_STATS
HIDDEN = reference.LSTM_HIDDEN_SIZE
LSTM_ROWS, LSTM_UNITS = CONSTANTS["VELO_LSTM_ROWS"], CONSTANTS["VELO_LSTM_UNITS"]
RNN_TENSORS = ("mix_layer2.weight", "mix_layer2.bias", "final_mix_layer.weight", "final_mix_layer.bias",
               "lstm.linear.weight", "lstm.linear.bias", "rnn_to_controls.weight", "rnn_to_controls.bias",
               "step_size.weight", "step_size.bias")
VELO_FIELD = FIELD["VeloTensor"]


def network_defines() -> tuple:
    """velo.cu's network constants (kernel traits), so that nothing in it mirrors the network by hand: the
    controller's sizes and clips, the fraction timescales and the LSTM inputs' positions (lopt.reference.velo:
    LSTM_FEATURE_NAMES' order, ELEMENT_FEATURE_NAMES' for the factor-table features), and the generated MLP's
    geometry and packed layout (``VELO_GEN_*``: :data:`GENERATED_MLP`'s ``cuda_defines``, the layout
    :func:`pack_candidates` writes). Float values are written as the C literals of the Python floats."""
    lstm, element = reference.LSTM_FEATURE_NAMES, reference.ELEMENT_FEATURE_NAMES

    def literal(value: float) -> str:
        return f"{float(value)!r}f"

    return (f"VELO_NUM_FEATURES={reference.NUM_ELEMENT_FEATURES}",
            f"VELO_TABLE_FEATURES_FIRST={element.index('row_accumulator_0')}",
            f"VELO_GRADIENT_CLIP={literal(reference.GRADIENT_CLIP)}",
            f"VELO_GRADIENT_FEATURE_CLIP={literal(reference.GRADIENT_FEATURE_CLIP)}",
            f"VELO_LSTM_INPUTS={reference.NUM_LSTM_FEATURES}", f"VELO_HIDDEN={reference.LSTM_HIDDEN_SIZE}",
            f"VELO_CONTROLS={reference.NUM_CANDIDATES}", f"VELO_WEIGHT_GENERATION_SCALE={float(reference.WEIGHT_GENERATION_SCALE)!r}",
            f"VELO_LOSS_TIMESCALES={reference.NUM_LOSS_TIMESCALES}", f"VELO_LOSS_FEATURES={reference.NUM_LOSS_FEATURES}",
            f"VELO_FRACTION_FEATURES={len(reference.FRACTION_TIMESCALES)}",
            # (an X-macro, X(0.03f) X(0.1f) ...: nvcc would split a -D value at commas)
            "VELO_FRACTION_TIMESCALES_EACH(X)=" + " ".join(f"X({literal(t)})" for t in reference.FRACTION_TIMESCALES),
            f"VELO_RANK_CLASSES={reference.NUM_RANK_CLASSES}",
            f"VELO_LSTM_LOSS_FIRST={lstm.index('loss_feature_0')}", f"VELO_LSTM_MEAN_RMS={lstm.index('mean_rms')}",
            f"VELO_LSTM_RANK_FIRST={lstm.index('rank_0')}", f"VELO_LSTM_VARIANCES_FIRST={lstm.index('var_momentum_0')}",
            ) + GENERATED_MLP.cuda_defines("VELO_GEN")


def pack_candidates(mlp: dict) -> torch.Tensor:
    """The candidate MLPs as one (256, GENERATED_MLP's floats) float32 matrix: roles in MLP_CANDIDATE_TENSORS
    order, which is :data:`GENERATED_MLP`'s packing order (input, hidden, output layer; weight, then bias)."""
    stacks = [mlp[name].detach().to(torch.float32) for name in reference.MLP_CANDIDATE_TENSORS.values()]
    layers = GENERATED_MLP.tensor_shapes()
    if [tuple(s.shape[1:]) for s in stacks] != list(layers.values()):
        raise ValueError(f"VeLO's candidate MLPs {[tuple(s.shape) for s in stacks]} are not the registered "
                         f"{_MLP_CONFIG['param_inits']} x {list(layers.values())} of {', '.join(layers)}")
    return torch.cat([s.reshape(s.shape[0], -1) for s in stacks], dim=1).contiguous()


@dataclass
class VeLOWork:
    """What a VeLO plan holds besides the shared accumulate phase's workspaces: the statistics, the
    controller's per-tensor inputs and outputs (the LSTM's float64 rows, the generated MLPs' records), the
    factor tables' share of the first layer, and the per-tensor LSTM state table."""

    stats_partials: torch.Tensor
    feature_scales: torch.Tensor
    lstm_inputs: torch.Tensor
    param_scales: torch.Tensor
    mixed_max: torch.Tensor
    mix_partial: torch.Tensor
    hidden_new: torch.Tensor
    cell_new: torch.Tensor
    records: torch.Tensor
    row_contributions: torch.Tensor
    col_contributions: torch.Tensor
    loss: torch.Tensor  # a loss tensor of another dtype or device, converted
    tensor_sums: torch.Tensor | None  # sharded parameters: per tensor, the sums reduced across processes
    velo_table: launcher.MetadataTable  # VeloTensor rows (the LSTM state's addresses, the rank class)


class VeLOFused(FusedEngine):
    """The fused engine behind ``VeLO(backend="fused")``."""

    SOURCE = "velo.cu"
    KERNELS = ("velo_statistics", "velo_tensor_control", "velo_mix", "velo_lstm", "velo_heads",
               "velo_table_contributions", "velo_apply")
    APPLY_CHUNK_DEFINE = "VELO_APPLY_CHUNK"
    GRADIENT_CLIP = reference.GRADIENT_CLIP

    @classmethod
    def kernel_traits(cls) -> tuple:
        return super().kernel_traits() + network_defines()

    def __init__(self, optimizer):
        super().__init__(optimizer)
        meta = optimizer.meta_weights.tensors
        self.rnn = {name: meta["rnn"][name].detach().to(self.device, torch.float32).contiguous() for name in RNN_TENSORS}
        self.candidates = pack_candidates(meta["mlp"]).to(self.device)
        self.apply_grid = self.persistent_grid("velo_apply")

    def _allocate(self, plan: Plan) -> "VeLOWork":
        layout, n = plan.layout, plan.layout.num_tensors
        rows = empty_rows("VeloTensor", n)
        for row, p in enumerate(plan.params):
            state = self.optimizer.state[p]
            for name in ("lstm_hidden", "lstm_cell"):
                if not state[name].is_contiguous() or state[name].dtype != torch.float32:
                    state[name] = state[name].to(torch.float32).contiguous()
            rows[row, VELO_FIELD["lstm_hidden"]] = state["lstm_hidden"].data_ptr()
            rows[row, VELO_FIELD["lstm_cell"]] = state["lstm_cell"].data_ptr()
            rows[row, VELO_FIELD["rank_class"]] = min(reference.tensor_rank(p.shape), reference.NUM_RANK_CLASSES)
        velo_table = launcher.MetadataTable(self.device)
        velo_table.update(rows)
        workspace = plan.workspace
        return VeLOWork(
            stats_partials=workspace(layout.total_stats_chunks * STATS_PER_CHUNK, torch.float64),
            feature_scales=workspace(n * NUM_FEATURES, torch.float32),
            lstm_inputs=workspace(n * reference.NUM_LSTM_FEATURES, torch.float64),
            param_scales=workspace(n, torch.float32),
            mixed_max=workspace(HIDDEN, torch.int64),
            mix_partial=workspace(n * HIDDEN, torch.float64),
            hidden_new=workspace(n * HIDDEN, torch.float64),
            cell_new=workspace(n * HIDDEN, torch.float64),
            records=workspace(n * self.constant("VELO_RECORD_FLOATS"), torch.float32),
            row_contributions=workspace(layout.total_row_entries * GENERATED_MLP.hidden, torch.float32),
            col_contributions=workspace(layout.total_col_entries * GENERATED_MLP.hidden, torch.float32),
            loss=workspace(1, torch.float32),
            tensor_sums=workspace(n * STATS_PER_CHUNK, torch.float64) if layout.sharded else None,
            velo_table=velo_table)

    def _loss_arguments(self, plan: Plan, loss) -> dict:
        """The kernels' loss arguments: its tensor, dtype code, value and divisor (lopt.optimizers.velo.StepLoss)."""
        if loss.tensor is None:
            return {"loss_tensor": None, "loss_dtype": 0, "loss_value": loss.value, "loss_divisor": 1.0}
        tensor = loss.tensor
        if tensor.device != self.device or tensor.dtype not in launcher.DTYPE_CODES:
            plan.work.loss.copy_(tensor.reshape(1))  # float64, another GPU: one conversion
            tensor = plan.work.loss
        return {"loss_tensor": tensor, "loss_dtype": launcher.DTYPE_CODES[tensor.dtype], "loss_value": 0.0,
                "loss_divisor": loss.count}

    def _loss_buffer_arguments(self) -> dict:
        first = self.optimizer.param_groups[0]
        for key, dtype in (("loss_means", torch.float32), ("loss_running_min", torch.float32), ("loss_count", torch.int32)):
            value = first[key]
            if not (value.device == self.device and value.dtype == dtype and value.is_contiguous()):
                first[key] = value.to(device=self.device, dtype=dtype).contiguous()
        return {"loss_means": first["loss_means"], "loss_running_min": first["loss_running_min"],
                "loss_count": first["loss_count"], "loss_decays": self.optimizer.loss_buffer().decays}

    def _launch_statistics(self, plan: Plan, flags: dict) -> None:
        layout = plan.layout
        self.launch("velo_statistics", layout.total_stats_chunks,
                    tensors=plan.tensor_table.table, gradients=plan.gradients.table, num_tensors=layout.num_tensors,
                    groups=plan.group_table.table, row_factors=plan.row_factors, col_factors=plan.col_factors,
                    **flags, stats_partials=plan.work.stats_partials)

    def _step_arguments(self, plan: Plan, loss) -> tuple:
        return (self._loss_arguments(plan, loss),)

    def _control(self, plan: Plan, flags: dict, loss_arguments: dict) -> None:
        n, layout = plan.layout.num_tensors, plan.layout
        # With sharded parameters in two launches around the reduce of every tensor's sums (one collective).
        for phase in ((1, 2) if layout.sharded else (0,)):
            self.launch("velo_tensor_control", n + commit_blocks(layout),
                        tensors=plan.tensor_table.table, velo_tensors=plan.work.velo_table.table, num_tensors=n,
                        groups=plan.group_table.table, stats_partials=plan.work.stats_partials,
                        row_table=plan.row_table, col_table=plan.col_table, **flags, **self._loss_buffer_arguments(),
                        **loss_arguments, num_steps=self.optimizer.num_steps, feature_scales=plan.work.feature_scales,
                        lstm_inputs=plan.work.lstm_inputs, param_scales=plan.work.param_scales,
                        mixed_max=plan.work.mixed_max, phase=phase, tensor_sums=plan.work.tensor_sums,
                        total_row_entries=layout.total_row_entries, total_col_entries=layout.total_col_entries)
            if phase == 1:
                self.optimizer.reducer.sum_(plan.work.tensor_sums)
        rnn = self.rnn
        self.launch("velo_mix", n,
                    lstm_inputs=plan.work.lstm_inputs, mix_weight=rnn["mix_layer2.weight"],
                    mix_bias=rnn["mix_layer2.bias"], final_weight=rnn["final_mix_layer.weight"],
                    final_bias=rnn["final_mix_layer.bias"], mixed_max=plan.work.mixed_max,
                    mix_partial=plan.work.mix_partial)
        self.launch("velo_lstm", (-(-n // LSTM_ROWS), HIDDEN // LSTM_UNITS),
                    velo_tensors=plan.work.velo_table.table, num_tensors=n, mix_partial=plan.work.mix_partial,
                    mixed_max=plan.work.mixed_max, lstm_weight=rnn["lstm.linear.weight"],
                    lstm_bias=rnn["lstm.linear.bias"], hidden_new=plan.work.hidden_new, cell_new=plan.work.cell_new)
        self.launch("velo_heads", n,
                    velo_tensors=plan.work.velo_table.table, hidden_new=plan.work.hidden_new,
                    cell_new=plan.work.cell_new, controls_weight=rnn["rnn_to_controls.weight"],
                    controls_bias=rnn["rnn_to_controls.bias"], step_size_weight=rnn["step_size.weight"],
                    step_size_bias=rnn["step_size.bias"], candidates=self.candidates,
                    feature_scales=plan.work.feature_scales, param_scales=plan.work.param_scales, **flags,
                    **loss_arguments, records=plan.work.records)
        entries = layout.total_row_entries + layout.total_col_entries
        self.launch("velo_table_contributions", -(-entries // self.blocks["velo_table_contributions"]),
                    tensors=plan.tensor_table.table, num_tensors=n, records=plan.work.records,
                    row_table=plan.row_table, col_table=plan.col_table, total_row_entries=layout.total_row_entries,
                    total_col_entries=layout.total_col_entries, row_contributions=plan.work.row_contributions,
                    col_contributions=plan.work.col_contributions)

    def _apply(self, plan: Plan, flags: dict, loss_arguments: dict) -> None:
        layout = plan.layout
        self.launch("velo_apply", max(1, min(self.apply_grid, layout.total_apply_chunks)),
                    tensors=plan.tensor_table.table, gradients=plan.gradients.table, num_tensors=layout.num_tensors,
                    **self.group_arguments(plan), total_chunks=layout.total_apply_chunks, records=plan.work.records,
                    row_factors=plan.row_factors, col_factors=plan.col_factors,
                    row_contributions=plan.work.row_contributions, col_contributions=plan.work.col_contributions,
                    **flags, skipped_steps=self.skipped_counter(), **self._loss_buffer_arguments(), **loss_arguments)
