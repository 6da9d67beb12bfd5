"""Kernel launch plumbing shared by every fused optimizer, written once.

* :func:`fused_unavailable_reason` — can the fused backend run here, and if not, why.
* :func:`kernel_source` — a ``cuda_src/`` file with its ``#include "…"`` lines inlined (the
  contract header ``lopt_contract.cuh`` generated from :mod:`lopt.fused.contract`), so the on-disk
  cache (keyed by the source text and options) sees every header change.
* :func:`get_module` — compile once per process per (source, device architecture, options) with
  NVRTC, and keep the binary on disk across processes (:func:`kernel_cache_dir`).
* :func:`launch` — launch on PyTorch's current stream of the tensors' device (so it composes with
  user streams and CUDA graph capture) and check for launch errors; with ``LOPT_CUDA_SYNC_CHECK=1``
  every launch is also synchronised and checked (for debugging).
* :class:`MetadataTable` — a table of int64 (or float32) fields per row (apex
  ``multi_tensor_apply`` style: one launch covers many tensors) kept in device memory and
  re-uploaded only when its content changes, through a reused pinned staging buffer, so
  steady-state steps allocate nothing.
"""

from __future__ import annotations

import os
import re
import threading
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from lopt import registry


MIN_COMPUTE_CAPABILITY = (8, 0)  # the MLPs run on TF32 and BF16 tensor cores (mma.sync)

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Options for exactness: IEEE division and square root, denormals kept, no fast-math intrinsics.
NVRTC_OPTIONS = ("--std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)".*$', re.MULTILINE)


def cuda_source_dir() -> Path:
    """The kernel sources: shipped in an installed package as lopt/_cuda_src, else the source tree's cuda_src/."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "_cuda_src"
    return installed if installed.is_dir() else package.parent / "cuda_src"


def expand_includes(text: str) -> str:
    """``text`` with its ``#include "…"`` lines replaced by the ``cuda_src/`` headers (each once; the
    contract header generated from :mod:`lopt.fused.contract`)."""
    from lopt.fused import contract

    directory = cuda_source_dir()
    seen: set = set()

    def expand(text: str) -> str:
        def header(match) -> str:
            name = match.group(1)
            if name in seen:
                return ""
            seen.add(name)
            return expand(contract.cuda_header() if name == contract.HEADER_NAME else (directory / name).read_text())

        return _INCLUDE.sub(header, text.replace("#pragma once", ""))

    return expand(text)


def kernel_source(filename: str) -> str:
    """The text of ``cuda_src/filename`` with local includes inlined (each header once)."""
    return expand_includes((cuda_source_dir() / filename).read_text())


def cupy_or_none():
    try:
        import cupy

        return cupy
    except Exception:  # ImportError, or a CuPy that fails to find its CUDA libraries
        return None


def fused_unavailable_reason(architecture: str, devices) -> str | None:
    """None if the fused backend can run ``architecture`` for parameters on ``devices``, else why not."""
    if architecture not in registry.fused_architectures():
        return f"lopt has no fused kernels for {architecture} yet"
    devices = set(devices)
    if not devices:
        return "the optimizer has no parameters"
    if any(d.type != "cuda" for d in devices):
        return "the parameters are not all on a CUDA device"
    if not torch.cuda.is_available():
        return "no CUDA device is available to PyTorch"
    too_old = sorted(str(d) for d in devices if torch.cuda.get_device_capability(d) < MIN_COMPUTE_CAPABILITY)
    if too_old:
        return f"the fused kernels need compute capability >= 8.0 (TF32 and BF16 tensor cores), which {', '.join(too_old)} lacks"
    if cupy_or_none() is None:
        return "CuPy is not installed (pip install 'lopt[cuda12]' or 'lopt[cuda13]', matching your CUDA major version)"
    return None


def kernel_cache_dir() -> Path:
    """Where compiled kernels are kept across processes (``LOPT_KERNEL_CACHE`` overrides)."""
    return Path(os.environ.get("LOPT_KERNEL_CACHE", Path.home() / ".cache" / "lopt" / "kernels"))


def nvrtc_architecture(compute_capability: tuple, nvrtc_max: int) -> str:
    """The ``--gpu-architecture`` to build for a device: its own machine code (``sm_XY``), or, for a
    device newer than this NVRTC knows, PTX of the newest architecture it knows (``compute_XY``),
    which the driver compiles when the module is loaded."""
    capability = compute_capability[0] * 10 + compute_capability[1]
    return f"compute_{nvrtc_max}" if capability > nvrtc_max else f"sm_{capability}"


def _nvrtc_compile(source: str, options: tuple, architecture: str) -> bytes:
    """Machine code (``sm_*``) or PTX (``compute_*``) from NVRTC, called directly: CuPy's module cache
    appends ``-ftz=true``, which would flush denormals where the reference keeps them."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, "lopt_kernels.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(program, [*options, f"--gpu-architecture={architecture}"])
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"{err}\n{nvrtc.getProgramLog(program)}") from None
        if architecture.startswith("sm_"):
            return nvrtc.getCUBIN(program)
        ptx = nvrtc.getPTX(program)
        return ptx if isinstance(ptx, bytes) else ptx.encode()
    finally:
        nvrtc.destroyProgram(program)


def _load_module(binary: bytes):
    module = cupy_or_none().cuda.function.Module()
    module.load(binary)
    return module


# A cached binary is stored behind a header (magic, sha256 of the binary): the driver does not reject
# a truncated or corrupt image reliably (it can crash the process), so lopt checks it before loading.
_CACHE_MAGIC = b"LOPTBIN1"


def _cache_record(binary: bytes) -> bytes:
    import hashlib

    return _CACHE_MAGIC + hashlib.sha256(binary).digest() + binary


def _cached_binary(record: bytes) -> bytes | None:
    """The binary of a cache record, or None if the record is not whole."""
    import hashlib

    header = len(_CACHE_MAGIC) + 32
    if len(record) <= header or not record.startswith(_CACHE_MAGIC):
        return None
    binary = record[header:]
    return binary if hashlib.sha256(binary).digest() == record[len(_CACHE_MAGIC):header] else None


@lru_cache(maxsize=None)
def _compiled(source: str, name: str, device_index: int, defines: tuple):
    """Compile for the device with NVRTC and cache the binary on disk; a cached binary that is not whole
    (truncated, corrupt) or does not load (stale) is rebuilt, with a warning."""
    import hashlib
    import warnings

    cupy = cupy_or_none()
    from cupy.cuda import compiler

    options = NVRTC_OPTIONS + tuple(d if d.startswith("-") else f"-D{d}" for d in defines)
    with cupy.cuda.Device(device_index):
        architecture = nvrtc_architecture(torch.cuda.get_device_capability(device_index),
                                          int(compiler._get_max_compute_capability()))
        key = hashlib.sha256("\0".join([source, *options, architecture, str(compiler._get_nvrtc_version()),
                                        cupy.__version__]).encode()).hexdigest()
        path = kernel_cache_dir() / f"{name}-{architecture}-{key[:24]}.cubin"
        if path.is_file():
            binary = _cached_binary(path.read_bytes())
            problem = "it is truncated or corrupt" if binary is None else None
            if binary is not None:
                try:
                    return _load_module(binary)
                except Exception as err:  # a whole image the driver refuses: stale
                    problem = f"the driver refused it ({err})"
            warnings.warn(f"lopt: the cached kernel binary {path} could not be used ({problem}); it is rebuilt",
                          RuntimeWarning, stacklevel=4)
        binary = _nvrtc_compile(source, options, architecture)
        module = _load_module(binary)
        try:  # write-then-rename, so concurrent processes never read a partial file
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(_cache_record(binary))
            partial.replace(path)
        except OSError:
            pass  # an unwritable cache only costs a recompile next time
    return module


def module_from_source(source: str, device: torch.device, defines=(), name: str = "lopt_kernels"):
    """The compiled module of CUDA ``source`` (includes already expanded) for ``device``."""
    try:
        return _compiled(source, name, device.index if device.index is not None else torch.cuda.current_device(),
                         tuple(defines))
    except Exception as err:
        raise RuntimeError(f"compiling {name} for {device} failed: {err}") from err


def get_module(filename: str, device: torch.device, defines=()):
    """The compiled ``cuda_src/filename`` for ``device`` (compiled on first use, then cached)."""
    return module_from_source(kernel_source(filename), device, defines, name=Path(filename).stem)


def kernel_attribute(kernel, name: str) -> int:
    """A compiled kernel's attribute: ``"num_regs"`` or ``"shared_size_bytes"`` (static shared memory)."""
    from cupy_backends.cuda.api import driver

    attribute = {"num_regs": driver.CU_FUNC_ATTRIBUTE_NUM_REGS,
                 "shared_size_bytes": driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES}[name]
    return driver.funcGetAttribute(attribute, kernel.ptr)


_SYNC_CHECK = os.environ.get("LOPT_CUDA_SYNC_CHECK", "") not in ("", "0")


_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device: torch.device) -> int:
    """The handle of PyTorch's current stream on ``device``: what ``torch.cuda.current_stream(device)
    .cuda_stream`` is, without building a Stream object (which costs the host far more, paid
    by every launch and upload: docs/performance.md §4)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _raw_current_stream is None:  # (a PyTorch without the private accessor)
        return torch.cuda.current_stream(index).cuda_stream
    return _raw_current_stream(index)


class PackedArguments:
    """A kernel's arguments as ``cuLaunchKernel`` takes them: each value in one host buffer at an 8-byte-aligned
    offset of its own, and the array of those addresses (``kernelParams``; the driver reads each value with the
    width the kernel declares, and copies them all before the launch returns). Built once per kernel from its
    typed arguments (``bind_arguments``: numpy scalars of the declared widths, a struct by value as a numpy
    structured scalar), then filled by one ``struct.pack_into`` per launch: CuPy's own call converted every
    argument anew, the larger part of a launch's host time (docs/performance.md §8)."""

    CODES = {np.uint64: "Q", np.int64: "q", np.int32: "i4x", np.float32: "f4x"}

    def __init__(self, args: tuple):
        import ctypes
        import struct

        layout, offsets, self.structs = ["<"], [], []
        for index, value in enumerate(args):
            offsets.append(struct.calcsize("".join(layout)))
            if isinstance(value, np.void):
                layout.append(f"{value.nbytes}s" + "x" * (-value.nbytes % 8))
                self.structs.append((index, value.nbytes))
            else:
                layout.append(self.CODES[type(value)])
        self.struct = struct.Struct("".join(layout))
        self.buffer = ctypes.create_string_buffer(max(self.struct.size, 8))
        base = ctypes.addressof(self.buffer)
        self.addresses = (ctypes.c_void_p * max(len(args), 1))(*[base + offset for offset in offsets])
        self.kernel_params = ctypes.addressof(self.addresses)
        self.types = tuple(map(type, args))

    def pack(self, args: tuple) -> int:
        """Write ``args`` into the buffer; the address of their ``kernelParams`` array."""
        if self.structs:
            args = list(args)
            for index, nbytes in self.structs:
                if args[index].nbytes != nbytes:
                    raise ValueError(f"a struct argument of {args[index].nbytes} bytes where the kernel's first "
                                     f"launch passed {nbytes}")
                args[index] = args[index].tobytes()
        self.struct.pack_into(self.buffer, 0, *args)
        return self.kernel_params


# Per thread, {kernel function's address: its PackedArguments}: a launch writes its buffer and the driver reads
# it before returning, so two threads launching one kernel at once must not share one.
_per_thread = threading.local()


def launch(kernel, grid, block: int, args: tuple, device: torch.device, shared_mem: int = 0) -> None:
    """Launch ``kernel`` on PyTorch's current stream of ``device`` (``grid``: blocks, or a tuple of up to 3;
    an empty grid launches nothing), through the driver with its arguments packed (:class:`PackedArguments`)."""
    grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,))) + (1, 1)
    if min(grid[:3]) <= 0:
        return
    try:
        packed_by_kernel = _per_thread.packed
    except AttributeError:
        packed_by_kernel = _per_thread.packed = {}
    packed = packed_by_kernel.get(kernel.ptr)
    if packed is None or packed.types != tuple(map(type, args)):
        packed = packed_by_kernel[kernel.ptr] = PackedArguments(args)
    from cupy_backends.cuda.api import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index != torch.cuda.current_device():  # (the driver launches in the current device's context)
        with torch.cuda.device(index):
            launch(kernel, grid, block, args, device, shared_mem)
        return
    driver.launchKernel(kernel.ptr, grid[0], grid[1], grid[2], int(block), 1, 1, shared_mem,
                        current_stream_handle(device), packed.pack(args), 0)
    if _SYNC_CHECK:
        torch.cuda.current_stream(device).synchronize()
        cupy_or_none().cuda.runtime.getLastError()


def pointer(tensor) -> np.uint64:
    return np.uint64(tensor.data_ptr() if tensor is not None else 0)


# ------------------------------------------------------------------------------------------ kernel arguments
#
# A kernel's parameter list in its source is the contract of its launch: the engines pass arguments by
# name, and bind_arguments orders and converts them as the source declares them, so a launch that
# misses, invents or swaps an argument fails at once, naming it (every launch runs in the CPU tests,
# against recorded kernels), and the call sites carry no positional lists or numpy casts.

_KERNEL_DECLARATION = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(([^)]*)\)')


def _pointer_argument(value) -> np.uint64:
    try:
        return np.uint64(value.data_ptr())  # (a tensor: the common case first)
    except AttributeError:
        return np.uint64(0) if value is None else np.uint64(value)


def _struct_argument(value) -> np.void:
    """A struct passed by value: a numpy structured scalar of its exact layout (e.g. lopt.fused.celo2's
    network_argument), which CuPy passes as the struct's bytes."""
    if not isinstance(value, np.void):
        raise TypeError(f"a struct kernel parameter takes a numpy structured scalar, got {type(value).__name__}")
    return value


# How each declared type is passed (CuPy takes numpy scalars of the exact width; pointers as uint64; structs
# by value as numpy structured scalars).
ARGUMENT_TYPES = {"pointer": _pointer_argument, "int": np.int32, "i64": np.int64, "long long": np.int64,
                  "float": np.float32, "Celo2Network": _struct_argument}


class KernelParameter(NamedTuple):
    name: str
    c_type: str  # "pointer" for any pointer, else the scalar type as written: int, i64, long long, float
    convert: object = None  # (ARGUMENT_TYPES[c_type], looked up once)


def parse_parameters(declaration: str) -> tuple:
    """The parameters of one kernel declaration's list, e.g. ``"const float* __restrict__ x, int n"``."""
    parameters = []
    for text in declaration.split(","):
        words = text.replace("__restrict__", "").replace("const", "").replace("*", " * ").split()
        c_type = "pointer" if "*" in words else " ".join(words[:-1])
        parameters.append(KernelParameter(words[-1], c_type, ARGUMENT_TYPES.get(c_type)))
    return tuple(parameters)


def _expanded(declaration: str, definitions: dict) -> str:
    """A parameter list written as one object-like macro (kernels that share their list: ``celo2_slices``'
    shapes) as the macro's ``#define`` spells it (``definitions``: _macro_definitions); any other list as it is."""
    name = declaration.strip()
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        return declaration
    texts = definitions.get(name)
    if not texts or len(texts) != 1:
        raise RuntimeError(f"a kernel's parameter list {name} is no macro the source defines"
                           + (f" once ({sorted(texts)})" if texts else ""))
    [text] = texts
    return text


@lru_cache(maxsize=None)
def declared_parameters(filename: str) -> dict:
    """{kernel name: its parameters} of a ``cuda_src`` file with its headers. A kernel declared in two
    branches of a build switch must have the same parameters in both."""
    kernels: dict = {}
    source = kernel_source(filename)
    definitions = _macro_definitions(source)
    for name, declaration in _KERNEL_DECLARATION.findall(source):
        parameters = parse_parameters(_expanded(declaration, definitions))
        if kernels.setdefault(name, parameters) != parameters:
            raise RuntimeError(f"{filename}: kernel {name} is declared twice with different parameters")
        unknown = [p for p in parameters if p.c_type not in ARGUMENT_TYPES]
        if unknown:
            raise RuntimeError(f"{filename}: kernel {name} has parameters of types lopt cannot pass: {unknown}")
    return kernels


# ------------------------------------------------------------------------------------------ block sizes, constants
#
# A kernel's block size is the first number of its ``__launch_bounds__`` (which every kernel declares), and a
# layout constant that the host needs (a record's floats, blocks per matrix) is the source's ``#define``: the
# engines read both from the source as it is built, so no number is written in Python and in CUDA by hand.

_LAUNCH_BOUNDS = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\(([^)]*)\)\s*)?(\w+)\(')
# (an object-like #define, its continuation lines included; a function-like one has no space before its "(")
_OBJECT_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)(?:[ \t]+((?:[^\n]*\\\n)*[^\n]*))?$",
                           re.MULTILINE)
_INTEGER = re.compile(r"\b(\d+)[uUlL]*\b")


def _macro_definitions(source: str) -> dict:
    """{name: the set of texts an object-like ``#define`` gives it in ``source``} (continuation lines joined,
    comments dropped)."""
    definitions: dict = {}
    for name, text in _OBJECT_MACRO.findall(source):
        definitions.setdefault(name, set()).add(text.replace("\\\n", " ").split("//")[0].strip())
    return definitions


def _integer_value(node) -> int:
    import ast

    if isinstance(node, ast.Expression):
        return _integer_value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _integer_value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _integer_value(node.left), _integer_value(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right != 0:
            quotient = abs(left) // abs(right) * (1 if (left < 0) == (right < 0) else -1)  # (C's: toward zero)
            return left - right * quotient if isinstance(node.op, ast.Mod) else quotient
    raise ValueError(node)


def _evaluate(expression: str, definitions: dict, given: dict, filename: str, seen: tuple = ()) -> int:
    """The integer value of a C constant expression, its macros expanded (``given``: the build's ``-D`` values,
    which take precedence over the source's own, as over an ``#ifndef`` default)."""
    import ast

    def value_of(match) -> str:
        name = match.group(0)
        if name in seen:
            raise RuntimeError(f"{filename}: macro {name} is defined in terms of itself")
        if name in given:
            text = given[name]
        else:
            texts = definitions.get(name, set())
            if len(texts) != 1:
                raise RuntimeError(f"{filename}: {name} is " + ("not defined" if not texts else
                                   f"defined differently in two places ({sorted(texts)})") +
                                   "; a block size or host-read constant needs one #define")
            [text] = texts
        return f"({_evaluate(text, definitions, given, filename, seen + (name,))})"

    text = re.sub(r"\b[A-Za-z_]\w*", value_of, _INTEGER.sub(r"\1", expression))
    try:
        return _integer_value(ast.parse(text, mode="eval"))
    except (SyntaxError, ValueError):
        raise RuntimeError(f"{filename}: cannot evaluate {expression!r} ({text}): not an integer expression of "
                           f"+ - * / % and parentheses") from None


def _given(defines) -> dict:
    return dict(d.split("=", 1) if "=" in d else (d, "1") for d in defines if not d.startswith("-"))


@lru_cache(maxsize=None)
def declared_block_sizes(filename: str, defines: tuple = ()) -> dict:
    """{kernel name: its block size} of a ``cuda_src`` file built with ``defines``: each kernel's
    ``__launch_bounds__`` first value (what every launch of it uses: the kernels index by their declared
    size). A kernel without one, or declared twice with two sizes, is an error."""
    source = kernel_source(filename)
    definitions, given = _macro_definitions(source), _given(defines)
    sizes: dict = {}
    for bounds, name in _LAUNCH_BOUNDS.findall(source):
        if not bounds:
            raise RuntimeError(f"{filename}: kernel {name} declares no __launch_bounds__, where the launcher "
                               f"takes its block size from")
        size = _evaluate(bounds.split(",")[0], definitions, given, filename)
        if sizes.setdefault(name, size) != size:
            raise RuntimeError(f"{filename}: kernel {name} is declared twice with different block sizes")
    return sizes


@lru_cache(maxsize=None)
def source_constant(filename: str, name: str, defines: tuple = ()) -> int:
    """The integer value of macro ``name`` in ``cuda_src/filename`` built with ``defines``."""
    return _evaluate(name, _macro_definitions(kernel_source(filename)), _given(defines), filename)


def bind_arguments(kernel: str, parameters: tuple, arguments: dict) -> tuple:
    """``arguments`` (by parameter name) in the declared order, each converted to its declared type
    (a pointer from a tensor, None, or a ``numpy.uint64`` address). Raises RuntimeError naming what is
    missing or unknown."""
    if len(arguments) == len(parameters):
        try:
            return tuple([convert(arguments[name]) for name, _, convert in parameters])
        except KeyError:
            pass
    names = [p.name for p in parameters]
    missing = [name for name in names if name not in arguments]
    unknown = [name for name in arguments if name not in names]
    raise RuntimeError(f"launch of {kernel}: missing arguments {missing}, unknown arguments {unknown} "
                       f"(the kernel declares {names})")


class MetadataTable:
    """Rows of int64 (or float32) fields in device memory, re-uploaded only when they change.

    ``update(rows)`` takes a 2-d numpy array. A change of shape reallocates; a change of content
    reuses the device buffer and uploads through a ring of pinned staging buffers (one is reused
    only once its previous upload has run, which with :data:`STAGING_RING` of them is long done), so
    steady-state steps allocate nothing, never wait for the device, and the upload is a plain
    asynchronous copy (also inside CUDA graph capture, where replays re-read that staging buffer).

    The copy and the event that guards its staging buffer are CUDA runtime calls on PyTorch's current
    stream, each staging buffer with its own event made once: a step uploads this way two to four
    times before its kernels read the tables, and a PyTorch ``copy_`` with a new ``Event`` cost the
    host far more per upload (``benchmarks/profile_host.py``; docs/performance.md §4).
    """

    STAGING_RING = 4

    def __init__(self, device: torch.device, dtype=np.int64):
        self.device = device
        self.dtype = np.dtype(dtype)
        self.host = None
        self.table = None
        self.staging = []  # _Staging buffers
        self.next_staging = 0

    def update(self, rows: np.ndarray) -> torch.Tensor:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if self.table is not None and self.host.shape == rows.shape and np.array_equal(self.host, rows):
            return self.table
        if self.table is None or self.host.shape != rows.shape:
            torch_dtype = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32,
                           np.dtype(np.float64): torch.float64}[self.dtype]
            self.table = torch.empty(rows.shape, dtype=torch_dtype, device=self.device)
            self.host = np.empty_like(rows)
            self.staging = []
        if len(self.staging) < self.STAGING_RING:
            staging = _Staging(rows, self.device)
            self.staging.append(staging)
        else:
            staging = self.staging[self.next_staging]
            self.next_staging = (self.next_staging + 1) % self.STAGING_RING
            staging.wait()
        staging.upload(rows, self.table, current_stream_handle(self.device))
        np.copyto(self.host, rows)
        return self.table


class _Staging:
    """A pinned host buffer of a table's size and the event of its last upload."""

    def __init__(self, rows: np.ndarray, device: torch.device):
        self.buffer = torch.empty(rows.shape, dtype=torch.from_numpy(rows[:0]).dtype, pin_memory=True)
        self.view = self.buffer.numpy()
        cupy = cupy_or_none()
        with cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()):
            self.event = cupy.cuda.Event(disable_timing=True)
        self.pending = False  # (an upload recorded the event and may not have run)

    def __del__(self):
        # PyTorch's pinned-memory cache may hand this buffer out again as soon as it is freed, and it does
        # not know of the copy above: a table dropped (a new plan) before its last upload ran waits for it.
        try:
            self.wait()
        except Exception:  # (interpreter shutdown: CuPy may be gone, and so is every stream)
            pass

    def wait(self) -> None:
        """Until the buffer's last upload has run (uploaded STAGING_RING updates ago: in practice done)."""
        runtime = cupy_or_none().cuda.runtime
        if self.pending and runtime.eventQuery(self.event.ptr) != 0:  # (0: cudaSuccess, the work is done)
            runtime.eventSynchronize(self.event.ptr)
        self.pending = False

    def upload(self, rows: np.ndarray, table: torch.Tensor, stream: int) -> None:
        runtime = cupy_or_none().cuda.runtime
        np.copyto(self.view, rows)
        runtime.memcpyAsync(table.data_ptr(), self.buffer.data_ptr(), rows.nbytes, runtime.memcpyHostToDevice, stream)
        if torch.cuda.is_current_stream_capturing():
            self.pending = False  # captured as a graph node; replays re-read this buffer
        else:
            runtime.eventRecord(self.event.ptr, stream)
            self.pending = True
