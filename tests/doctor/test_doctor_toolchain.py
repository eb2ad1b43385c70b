"""The doctor's toolchain check, with the real compiler, ninja and nvcc of this machine and
environments that hide them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from anydevice.doctor.toolchain import check_toolchain
from anydevice.extension import find_compiler, find_ninja, find_nvcc
from machines import gpu, machine

needs_tools = pytest.mark.skipif(
    not (find_compiler().found and find_ninja().found), reason="needs a C++ compiler and ninja"
)
needs_nvcc = pytest.mark.skipif(not find_nvcc().found, reason="needs nvcc")


@needs_tools
def test_this_machine_toolchain_is_reported_with_versions():
    c = check_toolchain(machine(cuda_runtime=None, torch_build="CPU"), os.environ)
    assert c.name == "toolchain"
    compiler, ninja = find_compiler(), find_ninja()
    assert compiler.version is not None and compiler.version in c.summary
    assert f"ninja {ninja.version}" in c.summary
    if find_nvcc().found:  # a CPU torch: nvcc is there but .cu sources are left out
        assert f"nvcc {find_nvcc().version}" in c.summary and "CPU-only" in c.summary
    assert c.status == "ok" and c.fix is None


def test_missing_compiler_warns_with_the_install_command():
    c = check_toolchain(machine(), {**os.environ, "CXX": "/nonexistent/g++"})
    assert c.status == "warn"
    assert "no C++ compiler (CXX='/nonexistent/g++' not found)" in c.summary
    assert c.fix is not None and "apt install g++" in c.fix


def test_missing_ninja_names_pip_install(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ninja", None)  # the ninja package is not installed
    c = check_toolchain(machine(), {**os.environ, "PATH": str(tmp_path)})
    assert "no ninja" in c.summary
    assert c.fix is not None and "pip install ninja" in c.fix
    assert c.status == "warn"  # the compiler is not on that PATH either


@needs_nvcc
def test_nvcc_of_another_cuda_major_than_torch_warns():
    nvcc = find_nvcc()
    assert nvcc.version is not None
    other = f"{int(nvcc.version.split('.')[0]) - 1}.8"
    c = check_toolchain(machine(gpu(0), cuda_runtime=other), os.environ)
    assert c.status == "warn"
    assert f"nvcc is CUDA {nvcc.version} but torch uses CUDA {other}" in c.summary
    assert c.fix is not None and f"Install the CUDA {other.split('.')[0]}.x toolkit" in c.fix
    env = dict(os.environ)
    if Path("/usr/local/cuda/include/cuda_runtime.h").exists():
        env["CUDA_HOME"] = "/usr/local/cuda"  # nvcc on PATH may be a wrapper outside it
    if not find_nvcc(env).problem:
        same = check_toolchain(machine(gpu(0), cuda_runtime=nvcc.version), env)
        assert same.status == "ok", same


def test_no_nvcc_with_a_cuda_torch_and_a_gpu_says_cu_sources_are_left_out():
    env = {**os.environ, "CUDA_HOME": "/nonexistent/cuda"}
    c = check_toolchain(machine(gpu(0), cuda_runtime="13.0"), env)
    assert "no nvcc (no nvcc in /nonexistent/cuda/bin" in c.summary
    assert ".cu sources of ad.load_extension are left out" in c.summary
    assert c.fix is not None and "CUDA toolkit 13.0" in c.fix
    # Without a GPU, nvcc is not needed.
    assert "not needed" in check_toolchain(machine(), env).summary


@needs_nvcc
def test_a_cuda_home_without_headers_is_named_with_the_fix(tmp_path):
    # A toolkit folder whose bin/nvcc works but which has no include/ (like /usr/local when
    # nvcc on PATH is /usr/local/bin/nvcc): torch's builder would fail on cuda_runtime.h.
    nvcc = find_nvcc()
    assert nvcc.path is not None
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(nvcc.path)
    env = {**os.environ, "CUDA_HOME": str(tmp_path)}
    broken = find_nvcc(env)
    assert broken.found and broken.version == nvcc.version
    assert f"{tmp_path}/include has no cuda_runtime.h" in broken.problem
    assert "set CUDA_HOME to the CUDA toolkit's folder" in broken.problem
    c = check_toolchain(machine(gpu(0), cuda_runtime=nvcc.version), env)
    assert c.status == "warn" and "nvcc cannot build torch extensions" in c.summary
    assert c.fix is not None and "export CUDA_HOME=" in c.fix
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").write_text("")
    assert find_nvcc(env).problem == ""


@needs_nvcc
def test_a_cpu_only_torch_gets_no_cuda_home_advice(tmp_path):
    """nvcc with a set-up torch's builder would refuse (no headers beside it), but torch is
    CPU-only: nothing of nvcc's matters, so no CUDA_HOME to set."""
    nvcc = find_nvcc()
    assert nvcc.path is not None
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(nvcc.path)
    env = {**os.environ, "CUDA_HOME": str(tmp_path)}
    assert "set CUDA_HOME" in find_nvcc(env).problem
    c = check_toolchain(machine(cuda_runtime=None, torch_build="CPU"), env)
    assert "CUDA_HOME" not in c.summary and (c.fix is None or "CUDA_HOME" not in c.fix), c
    assert "unused: torch is CPU-only, so .cu sources are left out" in c.summary
    with_gpu = check_toolchain(machine(gpu(0), cuda_runtime=None, torch_build="CPU"), env)
    assert "CUDA_HOME" not in with_gpu.summary  # a GPU, but a torch that cannot use it
