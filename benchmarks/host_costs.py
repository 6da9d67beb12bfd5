"""What each host operation of a fused step costs on this machine (median µs), measured as a
synchronised step meets them: each one timed once right after the device went idle.

    PYTHONPATH=. python benchmarks/host_costs.py [velo|small_fc_lopt] [gpt2-medium] > costs.txt

A synchronised step's device waits for the host until the first launch; this breaks that wait
into its parts (the check phase's attribute reads, the tables' numpy work, an upload, a launch).
"""

import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.bench_fused import gradient_sets, make
from lopt.fused import launcher
from lopt.param_sets import build_parameters
from lopt.weights import random_weights

name = sys.argv[1] if len(sys.argv) > 1 else "velo"
param_set = sys.argv[2] if len(sys.argv) > 2 else "gpt2-medium"
params = build_parameters(param_set, "cuda")
grads = gradient_sets(params, count=1)[0]
for p, g in zip(params, grads):
    p.grad = g
optimizer = make(name, params, "fused", random_weights(name))
loss = torch.tensor(2.5, device="cuda")
for _ in range(3):
    optimizer.step(loss) if getattr(optimizer, "requires_loss", False) else optimizer.step()
torch.cuda.synchronize()
engine, plan = optimizer._fused_engine, optimizer._fused_engine.plan
g0, p0 = grads[0], params[0]
staging = torch.empty(plan.axis_rows.shape, dtype=torch.int64, pin_memory=True)
device_table = torch.empty(plan.axis_rows.shape, dtype=torch.int64, device="cuda")
cupy = launcher.cupy_or_none()
index = torch.cuda.current_device()


def upload_torch():
    device_table.copy_(staging, non_blocking=True)


def upload_cupy():
    stream = torch._C._cuda_getCurrentRawStream(index)
    cupy.cuda.runtime.memcpyAsync(device_table.data_ptr(), staging.data_ptr(), staging.numel() * 8,
                                  cupy.cuda.runtime.memcpyHostToDevice, stream)


def event_torch():
    torch.cuda.Event().record(torch.cuda.current_stream())


cupy_event = cupy.cuda.Event(disable_timing=True)


def event_cupy():
    cupy.cuda.runtime.eventRecord(cupy_event.ptr, torch._C._cuda_getCurrentRawStream(index))


noop = cupy.RawKernel('extern "C" __global__ void noop() {}', "noop")
device = torch.device("cuda", index)


def launch_noop():
    launcher.launch(noop, 1, 32, (), device)


def addresses_column():
    plan.grad_addresses[:, 0] = plan.grad_pointers


def axis_rows():
    plan.layout.axis_rows(plan.pointers, out=plan.axis_rows)


scratch_axis_rows, scratch_addresses = plan.axis_rows.copy(), plan.grad_addresses.copy()
scratch_axis_table, scratch_gradients = launcher.MetadataTable(device), launcher.MetadataTable(device)


def table_update():  # (tables of the plan's sizes that the kernels do not read; a change every call, so it uploads)
    scratch_axis_rows[0, 0] += 1
    scratch_axis_table.update(scratch_axis_rows)


def gradients_update():
    scratch_addresses[0, 0] += 1
    scratch_gradients.update(scratch_addresses)


def per_tensor(fn):
    return lambda: [fn(g) for g in grads]


operations = {
    "fast check (all tensors; since 75d2072 with its accumulate launches)": engine.checked_gradients,
    "general check (all tensors)": optimizer._check_gradients,
    "p.grad x all": lambda: [p.grad for p in params],
    "g.shape x all": per_tensor(lambda g: g.shape),
    "g.dtype x all": per_tensor(lambda g: g.dtype),
    "g.layout x all": per_tensor(lambda g: g.layout),
    "g.get_device() x all": per_tensor(lambda g: g.get_device()),
    "g.is_contiguous() x all": per_tensor(lambda g: g.is_contiguous()),
    "g.data_ptr() x all": per_tensor(lambda g: g.data_ptr()),
    "empty loop x all": per_tensor(lambda g: None),
    "grad_addresses[:, 0] = list": addresses_column,
    "layout.axis_rows": axis_rows,
    "MetadataTable.update (axis table, changed)": table_update,
    "MetadataTable.update (gradient array, changed)": gradients_update,
    "torch copy_ H2D pinned (axis table)": upload_torch,
    "cupy memcpyAsync H2D pinned (axis table)": upload_cupy,
    "torch.cuda.Event().record": event_torch,
    "cupy eventRecord": event_cupy,
    "launcher.launch (an empty kernel)": launch_noop,
    "torch.cuda.current_stream()": torch.cuda.current_stream,
    "torch._C._cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(index),
}
results = {}
for label, fn in operations.items():
    samples = []
    for _ in range(60):
        torch.cuda._sleep(200_000)  # (~0.1 ms of device work, then the host waits as in a synchronised step)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    warm = []
    for _ in range(60):
        start = time.perf_counter()
        fn()
        warm.append((time.perf_counter() - start) * 1e6)
    results[label] = (statistics.median(samples[10:]), statistics.median(warm[10:]))
torch.cuda.synchronize()
print(f"{name} on {param_set} ({len(params)} tensors): median µs after an idle wait / back to back")
for label, (cold, warm) in results.items():
    print(f"  {cold:9.1f} {warm:9.1f}  {label}")
