"""Fused CELO2 and ELO-CELO2: launches ``cuda_src/celo2.cu`` for every tensor of every group, and runs
Newton–Schulz on stacks of same-shaped matrices in torch.

Mirrors ``lopt/reference/celo2.py`` (docs/celo2.md; the fused engine's decisions: §8). One step:

1. ``celo2_gradient_norm``   (where a group clips) Σ g² per chunk of every gradient; its last block forms the
                             global norm and each clipping tensor's factor ``max_norm / max(‖g‖, max_norm)``
                             (reference ``clip_scale``), before the accumulate phase, which clamps ``f·g``
                             (clip before clamp)
2. the shared accumulate phase (``adafactor_axis_partials`` with each tensor's gradient transform
   ``clamp(f·g, ±grad_clip_value)``, ``adafactor_finalize``, ``adafactor_factor_tables``)
3. ``celo2_statistics``      the learned tensors' features' Σ x² (but a factored tensor's 12 table features')
                             and Σ p²; every gradient element checked
4. ``celo2_control``         normaliser scales (the table features' sums over the R and C entries) and
                             ``param_scale``; the AdamW tensors' bias corrections; a kept step's R and C committed
   ``celo2_slices``          the sliced tensors (:func:`sliced`: conv kernels of small ``kh × kw`` slices, in
                             either memory layout), each slice whole: its features, per-slice normalisation,
                             the MLP (float32), Newton–Schulz of the slice, finish_step and the update; 1 × 1
                             and 3 × 3 slices a thread each, by kernels built for their shape
                             (:data:`SLICE_KERNELS`), the others a warp each
5. ``celo2_table_features``  per R and C entry, its table features' share of the MLP's first layer
   ``celo2_mlp``             the element's own features, normalisation, the MLP from its entries' shares (float32;
                             ``precision="fast"``: on tensor cores, :func:`fast_mlp`), the proposed step written to
                             its place in its stack (the tensor's matrix as it lies in memory; fast: a matrix's
                             straight into Newton–Schulz's bfloat16 input, undivided), and per block and tensor
                             the float64 Σ s² of those values; the accumulators stored
6. ``celo2_normalise``       each matrix to orthogonalise: its norm (its segments' sums) plus ``ns_eps``, whether
                             its proposed step has a non-finite element, and the matrix divided by the former (a
                             non-finite element as 0) into the workspace; a matrix of one row or column
                             (:attr:`Stack.scalar`) its whole iteration, a scalar recurrence, into its result.
                             Fast: the first polynomial's coefficients ``(a/d, b/d³, c/d⁵)`` instead (the input
                             repaired in place only where non-finite or its norm out of range: docs/celo2.md §8.1)
   torch, per family         Newton–Schulz's products (:func:`newton_schulz_family`: float32 with TF32 off,
                             or bfloat16 for ``precision="fast"``, whose first polynomial divides by the norm:
                             ``celo2_first_polynomial``), in place in the workspace (or replayed from one CUDA
                             graph per plan: ``REPLAY_PRODUCTS``)
   ``celo2_matrix_sums``     each learned tensor: Σ s² of its final step, ``finish_step``'s two factors
7. ``celo2_adamw``           (after the MLP pass) the AdamW branch: CELO2's own moments with their own step
                             counts, ELO-CELO2's shared accumulators
   ``celo2_apply``           the learned tensors' ``p ← p − lr·(rms_mult·u + weight_decay·p)``; the step counters
8. torch, "elsewhere"        the other learned tensors of several slices (larger slices, rank >= 5 in another
                             memory order), whose normalisation and Newton–Schulz run per slice of their last two
                             axes: the reference functions, written where the step is kept (no host
                             synchronisation)

The MLP and apply passes walk the learned tensors' chunks alone, the AdamW pass the AdamW tensors'
(:class:`lopt.fused.engine.Walk`), each split evenly over its persistent grid.

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
from lopt.fused.engine import FusedEngine, Plan, Walk, arranged, commit_blocks, memory_order, walk_of
from lopt.network import PREFIX, MLPGeometry
from lopt.reference import accumulators
from lopt.reference import celo2 as reference

LEARNED, ADAM_OWN, ADAM_SHARED, ELSEWHERE, SLICED = (CONSTANTS[f"CELO2_{kind}"] for kind in
                                                     ("LEARNED", "ADAM_OWN", "ADAM_SHARED", "ELSEWHERE", "SLICED"))
SLICE_MAX = CONSTANTS["CELO2_SLICE_MAX"]
SUMS = CONSTANTS["CELO2_SUMS"]
NORMALISE_BLOCKS = 64  # blocks per matrix of celo2_normalise (grid-stride)
FIRST_POLYNOMIAL_PAIRS = 4  # pairs of entries per thread of celo2_first_polynomial (grid-stride)
CELO2_FIELD = FIELD["Celo2Tensor"]
STATUS_NONFINITE = CONSTANTS["STATUS_NONFINITE"]
# A factored tensor's table features (R, C and their rsqrt: C2_TABLE_FIRST ... C2_TABLE_END in celo2.cu), which
# enter the MLP through its R and C entries' shares (celo2_table_features); an element forms the rest itself
# (C2_ELEMENT_FEATURES).
_TABLE_GROUPS = [index for index, (name, _) in enumerate(reference.FEATURE_GROUPS) if name.endswith("_accumulator")]
TABLE_INPUTS = range(sum(reference.GROUP_WIDTHS[:_TABLE_GROUPS[0]]), sum(reference.GROUP_WIDTHS[:_TABLE_GROUPS[-1] + 1]))
ELEMENT_INPUTS = reference.NUM_INPUTS - len(TABLE_INPUTS)


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


def entry_floats(geometry: MLPGeometry) -> int:
    """Floats per R or C entry of ``celo2_table_features``: the entry's share of the first layer (one per hidden
    unit), then its three factors, padded to a multiple of 4 (the MLP pass reads them as float4s)."""
    return -(-(geometry.hidden + 3) // 4) * 4


def fast_mlp(precision: str, geometry: MLPGeometry) -> bool:
    """Whether ``celo2_mlp`` runs the MLP on tensor cores (BF16 products, float32 sums: ``precision="fast"``'s
    MLP): where the geometry fits one 8-column tile and a 32-input first layer (the element's own inputs and one
    per hidden unit). Else, and in exact mode, float32 on the CUDA cores."""
    return precision == "fast" and geometry.hidden <= 8 and ELEMENT_INPUTS + geometry.hidden <= 32


def kernel_defines(precision: str, geometry: MLPGeometry) -> tuple:
    """What celo2.cu is compiled with: the MLP's arithmetic (``fast_mlp``), whether the MLP pass writes the
    matrices' steps straight into Newton–Schulz's bfloat16 input (``precision="fast"``: C2_DIRECT_WORK), the
    network's geometry (kernel traits) and its table entries' size."""
    return ((f"C2_FAST_MLP={int(fast_mlp(precision, geometry))}", f"C2_DIRECT_WORK={int(precision == 'fast')}")
            + geometry.cuda_defines("C2_MLP") + (f"C2_ENTRY_FLOATS={entry_floats(geometry)}",))


# The MLP pass takes the packed network by value, as a kernel parameter (celo2.cu, Celo2Network): 4 KB is what
# every CUDA driver lets a launch pass (the published network, hidden 8, is 1,388 bytes).
NETWORK_PARAMETER_BYTES = 3584


def network_argument(packed: torch.Tensor) -> np.void:
    """The packed network (float32) as the by-value ``Celo2Network`` argument of ``celo2_mlp``."""
    values = packed.detach().cpu().to(torch.float32).numpy()
    if values.nbytes > NETWORK_PARAMETER_BYTES:
        raise ValueError(f"CELO2's fused MLP takes its network as a kernel parameter of at most "
                         f"{NETWORK_PARAMETER_BYTES} bytes; this network has {values.size} weights "
                         f"({values.nbytes} bytes): use backend='naive' for networks this large")
    struct = np.dtype({"names": ["w"], "formats": [(np.float32, (values.size,))]}, align=True)
    return np.frombuffer(values.tobytes(), dtype=struct)[0]


def scaled_polynomial(gram: torch.Tensor, square: torch.Tensor, first: torch.Tensor) -> None:
    """The first polynomial of matrices given undivided (``first``: per matrix ``(ka, kb, kc, ·)``, float32):
    ``P = kb·A + kc·A A``, plus ``ka`` on the diagonal, in float32 (each product and sum rounded), rounded once to
    ``square``'s dtype, in place of ``square`` (``A A``; ``gram`` holds ``A``). With ``(a/d, b/d³, c/d⁵)``,
    ``P S`` is the iteration's first step on ``X = S/d``. (celo2_first_polynomial on a GPU, the same arithmetic.)"""
    ka, kb, kc = (first[:, i, None, None] for i in range(3))
    value = kb * gram.float() + kc * square.float()
    value.diagonal(dim1=-2, dim2=-1).add_(ka[..., 0])
    square.copy_(value)


def newton_schulz_products(x: torch.Tensor, y: torch.Tensor, gram: torch.Tensor, polynomial: torch.Tensor,
                           coefficients, steps: int, exact: bool, first: torch.Tensor | None = None) -> torch.Tensor:
    """``steps`` iterations of ``reference.newton_schulz`` on the stack ``x`` (``(count, rows, cols)``, already
    divided by its norms, or, with ``first``, not: see :func:`newton_schulz_family`), ping-ponging between ``x``
    and ``y``; returns the one holding the result. The
    iteration on the smaller Gram matrix: for ``rows <= cols`` ``A = X Xᵀ``, ``P = b·A + c·A A`` and
    ``X ← a·X + P X``; for ``rows > cols`` the same on ``Xᵀ``, written as ``A = XᵀX`` and ``X ← a·X + X Pᵀ``
    (cuBLAS reads the transposes in place). ``P`` is one product whose epilogue adds ``b·A``. ``exact``:
    ``a·X + P X`` in the reference's form (the product's epilogue adds ``a·X``); else as ``(a·I + P) X``
    (bfloat16's rounding dwarfs the difference).
    ``gram`` and ``polynomial``: ``(count, k, k)`` workspaces, ``k = min(rows, cols)``."""
    return newton_schulz_family([(x, y)], gram, polynomial, coefficients, steps, exact, first)[0]


def newton_schulz_family(stacks: list, gram: torch.Tensor, polynomial: torch.Tensor, coefficients, steps: int,
                         exact: bool, first: torch.Tensor | None = None, first_polynomial=scaled_polynomial) -> list:
    """:func:`newton_schulz_products` for several stacks at once whose Gram matrices are of one size ``k``
    (``stacks``: their ``(x, y)`` pairs, each of its own shape): each iteration forms every stack's Gram matrices
    into its part of ``gram`` (``(Σ count, k, k)``, the stacks' in order), then the polynomial of all of them in
    one launch (fast: two), then each stack's product. Per matrix the same arithmetic as one stack alone; a stack of
    another shape costs its two products an iteration and no more of the polynomial's launches (ViT-B/16's and
    GPT-2 medium's matrices all have one smaller side). Returns each stack's result buffer.
    ``first`` (the fast form only; ``(Σ count, 4)`` float32, per matrix ``(a/d, b/d³, c/d⁵, ·)`` for its divisor
    ``d``): the stacks hold each matrix ``S`` undivided, and the first iteration's polynomial is
    ``first_polynomial(gram, A A, first)`` (:func:`scaled_polynomial`), whose ``P S`` is the first step on
    ``S/d``: the division rides on the Gram matrices, k × k each, not on the matrices (precision="fast")."""
    if first is not None and exact:
        raise ValueError("undivided matrices (first=) are the fast form's: exact Newton–Schulz divides them first")
    a, b, c = coefficients
    pairs = list(stacks)
    bounds = np.cumsum([0] + [x.shape[0] for x, _ in pairs])
    for iteration in range(steps):
        for (x, _), start, end in zip(pairs, bounds[:-1], bounds[1:]):
            out = gram[start:end]
            torch.bmm(x.mT, x, out=out) if x.shape[-2] > x.shape[-1] else torch.bmm(x, x.mT, out=out)
        if iteration == 0 and first is not None:
            torch.bmm(gram, gram, out=polynomial)
            first_polynomial(gram, polynomial, first)
        else:
            # P = b·A + c·A A in one product (the GEMM's epilogue forms b·A: no pass of its own over the Gram
            # matrices)
            torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=polynomial)
            if not exact:
                polynomial.diagonal(dim1=-2, dim2=-1).add_(a)
        for (x, y), start, end in zip(pairs, bounds[:-1], bounds[1:]):
            p = polynomial[start:end]
            tall = x.shape[-2] > x.shape[-1]
            if exact:
                torch.baddbmm(x, x, p.mT, beta=a, out=y) if tall else torch.baddbmm(x, p, x, beta=a, out=y)
            else:
                torch.bmm(x, p.mT, out=y) if tall else torch.bmm(p, x, out=y)
        pairs = [(y, x) for x, y in pairs]
    return [x for x, _ in pairs]


@dataclass
class Stack:
    """Same-shaped learned steps of one group, each ``(rows, cols)`` as the tensor's matrix lies in memory,
    contiguous in the step buffer from ``offset``: Newton–Schulz takes them as one batch (orienting each by
    its smaller side, so that a matrix and its transpose come out transposed alike). ``matrices``: parameters
    of rank >= 2 (:func:`one_matrix`; vectors and 0-d parameters, as ``(1, n)``, are never orthogonalised)."""

    group: int
    rows_per_matrix: int
    cols: int
    offset: int
    tensor_rows: list
    matrices: bool
    # Newton–Schulz's workspaces, ``(Σ count, k, k)``, k = min(rows, cols), shared by every stack of matrices with
    # this k (its family: newton_schulz_family), this stack's matrices from family_start
    family_gram: torch.Tensor | None = None
    family_polynomial: torch.Tensor | None = None
    family_start: int = 0
    # the family's rows of first polynomial coefficients (``(Σ count, 4)``: newton_schulz_family's ``first``), which
    # celo2_normalise writes for a direct matrix (precision="fast")
    family_first: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return len(self.tensor_rows)

    @property
    def scalar(self) -> bool:
        """Matrices of one row or one column (a class token): their Gram matrices are 1 × 1, Newton–Schulz a
        scalar recurrence on each one's norm, which ``celo2_normalise`` runs whole; no product, no workspace."""
        return self.matrices and min(self.rows_per_matrix, self.cols) == 1

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        size = self.count * self.rows_per_matrix * self.cols
        return buffer[self.offset:self.offset + size].view(self.count, self.rows_per_matrix, self.cols)


def one_matrix(shape) -> bool:
    """Whether the fused passes step a learned tensor of this shape: rank <= 2, or a higher rank whose leading
    axes are all of size 1 (a class token ``(1, 1, d)``), whose one slice of its last two axes is the whole
    tensor, so that every normalisation and Newton–Schulz run over all of it, as a matrix's do. The others
    (conv kernels: a slice per leading index) are stepped elsewhere."""
    return math.prod(shape[:-2]) == 1


def sliced(p: torch.Tensor) -> bool:
    """Whether ``celo2_slices`` steps a learned tensor that is not :func:`one_matrix`: its slices of its last two
    axes (a conv kernel's ``kh × kw``) of at most ``SLICE_MAX`` (49: 7 × 7) elements each, the tensor dense and
    in row-major order or of rank 4 in any order (a conv kernel in channels-last order), so that
    :func:`slice_walk_row` locates every slice's elements. The others (larger slices, rank 5 or more in another
    order) are stepped elsewhere."""
    return (p.dim() >= 3 and math.prod(p.shape[-2:]) <= SLICE_MAX and memory_order(p) is not None
            and (p.is_contiguous() or p.dim() == 4))


# The slice kernel built for each slice shape (its loops unrolled, the slice's arrays in registers); any other
# shape (a 5 × 5 or 7 × 7 kernel's, a 3-d tensor's: few, long slices) goes to ``celo2_slices``, a warp per slice
# (its arrays in shared memory).
SLICE_KERNELS = {(1, 1): "celo2_slices_1x1", (3, 3): "celo2_slices_3x3"}
# Threads per slice: one each, but ``celo2_slices``' a warp each (few and long).
SLICE_THREADS_EACH = {"celo2_slices": 32}


def slice_kernel(shape) -> str:
    """The kernel that steps a sliced tensor of ``shape`` (:data:`SLICE_KERNELS`)."""
    return SLICE_KERNELS.get(tuple(shape[-2:]), "celo2_slices")


def slice_walk_row(p: torch.Tensor, first_slice: int, row: int) -> tuple:
    """A sliced tensor's SliceWalk row: slice s (its leading axes' index in row-major order) has its element
    (r, c) at memory index ``(s // inner)·outer_stride + (s % inner)·inner_stride + r·row_stride + c·col_stride``
    (the tensor's strides: a row-major tensor's slices one after the other, a channels-last kernel's strided)."""
    rows, cols = p.shape[-2:]
    if p.is_contiguous():
        return first_slice, row, rows, cols, 1, rows * cols, 0, cols, 1
    return first_slice, row, rows, cols, p.shape[1], p.stride(0), p.stride(1), p.stride(2), p.stride(3)


def stored_matrix(shape, order) -> tuple[int, int]:
    """A learned tensor's matrix as it lies in memory: ``(m, n)`` for a matrix in row-major order, ``(n, m)`` for
    one in column-major order (``order``: its axes from outermost to innermost; a tensor of :func:`one_matrix`'s
    higher ranks: its last two axes' order, the others being of size 1), ``(1, n)`` for a vector of n elements
    (a 0-d parameter: one). Newton–Schulz of the transpose is the transpose of Newton–Schulz."""
    if len(shape) <= 1:
        return 1, (shape[0] if shape else 1)
    outer, inner = [axis for axis in order if axis >= len(shape) - 2]
    return shape[outer], shape[inner]


def families_of(runs: list) -> list:
    """``runs`` (stack, steps, coefficients, in stack order) as lists that :func:`newton_schulz_family` takes
    at once: consecutive stacks of one Gram family, adjacent in its workspace, with the same steps and
    coefficients (a group's own choices split a family)."""
    families: list = []
    for run in runs:
        if families:
            last, steps, coefficients = families[-1][-1]
            stack = run[0]
            if (stack.family_gram is last.family_gram and stack.family_start == last.family_start + last.count
                    and run[1:] == (steps, coefficients)):
                families[-1].append(run)
                continue
        families.append([run])
    return families


@dataclass
class Celo2Work:
    """A CELO2 plan's own tables and workspaces."""

    kinds: list
    table: launcher.MetadataTable  # Celo2Tensor rows
    groups: launcher.MetadataTable  # the groups' float64 value blocks
    group_rows: np.ndarray | None
    steps: torch.Tensor  # the proposed steps, stack by stack
    work: torch.Tensor  # Newton–Schulz's two ping-pong buffers (float32, or bfloat16 for precision "fast"), each
    #                     laid out as `steps` up to the end of the matrices' stacks
    stacks: list
    first_polynomials: torch.Tensor  # float32 (family matrices, 4): Stack.family_first, each family's rows
    segment_sums: torch.Tensor  # float64 per (MLP block, tensor row) at block + row: Σ s² of the segment's finite
    #                             proposed values, its sign bit set where it met a non-finite one (celo2_normalise)
    sum_partials: torch.Tensor  # float64, C2_SUMS_SPLITS per learned tensor of celo2_matrix_sums
    sum_tickets: torch.Tensor  # int32 per learned tensor, 0 between launches (the last block of each resets its own)
    proposed_nonfinite: torch.Tensor  # int32 per tensor row: 1 where its proposed step is not all finite (final_step)
    learned_rows: torch.Tensor  # int32, the learned tensors' rows
    orthogonalised: tuple | None  # per stack, the Newton–Schulz steps the result pointers were last written for
    products_graph: tuple | None  # (its runs' key, the CUDA graph of Newton–Schulz's products: _newton_schulz)
    ns_rows: torch.Tensor | None  # int32, the rows of the matrices Newton–Schulz takes this step (scalar ones first)
    scalar_rows: int  # how many of ns_rows are scalar matrices' (Stack.scalar)
    stats_partials: torch.Tensor
    norm_partials: torch.Tensor | None  # (where a group clips) Σ g² per statistics chunk
    norm_ticket: torch.Tensor | None  # int32, 0 between launches (celo2_gradient_norm's last block resets it)
    transforms: torch.Tensor  # (factor, clamp) per tensor row
    clamps: list | None  # each group's grad_clip_value as the transforms' clamp column last holds it
    clips: torch.Tensor | None  # per row: its group clips (global norm)
    max_norms: torch.Tensor | None  # per row: its group's max_grad_norm (where it clips)
    limits: list | None
    feature_scales: torch.Tensor
    row_entries: torch.Tensor  # celo2_table_features' R entries (entry_floats each), then its C entries
    col_entries: torch.Tensor
    param_scales: torch.Tensor
    step_scales: torch.Tensor
    adam_corrections: torch.Tensor
    elsewhere_rows: list
    learned_walk: Walk  # the learned tensors' chunks (celo2_mlp, celo2_apply)
    adamw_walk: Walk  # the AdamW tensors' (celo2_adamw)
    # per slice kernel (slice_kernel) that has tensors: (int64 SliceWalk rows of its tensors, their slices' count)
    slice_walks: dict


class CELO2Fused(FusedEngine):
    """The fused engine behind ``CELO2(backend="fused")`` and ``ELO_CELO2(backend="fused")``."""

    SOURCE = "celo2.cu"
    KERNELS = ("celo2_statistics", "celo2_gradient_norm", "celo2_control", "celo2_slices", "celo2_slices_1x1",
               "celo2_slices_3x3", "celo2_table_features",
               "celo2_mlp", "celo2_matrix_sums", "celo2_normalise", "celo2_first_polynomial", "celo2_adamw",
               "celo2_apply")
    APPLY_CHUNK_DEFINE = "C2_APPLY_CHUNK"
    WEIGHT_DECAY_INSIDE_STEP = True  # (CELO2's rule and its AdamW branch's: p − lr·(u + weight_decay·p))

    # Newton–Schulz's products replayed from a CUDA graph captured once per plan (_newton_schulz); False: eager
    # every step (the tests set it both ways). On: the host issued ViT-B/16's ~125 product launches more slowly
    # than the GPU ran them (docs/celo2.md §8, step 6; docs/performance.md §8).
    REPLAY_PRODUCTS = True
    STEPS_SHARDED_PARAMETERS = False  # (Newton–Schulz would need each split matrix gathered: the naive backend does)

    def __init__(self, optimizer):
        if optimizer.has_sharded_parameters:
            raise RuntimeError("the fused CELO2 does not step sharded (DTensor, FSDP2) parameters yet")
        network, self.geometry = linear_network(optimizer.meta_weights.tensors["mlp"])
        super().__init__(optimizer, kernel_defines(optimizer.precision, self.geometry))
        self.network = network_argument(self.geometry.pack(network))
        self.work_dtype = torch.bfloat16 if optimizer.precision == "fast" else torch.float32
        self.mlp_grid = self.persistent_grid("celo2_mlp")
        self.apply_grid = self.persistent_grid("celo2_apply")
        self.adamw_grid = self.persistent_grid("celo2_adamw")
        self.sums_splits = self.constant("C2_SUMS_SPLITS")  # (celo2_matrix_sums' blocks per matrix)
        self._kinds: dict = {}

    @property
    def ALLOCATES_PER_STEP(self) -> bool:  # noqa: N802 (FusedEngine's attribute)
        """Only the learned tensors of several slices (the reference functions, on the device) allocate:
        Newton–Schulz runs in the plan's workspaces."""
        return bool(self.plan is not None and self.plan.work.elsewhere_rows)

    # ------------------------------------------------------------------ plan

    def _kind(self, group: dict, p) -> int:
        optimizer = self.optimizer
        if optimizer.uses_adamw(group, p):
            return ADAM_OWN if optimizer._OWN_ADAM_MOMENTS else ADAM_SHARED
        if one_matrix(tuple(p.shape)):
            return LEARNED
        return SLICED if sliced(p) else ELSEWHERE

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
        elsewhere, slices = [], []
        for row, (p, kind) in enumerate(zip(plan.params, kinds)):
            rows[row, CELO2_FIELD["kind"]] = kind
            state = self.optimizer.state[p]
            if kind == ADAM_OWN:
                for field, key in zip(("exp_avg", "exp_avg_sq"), reference.ADAM_KEYS):
                    rows[row, CELO2_FIELD[field]] = state[key].data_ptr()
                rows[row, CELO2_FIELD["adam_step"]] = state[reference.ADAM_STEP_KEY].data_ptr()
            elif kind == ELSEWHERE:
                elsewhere.append(row)
            elif kind == SLICED:
                rows[row, CELO2_FIELD["inputs"]] = reference.NUM_INPUTS
                slices.append(row)
            elif kind == LEARNED:
                shape = tuple(p.shape)
                m, cols = stored_matrix(shape, plan.memory_orders[row])
                matrix = len(shape) >= 2
                stacks.setdefault((plan.groups[row], m, cols, matrix), []).append(row)
                rows[row, CELO2_FIELD["inputs"]] = reference.NUM_INPUTS if matrix else reference.UNFACTORED_INPUTS
        stack_list, offset = [], 0
        # (the matrices' stacks first: Newton–Schulz's workspace covers the step buffer up to their end; those of
        # one smaller side k next to each other, sharing one Gram workspace: newton_schulz_family)
        for (group, m, cols, matrices), members in sorted(stacks.items(),
                                                          key=lambda item: (not item[0][3], min(item[0][1:3]))):
            stack = Stack(group=group, rows_per_matrix=m, cols=cols, offset=offset, tensor_rows=members,
                          matrices=matrices)
            for index, row in enumerate(members):
                rows[row, CELO2_FIELD["step_offset"]] = offset + index * m * cols
            offset += stack.count * m * cols
            stack_list.append(stack)
        families: dict = {}
        for stack in stack_list:
            if stack.matrices and not stack.scalar:
                families.setdefault(min(stack.rows_per_matrix, stack.cols), []).append(stack)
        first_polynomials = plan.workspace(4 * max(1, sum(stack.count for members in families.values()
                                                          for stack in members)), torch.float32).view(-1, 4)
        family_base = 0  # (each family's rows of first_polynomials, in family order)
        for k, members in families.items():
            count = sum(stack.count for stack in members)
            gram = plan.workspace(count * k * k, self.work_dtype).view(count, k, k)
            polynomial = plan.workspace(count * k * k, self.work_dtype).view(count, k, k)
            start = 0
            for stack in members:
                stack.family_gram, stack.family_polynomial, stack.family_start = gram, polynomial, start
                stack.family_first = first_polynomials[family_base:family_base + count]
                for index, row in enumerate(stack.tensor_rows):
                    rows[row, CELO2_FIELD["ns_matrix"]] = family_base + start + index
                start += stack.count
            family_base += count
        matrix_elements = sum(stack.count * stack.rows_per_matrix * stack.cols for stack in stack_list if stack.matrices)
        chunks = [-(-math.prod(shape) // self.apply_chunk) for shape in layout.shapes]
        learned_walk, firsts = walk_of([row for row in range(n) if kinds[row] == LEARNED], chunks, device)
        for row, first in firsts.items():
            rows[row, CELO2_FIELD["mlp_chunk"]] = first
        adamw_walk, _ = walk_of([row for row in range(n) if kinds[row] in (ADAM_OWN, ADAM_SHARED)], chunks, device)
        table = launcher.MetadataTable(device)
        table.update(rows)  # (the result pointers: _refresh_results, before the first MLP pass)
        slice_walks = {}
        for kernel in dict.fromkeys(slice_kernel(plan.params[row].shape) for row in slices):
            rows_of_kernel = [row for row in slices if slice_kernel(plan.params[row].shape) == kernel]
            walk_rows, total_slices = empty_rows("SliceWalk", len(rows_of_kernel)), 0
            for index, row in enumerate(rows_of_kernel):
                p = plan.params[row]
                walk_rows[index] = slice_walk_row(p, total_slices, row)
                total_slices += p.numel() // math.prod(p.shape[-2:])
            slice_walks[kernel] = (torch.from_numpy(walk_rows).to(device), total_slices)
        clipping = any(plan.key[2])
        transforms = torch.ones(max(n, 1), 2, dtype=torch.float32, device=device)
        return Celo2Work(
            kinds=kinds, table=table, groups=launcher.MetadataTable(device, dtype=np.float64), group_rows=None,
            steps=plan.workspace(offset, torch.float32), work=plan.workspace(2 * matrix_elements, self.work_dtype),
            stacks=stack_list, first_polynomials=first_polynomials,
            segment_sums=plan.workspace(self.mlp_grid + n, torch.float64),
            sum_partials=plan.workspace(max(n, 1) * self.sums_splits, torch.float64),
            sum_tickets=torch.zeros(max(n, 1), dtype=torch.int32, device=device),
            proposed_nonfinite=torch.zeros(max(n, 1), dtype=torch.int32, device=device),
            learned_rows=torch.tensor([row for stack in stack_list for row in stack.tensor_rows], dtype=torch.int32,
                                      device=device),
            orthogonalised=None, ns_rows=None, scalar_rows=0, products_graph=None,
            stats_partials=plan.workspace(layout.total_stats_chunks * SUMS, torch.float64),
            norm_partials=plan.workspace(layout.total_stats_chunks, torch.float64) if clipping else None,
            norm_ticket=torch.zeros(1, dtype=torch.int32, device=device) if clipping else None,
            transforms=transforms, clamps=None,
            clips=torch.tensor([plan.key[2][g] for g in plan.groups], dtype=torch.bool, device=device) if clipping else None,
            max_norms=plan.workspace(n, torch.float32) if clipping else None, limits=None,
            feature_scales=plan.workspace(n * self.constant("C2_SCALES"), torch.float32),  # (scales, un-shifts)
            row_entries=plan.workspace(layout.total_row_entries * entry_floats(self.geometry), torch.float32),
            col_entries=plan.workspace(layout.total_col_entries * entry_floats(self.geometry), torch.float32),
            param_scales=plan.workspace(n, torch.float32),
            step_scales=torch.ones(max(n, 1), 2, dtype=torch.float32, device=device),
            adam_corrections=torch.ones(max(n, 1), 2, dtype=torch.float32, device=device),
            elsewhere_rows=elsewhere, learned_walk=learned_walk, adamw_walk=adamw_walk,
            slice_walks=slice_walks)

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
            row[slot["ns_eps"]] = float(group["ns_eps"])
            # (celo2_normalise's scalar Newton–Schulz: the coefficients as the products take them, in float32)
            for name, value in zip(("ns_a", "ns_b", "ns_c"), group["ns_coefficients"]):
                row[slot[name]] = float(np.float32(value))
            row[slot["ns_steps"]] = float(group["ns_steps"])
            row[slot["orthogonalize"]] = float(bool(group["orthogonalize"]))
        if work.group_rows is None or not np.array_equal(values, work.group_rows):
            work.groups.update(values)
            work.group_rows = values
        # (per group, compared each step; the per-tensor columns rewritten only where a group's value changed)
        clamps = [float(group["grad_clip_value"]) for group in groups]
        if clamps != work.clamps:
            rows = [clamps[g] for g in plan.groups]
            work.transforms[:len(rows), 1].copy_(torch.tensor(rows, dtype=torch.float32))
            work.clamps = clamps
        if work.clips is not None:
            limits = [group["max_grad_norm"] for group in groups]
            if limits != work.limits:
                rows = [math.inf if limits[g] is None else limits[g] for g in plan.groups]
                work.max_norms.copy_(torch.tensor(rows, dtype=torch.float32))
                work.limits = limits

    def _clip_factors(self, plan: Plan, grad_scale) -> None:
        """The global clip, in one launch: Σ g² of every gradient (float64, fixed order), ‖g‖ rounded to float32,
        and each clipping tensor's factor ``max_norm / max(‖g‖, max_norm)`` (reference ``global_norm``,
        ``clip_scale``) into the transforms' factor column (celo2_gradient_norm's last block)."""
        layout, work = plan.layout, plan.work
        self.launch("celo2_gradient_norm", layout.total_stats_chunks, tensors=plan.tensor_table.table,
                    gradients=plan.gradients.table, num_tensors=layout.num_tensors,
                    grad_scale=self._on_device(grad_scale), status=plan.status, norm_partials=work.norm_partials,
                    norm_ticket=work.norm_ticket, clips=work.clips, max_norms=work.max_norms,
                    gradient_transforms=work.transforms)

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
        self.launch("celo2_statistics", layout.total_stats_chunks, tensors=plan.tensor_table.table,
                    gradients=plan.gradients.table, num_tensors=layout.num_tensors, groups=plan.group_table.table,
                    celo2_tensors=work.table.table, gradient_transforms=work.transforms, row_factors=plan.row_factors,
                    col_factors=plan.col_factors, **flags, stats_partials=work.stats_partials)

    def _control(self, plan: Plan, flags: dict, *args) -> None:
        layout, work = plan.layout, plan.work
        self.launch("celo2_control", layout.num_tensors + commit_blocks(layout),
                    tensors=plan.tensor_table.table, num_tensors=layout.num_tensors, groups=plan.group_table.table,
                    celo2_tensors=work.table.table, celo2_groups=work.groups.table,
                    stats_partials=work.stats_partials, row_table=plan.row_table, col_table=plan.col_table,
                    total_row_entries=layout.total_row_entries, total_col_entries=layout.total_col_entries, **flags,
                    feature_scales=work.feature_scales, param_scales=work.param_scales,
                    adam_corrections=work.adam_corrections)

    def _apply(self, plan: Plan, flags: dict, inputs=None) -> None:
        layout, work = plan.layout, plan.work
        tables = dict(tensors=plan.tensor_table.table, gradients=plan.gradients.table, groups=plan.group_table.table,
                      celo2_tensors=work.table.table, celo2_groups=work.groups.table,
                      gradient_transforms=work.transforms)
        for kernel, (walk, total_slices) in work.slice_walks.items():
            slices_per_block = self.blocks[kernel] // SLICE_THREADS_EACH.get(kernel, 1)
            self.launch(kernel, -(-total_slices // slices_per_block),
                        tensors=plan.tensor_table.table, gradients=plan.gradients.table, groups=plan.group_table.table,
                        celo2_groups=work.groups.table, gradient_transforms=work.transforms,
                        row_table=plan.row_table, col_table=plan.col_table, param_scales=work.param_scales,
                        network=self.network, walk=walk, walk_rows=walk.shape[0], total_slices=total_slices, **flags)
        if work.stacks:
            self._refresh_results(plan)
            entries = layout.total_row_entries + layout.total_col_entries
            if entries:
                self.launch("celo2_table_features", -(-entries // self.blocks["celo2_table_features"]),
                            tensors=plan.tensor_table.table, num_tensors=layout.num_tensors,
                            celo2_tensors=work.table.table, row_table=plan.row_table, col_table=plan.col_table,
                            total_row_entries=layout.total_row_entries, total_col_entries=layout.total_col_entries,
                            feature_scales=work.feature_scales, network=self.network, row_entries=work.row_entries,
                            col_entries=work.col_entries)
            self.launch("celo2_mlp", self._mlp_blocks(work.learned_walk), **tables,
                        **work.learned_walk.arguments(),
                        row_entries=work.row_entries, col_entries=work.col_entries, feature_scales=work.feature_scales,
                        param_scales=work.param_scales, network=self.network, **flags, steps=work.steps,
                        segment_sums=work.segment_sums)
        self._adamw(plan, flags, tables)
        if work.stacks:
            self._finish_steps(plan)
        # (one block at least: block 0 advances the step counters)
        self.launch("celo2_apply", max(1, min(self.apply_grid, work.learned_walk.chunks)),
                    tensors=plan.tensor_table.table, gradients=plan.gradients.table, groups=plan.group_table.table,
                    celo2_tensors=work.table.table, celo2_groups=work.groups.table, **work.learned_walk.arguments(),
                    num_tensors=layout.num_tensors, num_groups=len(self.optimizer.param_groups), steps=work.steps,
                    proposed_nonfinite=work.proposed_nonfinite, step_scales=work.step_scales, **flags,
                    skipped_steps=self.skipped_counter())
        if work.elsewhere_rows:
            self._step_elsewhere(plan, inputs)

    def _adamw(self, plan: Plan, flags: dict, tables: dict) -> None:
        """The AdamW tensors' pass (celo2_adamw) over their walk, on a persistent grid. (On a stream of its own
        beside Newton–Schulz's products, in short blocks, it measured no faster: docs/performance.md §8.)"""
        walk = plan.work.adamw_walk
        if walk.chunks:
            self.launch("celo2_adamw", min(self.adamw_grid, walk.chunks), **tables,
                        **walk.arguments(), adam_corrections=plan.work.adam_corrections, **flags)

    def _orthogonalised(self, plan: Plan) -> tuple:
        """Per stack, the Newton–Schulz steps it takes this step (-1 where its group does not orthogonalise, or
        it holds vectors): its groups' values, read every step (a group may change them)."""
        groups = self.optimizer.param_groups
        return tuple(int(groups[stack.group]["ns_steps"]) if stack.matrices and groups[stack.group]["orthogonalize"]
                     else -1 for stack in plan.work.stacks)

    def _refresh_results(self, plan: Plan) -> None:
        """Where each learned tensor's final step lies (its Celo2Tensor ``result``): in the workspace buffer
        Newton–Schulz ends in (its steps' parity), or the proposed step itself; and the rows Newton–Schulz
        takes. For precision="fast", where the MLP pass writes a matrix's step (``direct_work``): Newton–Schulz's
        input itself, where its products run one step at least (:meth:`_direct`). Rewritten (and uploaded) only
        when a group's choice changes."""
        work = plan.work
        choices = self._orthogonalised(plan)
        if choices == work.orthogonalised:
            return
        rows = work.table.host.copy()
        size = work.work.numel() // 2
        scalar_rows, product_rows = [], []  # (celo2_normalise takes the scalar matrices' rows first)
        first = work.work[:size]  # (Newton–Schulz's input: a direct matrix's, at its step's own index)
        for stack, steps in zip(work.stacks, choices):
            if steps < 0:
                base, dtype = work.steps, torch.float32
            else:
                base, dtype = work.work[(steps % 2) * size:(steps % 2 + 1) * size], self.work_dtype
                (scalar_rows if stack.scalar else product_rows).extend(stack.tensor_rows)
            for row in stack.tensor_rows:
                offset = int(rows[row, CELO2_FIELD["step_offset"]])
                rows[row, CELO2_FIELD["result"]] = base.data_ptr() + offset * base.element_size()
                rows[row, CELO2_FIELD["result_dtype"]] = launcher.DTYPE_CODES[dtype]
                rows[row, CELO2_FIELD["direct_work"]] = (first.data_ptr() + offset * first.element_size()
                                                         if self._direct(stack, steps) else 0)
        work.table.update(rows)
        ns_rows = scalar_rows + product_rows
        work.ns_rows = torch.tensor(ns_rows, dtype=torch.int32, device=plan.device) if ns_rows else None
        work.scalar_rows = len(scalar_rows)
        work.orthogonalised = choices

    def _direct(self, stack: Stack, steps: int) -> bool:
        """Whether the MLP pass writes this stack's steps straight into Newton–Schulz's input (bfloat16,
        undivided; the first polynomial divides: :func:`newton_schulz_family`'s ``first``): precision="fast",
        for matrices whose products run (a scalar matrix's whole iteration, and zero steps' divided input, are
        celo2_normalise's, from the step buffer)."""
        return self.work_dtype == torch.bfloat16 and stack.matrices and not stack.scalar and steps > 0

    def _mlp_blocks(self, walk: Walk) -> int:
        """celo2_mlp's grid for its walk: persistent, and never more blocks than chunks (so that every block walks
        one at least, and celo2_normalise finds a matrix's segment sums from its chunks alone)."""
        return max(1, min(self.mlp_grid, walk.chunks))

    def _finish_steps(self, plan: Plan) -> None:
        """Newton–Schulz on each stack of matrices whose group orthogonalises: their divisors and the divided
        matrices (one launch for every stack), then the products per stack in the workspace (float32 without
        TF32, or bfloat16); then ``finish_step``'s normalisation of every learned tensor's final step as two
        float32 factors (``normalise_by_square_sums``), which the apply pass multiplies by."""
        work, groups = plan.work, self.optimizer.param_groups
        tables = dict(tensors=plan.tensor_table.table, celo2_tensors=work.table.table)
        if work.ns_rows is not None:
            self.launch("celo2_normalise", (NORMALISE_BLOCKS, work.ns_rows.numel()), **tables,
                        celo2_groups=work.groups.table, rows=work.ns_rows, scalar_rows=work.scalar_rows,
                        segment_sums=work.segment_sums,
                        mlp_blocks=self._mlp_blocks(work.learned_walk), mlp_chunks=work.learned_walk.chunks,
                        steps=work.steps,
                        proposed_nonfinite=work.proposed_nonfinite, work=work.work,
                        work_dtype=launcher.DTYPE_CODES[self.work_dtype], first_polynomials=work.first_polynomials)
            runs = [(stack, steps, tuple(float(c) for c in groups[stack.group]["ns_coefficients"]))
                    for stack, steps in zip(work.stacks, work.orthogonalised) if steps > 0 and not stack.scalar]
            if runs:
                self._newton_schulz(plan, runs)
        self.launch("celo2_matrix_sums", (self.sums_splits, work.learned_rows.numel()), **tables,
                    rows=work.learned_rows, steps=work.steps, partials=work.sum_partials, tickets=work.sum_tickets,
                    proposed_nonfinite=work.proposed_nonfinite, step_scales=work.step_scales)

    def _newton_schulz(self, plan: Plan, runs: list) -> None:
        """Newton–Schulz's products for ``runs`` (stack, steps, coefficients) in the plan's workspace. With
        ``REPLAY_PRODUCTS``, on a GPU they are captured once, for the plan and its runs, as one CUDA graph that
        every later step replays on the current stream: ~25 launches per stack become one (a slower host would
        otherwise wait them out: ViT-B/16's ~125).
        The products read and write only the plan's own workspaces, whose addresses the graph keeps, so a replay
        is the eager products, kernel for kernel. Eager off the GPU (the CPU stand-ins), and where the step itself
        is being captured (the caller's graph then takes the products)."""
        work = plan.work
        if not self.REPLAY_PRODUCTS or plan.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            self._products(work, runs)
            return
        key = tuple((id(stack), steps, coefficients) for stack, steps, coefficients in runs)
        if work.products_graph is not None and work.products_graph[0] == key:
            work.products_graph[1].replay()
            return
        # A new capture, on a stream of its own (CUDA captures on a side stream). This step's products run eagerly
        # on that stream first: that is the warm-up a capture needs (cuBLAS creates its handle and this stream's
        # workspace outside the capture; in a process whose first product this is, creating them inside failed
        # it), and it is this step's result, since a capture runs nothing. "thread_local": other threads, a
        # DataLoader's pinning thread say, may go on calling CUDA meanwhile.
        current = torch.cuda.current_stream(plan.device)
        side = torch.cuda.Stream(plan.device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            self._products(work, runs)
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._products(work, runs)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        work.products_graph = (key, graph)

    def _products(self, work: Celo2Work, runs: list) -> None:
        """The products themselves, stack by stack (float32 with TF32 off, or bfloat16), on the current stream."""
        size = work.work.numel() // 2
        first, second = work.work[:size], work.work[size:]
        exact = self.work_dtype == torch.float32
        with float32_products() if exact else contextlib.nullcontext():
            for family in families_of(runs):
                stack, steps, coefficients = family[0]
                start, end = stack.family_start, family[-1][0].family_start + family[-1][0].count
                direct = self._direct(stack, steps)  # (the same for every run: fast, matrices, steps > 0)
                newton_schulz_family([(member.view(first), member.view(second)) for member, _, _ in family],
                                     stack.family_gram[start:end], stack.family_polynomial[start:end],
                                     coefficients, steps, exact=exact,
                                     first=stack.family_first[start:end] if direct else None,
                                     first_polynomial=self._first_polynomial)

    def _first_polynomial(self, gram: torch.Tensor, square: torch.Tensor, first: torch.Tensor) -> None:
        """:func:`scaled_polynomial` as one launch of celo2_first_polynomial (a CPU stand-in, or Gram matrices of
        2^31 entries or more, which the kernel's 32-bit indices do not reach: the torch form)."""
        count, k, _ = gram.shape
        if gram.device.type != "cuda" or k * k >= 2 ** 31:
            scaled_polynomial(gram, square, first)
            return
        pairs_per_block = self.blocks["celo2_first_polynomial"] * FIRST_POLYNOMIAL_PAIRS
        self.launch("celo2_first_polynomial", (-(-k * k // (2 * pairs_per_block)), count), gram=gram,
                    polynomial=square, coefficients=first, k=k)

    def _step_elsewhere(self, plan: Plan, inputs) -> None:
        """The learned tensors of several slices (not :func:`one_matrix`): the reference's learned_step on the
        device, from the step's gradient as the kernels form it (unscaled, ``clamp(f·g)``), written where the
        step is kept."""
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
