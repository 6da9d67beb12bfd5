"""What every fused engine shares: one plan for all the tensors of a step, its device tables, the
per-step refresh of pointers and hyper-parameters, and the accumulate phase's launches.

A fused step is the reference's phases as kernel launches (``docs/design.md``):

* **accumulate** — ``adafactor_axis_partials``, ``adafactor_finalize``, ``adafactor_factor_tables``
  (shared by both optimizers, :meth:`FusedEngine._accumulate`); ``max_grad_norm``'s Σ g² per clipped
  tensor comes from the same partials (a factored tensor's) or from one more sum in the axis pass
  (any other), and ``adafactor_finalize`` turns it into the tensor's clip factor, which every later
  pass multiplies the gradient by (``plan.clip_factors``);
* **statistics**, **control**, **apply** — each optimizer's own kernels (:meth:`_statistics`,
  :meth:`_control`, :meth:`_apply` of the subclasses).

The check phase's non-finite test runs inside the axis pass (on its sums, for the tensors with axis
jobs; ``adafactor_finalize`` makes that flag the step's) and inside the statistics pass, and sets a
device flag; the control and apply kernels read it, so a skipped step writes nothing and nothing
synchronises. A step
allocates nothing and uploads only what changed (pointers of fresh gradient tensors, scheduled
learning rates), so it can be captured in a CUDA graph.

Parameters of any dense layout (contiguous, ``channels_last``, any permutation of axes) are stepped
in place in their own memory order; their optimizer state is kept in the same order (its logical
shapes are unchanged, so state dicts interchange with the naive backend). Gradients whose strides
differ from their parameter's are copied into a buffer of the parameter's layout first.
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from lopt import distributed
from lopt.distributed import local_part
from lopt.fused import launcher
from lopt.fused.contract import CONSTANTS, FIELD, GROUP_VALUE_FLOATS, GROUP_VALUES, empty_rows
from lopt.fused.plan import TABLE_THREADS, TENSOR_POINTER_FIELDS, GroupLayout

FINALIZE_THREADS = CONSTANTS["FINALIZE_THREADS"]
GROUP_FIELD = FIELD["GroupMeta"]
AXIS_JOB_FIELD = FIELD["AxisJob"]
WALK_FIELD = FIELD["ChunkWalk"]
STATE_POINTER_FIELDS = ("mom", "rms", "fac_vec_row", "fac_vec_col", "fac_vec_v")  # TENSOR_POINTER_FIELDS[1:6]
assert TENSOR_POINTER_FIELDS[1:6] == ("mom", "rms", "fac_row", "fac_col", "fac_full")
assert TENSOR_POINTER_FIELDS[0] == "param" and TENSOR_POINTER_FIELDS[-2:] == ("param_dtype", "grad_dtype")


def memory_order(t: torch.Tensor) -> tuple | None:
    """The axes of ``t`` from outermost to innermost in memory, if ``t`` is dense (no gaps, no overlap); else None."""
    if t.is_contiguous():
        return tuple(range(t.dim()))
    order = tuple(sorted(range(t.dim()), key=lambda axis: (-t.stride(axis), axis)))
    return order if t.permute(order).is_contiguous() else None


def dense_layout_problem(t: torch.Tensor) -> str | None:
    """Why the fused kernels cannot step ``t`` in place (None if they can)."""
    if memory_order(t) is None:
        return (f"a parameter of shape {tuple(t.shape)} and strides {t.stride()} is not dense (a view with gaps or "
                f"overlaps); the fused kernels step parameters in place in their own memory order")
    return None


def arranged(t: torch.Tensor, order: tuple) -> torch.Tensor:
    """``t`` (same logical shape and values) laid out with its axes in memory order ``order``."""
    if t.numel() == 0 or t.permute(order).is_contiguous():
        return t
    inverse = tuple(int(i) for i in np.argsort(order))
    out = torch.empty([t.shape[a] for a in order], dtype=t.dtype, device=t.device).permute(inverse)
    out.copy_(t)
    return out


def pack_decays(decays) -> torch.Tensor:
    """The ``Decays`` struct of accumulators.cuh: each decay and its float32 complement, as the reference forms them."""
    momentum, rms, adafactor = decays.momentum.cpu(), decays.rms.cpu(), decays.adafactor.cpu()
    return torch.cat([momentum, 1 - momentum, rms, 1 - rms, adafactor, 1 - adafactor, torch.zeros(2)])


class GatheredGradients(NamedTuple):
    """What the fast check (:meth:`FusedEngine.checked_gradients`) read beside the gradients."""

    plan: "Plan"
    grad_pointers: list
    grad_dtypes: list


@dataclass
class FastCheck:
    """What the fast check (:meth:`FusedEngine.checked_gradients`) expects of a plan's steps: the groups'
    members, the parameters without a gradient, the axis jobs' sources (checked first, their accumulate
    phase launched early) and the other rows, each as ``(row, parameter, planned shape)``."""

    group_members: list
    without_gradients: list
    source_rows: list
    other_rows: list
    source_row_indices: list
    job_source: np.ndarray  # each axis job's position among the sources
    group_row_ranges: list  # each group's [start, end) of rows
    source_dtypes: list | None = None  # the sources' gradient dtypes as the axis table holds them


class Plan:
    """The shape-dependent part of a step, in three parts:

    * what defines it and never changes: ``layout`` (an immutable :class:`GroupLayout`), the parameters,
      their groups, memory orders and local views' geometry;
    * ``work``: the workspaces and per-plan constants the engine declares (``FusedEngine._allocate``
      returns them), beside the ones every engine's accumulate phase uses (declared here);
    * what each step refreshes: the device tables and their host mirrors, the pointers and dtypes they
      were built from, and ``check``, the fast check's expectations (None: every step takes the general
      check) with ``accumulated`` (whether it launched this step's accumulate phase).
    """

    def __init__(self, key, params, groups, group_params, layout: GroupLayout, memory_orders, locals_, device, *,
                 packed_entries: bool, allocate, fast_check, global_clipping: bool = False):
        self.key = key
        self.params = params
        self.groups = groups  # group row of each tensor
        self.group_params = group_params  # the participating parameters per group
        self.layout = layout
        self.memory_orders = memory_orders
        self.device = device
        self.locals = locals_  # this step's parameters as the kernels step them (a DTensor's local rows)
        self.param_pointers = [p.data_ptr() for p in locals_]
        self.sharded_rows = any(map(distributed.is_dtensor, params))  # (else each step skips local_part)
        self.geometries = [(tuple(p.shape), p.stride()) for p in locals_]
        # (row, strides) of parameters with two axes of one size (FusedEngine._same_strides)
        self.permutable_rows = [(row, p.stride()) for row, p in enumerate(locals_) if permutable(p.shape)]
        self.strided_rows = {row for row, p in enumerate(locals_) if not p.is_contiguous()}

        def workspace(n, dtype):
            return torch.empty(max(int(n), 1), dtype=dtype, device=device)

        self.workspace = workspace
        table_floats = CONSTANTS["TABLE_FLOATS"]
        self.axis_partials = workspace(layout.total_axis_partials, torch.float64)
        self.axis_means = workspace(layout.total_axis_outputs, torch.float32)
        self.row_table = workspace(layout.total_row_entries * table_floats, torch.float32)
        self.col_table = workspace(layout.total_col_entries * table_floats, torch.float32)
        self.row_factors = workspace(layout.total_row_entries * 4, torch.float32)  # compact copies (a float4 each)
        self.col_factors = workspace(layout.total_col_entries * 4, torch.float32)
        # The table features packed as BF16 inputs (packed_entry_inputs, a uint4 per entry), for an engine
        # whose apply pass reads them; None: the tables kernel writes none.
        self.row_packed = workspace(layout.total_row_entries * 4, torch.int32) if packed_entries else None
        self.col_packed = workspace(layout.total_col_entries * 4, torch.int32) if packed_entries else None
        self.status = torch.zeros(CONSTANTS["STATUS_INTS"], dtype=torch.int32, device=device)
        # max_grad_norm: each tensor's clip factor (1 for a tensor that is not clipped; None: none is)
        self.clip_factors = torch.ones(layout.num_tensors, device=device) if layout.num_norm_jobs else None
        self.tensor_table = launcher.MetadataTable(device)
        self.axis_table = launcher.MetadataTable(device)
        self.norm_table = launcher.MetadataTable(device)
        if layout.num_norm_jobs:
            self.norm_table.update(layout.static_norm_jobs)
        # Sharded parameters: the partial sums reduced across processes between launches.
        self.slab_sums = workspace(layout.split_slab_sums, torch.float64) if layout.split_slab_sums else None
        # Norm sums the host side finishes: a sharded tensor's are partial (reduced across processes first),
        # and a global norm (FusedEngine.GLOBAL_CLIPPING) sums every tensor's.
        if (layout.sharded or global_clipping) and layout.num_norm_jobs:
            norm = layout.static_norm_jobs
            self.norm_sums = workspace(layout.num_norm_jobs, torch.float64)
            self.norm_tensors = torch.as_tensor(norm[:, FIELD["NormJob"]["tensor"]], device=device)
            self.norms = workspace(layout.num_norm_jobs, torch.float32)
            self.max_norms = workspace(layout.num_norm_jobs, torch.float32)  # per clipped tensor, each step
            # (global clipping: which norm jobs' tensors are split among processes, whose sums are partial)
            split = [layout.split_tensors[int(t)] for t in norm[:, FIELD["NormJob"]["tensor"]]]
            self.split_norm_jobs = torch.tensor(split, dtype=torch.bool, device=device)
        else:
            self.norm_sums = None
        self.group_values = launcher.MetadataTable(device, dtype=np.float32)
        self.group_table = launcher.MetadataTable(device)
        # The step's gradient addresses, one int64 per tensor row: the kernels read them instead of a
        # field of the tensor table, so new gradient tensors (every step, after zero_grad) upload 8 bytes
        # a tensor and the tables stay as they are (tensor_row in cuda_src/common.cuh).
        self.gradients = launcher.MetadataTable(device)
        self.grad_addresses = np.zeros((layout.num_tensors, 1), dtype=np.int64)  # (its host side, in place)
        self.grad_copies: dict = {}  # tensor index -> buffer in the parameter's layout (mismatched gradient strides)
        # The tables' rows on the host, updated in place: the pointer columns (TENSOR_POINTER_FIELDS),
        # and what they were last built from.
        self.pointers = np.zeros((layout.num_tensors, len(TENSOR_POINTER_FIELDS)), dtype=np.int64)
        self.tensor_rows = layout.static_rows.copy()
        self.axis_rows = layout.static_jobs.copy()
        self.grad_pointers = self.grad_dtypes = self.grad_dtype_codes = self.uploaded_param_pointers = None
        self.tensor_rows_stale = True  # (the gradients' dtypes changed since the tensor table's upload)
        self.groups_signature = None  # (what the group tables were last built from: _groups_signature)
        self.limits = None  # (sharded max_grad_norm: the clip limits max_norms holds)
        self.accumulated = False
        self.work = allocate(self)  # the engine's workspaces and per-plan constants
        self.check: FastCheck | None = fast_check(self)


class FusedEngine:
    """Base of the fused engines: subclasses name their kernel source and kernels and implement the
    statistics, control and apply phases."""

    SOURCE = ""
    KERNELS: tuple = ()
    APPLY_CHUNK_DEFINE = ""  # the source's #define of its apply passes' chunk (elements per block and chunk)
    GRADIENT_CLIP = 0.0  # Adafactor's gradient clip (VeLO: 1000); 0 = none
    # The update rule (apply_update in cuda_src/accumulators.cuh): False, p − lr·u then the updated value
    # decays (small_fc_lopt, VeLO); True, p − lr·(u + weight_decay·p) (ELO). A kernel trait.
    WEIGHT_DECAY_INSIDE_STEP = False
    # What max_grad_norm means: False, each tensor is clipped by its own norm (small_fc_lopt); True, every
    # gradient of a clipping group by the norm of all the optimizer's gradients together (ELO).
    GLOBAL_CLIPPING = False
    # Whether the engine steps DTensor parameters sharded on dim 0 (FSDP2) with its reduce phase.
    STEPS_SHARDED_PARAMETERS = True
    # Whether a step allocates (from PyTorch's caching allocator: CELO2's Newton-Schulz products); else all
    # its workspaces belong to the plan.
    ALLOCATES_PER_STEP = False

    def __init__(self, optimizer, defines: tuple = ()):
        """``defines`` (``"NAME=VALUE"`` strings): the build of the kernels this engine runs (its precision);
        the update rule is added here."""
        if not self.APPLY_CHUNK_DEFINE:
            raise TypeError(f"{type(self).__name__} names no APPLY_CHUNK_DEFINE: the #define of {self.SOURCE}'s apply "
                            f"chunk (elements a block steps per chunk), which the plan's walks count in")
        defines = tuple(defines) + self.kernel_traits()
        self.defines = defines  # (what the kernels were built with: tests and benchmarks read it)
        # A proxy, not a reference: the optimizer owns its engine, and a cycle between them would keep
        # the parameters' state and the workspaces on the GPU after `del opt` until the garbage
        # collector happens to run.
        self.optimizer = weakref.proxy(optimizer)
        devices = {p.device for group in optimizer.param_groups for p in group["params"]}
        if len(devices) != 1:
            raise RuntimeError(f"the fused backend needs all parameters on one CUDA device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.module = launcher.get_module(self.SOURCE, self.device, defines=tuple(defines))
        names = ("adafactor_axis_partials", "adafactor_finalize", "adafactor_factor_tables") + self.KERNELS
        self.kernels = {name: self.module.get_function(name) for name in names}
        self.parameters = launcher.declared_parameters(self.SOURCE)  # (how each kernel takes its arguments)
        self.blocks = launcher.declared_block_sizes(self.SOURCE, defines)  # (each kernel's __launch_bounds__)
        self.apply_chunk = self.constant(self.APPLY_CHUNK_DEFINE)
        self.plan: Plan | None = None
        self.device_index = self.device.index if self.device.type == "cuda" else -1  # (as Tensor.get_device says)

    @classmethod
    def kernel_traits(cls) -> tuple:
        """The defines every engine's build gets from its class (the shared headers' traits)."""
        return (f"LOPT_WEIGHT_DECAY_INSIDE_STEP={int(cls.WEIGHT_DECAY_INSIDE_STEP)}",)

    # ------------------------------------------------------------------ check

    def checked_gradients(self, grad_scale=None, found_inf=None) -> tuple | None:
        """The check phase's fast path: ``(params, grads, gathered)`` per group as the general check
        (``_check_gradients``) would return them, or None to take that check.

        It applies while the last plan fits: the groups hold the same parameters, each with a gradient
        where the plan has one (none elsewhere), a dense contiguous tensor of the planned shape on this
        device, of the dtype it had last step, no parameter's storage has moved and none with two axes
        of one size has new strides (_same_strides). Those gradients are validated and their pointers
        read in one pass, the part of the host's work that grows with the number of tensors.

        A synchronised step's device waits for the host until the first launch, so the gradients that
        the accumulate phase reads (the factored tensors', and the clipped tensors' for their norms)
        are checked first and that phase is launched on them (``_accumulate_early``) before the
        others are checked: it writes only workspaces, so a check that fails after it changes nothing."""
        plan = self.plan
        if plan is None or plan.check is None:
            return None
        check = plan.check
        plan.accumulated = False
        groups = self.optimizer.param_groups
        if len(groups) != len(check.group_members):
            return None
        if tuple(group.get("max_grad_norm") is not None for group in groups) != plan.key[2]:
            return None
        for group, members in zip(groups, check.group_members):
            params = group["params"]
            if len(params) != len(members) or not all(map(operator.is_, params, members)):
                return None
        if any(p.grad is not None for p in check.without_gradients):
            return None  # (one more participating parameter: the general check re-plans)
        n = plan.layout.num_tensors
        grads, grad_pointers, grad_dtypes, param_pointers = [None] * n, [0] * n, [None] * n, [0] * n
        if not self._read_gradients(check.source_rows, grads, grad_pointers, grad_dtypes, param_pointers):
            return None
        self._accumulate_early(plan, grad_pointers, grad_dtypes, param_pointers, grad_scale, found_inf)
        if (not self._read_gradients(check.other_rows, grads, grad_pointers, grad_dtypes, param_pointers)
                or grad_dtypes != plan.grad_dtypes or param_pointers != plan.param_pointers
                or not self._same_strides(plan, plan.params)):
            plan.accumulated = False  # (a new dtype is validated by the general check; a new layout re-plans)
            return None
        grads_by_group = [grads[start:end] for start, end in check.group_row_ranges]
        return plan.group_params, grads_by_group, GatheredGradients(plan, grad_pointers, grad_dtypes)

    def _read_gradients(self, rows, grads, grad_pointers, grad_dtypes, param_pointers) -> bool:
        """Validate the gradients of ``rows`` ((row, parameter, planned shape)) and store each one, its
        pointer and dtype and its parameter's pointer at its row; False at the first one the general
        check must see.

        A sparse gradient is not contiguous (COO) or cannot say (CSR, BSR, ...: a RuntimeError), so no
        ``layout`` is read here: reading it too measurably lengthened this loop (docs/performance.md §4)."""
        tensor, device_index = torch.Tensor, self.device_index
        try:
            for row, p, shape in rows:
                g = p.grad
                if type(g) is not tensor or g.shape != shape or g.get_device() != device_index or not g.is_contiguous():
                    return False
                grads[row] = g
                grad_pointers[row] = g.data_ptr()
                grad_dtypes[row] = g.dtype
                param_pointers[row] = p.data_ptr()
        except RuntimeError:
            return False
        return True

    def _accumulate_early(self, plan: Plan, grad_pointers, grad_dtypes, param_pointers, grad_scale, found_inf) -> None:
        """The accumulate phase on the gradients checked so far (the axis jobs' sources), from the fast
        check: it reads the tensor table only for what is fixed for the plan (geometry, the factored
        accumulators) and the gradient array only at the sources' rows, which are uploaded first (the
        whole array follows in _refresh, once the other gradients are checked)."""
        check = plan.check
        rows = check.source_row_indices
        if rows:  # (else no axis jobs: the launches below only reset the status flags)
            dtypes = [grad_dtypes[row] for row in rows]
            if dtypes != check.source_dtypes:
                codes = launcher.DTYPE_CODES
                if not all(dtype in codes for dtype in dtypes):
                    return  # (the general check refuses it)
                jobs = plan.axis_rows  # (its other columns are fixed for the plan)
                jobs[:, AXIS_JOB_FIELD["dtype"]] = np.array([codes[dtype] for dtype in dtypes], dtype=np.int64)[check.job_source]
                plan.axis_table.update(jobs)
                check.source_dtypes = dtypes
            plan.grad_addresses[rows, 0] = [grad_pointers[row] for row in rows]
            plan.gradients.update(plan.grad_addresses)
        self._launch_axis_sums(plan, grad_scale)
        self._refresh_groups(plan)
        self._finish_accumulate(plan)
        plan.accumulated = True

    @staticmethod
    def _same_strides(plan: Plan, params) -> bool:
        """Whether the parameters with two axes of one size keep their strides. Those axes can be
        swapped at the same address (``p.data = p.data.t()`` for a square matrix), which changes no
        pointer and no shape: the element order the plan steps in."""
        return all(params[row].stride() == strides for row, strides in plan.permutable_rows)

    def _fast_check_rows(self, plan: Plan) -> FastCheck | None:
        """What the fast check expects of a new plan's steps (None: every step takes the general check)."""
        if plan.sharded_rows or plan.strided_rows:
            return None  # (their gradients need local parts or copies, which the general path makes)
        participating = {id(p): row for row, p in enumerate(plan.params)}
        members, without = [], []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in participating:
                    if p.grad is not None:
                        return None  # (a zero-element parameter with a gradient: the general check validates it)
                    without.append(p)
            members.append(list(group["params"]))
        sources = set(plan.layout.job_tensor)
        rows = [(row, p, p.shape) for row, p in enumerate(plan.params)]
        source_rows = [entry for entry in rows if entry[0] in sources]
        source_row_indices = [row for row, _, _ in source_rows]
        ends = np.cumsum([len(group_params) for group_params in plan.group_params])
        return FastCheck(group_members=members, without_gradients=without, source_rows=source_rows,
                         other_rows=[entry for entry in rows if entry[0] not in sources],
                         source_row_indices=source_row_indices,
                         job_source=np.searchsorted(source_row_indices, plan.layout.job_tensor),
                         group_row_ranges=list(zip([0, *ends[:-1].tolist()], ends.tolist())))

    # ------------------------------------------------------------------ plan

    def invalidate(self) -> None:
        """Forget the plan (after load_state_dict or add_param_group replaced state or groups)."""
        self.plan = None

    def persistent_grid(self, kernel_name: str) -> int:
        """As many blocks of ``kernel_name`` as fit on the device at once (a persistent grid)."""
        properties = torch.cuda.get_device_properties(self.device)
        threads = self.blocks[kernel_name]
        kernel = self.kernels[kernel_name]
        registers = launcher.kernel_attribute(kernel, "num_regs")
        shared = launcher.kernel_attribute(kernel, "shared_size_bytes") + 1024  # + the per-block reservation
        by_registers = 65536 // max(registers * threads, 1)
        by_shared_memory = properties.shared_memory_per_multiprocessor // shared
        per_sm = max(1, min(by_registers, by_shared_memory, 2048 // threads))
        return properties.multi_processor_count * per_sm

    def _plan_for(self, inputs) -> Plan:
        """The plan for this step's tensors: the last one while the same parameters (by identity, with
        the same storage or at least the same shape and strides) take part, else a new one."""
        params = [p for group_params in inputs.params for p in group_params]
        clipped_groups = tuple(group.get("max_grad_norm") is not None for group in self.optimizer.param_groups)
        key = (tuple(map(id, params)), tuple(map(len, inputs.params)), clipped_groups)
        plan = self.plan
        if plan is not None and plan.key == key:
            locals_ = list(map(local_part, params)) if plan.sharded_rows else params
            param_pointers = list(map(torch.Tensor.data_ptr, locals_))
            if param_pointers == plan.param_pointers and self._same_strides(plan, locals_):
                plan.locals = locals_
                return plan
            if all((tuple(p.shape), p.stride()) == geometry for p, geometry in zip(locals_, plan.geometries)):
                # (moved storage: _refresh_tensor_table re-uploads)
                plan.param_pointers, plan.locals = param_pointers, locals_
                return plan
        locals_ = list(map(local_part, params))  # (a DTensor's rows in this process; else the tensor)
        entries = [(g, p) for g, group_params in enumerate(inputs.params) for p in group_params]
        groups, shapes, dims, orders, global_rows = [], [], [], [], []
        for (g, p), local in zip(entries, locals_):
            if local.device != self.device:
                raise RuntimeError(f"the fused backend needs all parameters on {self.device}; one is on {local.device}")
            order = memory_order(local)
            if order is None:  # (refused at construction; a parameter re-strided since)
                raise RuntimeError(dense_layout_problem(local))
            shard = distributed.shard_layout(p)
            if shard.split and order != tuple(range(local.dim())):
                raise RuntimeError(f"the fused backend steps a sharded parameter's rows in place only when they are "
                                   f"contiguous; parameter of shape {tuple(p.shape)} has local strides {local.stride()}")
            logical_dims = self._factored_dims(g, p)  # (of the whole tensor)
            self._arrange_state(p, order, logical_dims)
            groups.append(g)
            orders.append(order)
            shapes.append(tuple(local.shape[a] for a in order) if local.dim() else (1,))
            dims.append(None if logical_dims is None else (order.index(logical_dims[0]), order.index(logical_dims[1])))
            global_rows.append(shard.global_shape[0] if shard.split else None)
        clipped = self._norm_job_rows(groups, clipped_groups)
        layout = GroupLayout(shapes, dims, groups, apply_chunk=self.apply_chunk, clipped=clipped,
                             global_rows=global_rows)
        if layout.sharded and self.optimizer.reducer.is_identity:
            raise RuntimeError("sharded parameters need the reducer of their device mesh")
        plan = Plan(key, params, groups, [list(group_params) for group_params in inputs.params], layout, orders,
                    locals_, self.device, packed_entries=self.packed_entries, allocate=self._allocate,
                    fast_check=self._fast_check_rows, global_clipping=self.GLOBAL_CLIPPING)
        plan.pointers[:, 1:1 + len(STATE_POINTER_FIELDS)] = np.array(
            [self._state_pointers(g, p) for g, p in entries], dtype=np.int64).reshape(len(params), len(STATE_POINTER_FIELDS))
        plan.pointers[:, -2] = [launcher.DTYPE_CODES[p.dtype] for p in params]
        self.plan = plan
        return plan

    def _factored_dims(self, group_index: int, p) -> tuple | None:
        """(d1, d0) of the parameter's factored accumulators, which the accumulate phase updates (None: it has
        none there). Subclass hook: CELO2 leaves out the tensors its accumulate phase does not step."""
        return self.optimizer.reference.factored_dims(tuple(p.shape))

    def _norm_job_rows(self, groups, clipped_groups) -> list:
        """Which tensor rows need their Σ g² from the axis pass (a norm job each): for a global norm every
        tensor where any group clips; for a per-tensor one, the clipped tensors. Subclass hook (CELO2 forms
        its global norm before the accumulate phase, which needs none)."""
        return [any(clipped_groups) if self.GLOBAL_CLIPPING else clipped_groups[g] for g in groups]

    def _state_pointers(self, group_index: int, p) -> list:
        """The addresses of the parameter's accumulators, in STATE_POINTER_FIELDS order (0: none)."""
        state = self.optimizer.state[p]
        return [local_part(state[name]).data_ptr() for name in STATE_POINTER_FIELDS]

    def _arrange_state(self, p, order, dims) -> None:
        """Create the parameter's state if needed and lay it out in the parameter's memory order (a
        sharded parameter's state is laid out as its rows are: contiguous)."""
        state = self.optimizer.ensure_state(p)
        if distributed.is_dtensor(p):
            for name, buf in state.items():
                if not local_part(buf).is_contiguous() or buf.dtype != torch.float32:
                    raise RuntimeError(f"the fused backend needs the state {name!r} of a sharded parameter as "
                                       f"contiguous float32 rows (got {buf.dtype}, strides {local_part(buf).stride()})")
            return
        n = p.dim()
        axes = {"mom": tuple(range(n)), "rms": tuple(range(n)), "fac_vec_v": tuple(range(n))}
        if dims is not None:
            d1, d0 = dims
            axes["fac_vec_row"] = tuple(a for a in range(n) if a != d0)
            axes["fac_vec_col"] = tuple(a for a in range(n) if a != d1)
        for name, logical_axes in axes.items():
            buf = state[name]
            if buf.dtype != torch.float32:
                buf = buf.to(torch.float32)
            if buf.numel() and n:
                # this buffer's axes in the parameter's memory order, then the decay axis
                buf_order = tuple(sorted(range(len(logical_axes)), key=lambda i: order.index(logical_axes[i])))
                buf = arranged(buf, buf_order + (len(logical_axes),))
            state[name] = buf

    packed_entries = False  # (an engine whose apply pass reads the packed table features: Plan.row_packed)

    def _allocate(self, plan: Plan):
        """Subclass hook: the engine's own workspaces, tables and per-plan constants for ``plan`` (its ``work``;
        called once, while the plan is built: its layout and parameters are set)."""
        return None

    # ------------------------------------------------------------------ per step

    def _refresh(self, plan: Plan, inputs) -> None:
        """Upload this step's gradient addresses (the gradient array: all that the first launch, the
        gradients' sums along axes, needs besides what is fixed for the plan) and, where the
        gradients' dtypes changed, the dtype columns of the axis and tensor tables. After the fast
        check's early accumulate phase the array holds the sources' addresses already; this completes it.

        Per tensor only the gradient's pointer, dtype and layout are read (the parameters' pointers in
        _plan_for or the fast check, the state's are fixed for the plan), so the host's share of a step
        stays small whether or not the gradients are new tensors every step: new tensors cost one
        upload of 8 bytes a tensor, and the tables are uploaded only when what they hold changed."""
        if inputs.gathered is not None:  # (the fast check read them)
            grad_pointers, grad_dtypes = inputs.gathered.grad_pointers, inputs.gathered.grad_dtypes
        else:
            grad_pointers, grad_dtypes = self._gradient_pointers(plan, inputs)
        if grad_dtypes != plan.grad_dtypes:
            plan.grad_dtype_codes = [launcher.DTYPE_CODES[dtype] for dtype in grad_dtypes]
            plan.pointers[:, -1] = plan.grad_dtype_codes
            if plan.layout.num_axis_jobs and not plan.accumulated:  # (else _accumulate_early uploaded it)
                plan.axis_table.update(plan.layout.axis_rows(plan.pointers, out=plan.axis_rows))
            plan.grad_dtypes, plan.tensor_rows_stale = grad_dtypes, True
        # (Always offered: the table compares with what it last uploaded, which an early accumulate
        # phase of a step that its check then refused may have changed.)
        plan.grad_addresses[:, 0] = grad_pointers
        plan.gradients.update(plan.grad_addresses)
        plan.grad_pointers = grad_pointers

    @staticmethod
    def _gradient_pointers(plan: Plan, inputs) -> tuple[list, list]:
        """The gradients' pointers and dtypes in the plan's row order: a DTensor's local rows, and a
        gradient laid out differently from its parameter copied into the parameter's layout first."""
        params = plan.locals  # (this step's, from _plan_for)
        grads = [g for group_grads in inputs.grads for g in group_grads]  # (as the check phase saw them)
        if plan.sharded_rows:
            grads = list(map(local_part, grads))
        strided = plan.strided_rows
        if strided or not all(map(torch.Tensor.is_contiguous, grads)):
            for row, g in enumerate(grads):
                if not g.is_contiguous() if row not in strided else g.stride() != params[row].stride():
                    copy = plan.grad_copies.get(row)
                    if copy is None or copy.dtype != g.dtype:
                        copy = plan.grad_copies[row] = torch.empty_like(params[row], dtype=g.dtype)  # p's layout
                    copy.copy_(g)
                    grads[row] = copy
        return list(map(torch.Tensor.data_ptr, grads)), [g.dtype for g in grads]

    def _refresh_tensor_table(self, plan: Plan) -> None:
        """The tensor table of the passes after the accumulate phase's first: its parameter pointers
        and gradient dtypes, where they changed."""
        if plan.tensor_rows_stale or plan.param_pointers is not plan.uploaded_param_pointers:
            plan.pointers[:, 0] = plan.param_pointers
            plan.tensor_table.update(plan.layout.tensor_rows(plan.pointers, out=plan.tensor_rows))
            plan.uploaded_param_pointers, plan.tensor_rows_stale = plan.param_pointers, False

    def _refresh_groups(self, plan: Plan) -> None:
        """The group tables (decays, multipliers, lr and weight decay as values or device pointers, the
        step counters), rebuilt only where what they are built from changed (_groups_signature)."""
        groups = self.optimizer.param_groups
        if plan.groups_signature is not None and self._groups_signature(groups) == plan.groups_signature:
            return
        values = np.zeros((len(groups), GROUP_VALUE_FLOATS), dtype=np.float32)
        device_scalars = {}
        for g, group in enumerate(groups):
            row = values[g]
            row[GROUP_VALUES["decays"]:GROUP_VALUES["decays"] + CONSTANTS["DECAYS_FLOATS"]] = \
                self._packed_decays(group).numpy()
            row[GROUP_VALUES["exp_mult"]] = group["exp_mult"]
            row[GROUP_VALUES["step_mult"]] = group.get("step_mult", 1.0)  # (ELO has none: its lr is the step)
            row[GROUP_VALUES["max_grad_norm"]] = group.get("max_grad_norm") or 0.0
            for name in ("lr", "weight_decay"):
                value = group[name]
                if self._read_on_device(value):
                    device_scalars[g, name] = value  # read on the device: schedulers update it in place
                else:
                    row[GROUP_VALUES[name]] = float(value)
            group["step"] = self._device_counter(group.get("step", 0))
        first = groups[0]
        first["skipped_steps"] = self._device_counter(first.get("skipped_steps", 0))
        values_table = plan.group_values.update(values)
        slot = values_table.element_size()
        rows = empty_rows("GroupMeta", len(groups))
        for g, group in enumerate(groups):
            base = values_table.data_ptr() + g * GROUP_VALUE_FLOATS * slot
            rows[g, GROUP_FIELD["values"]] = base
            for name in ("lr", "weight_decay"):
                scalar = device_scalars.get((g, name))
                rows[g, GROUP_FIELD[name]] = scalar.data_ptr() if scalar is not None else base + GROUP_VALUES[name] * slot
            rows[g, GROUP_FIELD["step"]] = group["step"].data_ptr()
        plan.group_table.update(rows)
        plan.groups_signature = self._groups_signature(groups)

    GROUP_TABLE_KEYS = ("momentum_decays", "rms_decays", "adafactor_decays", "exp_mult", "step_mult", "max_grad_norm",
                        "lr", "weight_decay", "step")

    def _read_on_device(self, value) -> bool:
        """Whether a group's lr or weight decay is a tensor the kernels read where it lies (float32 on
        this device); any other value is read here, each step."""
        return torch.is_tensor(value) and value.device == self.device and value.dtype == torch.float32

    def _groups_signature(self, groups) -> tuple:
        """What the group tables are built from: a tensor the kernels read (or the step counter) by its
        identity and address, any other value as the table holds it."""
        def key(value):
            if not torch.is_tensor(value):
                return value
            return (id(value), value.data_ptr()) if self._read_on_device(value) or value.dtype == torch.int64 \
                else float(value)

        return (tuple(tuple(key(group.get(name)) for name in self.GROUP_TABLE_KEYS) for group in groups),
                key(groups[0].get("skipped_steps")))

    def _packed_decays(self, group) -> torch.Tensor:
        key = (group["momentum_decays"], group["rms_decays"], group["adafactor_decays"])
        cache = self.__dict__.setdefault("_decays_cache", {})
        if key not in cache:
            cache[key] = pack_decays(self.optimizer.decays(group))
        return cache[key]

    def _device_counter(self, value) -> torch.Tensor:
        if torch.is_tensor(value) and value.device == self.device and value.dtype == torch.int64 and value.dim() == 0:
            return value
        return torch.tensor(int(value), dtype=torch.int64, device=self.device)

    def flags(self, plan: Plan, inputs) -> dict:
        """The kernels' step-flag arguments: grad_scale, found_inf (GradScaler's, or none) and status."""
        return self._flags(plan, inputs.grad_scale, inputs.found_inf)

    def _flags(self, plan: Plan, grad_scale, found_inf) -> dict:
        return {"grad_scale": self._on_device(grad_scale), "found_inf": self._on_device(found_inf),
                "status": plan.status}

    def _on_device(self, tensor):
        if tensor is None:
            return None
        if tensor.device != self.device or tensor.dtype != torch.float32:
            raise RuntimeError(f"the fused backend needs GradScaler's tensors as float32 on {self.device}, got "
                               f"{tensor.dtype} on {tensor.device}")
        return tensor

    # ------------------------------------------------------------------ phases

    def step(self, inputs, *args) -> None:
        """One step: ``inputs`` from the optimizer's check phase, ``args`` what the optimizer's own
        phases need (VeLO: the loss)."""
        self.optimizer._check_fused_processes_hold_the_same_tensors()
        gathered = inputs.gathered
        plan = gathered.plan if gathered is not None and gathered.plan is self.plan else self._plan_for(inputs)
        self._refresh(plan, inputs)
        flags = self.flags(plan, inputs)
        extra = self._step_arguments(plan, *args)
        self._accumulate(plan, inputs)
        self._statistics(plan, flags)
        if self.optimizer.nonfinite == "raise":
            self._raise_if_unusable(plan, inputs)
        self._control(plan, flags, *extra)
        self._apply(plan, flags, *extra)

    def _step_arguments(self, plan: Plan, *args) -> tuple:
        """Subclass hook: the kernel arguments of ``args`` (computed once per step)."""
        return args

    def _accumulate(self, plan: Plan, inputs) -> None:
        """The accumulate phase; with sharded parameters, what is partial in each process (the means over
        a split axis, the norms, the slab sums of row_col_mean) is summed across processes in between.
        Where the fast check launched it already (on these gradients), only the tensor table is left."""
        if plan.accumulated:
            plan.accumulated = False
            self._refresh_tensor_table(plan)
            return
        self._launch_axis_sums(plan, inputs.grad_scale)
        self._refresh_tensor_table(plan)  # (while the device runs the launch above)
        self._refresh_groups(plan)
        self._finish_accumulate(plan)

    def _launch_axis_sums(self, plan: Plan, grad_scale) -> None:
        layout = plan.layout
        self.launch("adafactor_axis_partials", layout.total_axis_blocks,
                    jobs=plan.axis_table.table if layout.num_axis_jobs else None, num_jobs=layout.num_axis_jobs,
                    gradients=plan.gradients.table, partials=plan.axis_partials,
                    grad_scale=self._on_device(grad_scale), gradient_clip=self.GRADIENT_CLIP,
                    gradient_transforms=self._gradient_transforms(plan), status=plan.status)

    def _gradient_transforms(self, plan: Plan):
        """Subclass hook: a float2 per tensor row, (factor, clamp), that the axis pass applies to each gradient
        element before it squares it (None: no factor, and the class's GRADIENT_CLIP as the clamp)."""
        return None

    def _finish_accumulate(self, plan: Plan) -> None:
        layout = plan.layout
        mean_blocks = max(1, -(-layout.total_axis_outputs // FINALIZE_THREADS))  # (finalize_mean_blocks)
        self.launch("adafactor_finalize", mean_blocks + layout.num_norm_jobs,
                    jobs=plan.axis_table.table if layout.num_axis_jobs else None, num_jobs=layout.num_mean_jobs,
                    total_outputs=layout.total_axis_outputs, partials=plan.axis_partials, axis_means=plan.axis_means,
                    status=plan.status, norm_jobs=plan.norm_table.table if layout.num_norm_jobs else None,
                    tensors=plan.tensor_table.table, **self.group_arguments(plan), clip_factors=plan.clip_factors,
                    norm_sums=plan.norm_sums)
        reducer = self.optimizer.reducer
        if layout.split_outputs:
            reducer.sum_(plan.axis_means[:layout.split_outputs])
        if plan.norm_sums is not None and self.GLOBAL_CLIPPING:
            self._global_clip_factors(plan)
        elif plan.norm_sums is not None:
            self._sharded_clip_factors(plan, reducer.sum_(plan.norm_sums))
        table_blocks = layout.total_slabs + -(-layout.total_col_entries // TABLE_THREADS)
        phases = (1, 2) if plan.slab_sums is not None else (0,)
        for phase in phases:
            self.launch("adafactor_factor_tables", table_blocks,
                        tensors=plan.tensor_table.table, num_tensors=layout.num_tensors, groups=plan.group_table.table,
                        total_slabs=layout.total_slabs, total_col_entries=layout.total_col_entries,
                        axis_means=plan.axis_means, row_table=plan.row_table, col_table=plan.col_table,
                        row_factors=plan.row_factors, col_factors=plan.col_factors, row_packed=plan.row_packed,
                        col_packed=plan.col_packed, clip_factors=plan.clip_factors, phase=phase,
                        slab_sums=plan.slab_sums)
            if phase == 1:
                reducer.sum_(plan.slab_sums)

    def _refresh_max_norms(self, plan: Plan) -> None:
        """``plan.max_norms``: each norm job's tensor's group limit (inf for a group that does not clip, which
        only a global norm has jobs for), uploaded only when the limits changed."""
        groups = self.optimizer.param_groups
        limits = [groups[plan.groups[int(t)]]["max_grad_norm"] for t in plan.layout.static_norm_jobs[:, 0]]
        if plan.limits != limits:
            plan.max_norms.copy_(torch.tensor([math.inf if limit is None else limit for limit in limits],
                                              dtype=torch.float32))
            plan.limits = limits

    def _sharded_clip_factors(self, plan: Plan, square_sums: torch.Tensor) -> None:
        """max_grad_norm over sharded tensors: the clip factors from the reduced Σ g², as
        gradient_clip_factor forms them (min(1, (1 / (‖g‖ + 1e-6)) · max_norm), float32), on the device."""
        self._refresh_max_norms(plan)
        plan.norms.copy_(square_sums.clamp_(min=0).sqrt_())
        plan.norms.add_(1e-6).reciprocal_().mul_(plan.max_norms).clamp_(max=1.0)
        plan.clip_factors.index_copy_(0, plan.norm_tensors, plan.norms)

    def _global_clip_factors(self, plan: Plan) -> None:
        """max_grad_norm over every gradient together (GLOBAL_CLIPPING; reference: ``global_clip_factor``): ``N``,
        the float32 square root of Σ g² over every tensor (float64; the parts of tensors split among processes,
        FSDP2, reduced across them; whole tensors are every process's, as the fused backends refuse ZeRO's
        partitions, ``_check_fused_processes_hold_the_same_tensors``); each tensor of a clipping group gets
        ``(1 / N) · max_grad_norm`` where ``N`` exceeds it, every other tensor 1. On the device, from the norm
        jobs' sums."""
        self._refresh_max_norms(plan)
        sums = plan.norm_sums.clamp(min=0)
        split = plan.split_norm_jobs  # (masked sums, not indexing by the mask: no host sync, capturable)
        parts = torch.stack([torch.where(split, sums, 0.0).sum(), torch.where(split, 0.0, sums).sum()])
        if plan.layout.sharded:
            self.optimizer.reducer.sum_(parts[:1])
        norm = parts.sum().sqrt().to(torch.float32)
        factors = torch.where(norm > plan.max_norms, norm.reciprocal() * plan.max_norms, 1.0)
        plan.clip_factors.index_copy_(0, plan.norm_tensors, factors)

    def _raise_if_unusable(self, plan: Plan, inputs) -> None:
        """nonfinite='raise': one read of the device flag; nothing has been written yet."""
        from lopt.errors import NonFiniteGradientError
        from lopt.optimizers.naive import _tensor_hyperparameters

        if inputs.found_inf is not None and float(inputs.found_inf) != 0:
            return  # GradScaler's overflow: it skips the step itself
        if int(plan.status[CONSTANTS["STATUS_NONFINITE"]]) == 0:
            return
        for index, name, value in _tensor_hyperparameters(self.optimizer.param_groups):
            number = float(value)
            if not (number >= 0 and number < float("inf")):
                raise NonFiniteGradientError(
                    f"{self.optimizer.__class__.__name__}.step: param group #{index}'s {name} is a tensor holding "
                    f"{number!r} (it must be a finite number >= 0); nothing was changed (nonfinite='raise')")
        index = next((i for i, p in enumerate(self.optimizer._all_params())
                      if p.grad is not None and not bool((local_part(p.grad).float().abs() < 2.0**64).all())), None)
        if index is None:
            raise NonFiniteGradientError(f"{self.optimizer.__class__.__name__}.step: a gradient of another process holds "
                                         f"NaN, an infinite value or a value of magnitude >= 2^64; nothing was "
                                         f"changed (nonfinite='raise')")
        raise NonFiniteGradientError(f"{self.optimizer.__class__.__name__}.step: the gradient of parameter #{index} holds "
                                     f"NaN, an infinite value or a value of magnitude >= 2^64; nothing was changed "
                                     f"(nonfinite='raise')")

    def _statistics(self, plan: Plan, flags: dict) -> None:
        """The statistics phase: one launch over every chunk; with sharded parameters the non-finite flag
        is then reduced, so that a bad gradient element in any process's rows skips the step in all of them."""
        self._launch_statistics(plan, flags)
        if plan.layout.sharded:
            self.optimizer.reducer.max_(plan.status)

    def _launch_statistics(self, plan: Plan, flags: dict) -> None:
        """Subclass hook: the statistics kernel over every chunk (``layout.total_stats_chunks`` blocks)."""
        raise NotImplementedError

    def _control(self, plan: Plan, flags: dict, *args) -> None:
        raise NotImplementedError

    def _apply(self, plan: Plan, flags: dict, *args) -> None:
        raise NotImplementedError

    def launch(self, name: str, grid, shared_mem: int = 0, **arguments) -> None:
        """Launch kernel ``name`` in blocks of its declared size (:attr:`blocks`) with its arguments by parameter
        name (``launcher.bind_arguments``)."""
        args = launcher.bind_arguments(name, self.parameters[name], arguments)
        launcher.launch(self.kernels[name], grid, self.blocks[name], args, self.device, shared_mem)

    def constant(self, name: str) -> int:
        """A ``#define`` of this engine's kernel source as built (``launcher.source_constant``)."""
        return launcher.source_constant(self.SOURCE, name, self.defines)

    def group_arguments(self, plan: Plan) -> dict:
        return {"groups": plan.group_table.table, "num_groups": len(self.optimizer.param_groups)}

    def skipped_counter(self) -> torch.Tensor:
        return self.optimizer.param_groups[0]["skipped_steps"]


@dataclass
class Walk:
    """The chunks a persistent pass walks where it steps some of the tensors only (ChunkWalk rows; walk_chunks_of in
    accumulators.cuh): theirs, numbered in a space of their own that the pass's grid splits evenly."""

    table: torch.Tensor | None  # int64 (first_chunk, tensor) per tensor; None where it walks none
    rows: int
    chunks: int

    def arguments(self) -> dict:
        return dict(walk=self.table, walk_rows=self.rows, walk_chunks=self.chunks)


def walk_of(rows: list, chunks: list, device) -> tuple[Walk, dict]:
    """The walk over tensor rows ``rows`` (ascending; ``chunks[row]`` apply chunks each, a tensor of none
    left out), and each row's first chunk in it."""
    entries, firsts, total = [], {}, 0
    for row in rows:
        if chunks[row] > 0:
            entries.append((total, row))
            firsts[row] = total
            total += chunks[row]
    if not entries:
        return Walk(None, 0, 0), firsts
    table = empty_rows("ChunkWalk", len(entries))
    table[:, WALK_FIELD["first_chunk"]] = [first for first, _ in entries]
    table[:, WALK_FIELD["tensor"]] = [row for _, row in entries]
    return Walk(torch.from_numpy(table).to(device), len(entries), total), firsts


def commit_blocks(layout) -> int:
    """Blocks of a control kernel that write a kept step's new R and C to the state
    (commit_factored_accumulators in accumulators.cuh): about 2048 table entries each, at most 128."""
    entries = layout.total_row_entries + layout.total_col_entries
    return min(128, -(-entries // 2048))


def permutable(shape) -> bool:
    """Whether two axes of ``shape`` have the same size (> 1): a permutation of them keeps the shape."""
    sizes = [size for size in shape if size > 1]
    return len(set(sizes)) < len(sizes)


def non_dense_parameter(params) -> str | None:
    """Why the fused backend cannot take ``params`` (None if every one is dense)."""
    for index, p in enumerate(params):
        problem = dense_layout_problem(p)
        if problem:
            return f"parameter #{index}: {problem}"
    return None
