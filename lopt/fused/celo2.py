"""Fused CELO2 and ELO-CELO2: launches ``cuda_src/celo2.cu`` for every tensor of every group, and runs
Newton–Schulz on stacks of same-shaped matrices in torch.

Mirrors ``lopt/reference/celo2.py`` (docs/celo2.md; the fused engine's decisions: §8). One step:

1. ``celo2_gradient_norm``   (where a group clips) Σ g² per chunk of every gradient; the global norm and each
                             clipping tensor's factor ``max_norm / max(‖g‖, max_norm)`` are formed on the
                             device (reference ``clip_scale``), before the accumulate phase, which clamps
                             ``f·g`` (clip before clamp)
2. the shared accumulate phase (``adafactor_axis_partials`` with each tensor's gradient transform
   ``clamp(f·g, ±grad_clip_value)``, ``adafactor_finalize``, ``adafactor_factor_tables``)
3. ``celo2_statistics``      the learned tensors' features' Σ x² and Σ p²; every gradient element checked
4. ``celo2_control``         normaliser scales and ``param_scale``; the AdamW tensors' bias corrections; a kept
                             step's R and C committed
5. ``celo2_mlp``             features, normalisation, the MLP, the proposed step written to its place in its
                             stack (a matrix with more rows than columns transposed, as ``newton_schulz``
                             orients it); the accumulators stored
6. torch, per stack          ``reference.orthogonalise`` (float32 products, TF32 off), then Σ s² per matrix
                             and the two factors of ``finish_step``'s normalisation
7. ``celo2_apply``           ``p ← p − lr·(rms_mult·u + weight_decay·p)``; the AdamW branch (CELO2's own moments
                             with its own step counts; ELO-CELO2's shared accumulators); the step counters
8. torch, "elsewhere"        learned tensors of rank >= 3 (conv kernels), whose normalisation and
                             Newton–Schulz run per slice of their last two axes: the reference functions,
                             written where the step is kept (no host synchronisation)

Everything stays on the device (a step is capturable in a CUDA graph). The fused backend refuses
sharded parameters (FSDP2): ``backend="auto"`` then takes the naive one.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from lopt.fused import launcher
from lopt.fused.contract import CELO2_GROUP_DOUBLES, CELO2_GROUP_VALUES, CONSTANTS, FIELD, empty_rows
from lopt.fused.engine import STATS_THREADS, FusedEngine, Plan, arranged, commit_blocks
from lopt.network import PREFIX, MLPGeometry
from lopt.reference import accumulators
from lopt.reference import celo2 as reference

LEARNED, ADAM_OWN, ADAM_SHARED, ELSEWHERE = (CONSTANTS[f"CELO2_{kind}"] for kind in
                                             ("LEARNED", "ADAM_OWN", "ADAM_SHARED", "ELSEWHERE"))
SUMS = CONSTANTS["CELO2_SUMS"]
CONTROL_THREADS = 256
FEATURE_SCALE_FLOATS = 64  # per tensor: 30 scales, then at 32 the 30 un-shifts (C2_SCALES in celo2.cu)
CELO2_FIELD = FIELD["Celo2Tensor"]
STATUS_NONFINITE = CONSTANTS["STATUS_NONFINITE"]


def linear_network(network: dict) -> tuple[dict, MLPGeometry]:
    """CELO2's MLP (``x @ w`` weights, a split first layer) as a PyTorch-layout network (``out × in``), and its
    geometry, so that ``MLPGeometry`` packs it and generates the kernels' constants as for small_fc_lopt's."""
    first = reference.first_layer_weight(network)  # (30, hidden)
    layers = reference.dense_layer_count(network)
    if first.shape[0] != reference.NUM_INPUTS or layers < 1:
        raise ValueError(f"CELO2's fused kernels take the published network's layout (30 inputs, dense layers "
                         f"after the split first layer); these weights have {first.shape[0]} inputs and {layers} "
                         f"dense layers")
    hidden = int(first.shape[1])
    out = {f"{PREFIX}input.weight": first.t(), f"{PREFIX}input.bias": network[reference.FIRST_BIAS]}
    for j in range(layers):
        name = "output" if j == layers - 1 else f"linear_{j}"
        weight = network[reference.DENSE_WEIGHT.format(j)]
        if weight.shape[0] != hidden or (j < layers - 1 and weight.shape[1] != hidden):
            raise ValueError(f"CELO2's fused kernels take hidden layers of one width; dense_w.{j} has shape "
                             f"{tuple(weight.shape)} after a first layer of {hidden} units")
        out[f"{PREFIX}{name}.weight"] = weight.t()
        out[f"{PREFIX}{name}.bias"] = network[reference.DENSE_BIAS.format(j)]
    geometry = MLPGeometry(inputs=reference.NUM_INPUTS, hidden=hidden, hidden_layers=layers - 1,
                           outputs=int(out[f"{PREFIX}output.weight"].shape[0]))
    if geometry.outputs != reference.NUM_OUTPUTS:
        raise ValueError(f"CELO2's network gives {reference.NUM_OUTPUTS} outputs; these weights give {geometry.outputs}")
    return out, geometry


@contextlib.contextmanager
def float32_products():
    """Matrix products in float32 (TF32 off) for Newton–Schulz, whatever the caller's setting, restored after."""
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


def kernel_defines(geometry: MLPGeometry) -> tuple:
    """What celo2.cu is compiled with: the network's geometry (kernel traits)."""
    return geometry.cuda_defines("C2_MLP")


@dataclass
class Stack:
    """Same-shaped learned steps of one group, each ``(rows, cols)`` with rows <= cols, contiguous in the step
    buffer from ``offset``: Newton–Schulz takes them as one batch. ``matrices``: rank-2 parameters (vectors
    and 0-d parameters, as ``(1, n)``, are never orthogonalised)."""

    group: int
    rows_per_matrix: int
    cols: int
    offset: int
    tensor_rows: list
    matrices: bool
    tensor_index: torch.Tensor | None = None  # the tensor rows, on the device (index_copy_)

    @property
    def count(self) -> int:
        return len(self.tensor_rows)

    def view(self, steps: torch.Tensor) -> torch.Tensor:
        size = self.count * self.rows_per_matrix * self.cols
        return steps[self.offset:self.offset + size].view(self.count, self.rows_per_matrix, self.cols)


def step_placement(shape, order) -> tuple[tuple[int, int], int, int, int]:
    """Where a learned tensor's elements go in its stack: ``((rows, cols), inner, outer_stride, inner_stride)``
    for an element ``e`` of the tensor in memory order (``order``: its axes from outermost to innermost):
    ``(e // inner) · outer_stride + (e % inner) · inner_stride``. A matrix ``(m, n)`` is placed as itself where
    ``m <= n`` and transposed otherwise (``newton_schulz``'s orientation); a vector of n elements (a 0-d
    parameter: one) as ``(1, n)``."""
    if len(shape) <= 1:
        n = shape[0] if shape else 1
        return (1, n), n, 0, 1
    m, n = shape
    transposed = m > n
    inner = shape[order[1]]
    if order == (0, 1):  # memory (i, j): row i, column j of the logical matrix
        strides = (1, m) if transposed else (n, 1)
    else:  # memory (j, i)
        strides = (m, 1) if transposed else (1, n)
    return ((n, m) if transposed else (m, n)), inner, strides[0], strides[1]


@dataclass
class Celo2Work:
    """A CELO2 plan's own tables and workspaces."""

    kinds: list
    table: launcher.MetadataTable  # Celo2Tensor rows
    groups: launcher.MetadataTable  # the groups' float64 value blocks
    group_rows: np.ndarray | None
    steps: torch.Tensor  # the proposed steps, stack by stack
    stacks: list
    stats_partials: torch.Tensor
    norm_partials: torch.Tensor | None  # (where a group clips) Σ g² per statistics chunk
    transforms: torch.Tensor  # (factor, clamp) per tensor row
    clamps: list | None  # the clamp column as last uploaded
    clips: torch.Tensor | None  # per row: its group clips (global norm)
    max_norms: torch.Tensor | None  # per row: its group's max_grad_norm (where it clips)
    limits: list | None
    feature_scales: torch.Tensor
    param_scales: torch.Tensor
    step_scales: torch.Tensor
    adam_corrections: torch.Tensor
    elsewhere_rows: list


class CELO2Fused(FusedEngine):
    """The fused engine behind ``CELO2(backend="fused")`` and ``ELO_CELO2(backend="fused")``."""

    SOURCE = "celo2.cu"
    KERNELS = ("celo2_statistics", "celo2_gradient_norm", "celo2_control", "celo2_mlp", "celo2_apply")
    APPLY_CHUNK = 128  # one element per thread (C2_APPLY_CHUNK)
    APPLY_THREADS = 128
    WEIGHT_DECAY_INSIDE_STEP = True  # (CELO2's rule and its AdamW branch's: p − lr·(u + weight_decay·p))

    STEPS_SHARDED_PARAMETERS = False  # (Newton–Schulz would need each split matrix gathered: the naive backend does)
    ALLOCATES_PER_STEP = True  # (reference.orthogonalise's temporaries, from PyTorch's caching allocator)

    def __init__(self, optimizer):
        if optimizer.has_sharded_parameters:
            raise RuntimeError("the fused CELO2 does not step sharded (DTensor, FSDP2) parameters yet")
        network, self.geometry = linear_network(optimizer.meta_weights.tensors["mlp"])
        super().__init__(optimizer, kernel_defines(self.geometry))
        self.network = self.geometry.pack(network).to(self.device)
        self.mlp_grid = self.persistent_grid("celo2_mlp", self.APPLY_THREADS)
        self.apply_grid = self.persistent_grid("celo2_apply", self.APPLY_THREADS)
        self._kinds: dict = {}

    # ------------------------------------------------------------------ plan

    def _kind(self, group: dict, p) -> int:
        optimizer = self.optimizer
        if optimizer.uses_adamw(group, p):
            return ADAM_OWN if optimizer._OWN_ADAM_MOMENTS else ADAM_SHARED
        return LEARNED if p.dim() <= 2 else ELSEWHERE

    def _plan_for(self, inputs) -> Plan:
        groups = self.optimizer.param_groups
        self._kinds = {id(p): self._kind(groups[g], p) for g, params in enumerate(inputs.params) for p in params}
        return super()._plan_for(inputs)

    def _factored_dims(self, group_index: int, p):
        """The accumulate phase updates R and C of the learned tensors it steps (and of ELO-CELO2's AdamW
        tensors, whose accumulators its AdamW branch reads); CELO2's AdamW tensors have none, and the
        tensors stepped elsewhere update theirs there."""
        if self._kinds[id(p)] in (ADAM_OWN, ELSEWHERE):
            return None
        return reference.factored_dims(tuple(p.shape))

    def _norm_job_rows(self, groups, clipped_groups) -> list:
        return [False] * len(groups)  # (the global norm comes from celo2_gradient_norm, before the axis pass)

    def _state_pointers(self, group_index: int, p) -> list:
        if self._kinds[id(p)] == ADAM_OWN:
            return [0] * 5
        return super()._state_pointers(group_index, p)

    def _arrange_state(self, p, order, dims) -> None:
        """The learned branch's accumulators as every engine lays them out; CELO2's AdamW moments in the
        parameter's memory order, and its step count as a device counter (the apply pass advances it)."""
        if self._kinds[id(p)] != ADAM_OWN:
            super()._arrange_state(p, order, dims)
            return
        state = self.optimizer.ensure_state(p)
        for key in reference.ADAM_KEYS:
            buf = state[key] if state[key].dtype == torch.float32 else state[key].float()
            state[key] = arranged(buf, order) if p.dim() else buf
        state[reference.ADAM_STEP_KEY] = self._device_counter(state[reference.ADAM_STEP_KEY])

    def _allocate(self, plan: Plan) -> Celo2Work:
        layout, device, n = plan.layout, plan.device, plan.layout.num_tensors
        kinds = [self._kinds[id(p)] for p in plan.params]
        rows = empty_rows("Celo2Tensor", n)
        stacks: dict = {}
        elsewhere = []
        for row, (p, kind) in enumerate(zip(plan.params, kinds)):
            rows[row, CELO2_FIELD["kind"]] = kind
            state = self.optimizer.state[p]
            if kind == ADAM_OWN:
                for field, key in zip(("exp_avg", "exp_avg_sq"), reference.ADAM_KEYS):
                    rows[row, CELO2_FIELD[field]] = state[key].data_ptr()
                rows[row, CELO2_FIELD["adam_step"]] = state[reference.ADAM_STEP_KEY].data_ptr()
            elif kind == ELSEWHERE:
                elsewhere.append(row)
            elif kind == LEARNED:
                shape = tuple(p.shape)
                (m, cols), inner, outer_stride, inner_stride = step_placement(shape, plan.memory_orders[row])
                key = (plan.groups[row], m, cols, len(shape) == 2)
                stacks.setdefault(key, []).append((row, inner, outer_stride, inner_stride))
                rows[row, CELO2_FIELD["inputs"]] = reference.NUM_INPUTS if len(shape) == 2 else reference.UNFACTORED_INPUTS
        stack_list, offset = [], 0
        for (group, m, cols, matrices), members in stacks.items():
            stack = Stack(group=group, rows_per_matrix=m, cols=cols, offset=offset,
                          tensor_rows=[row for row, *_ in members], matrices=matrices)
            for index, (row, inner, outer_stride, inner_stride) in enumerate(members):
                rows[row, CELO2_FIELD["step_offset"]] = offset + index * m * cols
                rows[row, CELO2_FIELD["inner"]] = inner
                rows[row, CELO2_FIELD["outer_stride"]] = outer_stride
                rows[row, CELO2_FIELD["inner_stride"]] = inner_stride
            stack.tensor_index = torch.tensor(stack.tensor_rows, dtype=torch.int64, device=device)
            offset += stack.count * m * cols
            stack_list.append(stack)
        table = launcher.MetadataTable(device)
        table.update(rows)
        clipping = any(plan.key[2])
        transforms = torch.ones(max(n, 1), 2, dtype=torch.float32, device=device)
        return Celo2Work(
            kinds=kinds, table=table, groups=launcher.MetadataTable(device, dtype=np.float64), group_rows=None,
            steps=plan.workspace(offset, torch.float32), stacks=stack_list,
            stats_partials=plan.workspace(layout.total_stats_chunks * SUMS, torch.float64),
            norm_partials=plan.workspace(layout.total_stats_chunks, torch.float64) if clipping else None,
            transforms=transforms, clamps=None,
            clips=torch.tensor([plan.key[2][g] for g in plan.groups], dtype=torch.bool, device=device) if clipping else None,
            max_norms=plan.workspace(n, torch.float32) if clipping else None, limits=None,
            feature_scales=plan.workspace(n * FEATURE_SCALE_FLOATS, torch.float32),
            param_scales=plan.workspace(n, torch.float32),
            step_scales=torch.ones(max(n, 1), 2, dtype=torch.float32, device=device),
            adam_corrections=torch.ones(max(n, 1), 2, dtype=torch.float32, device=device),
            elsewhere_rows=elsewhere)

    def _accumulate_early(self, plan: Plan, grad_pointers, grad_dtypes, param_pointers, grad_scale, found_inf) -> None:
        """The fast check's early accumulate phase where no group clips. Where one does, the axis pass clamps
        ``f·g`` with ``f`` from the norm of every gradient, so the accumulate phase waits for the whole check."""
        if plan.work.clips is not None:
            return
        self._refresh_celo2_groups(plan)
        super()._accumulate_early(plan, grad_pointers, grad_dtypes, param_pointers, grad_scale, found_inf)

    def _gradient_transforms(self, plan: Plan):
        return plan.work.transforms

    # ------------------------------------------------------------------ per step

    def _refresh_celo2_groups(self, plan: Plan) -> None:
        """The groups' CELO2 values (uploaded where they changed), the clamp of every tensor, and the clipping
        groups' limits."""
        work, groups = plan.work, self.optimizer.param_groups
        values = np.zeros((len(groups), CELO2_GROUP_DOUBLES), dtype=np.float64)
        slot = CELO2_GROUP_VALUES
        for g, group in enumerate(groups):
            row = values[g]
            lr = group["lr"]
            on_device = self._read_on_device(lr)
            row[slot["grad_clip_value"]] = group["grad_clip_value"]
            row[slot["rms_mult"]] = group["rms_mult"]
            row[slot["param_scale_mult"]] = float(bool(group["param_scale_mult"]))
            row[slot["adam_lr_mult"]] = group["adam_lr_mult"]
            row[slot["adam_lr_on_device"]] = float(on_device)
            # (the host's product in float64, as the reference's adam_lr_mult * lr, rounded once by the kernel)
            row[slot["adam_lr"]] = 0.0 if on_device else group["adam_lr_mult"] * float(lr)
            row[slot["adam_weight_decay"]] = float(group["adam_weight_decay"])
            betas = group.get("adam_betas", (0.0, 0.0))
            row[slot["adam_beta1"]], row[slot["adam_beta2"]] = float(betas[0]), float(betas[1])
            row[slot["adam_eps"]] = float(group.get("adam_eps", 0.0))
        if work.group_rows is None or not np.array_equal(values, work.group_rows):
            work.groups.update(values)
            work.group_rows = values
        clamps = [float(groups[g]["grad_clip_value"]) for g in plan.groups]
        if clamps != work.clamps:
            work.transforms[:len(clamps), 1].copy_(torch.tensor(clamps, dtype=torch.float32))
            work.clamps = clamps
        if work.clips is not None:
            limits = [groups[g]["max_grad_norm"] for g in plan.groups]
            if limits != work.limits:
                work.max_norms.copy_(torch.tensor([math.inf if x is None else x for x in limits], dtype=torch.float32))
                work.limits = limits

    def _clip_factors(self, plan: Plan, grad_scale) -> None:
        """The global clip: Σ g² of every gradient (float64, fixed order), ‖g‖ rounded to float32, and each
        clipping tensor's factor ``max_norm / max(‖g‖, max_norm)`` (reference ``global_norm``, ``clip_scale``),
        into the transforms' factor column; on the device."""
        layout, work = plan.layout, plan.work
        self.launch("celo2_gradient_norm", layout.total_stats_chunks, STATS_THREADS, tensors=plan.tensor_table.table,
                    gradients=plan.gradients.table, num_tensors=layout.num_tensors,
                    grad_scale=self._on_device(grad_scale), status=plan.status, norm_partials=work.norm_partials)
        norm = reference.global_norm(work.norm_partials[:layout.total_stats_chunks].sum())
        factors = work.max_norms / torch.maximum(norm, work.max_norms)
        work.transforms[:layout.num_tensors, 0].copy_(torch.where(work.clips, factors, 1.0))

    def step(self, inputs, *args) -> None:
        """One step (the module's docstring): check, clip, accumulate, statistics, control, MLP, Newton–Schulz,
        apply, and the tensors stepped elsewhere."""
        self.optimizer._check_fused_processes_hold_the_same_tensors()
        gathered = inputs.gathered
        plan = gathered.plan if gathered is not None and gathered.plan is self.plan else self._plan_for(inputs)
        self._refresh(plan, inputs)
        flags = self.flags(plan, inputs)
        self._refresh_tensor_table(plan)
        self._refresh_groups(plan)
        self._refresh_celo2_groups(plan)
        if plan.work.clips is not None:
            self._clip_factors(plan, inputs.grad_scale)
        self._accumulate(plan, inputs)
        self._statistics(plan, flags)
        if self.optimizer.nonfinite == "raise":
            self._raise_if_unusable(plan, inputs)
        self._control(plan, flags)
        self._apply(plan, flags, inputs)

    def _launch_statistics(self, plan: Plan, flags: dict) -> None:
        layout, work = plan.layout, plan.work
        self.launch("celo2_statistics", layout.total_stats_chunks, STATS_THREADS, tensors=plan.tensor_table.table,
                    gradients=plan.gradients.table, num_tensors=layout.num_tensors, groups=plan.group_table.table,
                    celo2_tensors=work.table.table, gradient_transforms=work.transforms, row_table=plan.row_table,
                    col_table=plan.col_table, **flags, stats_partials=work.stats_partials)

    def _control(self, plan: Plan, flags: dict, *args) -> None:
        layout, work = plan.layout, plan.work
        self.launch("celo2_control", layout.num_tensors + commit_blocks(layout), CONTROL_THREADS,
                    tensors=plan.tensor_table.table, num_tensors=layout.num_tensors, groups=plan.group_table.table,
                    celo2_tensors=work.table.table, celo2_groups=work.groups.table,
                    stats_partials=work.stats_partials, row_table=plan.row_table, col_table=plan.col_table,
                    total_row_entries=layout.total_row_entries, total_col_entries=layout.total_col_entries, **flags,
                    feature_scales=work.feature_scales, param_scales=work.param_scales,
                    adam_corrections=work.adam_corrections)

    def _apply(self, plan: Plan, flags: dict, inputs=None) -> None:
        layout, work = plan.layout, plan.work
        chunks = layout.total_apply_chunks
        tables = dict(tensors=plan.tensor_table.table, gradients=plan.gradients.table, num_tensors=layout.num_tensors,
                      groups=plan.group_table.table, total_chunks=chunks, celo2_tensors=work.table.table,
                      celo2_groups=work.groups.table, gradient_transforms=work.transforms)
        if work.stacks:
            self.launch("celo2_mlp", max(1, min(self.mlp_grid, chunks)), self.APPLY_THREADS, **tables,
                        row_table=plan.row_table, col_table=plan.col_table, feature_scales=work.feature_scales,
                        param_scales=work.param_scales, network=self.network, **flags, steps=work.steps)
            self._finish_steps(plan)
        self.launch("celo2_apply", max(1, min(self.apply_grid, chunks)), self.APPLY_THREADS, **tables,
                    num_groups=len(self.optimizer.param_groups), steps=work.steps, step_scales=work.step_scales,
                    adam_corrections=work.adam_corrections, **flags, skipped_steps=self.skipped_counter())
        if work.elsewhere_rows:
            self._step_elsewhere(plan, inputs)

    def _finish_steps(self, plan: Plan) -> None:
        """Newton–Schulz on each stack of matrices whose group orthogonalises (reference ``orthogonalise``,
        float32 products without TF32), then ``finish_step``'s normalisation of each matrix as two float32
        factors (``normalise_by_square_sums``), which the apply pass multiplies by."""
        work, groups = plan.work, self.optimizer.param_groups
        for stack in work.stacks:
            group = groups[stack.group]
            steps = stack.view(work.steps)
            if stack.matrices and group["orthogonalize"]:
                with float32_products():
                    steps.copy_(reference.orthogonalise(steps, group["ns_coefficients"], group["ns_steps"],
                                                        group["ns_eps"]))
            sums = accumulators.float64_square_sum(accumulators.finite_part(steps), dim=(-2, -1))
            scales = torch.rsqrt(reference.NORMALISER_EPSILON + sums / (stack.rows_per_matrix * stack.cols))
            shift = torch.where(scales < 2.0**-60, 2.0**64, 1.0).to(torch.float64)
            work.step_scales.index_copy_(0, stack.tensor_index,
                                         torch.stack([(scales * shift).float(), (1 / shift).float()], dim=1))

    def _step_elsewhere(self, plan: Plan, inputs) -> None:
        """The learned tensors of rank >= 3: the reference's learned_step on the device, from the step's
        gradient as the kernels form it (unscaled, ``clamp(f·g)``), written where the step is kept."""
        optimizer, work = self.optimizer, plan.work
        keep = plan.status[STATUS_NONFINITE] == 0
        if inputs.found_inf is not None:
            keep = keep & (inputs.found_inf == 0)
        inverse_scale = inputs.grad_scale.double().reciprocal().float() if inputs.grad_scale is not None else None
        grads = [g for group_grads in inputs.grads for g in group_grads]
        with float32_products():
            for row in work.elsewhere_rows:
                p, group = plan.params[row], optimizer.param_groups[plan.groups[row]]
                state = optimizer.state[p]
                grad = grads[row].detach().to(torch.float32)
                if inverse_scale is not None:
                    grad = grad * inverse_scale
                grad = torch.clamp(grad * work.transforms[row, 0], -group["grad_clip_value"], group["grad_clip_value"])
                value = p.detach().to(torch.float32)
                dims = reference.factored_dims(tuple(p.shape))
                updated = {key: state[key].clone() for key in reference.ACCUMULATOR_KEYS}
                accumulators.update_accumulators(updated, grad.unsqueeze(-1), optimizer.decays(group, p.device), dims)
                features = reference.per_element_features(grad.unsqueeze(-1), value.unsqueeze(-1), updated, dims)
                update = reference.learned_update(
                    features, value, optimizer.weights_on(p.device)["mlp"], exp_mult=group["exp_mult"],
                    rms_mult=group["rms_mult"], param_scale_mult=group["param_scale_mult"],
                    orthogonalize=group["orthogonalize"], ns_coefficients=group["ns_coefficients"],
                    ns_steps=group["ns_steps"], ns_eps=group["ns_eps"])
                new = reference.apply_step(value, update, group["lr"], group["weight_decay"]).to(p.dtype)
                with torch.no_grad():
                    p.copy_(torch.where(keep, new, p))
                    for key in reference.ACCUMULATOR_KEYS:
                        state[key].copy_(torch.where(keep, updated[key], state[key]))
