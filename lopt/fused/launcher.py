"""Kernel launch plumbing shared by every fused optimizer, written once.

* :func:`fused_unavailable_reason` — can the fused backend run here, and if not, why.
* :func:`kernel_source` — a ``cuda_src/`` file with its ``#include "…"`` lines inlined, so the
  on-disk cache (keyed by the source text and options) sees every header change.
* :func:`get_module` — compile once per process per (source, device architecture, options) with
  NVRTC, and keep the binary on disk across processes (:func:`kernel_cache_dir`).
* :func:`launch` — launch on PyTorch's current stream of the tensors' device (so it composes with
  user streams and CUDA graph capture) and check for launch errors; with ``LOPT_CUDA_SYNC_CHECK=1``
  every launch is also synchronised and checked (for debugging).
* :class:`MetadataTable` — a table of int64 fields per row (apex ``multi_tensor_apply`` style: one
  launch covers many tensors) kept in device memory and re-uploaded only when its content changes,
  through a reused pinned staging buffer, so steady-state steps allocate nothing.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

FUSED_ARCHITECTURES: tuple = ("small_fc_lopt",)

MIN_COMPUTE_CAPABILITY = (8, 0)  # the MLPs run on TF32 and BF16 tensor cores (mma.sync)

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Options for exactness: IEEE division and square root, denormals kept, no fast-math intrinsics.
NVRTC_OPTIONS = ("--std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def cuda_source_dir() -> Path:
    """The kernel sources: shipped in an installed package as lopt/_cuda_src, else the source tree's cuda_src/."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "_cuda_src"
    return installed if installed.is_dir() else package.parent / "cuda_src"


def kernel_source(filename: str) -> str:
    """The text of ``cuda_src/filename`` with local includes inlined (each header once)."""
    directory = cuda_source_dir()
    seen: set = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (directory / name).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(filename)


def cupy_or_none():
    try:
        import cupy

        return cupy
    except Exception:  # ImportError, or a CuPy that fails to find its CUDA libraries
        return None


def fused_unavailable_reason(architecture: str, devices) -> str | None:
    """None if the fused backend can run ``architecture`` for parameters on ``devices``, else why not."""
    if architecture not in FUSED_ARCHITECTURES:
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


@lru_cache(maxsize=None)
def _compiled(filename: str, device_index: int, defines: tuple):
    """Compile for the device with NVRTC and cache the cubin on disk."""
    import hashlib

    cupy = cupy_or_none()
    from cupy.cuda import compiler

    source = kernel_source(filename)
    options = NVRTC_OPTIONS + tuple(d if d.startswith("-") else f"-D{d}" for d in defines)
    with cupy.cuda.Device(device_index):
        architecture = nvrtc_architecture(torch.cuda.get_device_capability(device_index),
                                          int(compiler._get_max_compute_capability()))
        key = hashlib.sha256("\0".join([source, *options, architecture, str(compiler._get_nvrtc_version()),
                                        cupy.__version__]).encode()).hexdigest()
        path = kernel_cache_dir() / f"{Path(filename).stem}-{architecture}-{key[:24]}.cubin"
        if path.is_file():
            cubin = path.read_bytes()
        else:
            cubin = _nvrtc_compile(source, options, architecture)
            try:  # write-then-rename, so concurrent processes never read a partial file
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_suffix(f".{os.getpid()}.tmp")
                partial.write_bytes(cubin)
                partial.replace(path)
            except OSError:
                pass  # an unwritable cache only costs a recompile next time
        module = cupy.cuda.function.Module()
        module.load(cubin)
    return module


def get_module(filename: str, device: torch.device, defines=()):
    """The compiled ``cuda_src/filename`` for ``device`` (compiled on first use, then cached)."""
    try:
        return _compiled(filename, device.index if device.index is not None else torch.cuda.current_device(),
                         tuple(defines))
    except Exception as err:
        raise RuntimeError(f"compiling cuda_src/{filename} for {device} failed: {err}") from err


def kernel_attribute(kernel, name: str) -> int:
    """A compiled kernel's attribute: ``"num_regs"`` or ``"shared_size_bytes"`` (static shared memory)."""
    from cupy_backends.cuda.api import driver

    attribute = {"num_regs": driver.CU_FUNC_ATTRIBUTE_NUM_REGS,
                 "shared_size_bytes": driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES}[name]
    return driver.funcGetAttribute(attribute, kernel.ptr)


_SYNC_CHECK = os.environ.get("LOPT_CUDA_SYNC_CHECK", "") not in ("", "0")


@lru_cache(maxsize=64)
def _external_stream(handle: int, device_index: int):
    import warnings

    with warnings.catch_warnings():  # newer CuPy prefers Stream.from_external; this form works across versions
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy_or_none().cuda.ExternalStream(handle, device_index)  # wraps, never owns, torch's stream


def launch(kernel, grid: int, block: int, args: tuple, device: torch.device, shared_mem: int = 0) -> None:
    """Launch ``kernel`` on PyTorch's current stream of ``device``."""
    if grid <= 0:
        return
    stream = torch.cuda.current_stream(device)
    cupy_stream = _external_stream(stream.cuda_stream, device.index)
    kernel((int(grid), 1, 1), (int(block), 1, 1), args, shared_mem=shared_mem, stream=cupy_stream)
    if _SYNC_CHECK:
        stream.synchronize()
        cupy_or_none().cuda.runtime.getLastError()


def pointer(tensor) -> np.uint64:
    return np.uint64(tensor.data_ptr() if tensor is not None else 0)


class MetadataTable:
    """Rows of int64 fields in device memory, re-uploaded only when they change.

    ``update(rows)`` takes a 2-d int64 numpy array. A change of shape reallocates; a change of
    content reuses the device buffer and a pinned staging buffer (the previous upload is waited
    for before the staging buffer is overwritten), so steady-state steps allocate nothing and
    the upload is a plain asynchronous copy (also inside CUDA graph capture).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.host = None
        self.staging = None
        self.table = None
        self.uploaded = None

    def update(self, rows: np.ndarray) -> torch.Tensor:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if self.table is not None and self.host.shape == rows.shape and np.array_equal(self.host, rows):
            return self.table
        if self.table is None or self.host.shape != rows.shape:
            self.table = torch.empty(rows.shape, dtype=torch.int64, device=self.device)
            self.staging = torch.empty(rows.shape, dtype=torch.int64, pin_memory=True)
            self.uploaded = None
        if self.uploaded is not None:
            self.uploaded.synchronize()  # the staging buffer may still be in flight
        self.staging.numpy()[...] = rows
        self.table.copy_(self.staging, non_blocking=True)
        if torch.cuda.is_current_stream_capturing():
            self.uploaded = None  # captured as a graph node; replays re-read the staging buffer
        else:
            self.uploaded = torch.cuda.Event()
            self.uploaded.record(torch.cuda.current_stream(self.device))
        self.host = rows.copy()
        return self.table
