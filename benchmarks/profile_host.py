"""The host's share of a fused step: wall time of ``step()`` on the CPU (no synchronisation), when
each phase ends and each kernel is launched (a timeline, medians over steps that each start on an
idle device, as in a synchronised benchmark), and where the time goes (cProfile), after warm-up,
with a fresh set of gradient tensors every step as in bench_fused.py:

    PYTHONPATH=. python benchmarks/profile_host.py [velo|small_fc_lopt|celo2|...] [gpt2-medium] > host.txt

(HOST_CPROFILE=0: the times and the timeline alone; HOST_PRECISION=fast: the optimizer's fast precision;
HOST_GENERAL_CHECK=1: every step through the general check, not the fused engine's fast check, for an A/B;
HOST_GC_OFF=1: the garbage collector off.)

In a step timed with synchronisation the device waits for the host until the first launch: that
offset is the part of the host's share the step pays in full. A device timeline (CUDA events after
each launch) shows when each kernel finishes in such a step.
"""

import cProfile
import collections
import functools
import os
import pstats
import statistics
import sys
import time

import torch

from benchmarks.bench_fused import do_step, gradient_sets, make
from lopt import registry
from lopt.fused import launcher
from lopt.param_sets import build_parameters
from lopt.weights import random_weights

name = sys.argv[1] if len(sys.argv) > 1 else "velo"
param_set = sys.argv[2] if len(sys.argv) > 2 else "gpt2-medium"
params = build_parameters(param_set, "cuda")
grad_sets = gradient_sets(params)
options = {"precision": os.environ["HOST_PRECISION"]} if os.environ.get("HOST_PRECISION") else None
optimizer = make(name, params, "fused", random_weights(registry.get(name).architecture), options, param_set)
if os.environ.get("HOST_GC_OFF") == "1":  # (A/B: Python's cyclic garbage collector off for the whole run)
    import gc

    gc.disable()
if os.environ.get("HOST_GENERAL_CHECK") == "1":  # (A/B: every step through the general check)
    optimizer._fused_engine.checked_gradients = lambda *inputs: None
loss = torch.tensor(2.5, device="cuda")


def set_gradients(i):
    for p, g in zip(params, grad_sets[i % len(grad_sets)]):
        p.grad = g
    torch.cuda.synchronize()


def one_step(i):
    set_gradients(i)
    start = time.perf_counter()
    do_step(optimizer, loss)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host, start


for i in range(5):
    one_step(i)
hosts = [one_step(i)[0] for i in range(30)]
print(f"{name} on {param_set}: host time of step() (no sync): median {statistics.median(hosts) * 1e3:.3f} ms, "
      f"min {min(hosts) * 1e3:.3f} ms")

def record_numbered(offsets, events):
    """Add each (label, ms) to offsets[(label, n)], n counting the label's occurrences in this step."""
    seen = collections.Counter()
    for label, ms in events:
        seen[label] += 1
        offsets[(label, seen[label])].append(ms)


def print_timeline(title, offsets):
    """The median of each entry, in time order, with the gap since the one before."""
    print(f"\n{title}")
    previous = 0.0
    for (label, n), values in sorted(offsets.items(), key=lambda item: statistics.median(item[1])):
        at = statistics.median(values)
        print(f"  {at:7.3f}  (+{at - previous:6.3f})  {label}{f' ({n})' if n > 1 else ''}")
        previous = at


# Timeline: the end of each phase and each launch, in ms from the call of step().
marks = []


def marked(label, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        marks.append((label, time.perf_counter()))
        return result
    return wrapper


def entered(label, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        marks.append((label, time.perf_counter()))
        return fn(*args, **kwargs)
    return wrapper


engine = optimizer._fused_engine
if hasattr(optimizer, "_step_loss"):
    optimizer._step_loss = entered("VeLO.step entered (_step_loss)", optimizer._step_loss)
# The phases marked are the engine's methods of these names; a name the engine no longer has is skipped
# (the timeline then lacks its mark), so the script follows the engine's refactors.
if hasattr(engine, "_accumulate_early"):
    engine._accumulate_early = entered("_accumulate_early entered", engine._accumulate_early)
optimizer._checked_inputs = marked("check phase done", entered("check phase entered", optimizer._checked_inputs))
for method in ("_read_gradients", "_plan_for", "_refresh", "_refresh_groups", "flags", "_step_arguments", "_accumulate",
               "_statistics", "_control", "_apply"):
    if hasattr(engine, method):
        setattr(engine, method, marked(f"{method} done", getattr(engine, method)))
launcher.MetadataTable.update = marked("a table's update done", launcher.MetadataTable.update)
original_launch = engine.launch


def timed_launch(kernel_name, *args, **kwargs):
    marks.append((f"launch {kernel_name}", time.perf_counter()))
    original_launch(kernel_name, *args, **kwargs)


engine.launch = timed_launch
offsets = collections.defaultdict(list)
for i in range(30):
    marks.clear()
    host, start = one_step(i)
    record_numbered(offsets, [(label, (at - start) * 1e3) for label, at in marks] + [("step() returned", host * 1e3)])
engine.launch = original_launch
print_timeline("timeline of one step (median ms after step() is called; 30 steps):", offsets)

# The device's side of a synchronised step: when each kernel has finished, in ms after a CUDA event
# recorded just before step() is called (as bench_fused.py times a step), from an event recorded
# after each launch.
kernel_ends = []


def evented_launch(kernel_name, *args, **kwargs):
    original_launch(kernel_name, *args, **kwargs)
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    kernel_ends.append((kernel_name, event))


engine.launch = evented_launch
device_offsets = collections.defaultdict(list)
for i in range(30):
    set_gradients(i)
    marks.clear()  # (the phases' marks are not read here)
    kernel_ends.clear()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    do_step(optimizer, loss)
    end.record()
    end.synchronize()
    record_numbered(device_offsets, [(f"{kernel_name} finished", start.elapsed_time(event))
                                     for kernel_name, event in kernel_ends]
                    + [("the step's end event", start.elapsed_time(end))])
engine.launch = original_launch
print_timeline("device timeline of a synchronised step (median ms after the start event; 30 steps):", device_offsets)

if os.environ.get("HOST_CPROFILE", "1") == "0":
    sys.exit(0)
profiler = cProfile.Profile()
profiler.enable()
for i in range(30):
    one_step(i)
profiler.disable()
stats = pstats.Stats(profiler)
stats.sort_stats("tottime").print_stats(25)
stats.sort_stats("cumulative").print_stats(40)
