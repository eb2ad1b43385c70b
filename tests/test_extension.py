"""load_extension builds real extensions with the real compiler, ninja and torch headers.

One operator, the example's (examples/custom_kernel), is built once per test session into a
temporary cache folder that tests/test_examples.py shares. The failure paths run for real:
a PATH without ninja, a compiler that is not there, a source that does not compile.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

import anydevice as ad
from anydevice.extension import (
    _key,
    arch_flags,
    find_compiler,
    find_ninja,
    find_nvcc,
    first_errors,
    is_built,
    nvcc_unfit,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_kernel"
SOURCES = [EXAMPLE / "bias_gelu.cpp", EXAMPLE / "bias_gelu_cuda.cu"]


def shared_cache(factory: pytest.TempPathFactory) -> Path:
    """XDG_CACHE_HOME for this test session: tests/test_examples.py runs the example with
    it, so the operator is compiled once per session."""
    return factory.getbasetemp() / "xdg-cache"


@dataclass
class Built:
    sources: list[Path]
    cache: Path
    result: ModuleType | str
    seconds: float
    logged: list[str]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The example's operator (fused bias + GELU), built once for the session, with the
    example's flags, into the session's cache folder. Skipped, with the reason, where this
    machine has no C++ compiler or ninja to build it with."""
    for tool in (find_compiler(), find_ninja()):
        if not tool.found:
            pytest.skip(f"no {tool.name} to build extensions with ({tool.detail})")
    cache = shared_cache(tmp_path_factory) / "anydevice" / "extensions"
    handler = _Collect()
    log = logging.getLogger("anydevice")
    log.addHandler(handler)
    try:
        t0 = time.perf_counter()
        result = ad.load_extension(
            "ad_examples_bias_gelu",
            SOURCES,
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            build_dir=cache,
        )
        seconds = time.perf_counter() - t0
    finally:
        log.removeHandler(handler)
    return Built(SOURCES, cache, result, seconds, handler.messages)


@pytest.mark.long  # a C++ build of a minute (make test-long)
def test_cpp_kernel_runs_as_a_torch_op(built: Built):
    x, bias = torch.randn(33, 70), torch.randn(70)
    y = torch.ops.ad_examples.bias_gelu(x, bias)
    torch.testing.assert_close(y, torch.nn.functional.gelu(x + bias))
    # No Python module in the sources: the library is loaded and its path returned.
    assert isinstance(built.result, str) and Path(built.result).is_file()
    assert Path(built.result).parent.parent == built.cache


@pytest.mark.long  # a C++ build of a minute (make test-long)
@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA torch builds the .cu")
def test_cu_source_is_left_out_on_a_cpu_torch_with_one_line_saying_why(built: Built):
    lines = [m for m in built.logged if "leaving out" in m]
    assert len(lines) == 1, built.logged
    assert "bias_gelu_cuda.cu" in lines[0]
    assert f"torch {torch.__version__} is built without CUDA" in lines[0]
    # The CUDA kernel is not registered: no CUDA object was compiled.
    assert not list(Path(built.result).parent.glob("*.cuda.o"))


@pytest.mark.long  # a C++ build of a minute (make test-long)
@pytest.mark.cuda
@pytest.mark.real_gpu("a CUDA kernel built by nvcc for the GPU here")
def test_cuda_kernel_is_built_for_the_gpu_here_and_runs(built: Built):
    left_out = [m for m in built.logged if "leaving out" in m]
    if left_out:  # no nvcc, or one of another CUDA major than torch's: said, not an error
        pytest.skip(f"the .cu source was left out: {left_out[0]}")
    x, bias = torch.randn(1000, 333, device="cuda"), torch.randn(333, device="cuda")
    y = torch.ops.ad_examples.bias_gelu(x, bias)
    torch.testing.assert_close(y, torch.nn.functional.gelu(x + bias))
    assert list(Path(built.result).parent.glob("*.cuda.o"))
    here = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    ninja_file = (Path(built.result).parent / "build.ninja").read_text()
    for major, minor in here:
        assert f"code=sm_{major}{minor}" in ninja_file
    assert ninja_file.count("code=sm_") == len(here)  # only the GPUs that are here


def _path_without_ninja(tmp_path: Path) -> str:
    """A PATH folder with every program of the real PATH except ninja."""
    folder = tmp_path / "bin"
    if folder.is_dir():
        return str(folder)
    folder.mkdir()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not d or not Path(d).is_dir():
            continue
        for prog in Path(d).iterdir():
            target = folder / prog.name
            if prog.name != "ninja" and not target.exists():
                target.symlink_to(prog)
    return str(folder)


# One child process tries three loads of the built operator, as a user's fresh process
# would: with a compiler that is not there, with ninja nowhere, and with ninja only beside
# Python (PATH lacks it, as in a virtual environment that is not activated).
CHILD = """
import os, sys, torch, anydevice as ad

def attempt(label):
    try:
        path = ad.load_extension("ad_examples_bias_gelu", SOURCES, build_dir=CACHE,
                                 extra_cflags=["-O3"], extra_cuda_cflags=["-O3"])
    except ad.ExtensionError as e:
        print(label, "ExtensionError:", str(e).replace("\\n", " "))
        return
    y = torch.ops.ad_examples.bias_gelu(torch.zeros(1, 2), torch.tensor([0.0, 1.0]))
    print(label, "result", [round(v, 4) for v in y.flatten().tolist()], path)

os.environ["CXX"] = "/nonexistent/g++"
attempt("no-compiler:")
del os.environ["CXX"]
sys.modules["ninja"] = None  # the ninja package is not installed
attempt("no-ninja:")
del sys.modules["ninja"]
attempt("reuse:")
"""


@pytest.fixture(scope="session")
def child(built: Built, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The child's line for each attempt, and the library's file times before and after."""
    library = Path(str(built.result))
    files = [library, *library.parent.glob("*.o")]
    before = [p.stat().st_mtime_ns for p in files]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PATH"] = _path_without_ninja(tmp_path_factory.mktemp("bin"))
    code = CHILD.replace("SOURCES", repr([str(s) for s in built.sources])).replace(
        "CACHE", repr(str(built.cache))
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {line.split(":")[0]: line for line in out.stdout.splitlines() if ":" in line}
    after = [p.stat().st_mtime_ns for p in files]
    lines["rebuilt"] = str(before != after)
    return lines


@pytest.mark.long  # a C++ build of a minute (make test-long)
def test_second_process_reuses_the_build_and_finds_ninja_beside_python(
    built: Built, child: dict[str, str]
):
    assert "result [0.0, 0.8413]" in child["reuse"], child
    assert str(built.result) in child["reuse"]  # the same build folder
    assert child["rebuilt"] == "False"  # nothing compiled or linked again


@pytest.mark.long  # a C++ build of a minute (make test-long)
def test_missing_ninja_names_the_fix(child: dict[str, str]):
    line = child["no-ninja"]
    assert "ninja is needed to build extension 'ad_examples_bias_gelu'" in line, child
    assert "pip install ninja" in line


@pytest.mark.long  # a C++ build of a minute (make test-long)
def test_missing_compiler_names_it_and_the_fix(child: dict[str, str]):
    line = child["no-compiler"]
    assert "No C++ compiler to build extension 'ad_examples_bias_gelu'" in line, child
    assert "CXX='/nonexistent/g++' not found" in line
    assert "apt install g++" in line


def test_compile_error_shows_the_first_errors_not_the_whole_log(tmp_path: Path):
    src = tmp_path / "broken.cpp"
    # No torch headers: the failure comes fast. Five errors, a long log.
    src.write_text(
        "int f() { return undefined_a; }\n"
        "int g() { return undefined_b; }\n"
        "int h() { return undefined_c; }\n"
        "int i() { return undefined_d; }\n"
        "int j() { return undefined_e; }\n"
    )
    with pytest.raises(ad.ExtensionError) as info:
        ad.load_extension("ad_broken", [src], build_dir=tmp_path / "cache")
    message = str(info.value)
    assert "Building extension 'ad_broken' failed" in message
    assert "broken.cpp:1:" in message and "undefined_a" in message
    assert "undefined_c" in message and "undefined_d" not in message  # the first three
    assert "(2 more below them)" in message
    assert len(message.splitlines()) < 20
    assert "undefined_e" in info.value.log  # the whole log is kept...
    log_file = next((tmp_path / "cache").glob("ad_broken-*/build.log"))
    assert log_file.read_text() == info.value.log  # ...and written beside the build
    assert "-isystem" in info.value.log and "-isystem" not in message


def test_sources_defining_a_python_module_return_the_module(tmp_path: Path):
    src = tmp_path / "pymod.cpp"
    src.write_text(
        textwrap.dedent("""
        #include <Python.h>
        #define CAT_(a, b) a##b
        #define CAT(a, b) CAT_(a, b)
        static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
        static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
        static PyModuleDef def = {PyModuleDef_HEAD_INIT, "ad_pymod", NULL, -1, methods};
        PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
        """)
    )
    module = ad.load_extension("ad_pymod", [src], build_dir=tmp_path)
    assert isinstance(module, ModuleType)
    assert module.answer() == 42


def test_sources_may_include_others_named_in_depends(tmp_path: Path):
    """A source that includes others (a unity build): they count in the key, and the
    module they define is returned."""
    part = tmp_path / "part.cpp"
    module_source = textwrap.dedent("""
        #include <Python.h>
        #define CAT_(a, b) a##b
        #define CAT(a, b) CAT_(a, b)
        static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ANSWER); }
        static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
        static PyModuleDef def = {PyModuleDef_HEAD_INIT, "ad_parts", NULL, -1, methods};
        PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
        """)
    part.write_text("#define ANSWER 7\n" + module_source)
    whole = tmp_path / "whole.cpp"
    whole.write_text('#include "part.cpp"\n')
    assert not is_built("ad_parts", [whole], depends=[part], build_dir=tmp_path)
    module = ad.load_extension("ad_parts", [whole], depends=[part], build_dir=tmp_path)
    assert isinstance(module, ModuleType) and module.answer() == 7
    assert is_built("ad_parts", [whole], depends=[part], build_dir=tmp_path)
    part.write_text("#define ANSWER 8\n" + module_source)
    assert not is_built("ad_parts", [whole], depends=[part], build_dir=tmp_path)


def test_missing_source_is_named(tmp_path: Path):
    with pytest.raises(ad.ExtensionError, match=r"nope\.cpp.* does not exist") as info:
        ad.load_extension("ad_missing", [tmp_path / "nope.cpp"], build_dir=tmp_path)
    assert "Path(__file__).parent / 'nope.cpp'" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_name_must_be_an_identifier(tmp_path: Path):
    with pytest.raises(ad.ExtensionError, match="not a Python identifier"):
        ad.load_extension("my-ops", [tmp_path / "a.cpp"], build_dir=tmp_path)


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA torch may build it")
def test_only_cuda_sources_on_a_cpu_torch_is_an_error(tmp_path: Path):
    cu = tmp_path / "k.cu"
    cu.write_text("__global__ void k() {}\n")
    with pytest.raises(ad.ExtensionError, match=r"only CUDA sources.*built without CUDA"):
        ad.load_extension("ad_only_cuda", [cu], build_dir=tmp_path)


def test_build_key_follows_sources_flags_and_compiler(tmp_path: Path):
    a = tmp_path / "a.cpp"
    a.write_text("int x;\n")
    compiler = find_compiler()
    base = _key([a], [], None, compiler)
    assert _key([a], [], None, compiler) == base
    assert _key([a], ["-O3"], None, compiler) != base
    assert _key([a], [], ["-gencode=arch=compute_90,code=sm_90"], compiler) != base
    other = type(compiler)("compiler", compiler.path, "99.0.0", compiler.detail)
    assert _key([a], [], None, other) != base
    a.write_text("int y;\n")
    assert _key([a], [], None, compiler) != base
    # The same source in another checkout: torch's build.ninja names each source by its
    # path, so a shared build folder would be rebuilt at every switch between the two.
    copy = tmp_path / "other" / "a.cpp"
    copy.parent.mkdir()
    copy.write_text(a.read_text())
    assert _key([copy], [], None, compiler) != _key([a], [], None, compiler)


def test_arch_flags_cover_each_gpu_once_with_ptx_for_the_newest():
    assert arch_flags([]) == []
    assert arch_flags([(8, 6), (8, 6)]) == [
        "-gencode=arch=compute_86,code=sm_86",
        "-gencode=arch=compute_86,code=compute_86",
    ]
    # A GPU newer than nvcc knows: nvcc's newest, and PTX the driver compiles for it.
    assert arch_flags([(8, 0), (12, 0)], supported=[75, 80, 90, 100]) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_100,code=sm_100",
        "-gencode=arch=compute_100,code=compute_100",
    ]
    with pytest.raises(ad.ExtensionError, match=r"compute capability 6\.0.*sm_75"):
        arch_flags([(6, 0)], supported=[75, 80])


def test_first_errors_reads_nvcc_and_linker_errors():
    nvcc = 'k.cu(12): error: identifier "foo" is undefined\n  foo();\n  ^\n'
    assert first_errors(nvcc) == (
        ['k.cu(12): error: identifier "foo" is undefined', "  foo();", "  ^"],
        1,
    )
    link = "[2/2] c++ a.o -o a.so\nFAILED: a.so\na.o: undefined reference to `bar'\n"
    assert first_errors(link)[0] == ["a.o: undefined reference to `bar'"]
    assert first_errors("something odd\nninja: build stopped")[0] == ["something odd"]


# ----------------------------------------------------------------------------- nvcc's fit


def _nvcc_banner(tmp_path: Path, release: str) -> dict[str, str]:
    """A CUDA_HOME whose bin/nvcc is a real program printing nvcc's banner for
    ``release``, as the toolkits of common images do, with the toolkit's header beside."""
    home = tmp_path / f"cuda-{release}"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\n"
        "echo 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        f"echo 'Cuda compilation tools, release {release}, V{release}.131'\n"
    )
    nvcc.chmod(0o755)
    return {**os.environ, "CUDA_HOME": str(home)}


def test_an_nvcc_of_another_cuda_major_than_torchs_is_unfit_with_the_fix(tmp_path: Path):
    """nvcc 12.4 beside a torch built for CUDA 13.0: the .cu sources are left out with this
    reason (they were an ExtensionError that failed the whole load, .cpp included)."""
    old = find_nvcc(_nvcc_banner(tmp_path, "12.4"))
    assert old.version == "12.4"
    why = nvcc_unfit("13.0", old)
    assert "nvcc is CUDA 12.4" in why and "built with CUDA 13.0" in why
    assert "install the CUDA 13.x toolkit" in why and "torch built for CUDA 12.x" in why
    assert nvcc_unfit("12.8", old) == ""  # the same major: fine
    assert "nvcc was not found" in nvcc_unfit("13.0", find_nvcc({"CUDA_HOME": str(tmp_path)}))


@pytest.mark.skipif(not find_nvcc().found, reason="needs an nvcc on this machine")
def test_this_machines_nvcc_fits_a_torch_of_its_own_major_only():
    nvcc = find_nvcc()
    assert nvcc.version is not None
    major = int(nvcc.version.split(".")[0])
    assert "major version" in nvcc_unfit(f"{major - 1}.8", nvcc)
    assert nvcc_unfit(f"{major}.0", nvcc) == nvcc.problem


@pytest.mark.long  # a C++ build of a minute (make test-long)
def test_a_killed_builds_lock_does_not_hang_the_next_load(built: Built):
    """torch marks a build with a ``lock`` file and waits for it to go away, forever: a
    build killed mid-way hung every later load (the simulator's tests timed out on one).
    Now the stale lock is seen for what it is and removed, with one logged line."""
    folder = Path(str(built.result)).parent
    (folder / "lock").touch()  # what a build killed between its start and its end leaves
    code = (
        "import logging, anydevice as ad\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        f"ad.load_extension('ad_examples_bias_gelu', {[str(s) for s in built.sources]!r}, "
        f"extra_cflags=['-O3'], extra_cuda_cflags=['-O3'], build_dir={str(built.cache)!r})\n"
        "print('loaded')\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the load waited on the killed build's lock")
    finally:
        lock_left = (folder / "lock").exists()
        (folder / "lock").unlink(missing_ok=True)
    assert out.returncode == 0 and out.stdout.strip() == "loaded", out.stderr
    assert "left by a build that was killed" in out.stderr
    assert not lock_left
