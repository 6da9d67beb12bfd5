"""The fused engines' launches against the kernels' declarations, on the CPU.

CuPy passes kernel arguments by their numpy types, and a mismatch (an int64 where the kernel takes
an int, a float where it takes a pointer) is not an error on the GPU but a wrong read. Here each
engine runs whole steps with its kernels replaced by recorders (no GPU), and every launch's
arguments are checked against the parameter list its kernel declares in cuda_src/.
"""

from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
import torch

import lopt
from lopt import registry
from lopt.fused import launcher
from lopt.fused.celo2 import ADAM_OWN, ADAM_SHARED, LEARNED, SLICED
from lopt.fused.contract import FIELD
from lopt.fused.engine import FusedEngine, commit_blocks
from fused_helpers import fused_engine_optimizers
from spawned import leave_process

FUSED = fused_engine_optimizers()  # (one optimizer per fused engine)
# numpy type each C parameter type must reach CuPy as (a struct by value: a structured scalar)
C_TYPES = {"int": np.int32, "float": np.float32, "i64": np.int64, "long long": np.int64, "Celo2Network": np.void}


def declared_kernels(source_file: str) -> dict:
    """{kernel: [C type of each parameter]} of a cuda_src file (headers included), as the launcher reads them."""
    return {name: [p.c_type for p in params] for name, params in launcher.declared_parameters(source_file).items()}


class Recorder:
    def __init__(self, name, launches):
        self.name, self.launches = name, launches


class FakeModule:
    def __init__(self, launches):
        self.launches = launches

    def get_function(self, name):
        return Recorder(name, self.launches)


class CpuTable(launcher.MetadataTable):
    def update(self, rows):
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if self.table is None or tuple(self.table.shape) != rows.shape:
            self.table = torch.from_numpy(rows.copy())
        else:
            self.table.copy_(torch.from_numpy(rows))  # (as MetadataTable: the same table, new content)
        self.host = rows.copy()  # (as MetadataTable: callers update their rows in place)
        return self.table


def record_uploads(monkeypatch, record) -> None:
    """record(table, rows) for each update that changes a table's content: what MetadataTable uploads."""
    original = CpuTable.update

    def update(self, rows):
        if self.host is None or not np.array_equal(self.host, rows):
            record(self, rows.copy())
        return original(self, rows)

    monkeypatch.setattr(CpuTable, "update", update)


@pytest.fixture
def recorded(monkeypatch):
    launches = []
    monkeypatch.setattr(launcher, "get_module", lambda *a, **k: FakeModule(launches))
    monkeypatch.setattr(launcher, "MetadataTable", CpuTable)
    monkeypatch.setattr("lopt.fused.engine.launcher.MetadataTable", CpuTable)
    monkeypatch.setattr(FusedEngine, "persistent_grid", lambda self, name: 264)
    monkeypatch.setattr(launcher, "launch", lambda kernel, grid, block, args, device, shared_mem=0:
                        launches.append((kernel.name, grid, block, args)))
    return launches


def naive_for(name, params, geometry=None, **kwargs):
    """The registered optimizer ``name`` on the naive backend (``geometry``: (hidden, layers) of its MLP)."""
    entry = registry.get(name)
    shape = {} if geometry is None else {"hidden_size": geometry[0], "hidden_layers": geometry[1]}
    weights = lopt.random_weights(entry.architecture, seed=1, **shape)
    return entry.build(params, weights=weights, backend="naive", **kwargs)


def engine_for(name, params, **kwargs):
    opt = naive_for(name, params, **kwargs)
    # (the CPU tensors stand in for device memory)
    opt.backend, opt._fused_engine = "fused", registry.get(name).fused_engine_class(opt)
    return opt


@pytest.mark.parametrize("precision, mode", [("exact", 0), ("fast", 2)])
@pytest.mark.parametrize("hidden, layers", [(32, 1), (8, 2)])
def test_precision_and_geometry_choose_the_kernels_build(precision, mode, hidden, layers, recorded, monkeypatch):
    """SmallFCLOpt(precision=...) builds its kernels with split_mma.cuh's mode (exact the float32-accurate
    split, fast one BF16 product: LOPT_SPLIT_MODE 0 or 2, whose MMA counts test_kernels_compile.py checks),
    and for the geometry of its weights' MLP (lopt.network.MLPGeometry.cuda_defines)."""
    from lopt.network import MLPGeometry

    builds = []
    monkeypatch.setattr(launcher, "get_module", lambda source, device, defines=(): builds.append((source, defines))
                        or FakeModule(recorded))
    weights = lopt.random_weights("small_fc_lopt", seed=1, hidden_size=hidden, hidden_layers=layers)
    opt = lopt.SmallFCLOpt([torch.nn.Parameter(torch.randn(6, 4))], weights=weights, backend="naive",
                           precision=precision)
    engine = opt._make_fused_engine()
    [(source, defines)] = builds
    assert source == "small_fc_lopt.cu" and defines[0] == f"LOPT_SPLIT_MODE={mode}"
    geometry = MLPGeometry(39, hidden, layers, 2)
    assert defines[1:-1] == geometry.cuda_defines("SFC_MLP")
    assert defines[-1] == "LOPT_WEIGHT_DECAY_INSIDE_STEP=0"  # (small_fc_lopt's update rule; ELO's is 1)
    assert f"SFC_MLP_HIDDEN={hidden}" in defines and f"SFC_MLP_HIDDEN_LAYERS={layers}" in defines
    assert engine.tensor_cores == ((hidden, layers) == (32, 1))
    assert engine.packed_entries == (engine.tensor_cores and precision == "fast")
    assert torch.equal(engine.network.cpu(), geometry.pack(weights.tensors["mlp"]))


@pytest.mark.parametrize("name, source, options", [
    ("small_fc_lopt", "small_fc_lopt.cu", {}),
    ("small_fc_lopt", "small_fc_lopt.cu", {"max_grad_norm": 0.5}),  # (norm jobs, clip factors)
    ("small_fc_lopt", "small_fc_lopt.cu", {"geometry": (16, 2)}),  # (the generic MLP)
    ("velo", "velo.cu", {}),
    ("elo", "small_fc_lopt.cu", {"max_grad_norm": 0.5}),  # (global clipping: a norm job for every tensor)
    ("celo2", "celo2.cu", {}),
    ("celo2", "celo2.cu", {"max_grad_norm": 0.5}),  # (the global norm's own pass, before the axis pass)
    ("elo_celo2", "celo2.cu", {"max_grad_norm": None}),
])
def test_every_launch_matches_its_kernel_declaration(name, source, options, recorded):
    declared = declared_kernels(source)
    g = torch.Generator().manual_seed(0)
    shapes = [(), (5,), (6, 4), (2, 3, 4), (8, 3, 3, 3)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    params[2] = torch.nn.Parameter(torch.randn(4, 6, generator=g).t())  # a transposed parameter
    geometry = options.pop("geometry", None)
    opt = engine_for(name, [{"params": params[:2]}, {"params": params[2:], "lr": torch.tensor(0.5), **options}],
                     geometry=geometry)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step(torch.tensor(1.5)) if opt.requires_loss else opt.step()
    assert recorded, "no launches recorded"
    names = [launch[0] for launch in recorded]
    per_step = len(names) // 2
    assert names[:per_step] == names[per_step:]
    clips = any(group.get("max_grad_norm") is not None for group in opt.param_groups)
    # (CELO2: 2 launches of its own around Newton–Schulz's products, which are torch's, one for the R and C entries'
    # share of the first layer, one for the AdamW tensors, the vectors here, and two for the sliced tensors: their
    # 3 x 3 slices' kernel and the one for any other shape)
    assert per_step == {"small_fc_lopt": 6, "velo": 10, "elo": 6, "celo2": 13 + clips, "elo_celo2": 13 + clips}[name]
    if name in ("celo2", "elo_celo2"):  # (CELO2 clips f·g before its clamp: the norm comes first, no norm jobs)
        assert (names[0] == "celo2_gradient_norm") == clips and opt._fused_engine.plan.layout.num_norm_jobs == 0
        assert names[-5:] == ["celo2_mlp", "celo2_adamw", "celo2_normalise", "celo2_matrix_sums", "celo2_apply"]
        # the MLP and apply passes walk the learned matrix's chunks alone (the transposed one; the 3-d and 4-d
        # tensors are sliced: celo2_slices the 3 x 4 ones, a warp per slice, celo2_slices_3x3 the 3 x 3 ones, a thread
        # per slice), the
        # AdamW pass the vectors' (CELO2's own moments, ELO-CELO2's shared)
        work = opt._fused_engine.plan.work
        learned = [row for row, kind in enumerate(work.kinds) if kind == LEARNED]
        adam = [row for row, kind in enumerate(work.kinds) if kind in (ADAM_OWN, ADAM_SHARED)]
        assert learned == [2] and adam == [0, 1] and work.kinds[3:] == [SLICED, SLICED] and not work.elsewhere_rows
        control = names.index("celo2_control")
        assert sorted(names[control + 1:control + 3]) == ["celo2_slices", "celo2_slices_3x3"]
        # (first_slice, tensor, rows, cols, inner, outer_stride, inner_stride, row_stride, col_stride)
        walks = {"celo2_slices": ([[0, 3, 3, 4, 1, 12, 0, 4, 1]], 2), "celo2_slices_3x3": ([[0, 4, 3, 3, 1, 9, 0, 3, 1]], 24)}
        assert {kernel: (walk.tolist(), total) for kernel, (walk, total) in work.slice_walks.items()} == walks
        for kernel, (_, total) in walks.items():
            slices = next(launch for launch in recorded if launch[0] == kernel)
            parameters = declared_parameter_names(source)[kernel]
            assert slices[1] == 1 and slices[3][parameters.index("total_slices")] == total
        assert {work.kinds[row] for row in adam} == {ADAM_OWN if name == "celo2" else ADAM_SHARED}
        walked = {launch[0]: launch for launch in recorded[:per_step]}
        for kernel, rows in [("celo2_mlp", learned), ("celo2_apply", learned), ("celo2_adamw", adam)]:
            parameters = declared_parameter_names(source)[kernel]
            args = walked[kernel][3]
            assert args[parameters.index("walk_rows")] == len(rows)
            assert args[parameters.index("walk_chunks")] == sum(-(-params[row].numel() // 128) for row in rows)
        # celo2_normalise finds a matrix's divisor in the MLP pass's segment sums: the same grid's
        blocks = {launch[0]: launch for launch in recorded[:per_step]}
        normalise = blocks["celo2_normalise"][3][declared_parameter_names(source)["celo2_normalise"].index("mlp_blocks")]
        assert normalise == blocks["celo2_mlp"][1]
        # the MLP's network by value: the packed weights, bit for bit
        mlp = next(launch for launch in recorded if launch[0] == "celo2_mlp")
        network = mlp[3][declared_parameter_names(source)["celo2_mlp"].index("network")]
        engine = opt._fused_engine
        packed = engine.geometry.pack(celo2_linear_network(opt.meta_weights.tensors["mlp"])[0])
        assert np.array_equal(np.frombuffer(network.tobytes(), dtype=np.float32), packed.numpy())
    elif options:  # one norm block per clipped tensor, after the means' blocks: the second group's (small_fc_lopt's
        # per-tensor norms), or every tensor where a group clips by the global norm (ELO)
        finalize = next(launch for launch in recorded if launch[0] == "adafactor_finalize")
        norms = {"small_fc_lopt": 3, "elo": 5}[name]
        assert finalize[1] == 1 + norms and opt._fused_engine.plan.layout.num_norm_jobs == norms
        assert (opt._fused_engine.plan.norm_sums is not None) == (name == "elo")  # (its global sum: on the device)
    blocks = launcher.declared_block_sizes(source, opt._fused_engine.defines)
    for kernel, grid, block, args in recorded:
        assert block == blocks[kernel], f"{kernel}: launched in blocks of {block}, declared {blocks[kernel]}"
        types = declared[kernel]
        assert len(args) == len(types), f"{kernel}: {len(args)} arguments for {len(types)} parameters"
        for index, (arg, c_type) in enumerate(zip(args, types)):
            expected = np.uint64 if c_type == "pointer" else C_TYPES[c_type]
            assert type(arg) is expected, f"{kernel} argument #{index}: {type(arg).__name__} for a {c_type}"
        assert all(g > 0 for g in (grid if isinstance(grid, tuple) else (grid,))) and 0 < block <= 1024
    if name in ("small_fc_lopt", "elo"):  # the apply pass reads the fold's layers 2 and 3 on tensor cores, else the network
        engine = opt._fused_engine
        apply = next(launch for launch in recorded if launch[0] == "small_fc_lopt_apply")
        later = apply[3][declared_parameter_names(source)["small_fc_lopt_apply"].index("later_layers")]
        assert later == launcher.pointer(engine.plan.work.shared_frags if engine.tensor_cores else engine.network)
        assert engine.tensor_cores == (geometry is None)
    # The state was laid out in each parameter's own memory order, with unchanged logical shapes.
    state = opt.state[params[2]]
    assert state["mom"].shape == (6, 4, 3) and state["mom"].permute(1, 0, 2).is_contiguous()
    assert params[2].stride() == (1, 6)


def celo2_linear_network(network):
    from lopt.fused.celo2 import linear_network

    return linear_network(network)


def declared_parameter_names(source_file: str) -> dict:
    """{kernel: [name of each parameter]} of a cuda_src file (headers included)."""
    return {name: [p.name for p in params] for name, params in launcher.declared_parameters(source_file).items()}


@pytest.mark.parametrize("precision, packed", [("exact", False), ("fast", True)])
def test_fast_precision_hands_its_kernels_the_packed_entries(precision, packed, recorded):
    """precision="fast" has the tables kernel pack each entry's table features (packed_entry_inputs),
    the fold re-pack a shifted tensor's, and the apply pass read them: all three get the plan's packed
    tables. The exact mode allocates none and passes null."""
    from lopt.fused.small_fc_lopt import SmallFCLOptFused

    names = declared_parameter_names("small_fc_lopt.cu")
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5)),
              torch.nn.Parameter(torch.randn(3, 8, 2))]
    opt = naive_for("small_fc_lopt", params, precision=precision)
    opt.backend, opt._fused_engine = "fused", SmallFCLOptFused(opt)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    plan = opt._fused_engine.plan
    assert (plan.row_packed is not None) == packed and (plan.col_packed is not None) == packed
    if packed:  # a uint4 per entry of each table
        assert plan.row_packed.numel() == 4 * plan.layout.total_row_entries
        assert plan.col_packed.numel() == 4 * plan.layout.total_col_entries
    expected = [launcher.pointer(plan.row_packed), launcher.pointer(plan.col_packed)]
    for kernel in ("adafactor_factor_tables", "small_fc_lopt_fold", "small_fc_lopt_apply"):
        args = next(launch[3] for launch in recorded if launch[0] == kernel)
        given = [args[names[kernel].index(name)] for name in ("row_packed", "col_packed")]
        assert given == expected and (all(given) if packed else not any(given)), kernel


@pytest.mark.parametrize("name, stats, control", [("small_fc_lopt", "small_fc_lopt_feature_stats", "small_fc_lopt_fold"),
                                                   ("velo", "velo_statistics", "velo_tensor_control")])
def test_each_pass_is_one_launch_over_all_of_its_work(name, stats, control, recorded):
    """One statistics launch has a block per chunk of every tensor (the kernels find a chunk's tensor by
    its first_stats_chunk, in row order); the control launch a block per tensor and then its layout and
    commit blocks; the apply launch covers every chunk (a persistent grid, each block a contiguous
    range). Nothing depends on how many tensors there are but the grids."""
    shapes = [(40, 30), (7,), (64, 32), (3, 8, 16), (50,), (96, 64), (33, 5), (12,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = engine_for(name, params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step(torch.tensor(1.0)) if opt.requires_loss else opt.step()
    layout = opt._fused_engine.plan.layout
    t = FIELD["TensorMeta"]
    starts = layout.static_rows[:, t["first_stats_chunk"]]
    counts = layout.static_rows[:, t["num_stats_chunks"]]
    assert list(starts) == [0, *np.cumsum(counts)[:-1].tolist()] and layout.total_stats_chunks == counts.sum()
    [stats_launch] = [launch for launch in recorded if launch[0] == stats]
    assert stats_launch[1] == layout.total_stats_chunks
    [control_launch] = [launch for launch in recorded if launch[0] == control]
    assert control_launch[1] >= layout.num_tensors + commit_blocks(layout)
    [apply_launch] = [launch for launch in recorded if launch[0] == f"{name}_apply"]
    names = declared_parameter_names(f"{name}.cu")
    assert int(apply_launch[3][names[f"{name}_apply"].index("total_chunks")]) == layout.total_apply_chunks


def test_kernels_are_declared_once_with_known_parameter_types():
    for source in ("small_fc_lopt.cu", "velo.cu"):
        for kernel, types in declared_kernels(source).items():
            unknown = [t for t in types if t != "pointer" and t not in C_TYPES]
            assert not unknown, f"{source} {kernel}: parameter types {unknown}"
    parsed = launcher.parse_parameters("const float* __restrict__ x, int n, i64 total, float*out")
    assert [(p.name, p.c_type) for p in parsed] == [("x", "pointer"), ("n", "int"), ("total", "i64"), ("out", "pointer")]


def test_arguments_are_bound_by_name_in_the_declared_order_and_types():
    """Kernels take their arguments by parameter name (launcher.bind_arguments): order and numpy types come
    from the source's declaration, so a call site cannot swap two pointers; a missing or unknown name fails
    before anything is launched, naming it."""
    params = launcher.parse_parameters("const float* x, int n, i64 total, float scale, double* out")
    x, out = torch.zeros(3), torch.zeros(2, dtype=torch.float64)
    bound = launcher.bind_arguments("k", params, {"out": out, "scale": 0.5, "x": x, "total": 2**40, "n": 7})
    assert bound == (np.uint64(x.data_ptr()), 7, 2**40, 0.5, np.uint64(out.data_ptr()))
    assert [type(a) for a in bound] == [np.uint64, np.int32, np.int64, np.float32, np.uint64]
    assert launcher.bind_arguments("k", params, {"x": None, "n": 1, "total": 1, "scale": 1.0,
                                                 "out": np.uint64(1234)})[::4] == (0, 1234)
    with pytest.raises(RuntimeError, match=r"launch of k: missing arguments \['total'\], unknown arguments \['totl'\] "
                                           r"\(the kernel declares \['x', 'n', 'total', 'scale', 'out'\]\)"):
        launcher.bind_arguments("k", params, {"x": x, "n": 1, "totl": 1, "scale": 1.0, "out": out})
    with pytest.raises(RuntimeError, match=r"missing arguments \['out'\], unknown arguments \[\]"):
        launcher.bind_arguments("k", params, {"x": x, "n": 1, "total": 1, "scale": 1.0})


def test_packed_arguments_hold_each_value_at_its_kernel_param_address():
    """launcher.launch hands the driver a kernelParams array: each bound argument's bytes (its declared width,
    a struct's whole) at the address the array gives for it, in the declared order; a later launch rewrites them
    in place; a struct of another size than at the first launch is refused."""
    import ctypes

    network = np.frombuffer(np.arange(7, dtype=np.float32).tobytes(),
                            dtype=np.dtype({"names": ["w"], "formats": [(np.float32, (7,))]}))[0]
    params = launcher.parse_parameters("const float* x, int n, i64 total, Celo2Network net, float scale, int* out")
    x = torch.randn(3)

    def bound(n, scale):
        return launcher.bind_arguments("k", params, {"x": x, "n": n, "total": -2**40, "net": network,
                                                     "scale": scale, "out": np.uint64(0xDEADBEEF00)})

    packed = launcher.PackedArguments(bound(7, 0.25))
    for n, scale in [(7, 0.25), (-3, 1e-30)]:
        args = bound(n, scale)
        addresses = ctypes.cast(packed.pack(args), ctypes.POINTER(ctypes.c_void_p))
        read = [ctypes.string_at(addresses[i], arg.nbytes) for i, arg in enumerate(args)]
        assert read == [arg.tobytes() for arg in args]
        assert np.frombuffer(read[1], np.int32)[0] == n and np.frombuffer(read[4], np.float32)[0] == np.float32(scale)
        assert np.frombuffer(read[0], np.uint64)[0] == x.data_ptr() and read[3] == np.arange(7, dtype=np.float32).tobytes()
    small = np.frombuffer(np.zeros(2, np.float32).tobytes(), dtype=np.dtype({"names": ["w"], "formats": [(np.float32, (2,))]}))[0]
    args = list(bound(1, 1.0))
    args[3] = small
    with pytest.raises(ValueError, match="a struct argument of 8 bytes where the kernel's first launch passed 28"):
        packed.pack(tuple(args))


def test_launches_from_two_threads_fill_buffers_of_their_own(monkeypatch):
    """launcher.launch packs a kernel's arguments into a buffer the driver reads during the call: each thread
    has its own per kernel, so a launch in one thread cannot overwrite another's arguments mid-launch. Through a
    stand-in driver (no GPU here) that records what each launch's kernelParams point at."""
    import ctypes
    import sys
    import threading
    import types

    seen = []

    def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, kernel_params, extra):
        addresses = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))
        seen.append((threading.get_ident(), addresses[0], ctypes.c_int32.from_address(addresses[1]).value))

    driver = types.SimpleNamespace(launchKernel=launch_kernel)
    modules = {"cupy_backends": types.ModuleType("cupy_backends"), "cupy_backends.cuda": types.ModuleType("c"),
               "cupy_backends.cuda.api": types.SimpleNamespace(driver=driver), "cupy_backends.cuda.api.driver": driver}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "current_stream_handle", lambda device: 0)
    kernel = types.SimpleNamespace(ptr=0x1234)
    params = launcher.parse_parameters("const float* x, int n")

    both_launched = threading.Barrier(2)  # (both threads alive, their buffers too)

    def run(n):
        for _ in range(3):
            launcher.launch(kernel, 2, 64, launcher.bind_arguments("k", params, {"x": None, "n": n}), torch.device("cuda", 0))
        both_launched.wait(timeout=30)

    threads = [threading.Thread(target=run, args=(n,)) for n in (5, 9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    by_thread = {}
    for ident, address, n in seen:
        by_thread.setdefault(ident, set()).add((address, n))
    assert len(seen) == 6 and len(by_thread) == 2
    (first,), (second,) = by_thread.values()  # one buffer per thread, each launch read its own n
    assert first[0] != second[0] and {first[1], second[1]} == {5, 9}


def test_a_kernel_declared_differently_in_two_branches_is_refused(monkeypatch):
    text = ('extern "C" __global__ void k(int n, float* x) {}\n#if A\nextern "C" __global__ void k(int n, double* x) {}\n'
            '#else\nextern "C" __global__ void k(int n, float* y) {}\n#endif\n')
    monkeypatch.setattr(launcher, "kernel_source", lambda filename: text)
    launcher.declared_parameters.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"fake.cu: kernel k is declared twice with different parameters"):
            launcher.declared_parameters("fake.cu")
    finally:
        launcher.declared_parameters.cache_clear()


def test_kernels_sharing_a_parameter_list_macro_declare_its_parameters(monkeypatch):
    """Kernels built for several shapes (celo2_slices, _1x1, _3x3) share one parameter list written as an
    object-like macro: the launcher reads the macro's definition, continuation lines and all; a list that names
    no macro the source defines is refused, naming it."""
    slices = launcher.declared_parameters("celo2.cu")
    assert slices["celo2_slices"] == slices["celo2_slices_1x1"] == slices["celo2_slices_3x3"]
    assert [p.name for p in slices["celo2_slices"]][-3:] == ["grad_scale", "found_inf", "status"]
    text = ('#define ARGS const float* __restrict__ x, \\\n    int n, i64 total\n'
            'extern "C" __global__ void __launch_bounds__(128) a(ARGS) { body<1>(x, n, total); }\n'
            'extern "C" __global__ void __launch_bounds__(128, 4) b(ARGS) { body<3>(x, n, total); }\n'
            'extern "C" __global__ void c(int m) {}\n')
    monkeypatch.setattr(launcher, "kernel_source", lambda filename: text)
    launcher.declared_parameters.cache_clear()
    try:
        kernels = launcher.declared_parameters("fake.cu")
        assert {name: [(p.name, p.c_type) for p in params] for name, params in kernels.items()} == {
            "a": [("x", "pointer"), ("n", "int"), ("total", "i64")],
            "b": [("x", "pointer"), ("n", "int"), ("total", "i64")], "c": [("m", "int")]}
        monkeypatch.setattr(launcher, "kernel_source", lambda filename: text.replace("b(ARGS)", "b(ARGZ)"))
        launcher.declared_parameters.cache_clear()
        with pytest.raises(RuntimeError, match=r"a kernel's parameter list ARGZ is no macro the source defines"):
            launcher.declared_parameters("fake.cu")
    finally:
        launcher.declared_parameters.cache_clear()


def test_block_sizes_and_constants_are_read_from_the_source_as_built(monkeypatch):
    """A kernel's block size is its __launch_bounds__' first value and a host-read constant its #define, each
    evaluated through the source's macros, the build's -D values first (as over an #ifndef default), with C's
    integer division; a kernel without launch bounds, a macro defined two ways or not at all, and what is no
    integer expression are refused, naming the kernel or macro. (The real sources' sizes against what nvcc
    reads: test_kernels_compile.)"""
    text = ('#ifndef WARPS\n#define WARPS 4\n#endif\n#define THREADS (32 * WARPS)  // a comment\n'
            '#define CHUNK THREADS\n#define HALF (-7 / 2)\n#define REST (-7 % 2)\n#define F(x) ((x) + 1)\n'
            'extern "C" __global__ void __launch_bounds__(THREADS, 4) a(int n) {}\n'
            'extern "C" __global__ void __launch_bounds__(256u) b(int n) {}\n')
    sources = {"fake.cu": text}
    monkeypatch.setattr(launcher, "kernel_source", lambda filename: sources[filename])
    clear = (launcher.declared_block_sizes.cache_clear, launcher.source_constant.cache_clear)
    for c in clear:
        c()
    try:
        assert launcher.declared_block_sizes("fake.cu") == {"a": 128, "b": 256}
        assert launcher.declared_block_sizes("fake.cu", ("WARPS=2", "--fmad=false")) == {"a": 64, "b": 256}
        assert [launcher.source_constant("fake.cu", name) for name in ("CHUNK", "HALF", "REST")] == [128, -3, -1]
        refusals = {
            "kernel c declares no __launch_bounds__, where the launcher takes its block size from":
                text + 'extern "C" __global__ void c(int n) {}\n',
            r"THREADS is defined differently in two places \(\['\(32 \* WARPS\)', '64'\]\)":
                text + "#if X\n#define THREADS 64\n#endif\n",
            "kernel a is declared twice with different block sizes":
                text + 'extern "C" __global__ void __launch_bounds__(64) a(int n) {}\n',
        }
        for message, variant in refusals.items():
            sources["fake.cu"] = variant
            launcher.declared_block_sizes.cache_clear()
            with pytest.raises(RuntimeError, match=f"fake.cu: {message}"):
                launcher.declared_block_sizes("fake.cu")
        sources["fake.cu"] = text + "#define LOOP (LOOP + 1)\n#define SCALE 1.5f\n"
        with pytest.raises(RuntimeError, match="fake.cu: MISSING is not defined; a block size or host-read constant "
                                               "needs one #define"):
            launcher.source_constant("fake.cu", "MISSING")
        with pytest.raises(RuntimeError, match="fake.cu: macro LOOP is defined in terms of itself"):
            launcher.source_constant("fake.cu", "LOOP")
        with pytest.raises(RuntimeError, match=r"fake.cu: cannot evaluate '1.5f' \(1.5f\): not an integer "):
            launcher.source_constant("fake.cu", "SCALE")
        with pytest.raises(RuntimeError, match="fake.cu: F is not defined"):  # (a function-like macro)
            launcher.source_constant("fake.cu", "F")
    finally:
        for c in clear:
            c()


def test_engines_size_their_workspaces_and_chunks_from_the_source(recorded):
    """What an engine sizes on the host from its kernels' source: the apply chunk (each engine's
    APPLY_CHUNK_DEFINE), VeLO's per-tensor record, CELO2's feature scales and matrix sums' blocks."""
    params = [torch.nn.Parameter(torch.randn(300, 129)), torch.nn.Parameter(torch.randn(5))]
    for name, define, chunk in [("small_fc_lopt", "SFC_APPLY_CHUNK", 128), ("velo", "VELO_APPLY_CHUNK", 256),
                                ("celo2", "C2_APPLY_CHUNK", 128)]:
        opt = engine_for(name, params)
        for p in params:
            p.grad = torch.randn(p.shape) * 1e-2
        opt.step(torch.tensor(1.0)) if opt.requires_loss else opt.step()
        engine = opt._fused_engine
        assert engine.APPLY_CHUNK_DEFINE == define and engine.apply_chunk == chunk
        if name != "celo2":
            assert engine.plan.layout.total_apply_chunks == -(-300 * 129 // chunk) + 1
        if name == "velo":
            assert engine.plan.work.records.numel() == 2 * engine.constant("VELO_RECORD_FLOATS") == 312
        if name == "celo2":  # (the learned matrix: 30 scales and, from 32, 30 un-shifts; 16 blocks of sums)
            assert engine.plan.work.feature_scales.numel() == 2 * 64 and engine.sums_splits == 16
            assert engine.plan.work.learned_walk.chunks == -(-300 * 129 // chunk)

    class Unnamed(registry.get("small_fc_lopt").fused_engine_class):
        APPLY_CHUNK_DEFINE = ""

    opt = naive_for("small_fc_lopt", params)
    with pytest.raises(TypeError, match="Unnamed names no APPLY_CHUNK_DEFINE: the #define of small_fc_lopt.cu's "
                                        "apply chunk"):
        Unnamed(opt)


def test_velo_kernels_network_constants_are_generated_from_the_references():
    """velo.cu spells none of VeLO's network constants: the build gets them as -D values
    (lopt.fused.velo.network_defines, the engine's kernel traits), each what lopt.reference.velo and the
    registered architecture define — the sizes, the LSTM inputs' positions, the generated MLP's layout
    (VELO_GEN_*: the candidate stacks' shapes in role order), the clips, the fraction timescales — and the
    apply record's layout follows from them."""
    import re

    from lopt.fused import velo as fused
    from lopt.reference import velo as reference

    defines = fused.VeLOFused.kernel_traits()
    given = dict(d.split("=", 1) for d in defines)
    source = launcher.kernel_source("velo.cu")
    network = [name for name in given if name.startswith("VELO_")]
    assert len(network) >= 30
    for name in network:  # (defined by the build only)
        assert not re.search(rf"#define {re.escape(name.split('(')[0])}\b", source), name

    def constant(name):
        return launcher.source_constant("velo.cu", name, defines)

    candidates = lopt.random_weights("velo", seed=0).tensors["mlp"]
    shapes = [tuple(candidates[name].shape) for name in reference.MLP_CANDIDATE_TENSORS.values()]
    assert constant("VELO_CONTROLS") == reference.NUM_CANDIDATES and {shape[0] for shape in shapes} == {256}
    offsets = np.cumsum([0] + [math.prod(shape[1:]) for shape in shapes]).tolist()
    assert [constant(f"VELO_GEN_{part}") for part in ("W0", "B0", "W1", "B1", "W2", "B2", "FLOATS")] == offsets == [
        0, 120, 124, 140, 144, 156, 159]
    assert (constant("VELO_GEN_INPUTS"), constant("VELO_GEN_HIDDEN"), constant("VELO_GEN_OUTPUTS")) == (
        shapes[0][2], shapes[0][1], shapes[4][1]) == (reference.NUM_ELEMENT_FEATURES, 4, 3)
    assert fused.pack_candidates(candidates).shape == (256, 159)
    assert [constant(name) for name in ("VELO_NUM_FEATURES", "VELO_LSTM_INPUTS", "VELO_HIDDEN", "VELO_LOSS_TIMESCALES",
                                        "VELO_LOSS_FEATURES", "VELO_FRACTION_FEATURES", "VELO_RANK_CLASSES")] == [
        reference.NUM_ELEMENT_FEATURES, reference.NUM_LSTM_FEATURES, reference.LSTM_HIDDEN_SIZE,
        reference.NUM_LOSS_TIMESCALES, reference.NUM_LOSS_FEATURES, len(reference.FRACTION_TIMESCALES),
        reference.NUM_RANK_CLASSES] == [30, 30, 512, 10, 9, 9, 5]
    lstm = reference.LSTM_FEATURE_NAMES
    assert [constant(name) for name in ("VELO_LSTM_LOSS_FIRST", "VELO_LSTM_MEAN_RMS", "VELO_LSTM_RANK_FIRST",
                                        "VELO_LSTM_VARIANCES_FIRST")] == [9, 18, 19, 24]
    assert lstm[9] == "loss_feature_0" and lstm[18] == "mean_rms" and lstm[24:] == (
        "var_momentum_0", "var_momentum_1", "var_momentum_2", "var_rms_0", "var_rms_1", "var_rms_2")
    assert reference.ELEMENT_FEATURE_NAMES[constant("VELO_TABLE_FEATURES_FIRST"):][:4] == (
        "row_accumulator_0", "row_accumulator_1", "row_accumulator_2", "col_accumulator_0")

    def floats(text):
        return [float(x) for x in re.findall(r"([0-9.e+-]+)f", text)]

    assert floats(given["VELO_GRADIENT_CLIP"]) == [reference.GRADIENT_CLIP] == [1000.0]
    assert floats(given["VELO_GRADIENT_FEATURE_CLIP"]) == [reference.GRADIENT_FEATURE_CLIP]
    assert float(given["VELO_WEIGHT_GENERATION_SCALE"]) == reference.WEIGHT_GENERATION_SCALE == 100.0
    assert floats(given["VELO_FRACTION_TIMESCALES_EACH(X)"]) == list(reference.FRACTION_TIMESCALES)
    assert given["VELO_FRACTION_TIMESCALES_EACH(X)"].startswith("X(0.03f) X(0.1f) ")
    # The record: W0' by input (30 x 4), then b0, W1, b1, W2's two used rows, b2's two, lr_mult, param_scale.
    assert [constant(f"VELO_RECORD_{part}") for part in ("B0", "W1", "B1", "W2", "B2", "LR_MULT", "FLOATS")] == [
        120, 124, 140, 144, 152, 154, 156]

    wrong = dict(candidates, output_weights_=torch.zeros(256, 2, 4))
    with pytest.raises(ValueError, match=r"VeLO's candidate MLPs .*\(256, 2, 4\).* are not the registered 256 x "
                                         r"\[\(4, 30\), \(4,\), \(4, 4\), \(4,\), \(3, 4\), \(3,\)\]"):
        fused.pack_candidates(wrong)


def test_celo2_kernels_input_layout_is_the_references():
    """celo2.cu's input layout constants equal lopt.reference.celo2's feature groups: 30 inputs, the table
    features (R_k, C_k, rsqrt(R_k + 1e-8), rsqrt(C_k + 1e-8), three each, in that order) at [C2_TABLE_FIRST,
    C2_TABLE_END), the element's own the rest; the scales' workspace row holds the 30 scales and, from C2_UNSHIFT,
    the 30 un-shifts."""
    from lopt.fused import celo2 as fused
    from lopt.reference import celo2 as reference

    def constant(name):
        return launcher.source_constant("celo2.cu", name)

    first, end = constant("C2_TABLE_FIRST"), constant("C2_TABLE_END")
    assert constant("C2_FEATURES") == reference.NUM_INPUTS == 30 and range(first, end) == fused.TABLE_INPUTS
    assert constant("C2_ELEMENT_FEATURES") == fused.ELEMENT_INPUTS == 18
    starts = dict(zip((name for name, _ in reference.FEATURE_GROUPS), np.cumsum((0,) + reference.GROUP_WIDTHS).tolist()))
    assert [starts[name] - first for name in ("row_accumulator", "col_accumulator", "rsqrt_row_accumulator",
                                              "rsqrt_col_accumulator")] == [0, 3, 6, 9] and end - first == 12
    assert reference.NUM_INPUTS <= constant("C2_UNSHIFT") <= constant("C2_SCALES") - reference.NUM_INPUTS


@pytest.mark.parametrize("name", FUSED)
def test_an_optimizer_with_a_fused_engine_is_freed_without_the_garbage_collector(name, recorded):
    """The engine refers to its optimizer weakly: `del opt` frees the state and the workspaces at once
    (a cycle would hold GPU memory until a collection, enough to run a benchmark out of memory)."""
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))]
    gc.collect()
    gc.disable()
    try:
        opt = engine_for(name, params)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step(torch.tensor(1.5)) if opt.requires_loss else opt.step()
        engine, freed = weakref.ref(opt._fused_engine), weakref.ref(opt)
        del opt
        assert freed() is None and engine() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("name", FUSED)
def test_a_step_uploads_only_what_changed(name, recorded, monkeypatch):
    """New gradient tensors (every step, after zero_grad) upload the gradient array alone, one address
    per tensor row; the tensor table follows the gradients' dtypes and the parameters' addresses, the
    axis table the dtypes of the gradients it sums; a step with the same tensors uploads nothing."""
    from lopt.fused.contract import FIELD

    uploads = []
    record_uploads(monkeypatch, lambda table, rows: uploads.append((table, rows)))
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))]
    opt = engine_for(name, params)
    engine = opt._fused_engine

    def step_and_uploads():
        uploads.clear()
        opt.step(torch.tensor(1.5)) if opt.requires_loss else opt.step()
        plan = engine.plan
        names = {id(plan.gradients): "gradients", id(plan.tensor_table): "tensor", id(plan.axis_table): "axis"}
        return sorted({names[id(table)] for table, _ in uploads if id(table) in names})

    def addresses():
        return [p.grad.data_ptr() for p in params]

    for p in params:
        p.grad = torch.randn_like(p)
    step_and_uploads()
    assert step_and_uploads() == []  # the same gradient tensors
    params[0].grad = torch.randn_like(params[0])  # a new tensor at a new address
    assert step_and_uploads() == ["gradients"]
    assert engine.plan.gradients.host[:, 0].tolist() == addresses()
    assert engine.plan.tensor_table.host[0, FIELD["TensorMeta"]["grad"]] == 0  # (the kernels read the array)
    params[0].grad.data = params[0].grad.data.to(torch.bfloat16)  # another dtype (PyTorch's grad check is bypassed)
    assert step_and_uploads() == ["axis", "gradients", "tensor"]
    bf16 = launcher.DTYPE_CODES[torch.bfloat16]
    assert engine.plan.tensor_table.host[0, FIELD["TensorMeta"]["grad_dtype"]] == bf16
    assert set(engine.plan.axis_table.host[:, FIELD["AxisJob"]["dtype"]]) == {bf16}
    assert engine.plan.axis_table.host[:, FIELD["AxisJob"]["tensor"]].tolist() == [0, 0]  # (the weight's two sums)
    params[1].grad = torch.randn_like(params[1])
    assert step_and_uploads() == ["gradients"] and engine.plan.gradients.host[:, 0].tolist() == addresses()
    params[0].data = params[0].data.clone()  # the parameter moved to new storage, same shape
    assert step_and_uploads() == ["tensor"]
    assert engine.plan.tensor_table.host[0, FIELD["TensorMeta"]["param"]] == params[0].data_ptr()
    assert step_and_uploads() == []


@pytest.mark.parametrize("name", FUSED)
def test_the_group_tables_follow_the_groups_hyper_parameters(name, recorded, monkeypatch):
    """The group tables are rebuilt only where what they hold changed: a value changed by a user or a
    scheduler, a tensor replaced; a tensor read on the device (float32 there) is read by address, so
    its in-place updates need nothing; a step with the same groups uploads nothing."""
    from lopt.fused.contract import FIELD, GROUP_VALUES

    uploads = []
    record_uploads(monkeypatch, lambda table, rows: uploads.append((table, rows)))
    g = torch.Generator().manual_seed(9)
    weight, bias = torch.nn.Parameter(torch.randn(6, 4, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))
    opt = engine_for(name, [{"params": [weight]}, {"params": [bias], "lr": torch.tensor(0.25)}])
    engine = opt._fused_engine

    def step():
        uploads.clear()
        weight.grad, bias.grad = torch.randn(6, 4, generator=g), torch.randn(5, generator=g)
        opt.step(torch.tensor(1.5)) if opt.requires_loss else opt.step()
        plan = engine.plan
        return sorted({"values" if table is plan.group_values else "groups" for table, _ in uploads
                       if table is plan.group_values or table is plan.group_table})

    def value(group, name):
        return float(engine.plan.group_values.host[group, GROUP_VALUES[name]])

    step()
    assert step() == []
    opt.param_groups[0]["lr"] = 0.5  # (a number: read here, each step)
    assert step() == ["values"] and value(0, "lr") == 0.5
    opt.param_groups[0]["weight_decay"] = 0.125
    assert step() == ["values"] and value(0, "weight_decay") == 0.125
    opt.param_groups[1]["lr"].fill_(0.75)  # (float32 where the kernels run: read there, by address)
    assert step() == []
    lr = torch.tensor(0.375)
    opt.param_groups[1]["lr"] = lr  # (another tensor: its address goes into the table)
    assert step() == ["groups"]
    assert engine.plan.group_table.host[1, FIELD["GroupMeta"]["lr"]] == lr.data_ptr()
    opt.param_groups[1]["lr"] = torch.tensor(0.5, dtype=torch.float64)  # (read here by value, each step)
    assert step() == ["groups", "values"] and value(1, "lr") == 0.5
    opt.param_groups[1]["lr"].fill_(0.25)
    assert step() == ["values"] and value(1, "lr") == 0.25
    assert step() == []


@pytest.mark.parametrize("name", FUSED)
def test_a_refused_step_leaves_no_stale_gradient_address(name, recorded):
    """The fast check uploads the summed gradients' addresses before it reads the others. When the step
    is then refused, the next step still brings the whole array to its own gradients' addresses, also
    where they are those of the last step taken and the general check takes it."""
    g = torch.Generator().manual_seed(8)
    weight, bias = torch.nn.Parameter(torch.randn(6, 4, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))
    opt = engine_for(name, [weight, bias])
    engine = opt._fused_engine

    def step():
        opt.step(torch.tensor(1.5)) if opt.requires_loss else opt.step()

    taken = [torch.randn(6, 4, generator=g), torch.randn(5, generator=g)]
    for _ in range(2):  # (the plan, then the fast check)
        weight.grad, bias.grad = taken
        step()
    weight.grad, bias.grad = torch.randn(6, 4, generator=g), torch.randn(5, generator=g)
    bias.grad.data = bias.grad.data.to(torch.float64)  # (refused after the weight's sums were launched)
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        step()
    assert engine.plan.gradients.host[0, 0] == weight.grad.data_ptr()
    weight.grad, bias.grad = taken
    engine.checked_gradients = lambda *inputs: None
    step()
    assert engine.plan.gradients.host[:, 0].tolist() == [t.data_ptr() for t in taken]


STATISTICS_KERNELS = {name: registry.get(name).fused_engine_class.KERNELS[0] for name in FUSED}


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("fast_check", [True, False])
def test_the_first_launch_follows_only_the_gradient_addresses_upload(name, fast_check, recorded, monkeypatch):
    """A synchronised step waits for the host until its first launch, so a step with new gradients
    uploads only the gradient array (what the gradients' sums read besides the plan's fixed tables)
    before launching them. The fast check uploads the summed gradients' addresses, launches the
    whole accumulate phase (which reads no other gradient), checks the other gradients, and uploads
    the whole array before the first kernel that reads it, the statistics pass; no table is uploaded."""
    record_uploads(monkeypatch, lambda table, rows: recorded.append(("upload", table, rows)))
    weight, bias = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))
    opt = engine_for(name, [weight, bias])
    if not fast_check:
        opt._fused_engine.checked_gradients = lambda *inputs: None
    for _ in range(2):  # (the first step also builds the plan and its fixed tables)
        previous_bias_grad = bias.grad
        for p in (weight, bias):
            p.grad = torch.randn_like(p)
        recorded.clear()
        opt.step(torch.tensor(1.5)) if opt.requires_loss else opt.step()
    plan = opt._fused_engine.plan
    names = {id(plan.axis_table): "axis", id(plan.tensor_table): "tensor", id(plan.gradients): "gradients",
             id(plan.group_values): "group values", id(plan.group_table): "groups"}
    order = [("upload", names.get(id(event[1]), "other")) if event[0] == "upload" else event[0] for event in recorded]
    uploads = [event[2] for event in recorded if event[0] == "upload" and event[1] is plan.gradients]
    first_launch = order.index("adafactor_axis_partials")
    assert order[:first_launch] == [("upload", "gradients")], order
    assert ("upload", "tensor") not in order and ("upload", "axis") not in order, order
    gradient_uploads = [index for index, event in enumerate(order) if event == ("upload", "gradients")]
    statistics = [(index, recorded[index]) for index, event in enumerate(order) if event == STATISTICS_KERNELS[name]]
    first_reader = min(order.index(kernel) for kernel in order if isinstance(kernel, str)
                       and not kernel.startswith("adafactor_") and kernel != STATISTICS_KERNELS[name])
    [(statistics_index, statistics_launch)] = statistics
    assert statistics_launch[1] == 2  # (a chunk each, the weight's and the bias's)
    if fast_check:  # (the weight is summed along its axes; the bias is checked after the accumulate phase)
        assert len(gradient_uploads) == 2
        assert order.index("adafactor_factor_tables") < gradient_uploads[1] < statistics_index < first_reader
        assert uploads[0][:, 0].tolist() == [weight.grad.data_ptr(), previous_bias_grad.data_ptr()]
    else:
        assert len(gradient_uploads) == 1
        assert gradient_uploads[0] < statistics_index
    assert uploads[-1][:, 0].tolist() == [weight.grad.data_ptr(), bias.grad.data_ptr()]


@pytest.mark.parametrize("name", FUSED)
def test_the_fast_check_reads_what_the_general_check_would_and_leaves_the_rest_to_it(name, recorded, monkeypatch):
    """While the last plan fits, the check phase validates the gradients and reads their pointers in
    one pass (FusedEngine.checked_gradients): the same parameters and gradients as the general check,
    the same launches and tables. Anything it does not expect goes to the general check, which
    refuses bad gradients with its own messages or re-plans, and the fast check resumes after."""
    g = torch.Generator().manual_seed(3)
    weight, bias, frozen = (torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((6, 4), (5,), (3,)))
    opt = engine_for(name, [{"params": [weight, frozen]}, {"params": [bias]}])
    engine = opt._fused_engine
    general = []
    original = type(opt)._check_gradients
    monkeypatch.setattr(type(opt), "_check_gradients", lambda self: general.append(1) or original(self))

    def new_gradients():
        for p in (weight, bias):
            p.grad = torch.randn(p.shape, generator=g)

    def step():
        general.clear()
        opt.step(torch.tensor(1.5)) if opt.requires_loss else opt.step()
        return not general  # (True: the fast check took the step)

    new_gradients()
    assert not step()  # (the first step plans)
    new_gradients()
    checked = engine.checked_gradients()
    inputs = original(opt)
    assert checked[0] == inputs.params and [list(map(id, grads)) for grads in checked[1]] == \
        [list(map(id, grads)) for grads in inputs.grads]
    assert checked[2].grad_pointers == [weight.grad.data_ptr(), bias.grad.data_ptr()]
    assert checked[2].grad_dtypes == [torch.float32, torch.float32]
    def launches_and_tables():  # (tables by content; the statistics pass by the chunks it covers, which the
        # fast check launches in two parts: test_the_first_launch_follows_only_the_gradient_addresses_upload)
        plan, statistics = engine.plan, STATISTICS_KERNELS[name]
        chunks = sorted(chunk for kernel, grid, _, args in recorded if kernel == statistics
                        for chunk in range(int(args[4]), int(args[4]) + grid))
        return ([launch[:3] for launch in recorded if launch[0] != statistics], chunks, plan.tensor_table.host.copy(),
                plan.axis_table.host.copy())

    recorded.clear()
    assert step()
    fast = launches_and_tables()
    engine.checked_gradients = lambda *inputs: None  # the same step through the general check
    recorded.clear()
    assert not step()
    del engine.checked_gradients
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(launches_and_tables(), fast))

    refused = [  # (a gradient the general check refuses; its message)
        (lambda: setattr(weight.grad, "data", torch.randn(4, 6)), RuntimeError,
         r"gradient of parameter #0 has shape \(4, 6\) but the parameter has shape \(6, 4\)"),
        (lambda: setattr(bias.grad, "data", torch.randn(5, dtype=torch.float64)), TypeError,
         r"gradient of parameter #2 has unsupported dtype torch.float64"),
        (lambda: setattr(bias, "grad", torch.randn(5, generator=g).to_sparse()), RuntimeError,
         r"does not support sparse gradients \(parameter #2, shape \(5,\)\)"),
    ]
    for spoil, error, message in refused:
        new_gradients()
        spoil()
        recorded.clear()
        assert engine.checked_gradients() is None
        # (the bias is not factored: its gradient is checked after the accumulate phase was launched on
        # the weight's gradient, which then does not count for the step)
        early = [launch[0] for launch in recorded]
        assert early == (["adafactor_axis_partials", "adafactor_finalize", "adafactor_factor_tables"]
                         if spoil is not refused[0][0] else [])
        assert not engine.plan.accumulated
        with pytest.raises(error, match=message):
            step()
        assert not engine.plan.accumulated
        new_gradients()
        assert step()
    # A layout whose is_contiguous() raises (CSR; PyTorch refuses it as a dense parameter's .grad, so a
    # stand-in holds it) is left to the general check too, without an exception.
    import warnings
    from types import SimpleNamespace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (PyTorch calls its CSR support beta)
        csr = SimpleNamespace(grad=torch.randn(6, 4, generator=g).to_sparse_csr())
    assert not engine._read_gradients([(0, csr, (6, 4))], [None], [0], [None], [0])
    taken = [  # (a change the general check takes; whether it re-plans)
        (lambda: setattr(weight, "grad", torch.randn(4, 6, generator=g).t()), False),  # strides unlike p's
        (lambda: setattr(frozen, "grad", torch.randn(3, generator=g)), True),  # one more participating parameter
        (lambda: setattr(bias, "grad", None), True),  # one less
        (lambda: setattr(weight, "data", weight.data.clone()), False),  # the parameter's storage moved
        (lambda: opt.param_groups[1].__setitem__("max_grad_norm", 1.0), True),  # clipping in a group
        # a new (supported) dtype, of the bias, clipped since the change above: a source whose dtype the table
        # does not hold
        (lambda: setattr(bias.grad, "data", bias.grad.data.to(torch.bfloat16)), False),
    ]
    for change, replans in taken:
        new_gradients()
        change()
        recorded.clear()
        assert engine.checked_gradients() is None
        assert STATISTICS_KERNELS[name] not in [launch[0] for launch in recorded]  # (only ever after the check)
        plan_before = engine.plan
        assert not step()
        assert (engine.plan is not plan_before) == replans
        copies = engine.plan.grad_copies
        assert engine.plan.grad_pointers == [p.grad.data_ptr() if p.grad.is_contiguous() else copies[0].data_ptr()
                                             for p in (weight, frozen, bias) if p.grad is not None]
        new_gradients()
        frozen.grad = None
        step()  # (back to the usual gradients: re-plans where the change did)
        new_gradients()
        assert step()  # the fast check again


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("backend", ["naive", "fused"])
def test_a_parameter_resized_after_its_first_step_is_refused_and_nothing_changes(name, backend, recorded):
    """A parameter given another shape through .data after it took a step no longer matches its state:
    both backends refuse the step in the check phase, naming both shapes (the naive math would fail
    half-way, the fused kernels would index the state by the new shape), and change nothing."""
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.nn.Parameter(torch.randn(6, 4, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))
    opt = (engine_for if backend == "fused" else naive_for)(name, [weight, bias])

    def step():
        opt.step(torch.tensor(1.5)) if opt.requires_loss else opt.step()

    for _ in range(2):
        weight.grad, bias.grad = torch.randn(6, 4, generator=g), torch.randn(5, generator=g)
        step()
    weight.data = torch.randn(8, 4, generator=g)
    weight.grad, bias.grad = torch.randn(8, 4, generator=g), torch.randn(5, generator=g)
    before = [weight.detach().clone(), bias.detach().clone()]
    state_before = [{key: value.clone() for key, value in opt.state[p].items()} for p in (weight, bias)]
    steps_before = int(opt.state_dict()["param_groups"][0]["step"])  # (2; 0 here where the kernels are recorders)
    recorded.clear()
    with pytest.raises(RuntimeError, match=r"parameter #0 has shape \(8, 4\), but its optimizer state was made for "
                                           r"shape \(6, 4\).*build a new optimizer for the resized parameters"):
        step()
    assert torch.equal(weight, before[0]) and torch.equal(bias, before[1]) and recorded == []
    assert all(torch.equal(opt.state[p][key], value)
               for p, state in zip((weight, bias), state_before) for key, value in state.items())
    assert int(opt.state_dict()["param_groups"][0]["step"]) == steps_before


@pytest.mark.parametrize("name", FUSED)
def test_the_fast_check_without_factored_tensors_launches_the_accumulate_phase_first(name, recorded):
    """Vectors only: no axis jobs, so nothing to upload before the accumulate phase (its finalize still
    resets the status flags), which goes out before the gradients are read and matches the general
    check's step."""
    g = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(size, generator=g)) for size in (5, 3, 1)]
    opt = engine_for(name, params)
    engine = opt._fused_engine
    for index in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        recorded.clear()
        opt.step(torch.tensor(1.5)) if opt.requires_loss else opt.step()
    assert engine.plan.layout.num_axis_jobs == 0 and engine.plan.axis_table.table is None
    launched = [launch[0] for launch in recorded  # (an empty grid launches nothing: launcher.launch)
                if min(launch[1] if isinstance(launch[1], tuple) else (launch[1],)) > 0]
    assert launched[0] == "adafactor_finalize" and launched.count("adafactor_finalize") == 1
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    checked = engine.checked_gradients()
    assert checked is not None and checked[2].grad_pointers == [p.grad.data_ptr() for p in params]


@pytest.mark.parametrize("name", FUSED)
def test_a_square_parameter_transposed_in_place_is_replanned_in_its_new_order(name, recorded):
    """p.data = p.data.t() on a square matrix keeps the address and the shape, so only the strides tell
    the plan its element order changed: both checks look at them for parameters with two axes of one
    size, and the step re-plans in the new memory order (state re-arranged to follow the logical
    elements, gradients copied into the parameter's layout), as the naive backend indexes them."""
    g = torch.Generator().manual_seed(6)
    square, vector = torch.nn.Parameter(torch.randn(4, 4, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))
    opt = engine_for(name, [square, vector])
    engine = opt._fused_engine

    def step():
        square.grad, vector.grad = torch.randn(4, 4, generator=g), torch.randn(3, generator=g)
        opt.step(torch.tensor(1.5)) if opt.requires_loss else opt.step()

    step()
    step()
    plan = engine.plan
    assert plan.permutable_rows == [(0, (4, 1))]
    address, momentum = square.data_ptr(), opt.state[square]["mom"].clone()
    square.data = square.data.t()  # (the same storage, read column-major)
    assert square.data_ptr() == address and square.stride() == (1, 4)
    square.grad, vector.grad = torch.randn(4, 4, generator=g), torch.randn(3, generator=g)
    assert engine.checked_gradients() is None
    step()
    assert engine.plan is not plan and engine.plan.memory_orders[0] == (1, 0) and 0 in engine.plan.strided_rows
    state = opt.state[square]["mom"]
    assert torch.equal(state, momentum) and state.permute(1, 0, 2).is_contiguous()  # (same values, new order)


def sharded_worker(rank, name, init_file, out_file):
    """One of two gloo processes: a fused engine (kernels recorded, CPU tensors standing in for device
    memory) on DTensor parameters sharded on dim 0, two steps."""
    import traceback

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    result = {}
    try:
        launches = []
        launcher.get_module = lambda *a, **k: FakeModule(launches)
        launcher.MetadataTable = CpuTable
        FusedEngine.persistent_grid = lambda self, name: 264
        launcher.launch = lambda kernel, grid, block, args, device, shared_mem=0: launches.append(
            (kernel.name, grid, block, args))
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        g = torch.Generator().manual_seed(0)
        shapes = [(7, 5), (5, 9), (3, 4, 5, 6), (11,), (1, 8)]
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g), mesh, [Shard(0)])) for s in shapes]
        clipped = {"max_grad_norm": 0.1} if name in ("small_fc_lopt", "elo") else {}
        opt = engine_for(name, [{"params": params[:2], **clipped}, {"params": params[2:]}])
        for step in range(2):
            for p in params:
                p.grad = distribute_tensor(torch.randn(p.shape, generator=g), mesh, [Shard(0)])
            opt.step(torch.tensor(1.5 + rank)) if opt.requires_loss else opt.step()
        result["launches"] = launches
        result["collectives"] = opt.reducer.collectives
        result["layout"] = opt._fused_engine.plan.layout
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc()
    torch.save(result, f"{out_file}.{rank}")
    leave_process()


SHARDED_STEPS = {
    "small_fc_lopt": (["adafactor_axis_partials", "adafactor_finalize", "adafactor_factor_tables",
                       "adafactor_factor_tables", "small_fc_lopt_feature_stats", "small_fc_lopt_fold",
                       "small_fc_lopt_fold", "small_fc_lopt_apply"],
                      5),  # the split means, the slab sums, max_grad_norm's sums, the non-finite flag, the feature sums
    "elo": (["adafactor_axis_partials", "adafactor_finalize", "adafactor_factor_tables",
             "adafactor_factor_tables", "small_fc_lopt_feature_stats", "small_fc_lopt_fold",
             "small_fc_lopt_fold", "small_fc_lopt_apply"],
            5),  # as small_fc_lopt's; max_grad_norm's: the global Σ g² of the split tensors (one 2-element sum)
    "velo": (["adafactor_axis_partials", "adafactor_finalize", "adafactor_factor_tables", "adafactor_factor_tables",
              "velo_statistics", "velo_tensor_control", "velo_tensor_control", "velo_mix", "velo_lstm", "velo_heads",
              "velo_table_contributions", "velo_apply"],
             5),  # the loss's mean, the split means, the slab sums, the non-finite flag, the tensors' sums
}


@pytest.mark.parametrize("name", [name for name in FUSED if registry.get(name).fused_engine_class.STEPS_SHARDED_PARAMETERS])
def test_sharded_steps_launch_in_two_phases_around_the_reduces(tmp_path, name):
    """FSDP2 (gloo, 2 processes, recorded kernels): the launches of a step, each matching its kernel's
    declaration, and a fixed number of collectives, laid out alike in both processes."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    mp.spawn(sharded_worker, args=(name, str(tmp_path / "init"), out), nprocs=2, join=True)
    results = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"process {rank}:\n{result['error']}"
    declared = declared_kernels(registry.get(name).fused_engine_class.SOURCE)
    launches, collectives = SHARDED_STEPS[name]
    names = [launch[0] for launch in results[0]["launches"]]
    assert names == launches * 2
    for kernel, grid, block, args in results[0]["launches"] + results[1]["launches"]:
        types = declared[kernel]
        assert [type(a) for a in args] == [np.uint64 if t == "pointer" else C_TYPES[t] for t in types], kernel
    assert results[0]["collectives"] == results[1]["collectives"] == 1 + 2 * collectives  # (+1: the same-tensors check)
    a, b = (r["layout"] for r in results)
    assert (a.split_outputs, a.split_slab_sums, a.num_norm_jobs) == (b.split_outputs, b.split_slab_sums, b.num_norm_jobs)


def test_celo2_steps_a_tensor_of_one_slice_as_a_matrix(recorded, monkeypatch):
    """A learned tensor of rank >= 3 whose leading axes are all of size 1 (a class token) is the matrix of its
    last two axes: it joins the stack of that matrix's shape, and Newton–Schulz's launches take it. A conv
    kernel (several slices) of small slices is sliced (celo2_slices_3x3, celo2_slices_1x1 for the shapes they are
    built for), in either memory order; one of slices larger
    than SLICE_MAX, or of rank 5 in another order, is stepped elsewhere, by the reference functions. A matrix of one
    row (or column) is scalar: celo2_normalise takes its rows first and runs its whole iteration
    (scalar_rows), with no workspace of Gram matrices and no product."""
    import lopt.fused.celo2 as fused_celo2

    products = []
    family = fused_celo2.newton_schulz_family
    monkeypatch.setattr(fused_celo2, "newton_schulz_family",
                        lambda stacks, *args, **kwargs: products.append([x.shape for x, _ in stacks])
                        or family(stacks, *args, **kwargs))
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g))
              for s in [(1, 1, 9), (1, 9), (1, 6, 4), (2, 3, 3, 3), (2, 3, 8, 8), (5, 4, 1, 1)]]
    params.append(torch.nn.Parameter(torch.randn(4, 3, 3, 3, generator=g).to(memory_format=torch.channels_last)))
    params.append(torch.nn.Parameter(torch.randn(2, 3, 2, 3, 3, generator=g).to(memory_format=torch.channels_last_3d)))
    opt = engine_for("celo2", params)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    opt.step()
    engine = opt._fused_engine
    row = {tuple(p.shape): next(i for i, q in enumerate(engine.plan.params) if q is p) for p in params}
    stacks = {(s.rows_per_matrix, s.cols): sorted(s.tensor_rows) for s in engine.plan.work.stacks if s.matrices}
    assert stacks == {(1, 9): sorted([row[(1, 1, 9)], row[(1, 9)]]), (6, 4): [row[(1, 6, 4)]]}
    assert sorted(engine.plan.work.elsewhere_rows) == sorted([row[(2, 3, 8, 8)], row[(2, 3, 2, 3, 3)]])
    # (first_slice, tensor, rows, cols, inner, outer_stride, inner_stride, row_stride, col_stride): the row-major
    # kernel's slices one after the other, the channels-last one's strided (slice_walk_row)
    walks = {kernel: walk.tolist() for kernel, (walk, _) in engine.plan.work.slice_walks.items()}
    assert walks == {"celo2_slices_3x3": [[0, row[(2, 3, 3, 3)], 3, 3, 1, 9, 0, 3, 1],
                                          [6, row[(4, 3, 3, 3)], 3, 3, 3, 27, 1, 9, 3]],
                     "celo2_slices_1x1": [[0, row[(5, 4, 1, 1)], 1, 1, 1, 1, 0, 1, 1]]}
    assert {name for name, *_ in recorded} >= {"celo2_slices_3x3", "celo2_slices_1x1"}
    assert "celo2_slices" not in {name for name, *_ in recorded}
    [(grid, args)] = [(grid, args) for name, grid, _, args in recorded if name == "celo2_normalise"]
    names = declared_parameter_names("celo2.cu")["celo2_normalise"]
    assert grid[1] == 3 and args[names.index("scalar_rows")] == 2
    work = engine.plan.work
    assert sorted(work.ns_rows[:2].tolist()) == sorted([row[(1, 1, 9)], row[(1, 9)]])
    assert work.ns_rows[2].item() == row[(1, 6, 4)]
    scalar = [s for s in work.stacks if s.matrices and s.scalar]
    assert [s.tensor_rows for s in scalar] == [stacks[(1, 9)]] and scalar[0].family_gram is None
    assert products == [[(1, 6, 4)]]  # (one family: the (6, 4) matrix's products alone)


def test_celo2_per_tensor_clamps_and_limits_follow_their_groups(recorded):
    """Each tensor row's clamp (the transforms' second column, which the axis pass and the kernels apply) and, in a
    clipping optimizer, its max_grad_norm are its group's, and follow a change of the group's value at the next
    step (a group without max_grad_norm: no limit, inf)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(6, 4), (5,), (3, 8), (7,), (4, 4)]]
    opt = engine_for("elo_celo2", [{"params": params[:2], "grad_clip_value": 5.0},
                                   {"params": params[2:], "grad_clip_value": 7.0, "max_grad_norm": None}])

    def step_and_read():
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step()
        work = opt._fused_engine.plan.work
        return work.transforms[:len(params), 1].tolist(), work.max_norms[:len(params)].tolist()

    assert step_and_read() == ([5.0, 5.0, 7.0, 7.0, 7.0], [1.0, 1.0, math.inf, math.inf, math.inf])
    plan = opt._fused_engine.plan
    opt.param_groups[1]["grad_clip_value"], opt.param_groups[0]["max_grad_norm"] = 0.25, 3.0
    assert step_and_read() == ([5.0, 5.0, 0.25, 0.25, 0.25], [3.0, 3.0, math.inf, math.inf, math.inf])
    assert opt._fused_engine.plan is plan  # (the same plan: its columns rewritten in place)
    opt.param_groups[1]["max_grad_norm"], opt.param_groups[0]["max_grad_norm"] = 2.0, None  # (which groups clip: a new plan)
    assert step_and_read() == ([5.0, 5.0, 0.25, 0.25, 0.25], [math.inf, math.inf, 2.0, 2.0, 2.0])


def test_celo2_slice_kernels_cover_every_slice_a_thread_or_a_warp_each(recorded):
    """The slice kernels' grids: celo2_slices_1x1 and _3x3 step a slice per thread (blocks of C2_SLICE_THREADS
    slices), celo2_slices a slice per warp (blocks of C2_SLICE_THREADS / 32 slices: its 7 x 7 and 3-d tensors'
    slices are few and long); each launch is told the number of slices, which its last block's spare threads or
    warps check."""
    threads = launcher.source_constant("celo2.cu", "C2_SLICE_THREADS")
    assert threads == 128

    g = torch.Generator().manual_seed(0)
    shapes = [(3, 101, 7, 7), (9, 8, 5), (300, 3, 3), (130, 2, 1, 1)]  # 303 and 9 slices a warp; 300 and 260 a thread
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = engine_for("celo2", params)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    opt.step()
    parameters = declared_parameter_names("celo2.cu")
    launched = {name: (grid, block, args[parameters[name].index("total_slices")])
                for name, grid, block, args in recorded if name.startswith("celo2_slices")}
    warps = threads // 32
    assert launched == {"celo2_slices": (-(-312 // warps), threads, 312),
                        "celo2_slices_3x3": (-(-300 // threads), threads, 300),
                        "celo2_slices_1x1": (-(-260 // threads), threads, 260)}


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_celo2_result_pointers_follow_each_groups_newton_schulz(precision, recorded):
    """Where the apply pass reads each learned tensor's final step (Celo2Tensor.result): in the workspace
    buffer Newton–Schulz ends in (its step count's parity; bfloat16 for precision "fast"), or the proposed
    step itself where the group does not orthogonalise, or for vectors; rewritten when a group changes
    ns_steps or orthogonalize, and the Newton–Schulz launches cover exactly the matrices that take it. For
    precision "fast", the matrices whose products run take their step straight into Newton–Schulz's input
    (Celo2Tensor.direct_work: the even buffer at the step's index); none in the exact mode, nor a group of zero
    steps, nor vectors."""
    from lopt.fused.celo2 import CELO2_FIELD

    g = torch.Generator().manual_seed(0)
    first = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(6, 4), (6, 4), (3, 8)]]
    second = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(5, 5), (7,)]]
    opt = engine_for("celo2", [{"params": first}, {"params": second}], use_adamw_for_1d=False, precision=precision)
    params = first + second

    def step_and_read():
        recorded.clear()
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step()
        engine = opt._fused_engine
        work, plan = engine.plan.work, engine.plan
        rows = work.table.host
        size = work.work.numel() // 2
        buffers = {"steps": (work.steps.data_ptr(), 4, launcher.DTYPE_CODES[torch.float32]),
                   "even": (work.work.data_ptr(), work.work.element_size(), launcher.DTYPE_CODES[engine.work_dtype]),
                   "odd": (work.work.data_ptr() + size * work.work.element_size(), work.work.element_size(),
                           launcher.DTYPE_CODES[engine.work_dtype])}
        where, direct = {}, set()
        for p in params:
            row = next(i for i, q in enumerate(plan.params) if q is p)
            offset = int(rows[row, CELO2_FIELD["step_offset"]])
            address = int(rows[row, CELO2_FIELD["direct_work"]])
            assert address in (0, buffers["even"][0] + offset * buffers["even"][1]), (p.shape, address)
            if address:
                direct.add(tuple(p.shape))
            found = [name for name, (base, width, dtype) in buffers.items()
                     if int(rows[row, CELO2_FIELD["result"]]) == base + offset * width
                     and int(rows[row, CELO2_FIELD["result_dtype"]]) == dtype]
            where[tuple(p.shape)] = found[0] if len(found) == 1 else found
        launches = [launch for launch in recorded if launch[0] in ("celo2_matrix_sums", "celo2_normalise")]
        ns = [grid[1] for name, grid, _, args in launches if name == "celo2_normalise"]
        finals = [grid[1] for name, grid, _, args in launches if name == "celo2_matrix_sums"]
        assert finals == [len(params)]  # (every learned tensor's final step is summed)
        return where, (ns[0] if ns else 0), direct

    fast = precision == "fast"
    where, matrices, direct = step_and_read()  # ns_steps 5: odd
    assert where == {(6, 4): "odd", (3, 8): "odd", (5, 5): "odd", (7,): "steps"} and matrices == 4
    assert direct == ({(6, 4), (3, 8), (5, 5)} if fast else set())
    opt.param_groups[1]["ns_steps"] = 4
    where, matrices, direct = step_and_read()
    assert where == {(6, 4): "odd", (3, 8): "odd", (5, 5): "even", (7,): "steps"} and matrices == 4
    assert direct == ({(6, 4), (3, 8), (5, 5)} if fast else set())
    opt.param_groups[0]["orthogonalize"] = False
    where, matrices, direct = step_and_read()
    assert where == {(6, 4): "steps", (3, 8): "steps", (5, 5): "even", (7,): "steps"} and matrices == 1
    assert direct == ({(5, 5)} if fast else set())
    opt.param_groups[1]["ns_steps"] = 0  # (the divided input is the result: celo2_normalise writes it)
    where, matrices, direct = step_and_read()
    assert where == {(6, 4): "steps", (3, 8): "steps", (5, 5): "even", (7,): "steps"} and matrices == 1
    assert direct == set()
