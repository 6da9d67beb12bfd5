"""Fused small_fc_lopt: launches ``cuda_src/small_fc_lopt.cu`` for a whole parameter group.

Mirrors ``lopt/reference/small_fc_lopt.py``; one step of a group is six launches, whatever the
number of tensors:

1. ``adafactor_axis_partials``  g² sums for the factored accumulators (update_accumulators, R/C part)
2. ``adafactor_finalize``       R, C updated; the group's step counter (on the device) advances
3. ``adafactor_factor_tables``  row/col factors of the updated R, C (adafactor_factors)
4. ``small_fc_lopt_feature_stats``  per_element_features → sums of squares (normalise_features)
5. ``small_fc_lopt_fold``       normaliser scales and time_features folded into the first layer
6. ``small_fc_lopt_apply``      accumulators, features, mlp (tensor cores, float32 accuracy through
   split products: a TF32 product plus a BF16 correction product), update_from_mlp, apply_update

No host synchronisation and no allocation happen in a steady-state step; a step can be captured
in a CUDA graph (lr and weight decay are then those at capture time).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from lopt.fused import launcher
from lopt.fused.plan import AXIS_THREADS, TABLE_THREADS, TENSOR_POINTER_FIELDS, GroupLayout
from lopt.reference import small_fc_lopt as reference

SOURCE = "small_fc_lopt.cu"
STATS_THREADS = 256
STATS_CHUNK = 256 * 32
APPLY_THREADS = 128  # one element per thread per chunk
FOLD_THREADS = 256
FINALIZE_THREADS = 256
NUM_FEATURES = reference.NUM_ELEMENT_FEATURES
OPERAND_32x32 = 4 * 4 * 32 * 4  # a 32 x 32 weight matrix as a tensor-core B operand (split_mma.cuh)
FOLDED_FLOATS = OPERAND_32x32 + 32  # per tensor: folded first layer (operand) and its bias
SHARED_FRAGS_FLOATS = OPERAND_32x32 + 32 + 2 * 32 + 2  # per group: layer 2 (operand) + bias, layer 3 + bias


def pack_decays(decays: reference.Decays) -> torch.Tensor:
    """The ``Decays`` struct of lopt_common.cuh: each decay and its float32 complement, as the reference forms them."""
    momentum, rms, adafactor = decays.momentum.cpu(), decays.rms.cpu(), decays.adafactor.cpu()
    return torch.cat([momentum, 1 - momentum, rms, 1 - rms, adafactor, 1 - adafactor, torch.zeros(2)])


def pack_constants(decays: reference.Decays, network: dict) -> torch.Tensor:
    """Decays then W1, b1, W2, b2, W3, b3 (PyTorch out x in layout), float32, as small_fc_lopt.cu reads them."""
    parts = [pack_decays(decays)] + [
        network[name].detach().cpu().to(torch.float32).reshape(-1)
        for name in ("network.input.weight", "network.input.bias", "network.linear_0.weight",
                     "network.linear_0.bias", "network.output.weight", "network.output.bias")
    ]
    return torch.cat(parts)


def make_contiguous(p: torch.Tensor) -> None:
    if not p.is_contiguous():
        warnings.warn(
            f"fused backend: a parameter of shape {tuple(p.shape)} is not contiguous; it is made contiguous once "
            f"(p.data = p.data.contiguous()), so views of its old storage no longer alias it", RuntimeWarning, stacklevel=4)
        p.data = p.data.contiguous()


class _GroupPlan:
    """Shape-dependent layout, workspaces and device tables of one parameter group."""

    def __init__(self, params, device, key):
        shapes = [tuple(p.shape) for p in params]
        dims = [reference.factored_dims(s) for s in shapes]
        self.layout = GroupLayout(shapes, dims, stats_chunk=STATS_CHUNK, apply_chunk=APPLY_THREADS)
        self.key = key
        self.pointer_key = None  # (ids, parameter and gradient pointers) the device tables were built for
        self.tensor_table_device = self.axis_table_device = None
        layout = self.layout

        def workspace(n, dtype):
            return torch.empty(max(n, 1), dtype=dtype, device=device)

        self.axis_partials = workspace(layout.total_axis_partials, torch.float32)
        self.row_table = workspace(layout.total_row_entries * 12, torch.float32)
        self.col_table = workspace(layout.total_col_entries * 12, torch.float32)
        self.stats_partials = workspace(layout.total_stats_chunks * NUM_FEATURES, torch.float64)
        self.folded = workspace(layout.num_tensors * FOLDED_FLOATS, torch.float32)
        self.shared_frags = workspace(SHARED_FRAGS_FLOATS, torch.float32)
        self.tensor_table = launcher.MetadataTable(device)
        self.axis_table = launcher.MetadataTable(device)


class SmallFCLOptFused:
    """The fused engine behind ``SmallFCLOpt(backend="fused")``."""

    def __init__(self, optimizer, defines: tuple = ()):
        """``defines`` (``"NAME=VALUE"`` strings) override the kernels' tuning macros, for benchmarks."""
        self.optimizer = optimizer
        devices = {p.device for group in optimizer.param_groups for p in group["params"]}
        if len(devices) != 1:
            raise RuntimeError(f"the fused backend needs all parameters on one CUDA device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        for group in optimizer.param_groups:
            if group["max_grad_norm"] is not None:
                raise RuntimeError("max_grad_norm is not supported by the fused backend; clip gradients before step() "
                                   "(torch.nn.utils.clip_grad_norm_) or use backend='naive'")
        self.module = launcher.get_module(SOURCE, self.device, defines=tuple(defines))
        self.kernels = {name: self.module.get_function(name) for name in (
            "adafactor_axis_partials", "adafactor_finalize", "adafactor_factor_tables",
            "small_fc_lopt_feature_stats", "small_fc_lopt_fold", "small_fc_lopt_apply")}
        self.apply_grid = self._apply_grid()
        self.constants = {}
        self.plans = {}

    def _apply_grid(self) -> int:
        """Persistent grid for the apply pass: as many blocks as fit on the device at once."""
        properties = torch.cuda.get_device_properties(self.device)
        kernel = self.kernels["small_fc_lopt_apply"]
        registers = launcher.kernel_attribute(kernel, "num_regs")
        shared = launcher.kernel_attribute(kernel, "shared_size_bytes") + 1024  # + the per-block reservation
        by_registers = 65536 // max(registers * APPLY_THREADS, 1)
        by_shared_memory = properties.shared_memory_per_multiprocessor // shared
        per_sm = max(1, min(by_registers, by_shared_memory, 2048 // APPLY_THREADS))
        return properties.multi_processor_count * per_sm

    def invalidate(self) -> None:
        """Forget layouts and tables (after load_state_dict replaced the state tensors)."""
        self.plans.clear()

    def _constants_for(self, group) -> torch.Tensor:
        key = (group["momentum_decays"], group["rms_decays"], group["adafactor_decays"])
        if key not in self.constants:
            network = self.optimizer.meta_weights.tensors["mlp"]
            self.constants[key] = pack_constants(self.optimizer.decays(group), network).to(self.device)
        return self.constants[key]

    def _step_counter(self, group) -> torch.Tensor:
        step = group.get("step", 0)
        if not (torch.is_tensor(step) and step.device == self.device and step.dtype == torch.int64):
            step = torch.tensor(int(step), dtype=torch.int64, device=self.device)
            group["step"] = step
        return step

    def step(self, inputs) -> None:
        for group in self.optimizer.param_groups:
            self.step_group(group)

    def step_group(self, group) -> None:
        step_counter = self._step_counter(group)
        params = [p for p in group["params"] if p.grad is not None]
        # Fast path: same tensors, same storage as last step -> the device tables are current.
        plan = self.plans.get(id(group))
        pointer_key = (tuple(map(id, params)), tuple(p.data_ptr() for p in params),
                       tuple(p.grad.data_ptr() for p in params))
        if plan is not None and plan.pointer_key == pointer_key:
            self._launch_all(group, plan, self._constants_for(group), step_counter)
            return
        for p in params:
            if p.device != self.device:
                raise RuntimeError(f"the fused backend needs all parameters on {self.device}; one is on {p.device}")
            make_contiguous(p)
            self.optimizer.ensure_state(p)
        params = [p for p in params if p.numel() > 0]
        if not params:
            step_counter.add_(1)
            return
        shape_key = tuple((id(p), tuple(p.shape)) for p in params)
        if plan is None or plan.key != shape_key:
            plan = _GroupPlan(params, self.device, shape_key)
            self.plans[id(group)] = plan

        grads = [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in params]
        pointers = np.zeros((len(params), len(TENSOR_POINTER_FIELDS)), dtype=np.int64)
        for row, (p, g) in enumerate(zip(params, grads)):
            state = self.optimizer.state[p]
            for name in ("mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v"):
                if not state[name].is_contiguous() or state[name].dtype != torch.float32:
                    state[name] = state[name].to(torch.float32).contiguous()
            pointers[row] = (
                p.data_ptr(), g.data_ptr(), state["mom"].data_ptr(), state["rms"].data_ptr(),
                state["fac_vec_row"].data_ptr(), state["fac_vec_col"].data_ptr(), state["fac_vec_v"].data_ptr(),
                launcher.DTYPE_CODES[p.dtype], launcher.DTYPE_CODES[g.dtype],
            )
        layout = plan.layout
        plan.tensor_table_device = plan.tensor_table.update(layout.tensor_rows(pointers))
        plan.axis_table_device = (plan.axis_table.update(layout.axis_rows(pointers)) if layout.num_axis_jobs
                                  else plan.tensor_table_device)
        # Reusable next step only if the tables point at the tensors themselves (no temporary copies)
        # and every tensor with a gradient is in the plan.
        reusable = all(g is p.grad for p, g in zip(params, grads)) and len(params) == len(pointer_key[0])
        plan.pointer_key = pointer_key if reusable else None
        self._launch_all(group, plan, self._constants_for(group), step_counter)

    def _launch_all(self, group, plan, constants, step_counter) -> None:
        layout, k, dev, ptr = plan.layout, self.kernels, self.device, launcher.pointer
        tensor_table, axis_table = plan.tensor_table_device, plan.axis_table_device
        n, jobs = np.int32(layout.num_tensors), np.int32(layout.num_axis_jobs)
        launcher.launch(k["adafactor_axis_partials"], layout.total_axis_blocks, AXIS_THREADS,
                        (ptr(axis_table), jobs, ptr(plan.axis_partials)), dev)
        launcher.launch(k["adafactor_finalize"], max(1, -(-layout.total_axis_outputs // FINALIZE_THREADS)), FINALIZE_THREADS,
                        (ptr(axis_table), jobs, np.int64(layout.total_axis_outputs), ptr(plan.axis_partials),
                         ptr(constants), ptr(step_counter)), dev)
        table_blocks = layout.total_slabs + -(-layout.total_col_entries // TABLE_THREADS)
        launcher.launch(k["adafactor_factor_tables"], table_blocks, TABLE_THREADS,
                        (ptr(tensor_table), n, np.int64(layout.total_slabs), np.int64(layout.total_col_entries),
                         ptr(plan.row_table), ptr(plan.col_table)), dev)
        launcher.launch(k["small_fc_lopt_feature_stats"], layout.total_stats_chunks, STATS_THREADS,
                        (ptr(tensor_table), n, ptr(constants), ptr(plan.row_table), ptr(plan.col_table),
                         ptr(plan.stats_partials)), dev)
        launcher.launch(k["small_fc_lopt_fold"], layout.num_tensors + 1, FOLD_THREADS,
                        (ptr(tensor_table), n, ptr(plan.stats_partials), ptr(plan.row_table), ptr(plan.col_table),
                         ptr(constants), ptr(step_counter), ptr(plan.folded), ptr(plan.shared_frags)), dev)
        lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
        launcher.launch(k["small_fc_lopt_apply"], min(self.apply_grid, layout.total_apply_chunks), APPLY_THREADS,
                        (ptr(tensor_table), n, np.int64(layout.total_apply_chunks), ptr(constants), ptr(plan.folded),
                         ptr(plan.shared_frags), ptr(plan.row_table), ptr(plan.col_table), np.float32(-lr),
                         np.float32(-weight_decay * lr if weight_decay > 0 else 0.0),
                         np.float32(group["exp_mult"]), np.float32(group["step_mult"])), dev)
