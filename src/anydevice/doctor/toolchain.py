"""The build toolchain check: C++ compiler, ninja, nvcc and whether its CUDA matches torch's.

``torch.compile`` needs a C++ compiler (the CPU backend's code and Triton's launchers are
compiled with it); :func:`anydevice.load_extension` needs the compiler and ninja, and nvcc of
torch's CUDA major version for ``.cu`` sources. The tools are found as the builders find
them, from the environment the check is given (``PATH``, ``CXX``, ``CUDA_HOME``); torch's
CUDA version and the GPUs come from the inventory.
"""

from __future__ import annotations

from collections.abc import Mapping

from anydevice.doctor.results import Check, Status
from anydevice.extension import find_compiler, find_ninja, find_nvcc
from anydevice.hardware.backends.cuda import CudaBackend
from anydevice.hardware.inventory import Inventory

__all__ = ["check_toolchain"]

_COMPILER_FIX = (
    "Install a C++ compiler (Debian/Ubuntu: apt install g++; Fedora: dnf install gcc-c++; "
    "conda: conda install -c conda-forge gxx; macOS: xcode-select --install), or set CXX."
)


def check_toolchain(inv: Inventory, env: Mapping[str, str]) -> Check:
    """Whether custom kernels and ``torch.compile`` can be built here, and what to install."""
    title = "build toolchain (compiler, ninja, nvcc)"
    compiler, ninja, nvcc = find_compiler(env), find_ninja(env), find_nvcc(env)
    torch_cuda = inv.host.cuda_runtime
    gpus = len(inv.of_kind(CudaBackend.kind))  # what nvcc builds for
    found: list[str] = []
    problems: list[str] = []
    fixes: list[str] = []
    status: Status = "ok"

    if compiler.found:
        found.append(compiler.detail or f"{compiler.path} {compiler.version or ''}".strip())
    else:
        status = "warn"
        problems.append(
            f"no C++ compiler ({compiler.detail}): torch.compile and ad.load_extension "
            "cannot build anything"
        )
        fixes.append(_COMPILER_FIX)

    if ninja.found:
        where = "" if ninja.detail == "on PATH" else f" ({ninja.path}, the pip package)"
        found.append(f"ninja {ninja.version or '?'}{where}")
    else:
        status = "warn" if status == "warn" else "info"
        problems.append("no ninja: ad.load_extension (torch's extension builder) needs it")
        fixes.append("pip install ninja")

    if nvcc.found and torch_cuda is not None:
        found.append(f"nvcc {nvcc.version or '?'} ({nvcc.path})")
        if nvcc.problem and gpus:
            status = "warn"
            problems.append(f"nvcc cannot build torch extensions: {nvcc.problem}")
            fixes.append(f"export CUDA_HOME=<the CUDA {torch_cuda} toolkit folder>.")
        elif nvcc.problem:
            found.append(f"but {nvcc.problem}")
        if nvcc.version and nvcc.version.split(".")[0] != torch_cuda.split(".")[0]:
            status = "warn"
            problems.append(
                f"nvcc is CUDA {nvcc.version} but torch uses CUDA {torch_cuda}: CUDA "
                "extensions fail to build or load"
            )
            fixes.append(
                f"Install the CUDA {torch_cuda.split('.')[0]}.x toolkit and set CUDA_HOME to "
                f"it, or install a torch built for CUDA {nvcc.version.split('.')[0]}.x."
            )
    elif nvcc.found:  # a CPU-only torch: nothing of nvcc's set-up (CUDA_HOME) matters
        found.append(
            f"nvcc {nvcc.version or '?'} ({nvcc.path}), unused: torch is CPU-only, so .cu "
            "sources are left out"
        )
    elif torch_cuda is not None and gpus:
        status = "warn" if status == "warn" else "info"
        problems.append(
            f"no nvcc ({nvcc.detail}): the .cu sources of ad.load_extension are left out, "
            "so custom operators run their CPU kernels only"
        )
        fixes.append(f"Install the CUDA toolkit {torch_cuda} (torch's) and set CUDA_HOME.")
    else:
        found.append("no nvcc (not needed without a CUDA torch and a GPU)")

    summary = "; ".join(found) + "."
    if problems:
        summary = "; ".join(problems) + ". Found: " + (summary if found else "nothing.")
    return Check("toolchain", title, status, summary, " ".join(fixes) or None)
