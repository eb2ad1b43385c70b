"""Custom C++/CUDA operators, built for the devices that are here.

:func:`load_extension` is torch's ``cpp_extension.load`` with its traps taken out. The
classic recipe, ``load("ext", ["ext.cpp", "kernel.cu"])``, fails outright on a machine
without CUDA, builds for every GPU architecture unless ``TORCH_CUDA_ARCH_LIST`` is set,
breaks with an opaque error when nvcc's CUDA differs from torch's or when ninja or a
compiler is missing, and rebuilds from scratch in each new environment. Here:

- ``.cpp`` sources always build; ``.cu`` sources build only where torch has CUDA, nvcc is
  found with torch's CUDA major version and a GPU is here to build for; otherwise they are
  left out with one logged line saying why (an only-CUDA extension raises instead). An
  operator whose CPU kernel is registered in the ``.cpp`` (``TORCH_LIBRARY``) and whose
  CUDA kernel is registered in the ``.cu`` (``TORCH_LIBRARY_IMPL(ns, CUDA, m)``) therefore
  loads on both kinds of machine.
- The CUDA architectures are those of the GPUs here, read through NVML (no CUDA context),
  with PTX for the newest so that the code also runs on later GPUs.
- The build folder lives in the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``, then
  ``anydevice/extensions``), named by a hash of the sources, flags, Python, torch and
  compiler versions: a second load of the same sources, in any process, costs no compile.
- A missing compiler, ninja or source, and a compile error raise
  :class:`~anydevice.errors.ExtensionError`, which names the missing piece and the fix
  (for a compile error, the compiler's first errors, not the whole log).

The toolchain facts (:func:`find_compiler`, :func:`find_ninja`, :func:`find_nvcc`) are read
here and by ``anydevice doctor``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from anydevice.errors import ExtensionError

__all__ = [
    "Tool",
    "arch_flags",
    "cache_root",
    "find_compiler",
    "find_ninja",
    "find_nvcc",
    "first_errors",
    "is_built",
    "load_extension",
    "nvcc_unfit",
]

logger = logging.getLogger("anydevice")

CUDA_SUFFIXES = (".cu", ".cuh")
#: Bumped when the layout of a build folder changes, so old ones are not reused.
_KEY_VERSION = "1"
_COMPILER_INSTALL = (
    "Install one (Debian/Ubuntu: `apt install g++`; Fedora: `dnf install gcc-c++`; conda: "
    "`conda install -c conda-forge gxx`; macOS: `xcode-select --install`), or set CXX to "
    "its path."
)


@dataclass(frozen=True)
class Tool:
    """A build tool as found on this machine: where it is and which version it is.

    ``path`` is None when it was not found; ``version`` is None when it did not say.
    ``detail`` tells where it was looked for or what it reported; ``problem`` what keeps a
    found tool from working, with the fix ("" when nothing does).
    """

    name: str
    path: str | None
    version: str | None = None
    detail: str = ""
    problem: str = ""

    @property
    def found(self) -> bool:
        return self.path is not None


def _run(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The program's output (stdout and stderr), or None when it cannot run."""
    try:
        out = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=30,
            env={**environ, "LC_ALL": "C"},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout + out.stderr if out.returncode == 0 else None


def find_compiler(environ: Mapping[str, str] | None = None) -> Tool:
    """The C++ compiler torch's extension builder will call: ``$CXX``, else ``c++``.

    >>> find_compiler({"CXX": "/nonexistent/g++", "PATH": ""}).found
    False
    """
    env = os.environ if environ is None else environ
    name = env.get("CXX") or "c++"
    path = shutil.which(name, path=env.get("PATH", os.defpath))
    where = f"CXX={name!r}" if env.get("CXX") else f"{name!r} on PATH"
    if path is None:
        return Tool("compiler", None, None, f"{where} not found")
    version = _run([path, "-dumpfullversion", "-dumpversion"], env)
    banner = _run([path, "--version"], env) or ""
    first = banner.splitlines()[0].strip() if banner.strip() else ""
    return Tool(
        "compiler", path, version.strip() if version else None, first or f"{where} did not run"
    )


def _ninja_from_pip() -> str | None:
    """The folder of the ninja that ``pip install ninja`` put beside this Python, which is
    not on PATH when a virtual environment is used without activating it (as Jupyter and
    IDEs do)."""
    try:
        import ninja  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    return str(getattr(ninja, "BIN_DIR", "")) or None


def find_ninja(environ: Mapping[str, str] | None = None) -> Tool:
    """ninja, which torch's extension builder needs: the one ``pip install ninja`` put beside
    this Python when there is one, else the one on PATH.

    The pip one comes first so that an environment builds with the same ninja whether it is
    activated or not: ninja versions keep their logs in different formats, and a build folder
    made by one is rebuilt from scratch by another. ``detail`` says which was found:
    ``"ninja package"`` (:func:`load_extension` puts its folder on PATH for the build, which
    torch's builder needs) or ``"on PATH"``.
    """
    env = os.environ if environ is None else environ
    folder = _ninja_from_pip()
    path = shutil.which("ninja", path=folder) if folder else None
    detail = "ninja package"
    if path is None:
        path = shutil.which("ninja", path=env.get("PATH", os.defpath))
        detail = "on PATH"
    if path is None:
        return Tool("ninja", None, None, "not on PATH, and the ninja package is not installed")
    version = _run([path, "--version"], env)
    return Tool("ninja", path, version.strip() if version else None, detail)


def _cuda_home(env: Mapping[str, str]) -> str | None:
    """The CUDA toolkit folder, found as torch's ``cpp_extension`` finds it."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home is None:
        nvcc = shutil.which("nvcc", path=env.get("PATH", os.defpath))
        if nvcc is not None:
            home = str(Path(nvcc).parent.parent)
        elif Path("/usr/local/cuda").exists():
            home = "/usr/local/cuda"
    return home


def find_nvcc(environ: Mapping[str, str] | None = None) -> Tool:
    """The nvcc torch would use (``$CUDA_HOME/bin/nvcc``, else the one on PATH) and the
    CUDA release it belongs to (``"13.0"``)."""
    env = os.environ if environ is None else environ
    home = _cuda_home(env)
    if home is None:
        return Tool("nvcc", None, None, "CUDA_HOME unset, no nvcc on PATH, no /usr/local/cuda")
    path = Path(home, "bin", "nvcc")
    if not path.exists():
        return Tool("nvcc", None, None, f"no nvcc in {home}/bin (CUDA_HOME={home})")
    out = _run([str(path), "--version"], env) or ""
    m = re.search(r"release (\d+\.\d+)", out)
    problem = ""
    if not Path(home, "include", "cuda_runtime.h").exists():
        # e.g. /usr/local/bin/nvcc, a wrapper script: torch then takes /usr/local for CUDA_HOME.
        where = "CUDA_HOME" if env.get("CUDA_HOME") or env.get("CUDA_PATH") else "nvcc's folder"
        example = ", e.g. /usr/local/cuda" if Path("/usr/local/cuda/include").is_dir() else ""
        problem = (
            f"{home}/include has no cuda_runtime.h (torch's builder takes the toolkit folder "
            f"from {where}); set CUDA_HOME to the CUDA toolkit's folder{example}"
        )
    return Tool("nvcc", str(path), m.group(1) if m else None, f"CUDA_HOME={home}", problem)


def _nvcc_archs(nvcc: str) -> list[int]:
    """The real architectures this nvcc can build for (75, 80, ...), oldest first."""
    out = _run([nvcc, "--list-gpu-arch"], os.environ) or ""
    return sorted({int(n) for n in re.findall(r"compute_(\d+)", out)})


def arch_flags(capabilities: Iterable[tuple[int, int]], supported: Sequence[int] = ()) -> list[str]:
    """nvcc flags for these GPUs: machine code for each, and PTX for the newest.

    A GPU newer than nvcc knows gets the newest machine code nvcc has plus its PTX, which
    the driver compiles for the GPU when the library loads.

    >>> arch_flags([(9, 0), (8, 0), (9, 0)])
    ['-gencode=arch=compute_80,code=sm_80', '-gencode=arch=compute_90,code=sm_90', \
'-gencode=arch=compute_90,code=compute_90']
    >>> arch_flags([(12, 0)], supported=[75, 80, 90, 100])[-1]
    '-gencode=arch=compute_100,code=compute_100'

    Raises:
        ExtensionError: a GPU older than the oldest architecture nvcc supports.
    """
    nums = sorted({major * 10 + minor for major, minor in capabilities})
    if not nums:
        return []
    if supported:
        too_old = [n for n in nums if n < min(supported)]
        if too_old:
            raise ExtensionError(
                f"This nvcc cannot build for compute capability {too_old[0] // 10}."
                f"{too_old[0] % 10}: its oldest architecture is sm_{min(supported)}. Use an "
                "older CUDA toolkit (and a torch built for it) on this GPU."
            )
        nums = sorted({min(n, max(supported)) for n in nums})
    flags = [f"-gencode=arch=compute_{n},code=sm_{n}" for n in nums]
    return [*flags, f"-gencode=arch=compute_{nums[-1]},code=compute_{nums[-1]}"]


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """The folder build folders go under: ``$XDG_CACHE_HOME/anydevice/extensions``, with
    ``~/.cache`` when the variable is unset.

    >>> str(cache_root({"XDG_CACHE_HOME": "/c"}))
    '/c/anydevice/extensions'
    """
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base, "anydevice", "extensions")


_ERROR = re.compile(
    r":\d+(?::\d+)?: (?:fatal )?error\b"  # gcc, clang: file:line:col: error:
    r"|\(\d+\): (?:catastrophic )?error\b"  # nvcc: file(line): error
    r"|undefined reference to|collect2: error|\bld: |error: ld returned"
)
_PROGRESS = re.compile(r"^\[\d+/\d+\] ")


def first_errors(log: str, limit: int = 3) -> tuple[list[str], int]:
    """The first ``limit`` errors of a build log, each with the source lines the compiler
    printed under it, and how many errors the log has in all.

    >>> first_errors("[1/2] c++ -c a.cpp\\nFAILED: a.o\\na.cpp:3:5: error: 'f' was not "
    ...              "declared\\n    3 |   f();\\n      |   ^\\nninja: build stopped")
    (["a.cpp:3:5: error: 'f' was not declared", '    3 |   f();', '      |   ^'], 1)
    """
    lines = log.splitlines()
    hits = [i for i, line in enumerate(lines) if _ERROR.search(line)]
    out: list[str] = []
    for i in hits[:limit]:
        out.append(lines[i].rstrip())
        for follow in lines[i + 1 : i + 4]:  # the compiler's quote of the source
            if not follow.startswith((" ", "\t")) or _ERROR.search(follow):
                break
            out.append(follow.rstrip())
    if not hits:  # no line looks like an error: the end of the log, without ninja's chatter
        tail = [
            line
            for line in lines
            if line.strip() and not _PROGRESS.match(line) and not line.startswith("ninja:")
        ]
        out = [line[:300] for line in tail[-10:]]
    return out, len(hits)


@contextlib.contextmanager
def _path_with(folder: str | None) -> Iterator[None]:
    """PATH with ``folder`` in front for the duration of the block, then as it was."""
    if folder is None:
        yield
        return
    old = os.environ.get("PATH")
    os.environ["PATH"] = folder + (os.pathsep + old if old else "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def nvcc_unfit(torch_cuda: str, nvcc: Tool) -> str:
    """Why ``nvcc`` cannot build CUDA kernels for a torch built with CUDA ``torch_cuda``
    (``"13.0"``), with the fix; ``""`` when it can. Kernels must be compiled with torch's
    CUDA major version (common images ship nvcc 12.x beside a torch built for 13)."""
    if nvcc.path is None:
        return (
            f"nvcc was not found ({nvcc.detail}); install the CUDA toolkit {torch_cuda} "
            "(torch's) or set CUDA_HOME to it"
        )
    major = torch_cuda.split(".")[0]
    if nvcc.version is not None and nvcc.version.split(".")[0] != major:
        return (
            f"nvcc is CUDA {nvcc.version} ({nvcc.path}) but torch {torch.__version__} was "
            f"built with CUDA {torch_cuda}, and CUDA kernels must be compiled with the same "
            f"major version: install the CUDA {major}.x toolkit and set CUDA_HOME to it, or "
            f"install a torch built for CUDA {nvcc.version.split('.')[0]}.x"
        )
    return nvcc.problem


def _cuda_plan(extra_cuda_cflags: Sequence[str]) -> tuple[list[str] | None, str]:
    """The nvcc flags to build ``.cu`` sources with, or None and why they are left out
    (no CUDA in torch, no nvcc, an nvcc of another CUDA major, no GPU to build for).

    Raises:
        ExtensionError: a GPU here is older than nvcc can target.
    """
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is built without CUDA"
    nvcc = find_nvcc()
    unfit = nvcc_unfit(torch.version.cuda, nvcc)
    if unfit or nvcc.path is None:
        return None, unfit
    user_arch = os.environ.get("TORCH_CUDA_ARCH_LIST") or any(
        "arch" in f for f in extra_cuda_cflags
    )
    if user_arch:
        return [], ""  # the user's choice; torch reads TORCH_CUDA_ARCH_LIST itself
    from anydevice.hardware.backends.cuda import CudaBackend  # what nvcc builds for
    from anydevice.hardware.inventory import inventory

    nvidia = CudaBackend.kind
    caps = [
        d.compute_capability
        for d in inventory(telemetry=False, kinds=(nvidia,)).of_kind(nvidia)
        if d.compute_capability is not None
    ]
    if not caps:
        return None, (
            "no NVIDIA GPU is visible to build for (set TORCH_CUDA_ARCH_LIST, e.g. '9.0', "
            "to build for one that is not here)"
        )
    return arch_flags(caps, _nvcc_archs(nvcc.path)), ""


def _key(
    sources: Sequence[Path],
    cflags: Sequence[str],
    cuda_cflags: Sequence[str] | None,
    compiler: Tool,
) -> str:
    """A hash of everything the built library depends on, apart from included headers
    (ninja tracks those itself inside one build folder).

    The sources' full paths count, not their names alone: torch's ``build.ninja`` compiles
    each source by its path, so two checkouts of one project sharing a folder made ninja
    rebuild at every switch between them, minutes each, with every other process waiting.
    """
    h = hashlib.sha256()
    parts: list[str] = [
        _KEY_VERSION,
        sys.version,
        torch.__version__,
        str(torch.version.cuda),
        str(compiler.path and os.path.realpath(compiler.path)),
        compiler.detail,
        str(compiler.version),
        repr(list(cflags)),
        repr(None if cuda_cflags is None else list(cuda_cflags)),
        os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
    ]
    if cuda_cflags is not None:
        nvcc = find_nvcc()
        parts += [str(nvcc.path), str(nvcc.version)]
    for p in parts:
        h.update(p.encode() + b"\0")
    for src in sources:
        h.update(str(src.resolve()).encode() + b"\0" + src.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _building(folder: Path, name: str) -> Iterator[None]:
    """Hold the build folder for the block: one build at a time across processes, and no
    wait on a killed build's lock.

    torch marks a build in progress with a ``lock`` file and waits, silently and forever,
    for it to go away: a build killed mid-way (Ctrl-C, a timeout, the OOM killer) left
    every later load of the extension hanging. Here each build first takes an advisory
    lock (``flock``) on ``.anydevice.lock``, which the OS releases when its holder dies:
    holding it, a ``lock`` file of torch's can only be a killed build's, and is removed.
    Without ``flock`` (Windows) torch's lock is waited for, as torch does, with a warning.
    """
    stale = folder / "lock"
    try:
        import fcntl
    except ImportError:  # no flock: torch's own waiting, said
        if stale.exists():
            logger.warning(
                "load_extension(%r): waiting for %s: another process is building this "
                "extension. If none is (a build was killed), delete that file.",
                name,
                stale,
            )
        yield
        return
    with open(folder / ".anydevice.lock", "a+b") as held:
        if stale.exists():
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.warning(
                    "load_extension(%r): waiting: another process is building it in %s",
                    name,
                    folder,
                )
                fcntl.flock(held, fcntl.LOCK_EX)
        else:
            fcntl.flock(held, fcntl.LOCK_EX)
        if stale.exists():
            logger.warning(
                "load_extension(%r): removing %s, left by a build that was killed",
                name,
                stale,
            )
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _is_python_module(sources: Sequence[Path]) -> bool:
    """Whether the sources define a Python module (pybind11's, or a ``PyInit_`` function)."""
    return any(
        b"PYBIND11_MODULE" in s.read_bytes() or b"PyInit_" in s.read_bytes() for s in sources
    )


def is_built(
    name: str,
    sources: Sequence[str | os.PathLike[str]],
    *,
    extra_cflags: Sequence[str] = (),
    depends: Sequence[str | os.PathLike[str]] = (),
    build_dir: str | os.PathLike[str] | None = None,
) -> bool:
    """Whether :func:`load_extension` with these C++ sources and flags would load a
    library built before, here or by another process (it then compiles nothing). Asks
    nothing of the compiler beyond what ``load_extension`` does; False where it would
    raise (a source missing, no compiler) and for CUDA sources.

    >>> is_built("no_such_extension", ["/nonexistent/op.cpp"])
    False
    """
    paths = [Path(s).absolute() for s in ([sources] if isinstance(sources, str) else sources)]
    if not paths or any(p.suffix in CUDA_SUFFIXES or not p.is_file() for p in paths):
        return False
    compiler = find_compiler()
    if compiler.path is None:
        return False
    key = _key([*paths, *(Path(d).absolute() for d in depends)], extra_cflags, None, compiler)
    folder = Path(build_dir if build_dir is not None else cache_root()) / f"{name}-{key}"
    return (folder / f"{name}.so").is_file()


def load_extension(
    name: str,
    sources: Sequence[str | os.PathLike[str]],
    *,
    extra_cflags: Sequence[str] = (),
    extra_cuda_cflags: Sequence[str] = (),
    depends: Sequence[str | os.PathLike[str]] = (),
    build_dir: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> ModuleType | str:
    """Build (or reuse) and load a C++/CUDA extension, for the devices that are here.

    Built with torch's ``torch.utils.cpp_extension.load``. ``.cpp`` sources always build;
    ``.cu`` / ``.cuh`` sources only where torch has CUDA, nvcc (``CUDA_HOME`` or on PATH)
    has torch's CUDA major version, and a GPU is visible (or ``TORCH_CUDA_ARCH_LIST`` names
    architectures); otherwise they are left out and one line is logged (logger
    ``anydevice``, level WARNING) saying why. Register the CPU kernel of an operator in the
    ``.cpp`` (``TORCH_LIBRARY``) and its CUDA kernel in the ``.cu``
    (``TORCH_LIBRARY_IMPL(ns, CUDA, m)``), and the same call works on both kinds of machine.

    nvcc builds for the compute capabilities of the GPUs here (read through NVML, without a
    CUDA context), plus PTX for the newest; ``TORCH_CUDA_ARCH_LIST`` or an ``arch`` flag in
    ``extra_cuda_cflags`` overrides that. The build folder is named by a hash of the
    sources, flags, Python, torch, compiler and nvcc versions, under ``build_dir`` (default:
    :func:`cache_root`): loading unchanged sources again, in any process, compiles nothing.
    ninja is the one pip installed beside this Python when there is one (put on PATH for
    the build, so a virtual environment works without being activated), else the one on
    PATH.

    Args:
        name: the extension's name (a Python identifier); the sources see it as
            ``TORCH_EXTENSION_NAME``.
        sources: paths of ``.cpp`` and ``.cu`` files (relative ones from the current
            folder: ``Path(__file__).parent / "op.cpp"`` is safer).
        extra_cflags: flags for the C++ compiler (``["-O3"]``).
        extra_cuda_cflags: flags for nvcc (``["-O3", "--use_fast_math"]``).
        depends: files the sources include (headers, or sources compiled together in one
            file): their contents count in the build folder's name, as the sources' do,
            and a ``PYBIND11_MODULE`` in them makes the result a Python module.
        build_dir: the folder build folders go under (default: the user's cache).
        verbose: print the build's commands and output as it runs.

    Returns:
        The Python module, when the sources define one (``PYBIND11_MODULE`` or a
        ``PyInit_`` function); else the path of the library, which is loaded into the
        process (``torch.ops.load_library``) so its operators are in ``torch.ops``.

    Raises:
        ExtensionError: a source does not exist; no C++ compiler or no ninja; no ``.cpp``
            source and the ``.cu`` ones cannot be built here (no nvcc, an nvcc of another
            CUDA major than torch's, ...); the compiler or linker failed (the message has
            its first errors, ``.log`` the whole output, also written to ``build.log`` in
            the build folder).
    """
    if not name.isidentifier():
        raise ExtensionError(
            f"Extension name {name!r} is not a Python identifier; the sources see it as "
            "TORCH_EXTENSION_NAME. Use letters, digits and '_', e.g. 'my_ops'."
        )
    paths = [Path(s).absolute() for s in ([sources] if isinstance(sources, str) else sources)]
    if not paths:
        raise ExtensionError(f"load_extension({name!r}) was given no sources.")
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise ExtensionError(
            f"Source {str(missing[0])!r} of extension {name!r} does not exist (relative paths "
            f"are taken from the current folder, {os.getcwd()}). Pass existing paths, e.g. "
            f"Path(__file__).parent / {missing[0].name!r}."
        )
    cuda = [p for p in paths if p.suffix in CUDA_SUFFIXES]
    cpp = [p for p in paths if p.suffix not in CUDA_SUFFIXES]
    cuda_flags: list[str] | None = None
    if cuda:
        arch, why = _cuda_plan(extra_cuda_cflags)
        if arch is None:
            if not cpp:
                raise ExtensionError(
                    f"Extension {name!r} has only CUDA sources, and they cannot be built here: "
                    f"{why}. Add a .cpp source with a CPU kernel, or build on a CUDA machine."
                )
            logger.warning(
                "load_extension(%r): leaving out %s: %s; building the C++ sources alone.",
                name,
                ", ".join(p.name for p in cuda),
                why,
            )
        else:
            cuda_flags = [*extra_cuda_cflags, *arch]
    kept = cpp + (cuda if cuda_flags is not None else [])

    compiler = find_compiler()
    if compiler.path is None:
        raise ExtensionError(
            f"No C++ compiler to build extension {name!r}: {compiler.detail}. " + _COMPILER_INSTALL
        )
    ninja = find_ninja()
    if ninja.path is None:
        raise ExtensionError(
            f"ninja is needed to build extension {name!r}, and it is {ninja.detail}. Install "
            "it from PyPI: `pip install ninja` (or `pip install 'anydevice[kernels]'`)."
        )

    key = _key([*kept, *(Path(d).absolute() for d in depends)], extra_cflags, cuda_flags, compiler)
    folder = Path(build_dir if build_dir is not None else cache_root()) / f"{name}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    if verbose:
        logger.warning("load_extension(%r): building in %s", name, folder)
    from torch.utils import cpp_extension

    on_path = None if ninja.detail == "on PATH" else str(Path(ninja.path).parent)
    started = time.perf_counter()
    try:
        with _building(folder, name), _path_with(on_path):
            result = cpp_extension.load(
                name,
                [str(p) for p in kept],
                extra_cflags=list(extra_cflags),
                extra_cuda_cflags=cuda_flags,
                build_directory=str(folder),
                verbose=verbose,
                with_cuda=cuda_flags is not None,
                is_python_module=_is_python_module([*kept, *map(Path, depends)]),
            )
    except RuntimeError as e:
        text = str(e)
        if not text.startswith("Error building extension"):
            raise
        _, _, log = text.partition(": ")
        log_path = folder / "build.log"
        log_path.write_text(log)
        errors, count = first_errors(log)
        more = f" ({count - 3} more below them)" if count > 3 else ""
        shown = "\n".join(f"  {line}" for line in errors) or "  (printed above: verbose=True)"

        raise ExtensionError(
            f"Building extension {name!r} failed ({compiler.detail or compiler.path}); the "
            f"first errors{more}:\n{shown}\nThe whole log: {log_path}. Fix the source and "
            "call again: what compiled is kept.",
            log=log,
        ) from e
    if verbose:
        logger.warning("load_extension(%r): loaded in %.1f s", name, time.perf_counter() - started)
    return result  # type: ignore[no-any-return]  # cpp_extension is untyped
