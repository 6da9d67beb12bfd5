"""lopt under ``torch.distributed``: the **reduce** phase, and what lets the statistics be computed on shards.

A learned optimizer reads whole-tensor statistics (small_fc_lopt's feature second moments and
Adafactor means; VeLO's as well, plus its LSTM statistics and a max over all tensors' rows in the
controller). When a process holds only part of a tensor (FSDP2) or only some of the tensors
(ZeRO), each process computes *partial* sums, and one collective per reduction point completes
them: the updates equal those of one process holding everything, up to float32 rounding
(``docs/distributed.md``).

**The interface both backends call** is :class:`Reducer`:

* ``reducer.sum_(buffer)`` and ``reducer.max_(buffer)`` replace ``buffer`` (a contiguous tensor;
  float64 for sums of float32 data) by its element-wise sum or max over the process group, in
  place, and return it. On one process (no group, or a group of one) they do nothing.
* Every process of the group must make the same calls, in the same order, with buffers of the
  same size and dtype. The buffers therefore hold, **packed**, the partial results of *all*
  tensors of a reduction point in a fixed order (one collective per point, never one per tensor):
  e.g. the fused engine hands over one float64 buffer of every tensor's feature square sums, or
  of every tensor's Adafactor axis sums.
* On a CUDA device with NCCL the collective is enqueued on the current stream: nothing
  synchronises with the host, and a step can be captured in a CUDA graph.
* ``reducer.collectives`` and ``reducer.bytes_reduced`` count the calls and payload (for
  measurements).

:class:`SumPacket` is the naive backend's packing helper: each tensor adds its partial sums, one
``reduce()`` completes all of them, and each tensor reads its totals back.

**Supported layouts.** Plain tensors (one process, DDP, ZeRO: each process holds whole tensors),
or DTensors sharded on dim 0 over a 1-D device mesh (``Shard(0)``: what FSDP2's ``fully_shard``
makes), including uneven and empty shards. The helpers :func:`local_part`, :func:`shard_layout`
and :func:`sharded_like` map a DTensor to its local rows, its global shape and row offset, and
wrap state tensors the same way. Other layouts (``Shard(1)``, ``Replicate``, 2-D meshes / HSDP,
tensor parallelism) and mixtures of DTensor and plain parameters are refused by
:func:`check_supported_parameters`, before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ``process_group="local"``: this optimizer never communicates (each process trains on its own).
LOCAL = "local"

SUPPORTED_LAYOUTS = (
    "lopt steps plain tensors (one process, DDP, ZeroRedundancyOptimizer) and DTensor parameters sharded on "
    "dim 0 over a 1-D device mesh (placements (Shard(0),), what FSDP2's fully_shard makes)"
)


def _dist():
    """``torch.distributed`` when this torch build has it, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() else None


_DTENSOR_CLASS: list = []  # [DTensor] once looked up, [None] in a torch build without distributed support


# Tensors that are not DTensors, known by their type alone (no isinstance; the check phase tests every
# gradient and parameter against it in every step).
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (cheap: called for every parameter in every step)."""
    if type(tensor) in PLAIN_TENSOR_TYPES:
        return False
    if not _DTENSOR_CLASS:
        if _dist() is None:
            _DTENSOR_CLASS.append(None)
        else:
            from torch.distributed.tensor import DTensor

            _DTENSOR_CLASS.append(DTensor)
    return _DTENSOR_CLASS[0] is not None and isinstance(tensor, _DTENSOR_CLASS[0])


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: its local shard for a DTensor, else the tensor itself.

    In-place writes to the result change the DTensor.
    """
    return tensor.to_local() if is_dtensor(tensor) else tensor


def group_ranks(group) -> tuple:
    return tuple(_dist().get_process_group_ranks(group))


# ------------------------------------------------------------------------------------------ the reducer


class Reducer:
    """All-reduces of packed buffers over one process group; the identity without one (see the module docstring).

    ``group`` is a ``torch.distributed`` process group, or None for a single process.
    """

    def __init__(self, group=None):
        dist = _dist()
        if group is not None and dist.get_world_size(group) == 1:
            group = None
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.collectives = 0
        self.bytes_reduced = 0

    @property
    def is_identity(self) -> bool:
        """True on one process: the reductions do nothing."""
        return self.group is None

    def _all_reduce(self, buffer: torch.Tensor, op) -> torch.Tensor:
        if self.group is None:
            return buffer
        if not buffer.is_contiguous():
            raise ValueError("Reducer: buffers must be contiguous (pack them with torch.cat)")
        _dist().all_reduce(buffer, op=op, group=self.group)
        self.collectives += 1
        self.bytes_reduced += buffer.numel() * buffer.element_size()
        return buffer

    def sum_(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` ← its element-wise sum over the group (in place); returns it."""
        return self._all_reduce(buffer, None if self.group is None else _dist().ReduceOp.SUM)

    def max_(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` ← its element-wise maximum over the group (in place); returns it. NaN must not occur."""
        return self._all_reduce(buffer, None if self.group is None else _dist().ReduceOp.MAX)

    def mean_(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` ← its element-wise mean over the group (sum, then division by the group size)."""
        if self.group is None:
            return buffer
        return self.sum_(buffer).div_(self.size)

    def __repr__(self):
        return f"Reducer(size={self.size})" if self.group is not None else "Reducer(single process)"


class SumPacket:
    """Partial sums of many tensors, completed by one ``Reducer.sum_`` of a single float64 buffer.

    ``handle = packet.add(partial, split)`` records a partial sum: ``split`` says that the axis it
    sums over is divided among the processes (a DTensor's dim 0), so the other processes hold the
    rest of it. Sums over axes this process holds whole are complete already and stay out of the
    buffer. ``packet.reduce()`` then sums every split entry over the group at once, and
    ``packet[handle]`` is the (float64) total. Every process must add the split entries in the
    same order with the same shapes.
    """

    def __init__(self, reducer: Reducer):
        self.reducer = reducer
        self._values: list = []
        self._split: list = []
        self._reduced = False

    def add(self, partial: torch.Tensor, split: bool = True) -> int:
        self._values.append(partial.to(torch.float64))
        self._split.append(bool(split) and not self.reducer.is_identity)
        return len(self._values) - 1

    def reduce(self) -> "SumPacket":
        """One collective for every split entry (none when there is nothing to reduce)."""
        indices = [i for i, split in enumerate(self._split) if split]
        if indices:
            flat = torch.cat([self._values[i].reshape(-1) for i in indices])
            self.reducer.sum_(flat)
            offset = 0
            for i in indices:
                n = self._values[i].numel()
                self._values[i] = flat[offset:offset + n].view(self._values[i].shape)
                offset += n
        self._reduced = True
        return self

    def __getitem__(self, handle: int) -> torch.Tensor:
        if not self._reduced and self._split[handle]:
            raise RuntimeError("SumPacket: call reduce() before reading a split sum")
        return self._values[handle]


# ------------------------------------------------------------------------------------------ DDP or ZeRO
#
# Where each process's optimizer holds every tensor (one process, DDP), a sum over "all the optimizer's
# tensors" is this process's; where each holds its own partition (ZeroRedundancyOptimizer), it is the sum
# over the processes. Both are told apart by one fingerprint of the parameter shapes, the same in every
# process exactly when they hold the same tensors (ZeRO partitions whose shape lists happen to be
# identical cannot be told from DDP: docs/distributed.md).


def shape_fingerprint(params) -> float:
    """A number below 2^20 from the parameters' shapes (the same in every process for the same shapes:
    hashes of tuples of ints do not depend on the process): its sums and the sum of its squares over up
    to 2^13 processes are exact in float64."""
    return float(hash(tuple(tuple(p.shape) for p in params)) % 2**20)


def same_tensors_marks(params, device) -> torch.Tensor:
    """``[1, f, f²]`` (float64, ``f = shape_fingerprint(params)``): summed over the processes (e.g. in a
    :class:`SumPacket`), :func:`marks_say_same_tensors` tells on the device, without a synchronisation,
    whether every process holds the same tensors."""
    fingerprint = shape_fingerprint(params)
    return torch.tensor([1.0, fingerprint, fingerprint * fingerprint], dtype=torch.float64, device=device)


def marks_say_same_tensors(summed_marks: torch.Tensor) -> torch.Tensor:
    """From :func:`same_tensors_marks` summed over the processes: a 0-d bool tensor, True where every
    process had the same fingerprint (``n · Σf² == (Σf)²``, equality in Cauchy–Schwarz)."""
    count, total, total_of_squares = summed_marks.unbind()
    return count * total_of_squares == total * total


def processes_hold_the_same_tensors(reducer: Reducer, params, device) -> bool:
    """Whether every process's optimizer holds the same parameter shapes (True for one process): one
    small all-reduce and a synchronisation, for a decision made once (not per step)."""
    if reducer.is_identity:
        return True
    return bool(marks_say_same_tensors(reducer.sum_(same_tensors_marks(params, device))))


# ------------------------------------------------------------------------------------------ layouts


@dataclass(frozen=True)
class ShardLayout:
    """Where this process's part of a parameter lies: ``rows`` rows of dim 0 starting at global row
    ``offset`` of a tensor of ``global_shape``; ``split`` is True for a DTensor (its other rows are on
    other processes), False for a plain tensor (``offset`` 0, all rows)."""

    global_shape: tuple
    offset: int
    rows: int
    split: bool


def shard_layout(tensor: torch.Tensor) -> ShardLayout:
    """The :class:`ShardLayout` of a plain tensor or of a supported DTensor (``Shard(0)`` on a 1-D mesh).

    Dim 0 is split as ``torch.chunk`` splits it (DTensor's and FSDP2's rule): every process but the
    last ones holds ``ceil(n / size)`` rows, the rest fewer or none.
    """
    shape = tuple(tensor.shape)
    if not is_dtensor(tensor):
        return ShardLayout(shape, 0, shape[0] if shape else 1, False)
    reason = unsupported_layout_reason(tensor)
    if reason:
        raise TypeError(f"{reason}; {SUPPORTED_LAYOUTS}")
    mesh = tensor.device_mesh
    size, coordinate = mesh.size(0), mesh.get_local_rank(0)
    chunk = -(-shape[0] // size)
    offset = min(coordinate * chunk, shape[0])
    rows = min(chunk, shape[0] - offset)
    local_rows = tensor.to_local().shape[0]
    if local_rows != rows:
        raise ValueError(f"a DTensor of shape {shape} holds {local_rows} rows on mesh coordinate {coordinate}, "
                         f"but torch.chunk's split of dim 0 over {size} processes gives {rows}")
    return ShardLayout(shape, offset, rows, True)


def unsupported_layout_reason(tensor) -> str | None:
    """Why lopt cannot step this DTensor (None if it can: ``Shard(0)`` on a 1-D mesh)."""
    from torch.distributed.tensor import Shard

    mesh = tensor.device_mesh
    if mesh.ndim != 1:
        return (f"a DTensor on a {mesh.ndim}-D device mesh {tuple(mesh.shape)} (HSDP or tensor parallelism) with "
                f"placements {tuple(tensor.placements)}")
    if tuple(tensor.placements) != (Shard(0),):
        return f"a DTensor with placements {tuple(tensor.placements)}"
    if tensor.dim() == 0:
        return "a 0-d DTensor"
    return None


def sharded_like(local: torch.Tensor, param: torch.Tensor, has_axis_0: bool) -> torch.Tensor:
    """A state tensor of DTensor ``param`` from this process's part of it: ``Shard(0)`` like the parameter
    when ``local`` keeps the parameter's axis 0 as its own axis 0 (the local rows), else ``Replicate()``
    (every process holds the same whole tensor)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layout = shard_layout(param)
    if has_axis_0:
        global_shape = (layout.global_shape[0],) + tuple(local.shape[1:])
        placements = (Shard(0),)
    else:
        global_shape = tuple(local.shape)
        placements = (Replicate(),)
    return DTensor.from_local(local, param.device_mesh, placements, run_check=False, shape=torch.Size(global_shape),
                              stride=_contiguous_strides(global_shape))


def _contiguous_strides(shape) -> tuple:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


# ------------------------------------------------------------------------------------------ process groups


def resolve_process_group(option):
    """The group an optimizer communicates over: ``None`` → the default group when ``torch.distributed``
    is initialized (else none); ``"local"`` → none; a ``ProcessGroup`` → that group."""
    dist = _dist()
    if option == LOCAL:
        return None
    if option is None:
        return dist.group.WORLD if dist is not None and dist.is_initialized() else None
    if dist is None or not isinstance(option, dist.ProcessGroup):
        raise TypeError(f"process_group must be None (the default group when torch.distributed is initialized), "
                        f"'local' (no communication) or a torch.distributed ProcessGroup, got {option!r}")
    return option


def check_supported_parameters(params, owner: str) -> None:
    """Raise (naming the parameter) unless ``params`` are all plain tensors, or all supported DTensors on one mesh."""
    params = list(params)
    dtensors = [i for i, p in enumerate(params) if is_dtensor(p)]
    if not dtensors:
        return
    for index in dtensors:
        reason = unsupported_layout_reason(params[index])
        if reason:
            raise TypeError(f"{owner}: parameter #{index} (shape {tuple(params[index].shape)}) is {reason}. "
                            f"{SUPPORTED_LAYOUTS}")
    if len(dtensors) != len(params):
        plain = next(i for i, p in enumerate(params) if not is_dtensor(p))
        raise TypeError(f"{owner}: parameter #{plain} (shape {tuple(params[plain].shape)}) is a plain tensor but "
                        f"parameter #{dtensors[0]} is a DTensor; one optimizer steps either plain tensors or DTensors "
                        f"sharded on dim 0 (FSDP2), not both: apply fully_shard to every module with parameters, or "
                        f"give the plain parameters their own optimizer")
    mesh = params[dtensors[0]].device_mesh
    for index in dtensors[1:]:
        if params[index].device_mesh != mesh:
            raise TypeError(f"{owner}: parameter #{index} lives on device mesh {params[index].device_mesh}, parameter "
                            f"#{dtensors[0]} on {mesh}; all DTensor parameters of one optimizer must share one 1-D mesh")


def reducer_for(option, params, owner: str) -> Reducer:
    """The :class:`Reducer` of an optimizer with ``process_group=option`` over ``params`` (validated).

    With DTensor parameters the mesh's group is the one reduced over; ``process_group``, when
    given, must hold the same processes (else some data-parallel replicas would be missed).
    """
    params = list(params)
    check_supported_parameters(params, owner)
    group = resolve_process_group(option)
    dtensor = next((p for p in params if is_dtensor(p)), None)
    if dtensor is None:
        return Reducer(group)
    mesh_group = dtensor.device_mesh.get_group(0)
    if option == LOCAL:
        raise ValueError(f"{owner}: process_group='local' cannot step DTensor parameters: their statistics span the "
                         f"processes of their device mesh")
    if group is not None and group_ranks(group) != group_ranks(mesh_group):
        raise ValueError(f"{owner}: process_group holds ranks {list(group_ranks(group))} but the parameters are "
                         f"sharded over a mesh of ranks {list(group_ranks(mesh_group))}; pass "
                         f"process_group=mesh.get_group() (lopt supports one 1-D mesh that spans the data-parallel "
                         f"ranks; HSDP is not supported)")
    return Reducer(mesh_group)
