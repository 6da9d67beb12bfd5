"""Every kernel source compiles for the GPU generations lopt supports (CPU CI: nvcc, no GPU needed)."""

import os
import shutil
import subprocess

import pytest

from lopt.fused import launcher

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


def test_there_are_kernel_sources():
    assert "small_fc_lopt.cu" in SOURCES


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("source", SOURCES)
def test_kernel_compiles(source, arch, tmp_path):
    # The exact text NVRTC gets at run time (headers inlined), with the same exactness options.
    unit = tmp_path / source
    unit.write_text(launcher.kernel_source(source))
    options = [o for o in launcher.NVRTC_OPTIONS if not o.startswith("--std")]
    result = subprocess.run([nvcc(), f"-arch={arch}", "-cubin", "-std=c++17", *options, "-Werror", "all-warnings",
                             str(unit), "-o", str(tmp_path / "out.cubin")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out.cubin").stat().st_size > 0


def test_mlp_layers_are_one_tf32_and_one_bf16_product_per_k_step(tmp_path):
    unit = tmp_path / "small_fc_lopt.cu"
    unit.write_text(launcher.kernel_source("small_fc_lopt.cu"))
    result = subprocess.run([nvcc(), "-arch=compute_80", "-ptx", "-std=c++17", str(unit), "-o", str(tmp_path / "out.ptx")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    ptx = (tmp_path / "out.ptx").read_text()
    # 2 layers x 4 k-steps x 4 n-tiles x 2 m-tiles of each kind, all unrolled
    assert ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == 64
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 64


def test_kernel_source_inlines_each_header_once():
    text = launcher.kernel_source("small_fc_lopt.cu")
    assert '#include "' not in text
    assert text.count("struct TensorMeta {") == 1
