"""Every kernel source compiles for the GPU generations lopt supports (CPU CI: nvcc, no GPU needed)."""

import os
import re
import shutil
import subprocess

import pytest

import lopt
from lopt.fused import launcher
from lopt import registry
from lopt.fused.small_fc_lopt import TENSOR_CORE_GEOMETRY, kernel_defines
from lopt.network import MLPGeometry

SOURCES = sorted(p.name for p in launcher.cuda_source_dir().glob("*.cu"))
# Ampere, Hopper and (consumer) Blackwell: NVRTC builds for the device it runs on (launcher.nvrtc_architecture).
ARCHITECTURES = ["sm_80", "sm_90", "sm_120"]


def nvcc():
    path = shutil.which("nvcc")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc is not on PATH: CI must compile every kernel")
        pytest.skip("nvcc is not installed")
    return path


# Geometries of small_fc_lopt's MLP besides the published one (which runs on tensor cores): the generic path.
GENERIC_GEOMETRIES = [MLPGeometry(39, hidden, layers, 2) for hidden, layers in ((4, 1), (8, 2), (16, 3), (64, 1), (32, 3))]


def build_defines(source, precision="exact", geometry=TENSOR_CORE_GEOMETRY, engine=None):
    """What the engine compiles ``source`` with (small_fc_lopt.cu: its precision and its network's geometry;
    every engine: its class's kernel traits, e.g. the update rule). ``engine``: the engine class, else the
    first registered one that builds ``source``."""
    if engine is None:
        engine = next(registry.get(name).fused_engine_class for name in registry.names()
                      if registry.get(name).fused and registry.get(name).fused_engine_class.SOURCE == source)
    own = ()
    if source == "small_fc_lopt.cu":
        own = kernel_defines(precision, geometry)
    elif source == "celo2.cu":  # (the published network's geometry, 30 -> 8 -> 8 -> 3)
        from lopt.fused import celo2

        own = celo2.kernel_defines(precision, celo2.linear_network(lopt.random_weights("celo2", seed=0).tensors["mlp"])[1])
    return own + engine.kernel_traits()


def test_there_are_kernel_sources():
    assert {"small_fc_lopt.cu", "velo.cu", "celo2.cu"} <= set(SOURCES)


def compile_unit(text, arch, tmp_path, extra=()):
    unit = tmp_path / "unit.cu"
    unit.write_text(text)
    options = [o for o in launcher.NVRTC_OPTIONS if not o.startswith("--std")]
    return subprocess.run([nvcc(), f"-arch={arch}", "-cubin", "-std=c++17", *options, *extra, str(unit), "-o",
                           str(tmp_path / "out.cubin")], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("source", SOURCES)
def test_kernel_compiles(source, arch, tmp_path):
    """The exact text NVRTC gets at run time (headers inlined, the contract generated from Python), with the same
    exactness options; and every kernel's block size as the engines launch it (launcher.declared_block_sizes,
    read from the source) is the one nvcc compiled it for (the PTX's .maxntid, from its __launch_bounds__)."""
    defines = build_defines(source)
    result = compile_unit(launcher.kernel_source(source), arch, tmp_path,
                          ("-Werror", "all-warnings", *[f"-D{d}" for d in defines], "--keep", "--keep-dir", str(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out.cubin").stat().st_size > 0
    ptx = (tmp_path / "unit.ptx").read_text()
    compiled = {name: int(threads) for name, threads in
                re.findall(r"\.entry (\w+)\((?:[^)]*)\)\s*\.maxntid (\d+)", ptx)}  # (", 1, 1" before sm_120)
    assert compiled == launcher.declared_block_sizes(source, defines)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("source", ["small_fc_lopt.cu", "celo2.cu"])
def test_fast_precision_compiles(source, arch, tmp_path):
    """The sources with a build of their own for precision "fast", as the engine builds them (exact:
    test_kernel_compiles), without warnings."""
    defines = build_defines(source, "fast")
    assert source != "celo2.cu" or "C2_FAST_MLP=1" in defines
    result = compile_unit(launcher.kernel_source(source), arch, tmp_path,
                          ("-Werror", "all-warnings", *[f"-D{d}" for d in defines]))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_elos_build_compiles_with_its_update_rule(precision, tmp_path):
    """ELO's engine builds small_fc_lopt.cu with the weight decay inside the step (apply_update's other rule)."""
    from lopt.fused.elo import ELOFused

    defines = build_defines("small_fc_lopt.cu", precision, engine=ELOFused)
    assert "LOPT_WEIGHT_DECAY_INSIDE_STEP=1" in defines
    result = compile_unit(launcher.kernel_source("small_fc_lopt.cu"), "sm_90", tmp_path,
                          ("-Werror", "all-warnings", *[f"-D{d}" for d in defines]))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("geometry", GENERIC_GEOMETRIES, ids=lambda g: f"h{g.hidden}x{g.hidden_layers}")
def test_small_fc_lopt_other_geometries_compile(geometry, tmp_path):
    """The kernels specialised to another MLP geometry (the generic float32 path), without warnings; and a
    build without a geometry is refused by the kernel source itself."""
    result = compile_unit(launcher.kernel_source("small_fc_lopt.cu"), "sm_90", tmp_path,
                          ("-Werror", "all-warnings", *[f"-D{d}" for d in build_defines("small_fc_lopt.cu", "exact", geometry)]))
    assert result.returncode == 0, result.stderr
    if geometry is GENERIC_GEOMETRIES[0]:
        bare = compile_unit(launcher.kernel_source("small_fc_lopt.cu"), "sm_90", tmp_path)
        assert bare.returncode != 0 and "kernel_defines" in bare.stderr


def test_velo_kernels_refuse_a_network_they_are_not_written_for(tmp_path):
    """velo.cu takes VeLO's network from the build (lopt.fused.velo.network_defines): without it, or with a
    generated MLP its per-element code is not written for (8 hidden units), the build fails and says why."""
    from lopt.fused import velo
    from lopt.network import MLPGeometry

    source = launcher.kernel_source("velo.cu")
    from lopt.fused.engine import FusedEngine

    bare = compile_unit(source, "sm_90", tmp_path, [f"-D{d}" for d in FusedEngine.kernel_traits()])
    assert bare.returncode != 0 and "build with lopt.fused.velo.network_defines" in bare.stderr
    wide = MLPGeometry(inputs=30, hidden=8, hidden_layers=1, outputs=3).cuda_defines("VELO_GEN")
    defines = [d for d in build_defines("velo.cu") if not d.startswith("VELO_GEN_")] + list(wide)
    result = compile_unit(source, "sm_90", tmp_path, [f"-D{d}" for d in defines])
    assert result.returncode != 0 and "per_element_mlp holds a hidden layer in a float4: a 30-4-4-3 generated MLP" in (
        result.stderr)
    assert velo.GENERATED_MLP == MLPGeometry(inputs=30, hidden=4, hidden_layers=1, outputs=3)


@pytest.mark.parametrize("source, struct, field", [("velo.cu", "VeloTensor", "rank_class"),
                                                   ("small_fc_lopt.cu", "TensorMeta", "row_means"),
                                                   ("velo.cu", "GroupMeta", "weight_decay")])
def test_a_contract_drift_fails_to_compile(source, struct, field, tmp_path, monkeypatch):
    """The kernels compile against the structs Python writes: a field Python no longer writes (or
    renames) is a compile error in CI, not a wrong read on a GPU."""
    from lopt.fused import contract

    monkeypatch.setitem(contract.STRUCTS, struct, tuple(f for f in contract.STRUCTS[struct] if f != field))
    result = compile_unit(launcher.kernel_source(source), "sm_90", tmp_path, [f"-D{d}" for d in build_defines(source)])
    assert result.returncode != 0 and field in result.stderr


def ptx_of(source, defines, tmp_path):
    """``source`` compiled to PTX for sm_80 with ``defines`` (the instructions a build emits, before ptxas)."""
    unit = tmp_path / source
    unit.write_text(launcher.kernel_source(source))
    result = subprocess.run([nvcc(), "-arch=compute_80", "-ptx", "-std=c++17", *[f"-D{d}" for d in defines], str(unit),
                             "-o", str(tmp_path / "out.ptx")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return (tmp_path / "out.ptx").read_text()


# LOPT_SPLIT_MODE -> (TF32, BF16, FP16) MMAs of the MLP in the kernel's code, per n-tile and m-tile (4 x 2):
# exact (mode 0), layer 1 a TF32 and a BF16 product per k-step, in two versions (4 k-steps, and 3 for
# warps whose elements all read one shared entry), layer 2 three FP16 products per 16-deep step (2); one
# BF16 product per two k-steps (mode 2, precision="fast"), whose output layer adds 2 16-deep steps x 2
# m-tiles of FP16. The apply pass has two copies of its chunk code (the general one and the common
# tensor's, is_common_tensor), so each count appears twice.
# Another geometry (the generic path) multiplies on the CUDA cores: no MMA at all.
COPIES = 2
MMA_COUNTS = {("exact", TENSOR_CORE_GEOMETRY): (COPIES * (32 + 24), COPIES * (32 + 24), COPIES * 48),
              ("fast", TENSOR_CORE_GEOMETRY): (0, COPIES * 32, COPIES * 4),
              ("exact", GENERIC_GEOMETRIES[1]): (0, 0, 0)}


@pytest.mark.parametrize("precision, geometry", list(MMA_COUNTS), ids=lambda v: getattr(v, "hidden", v))
def test_mlp_layers_mma_counts(precision, geometry, tmp_path):
    ptx = ptx_of("small_fc_lopt.cu", build_defines("small_fc_lopt.cu", precision, geometry), tmp_path)
    assert (ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"),
            ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
            ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")) == MMA_COUNTS[precision, geometry]


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_celo2_mlp_mma_counts(precision, tmp_path):
    """CELO2's MLP pass on tensor cores in fast mode only: per warp's two m-tiles, the first layer's two 16-deep
    BF16 products, then one 8-deep product each for the hidden layer and the output layer, in each of the element
    loop's two instantiations (factored tensors and the others); in exact mode none (float32 on the CUDA cores)."""
    ptx = ptx_of("celo2.cu", build_defines("celo2.cu", precision), tmp_path)
    counts = (ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
              ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32"), ptx.count("ldmatrix"))
    assert counts == ((2 * 2 * 2, 2 * 2 * 2, 2 * 2 * 2) if precision == "fast" else (0, 0, 0))


def test_celo2_fast_mlp_needs_the_geometry_that_fits_a_tile():
    """Wider networks keep the float32 MLP in fast mode too (one 8-column tile; the element's 18 inputs and one
    per hidden unit in a 32-input row)."""
    from lopt.fused import celo2

    assert celo2.ELEMENT_INPUTS == 18 and celo2.TABLE_INPUTS == range(15, 27)  # (celo2.cu: C2_TABLE_FIRST, C2_TABLE_END)
    assert [celo2.fast_mlp("fast", MLPGeometry(30, hidden, 1, 3)) for hidden in (4, 8, 9, 16)] == [True, True, False, False]
    assert not celo2.fast_mlp("exact", MLPGeometry(30, 8, 1, 3))
    defines = celo2.kernel_defines("fast", MLPGeometry(30, 16, 2, 3))
    assert "C2_FAST_MLP=0" in defines and "C2_MLP_HIDDEN=16" in defines


def test_kernel_source_inlines_each_header_once():
    text = launcher.kernel_source("small_fc_lopt.cu")
    assert '#include "' not in text
    assert text.count("struct TensorMeta {") == 1


def nvrtc_library():
    """NVRTC from the nvidia-cuda-nvrtc wheel (the test extra installs it), loaded with ctypes: the
    run-time compiler itself, which needs no GPU."""
    import ctypes

    try:
        import nvidia
    except ImportError:
        nvidia = None
    libraries = [os.path.join(path, "cu13", "lib") for path in getattr(nvidia, "__path__", [])]
    directory = next((d for d in libraries if os.path.exists(os.path.join(d, "libnvrtc.so.13"))), None)
    if directory is None:
        if os.environ.get("CI"):
            pytest.fail("the nvidia-cuda-nvrtc wheel is not installed: CI must compile every kernel with NVRTC")
        pytest.skip("nvidia-cuda-nvrtc is not installed")
    builtins = sorted(f for f in os.listdir(directory) if f.startswith("libnvrtc-builtins.so"))[0]
    ctypes.CDLL(os.path.join(directory, builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(os.path.join(directory, "libnvrtc.so.13"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("source", SOURCES)
def test_kernel_compiles_with_nvrtc(source, arch):
    """What lopt does at run time (launcher._nvrtc_compile): NVRTC, lopt's options, the device's sm_XY."""
    import ctypes

    nvrtc = nvrtc_library()
    program = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), launcher.kernel_source(source).encode(), source.encode(),
                                    0, None, None) == 0
    try:
        options = [o.encode() for o in launcher.NVRTC_OPTIONS] + [f"--gpu-architecture={arch}".encode()]
        options += [f"-D{d}".encode() for d in build_defines(source)]
        status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        assert status == 0, log.value.decode()
        nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
        assert size.value > 0
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
