"""The CPU, and the host facts every inventory carries (OS, cores, cgroup limits, RAM).

What cannot change while the process runs (the CPU's model and flags, its physical core
count, the OS and Python) is read once per process (:func:`_fixed_facts`). What can is
read on every probe: memory, the cgroup's CPU quota and memory limit (a container's
limits can be changed while it runs, ``docker update``), the CPUs this process may run on
(``taskset``), torch's thread count, and the telemetry.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from anydevice.hardware import torchbuild
from anydevice.hardware.backends import build_label
from anydevice.hardware.backends.base import Backend, Counters, Probe
from anydevice.hardware.backends.kind import Kind, PrecisionPolicy, who
from anydevice.hardware.facts import DeviceInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "CpuBackend",
    "busy_seconds",
    "cgroup_cpu_quota",
    "cgroup_memory_limit",
    "core_ids",
    "torch_build",
    "usable_cores",
]

_CGROUP = Path("/sys/fs/cgroup")


def _precision(info: DeviceInfo) -> PrecisionPolicy:
    fp16 = "fp16 on a CPU is for checking fp16 code paths (scaling, skipped steps), not speed"
    if info.bf16:
        why = (
            f"{who(info)} has native bf16 (AVX512-BF16, AMX or Arm BF16): autocast runs "
            "matmuls and convolutions in bf16, no gradient scaling"
        )
        return PrecisionPolicy("bf16", why, caveats={"fp16": fp16})
    known = "has no" if info.bf16 is False else "may lack (unknown)"
    why = f"{who(info)} {known} native bf16 (AVX512-BF16, AMX or Arm BF16), so fp32"
    bf16 = "emulated on this CPU, slower than fp32: useful to check bf16 numerics"
    return PrecisionPolicy("fp32", why, caveats={"bf16": bf16, "fp16": fp16})


class CpuBackend(Backend):
    facts = Kind(
        "cpu",
        indexed=False,  # one host
        host=True,
        collective="gloo",
        autocast=True,
        math="mkldnn",  # oneDNN: bf16, or TF32 on some CPUs
        precision=_precision,
    )
    label = "CPU"

    is_host = True
    always_probed = True

    def channels_last_pays(self, info: DeviceInfo) -> tuple[bool, str]:
        return True, f"{info.spec} ({info.name}): oneDNN convolutions are fastest in NHWC"

    counts_peaks = False  # the process's high-water mark cannot be restarted: sampled

    def in_use(self) -> list[torch.device]:
        return []  # the host runs each op before it returns: nothing is queued

    def memory(self, device: torch.device) -> Counters:
        """The process's resident set, and its lifetime high-water mark."""
        now = rss()
        # The kernel's per-thread RSS counters are synced lazily, so the high-water mark
        # can trail the current reading by a few pages.
        return Counters(allocated=now, peak=max(now, peak_rss() or 0))

    def reset_peak(self, device: torch.device) -> None:
        return None

    def empty_cache(self, device: torch.device) -> None:
        """Give freed heap pages back to the system (glibc's ``malloc_trim``)."""
        trim = _malloc_trim()
        if trim is not None:
            trim(0)

    def free_total(self, device: torch.device) -> tuple[int | None, int | None, list[str]]:
        cpu = self.probe(telemetry=False).devices[0]
        return int(cpu.memory_free or 0), int(cpu.memory_total or 0), []

    def synchronize(self, device: torch.device) -> None:
        return None

    def cache_bytes(self, device: torch.device) -> int:
        """The largest cache in ``/sys/devices/system/cpu/cpu0/cache``; 0 where unread."""
        caches = Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")
        return max((_cache_size(p) for p in caches), default=0)

    def probe(self, *, telemetry: bool = True) -> Probe:
        import torch

        facts = {
            "torch": str(torch.__version__),
            "torch_build": torch_build(),
            "torch_threads": torch.get_num_threads(),
            "cuda_runtime": torch.version.cuda,
        }
        return self._probe(telemetry, facts, ())

    def probe_without_torch(self, *, telemetry: bool = True) -> Probe:
        """The host and the CPU; torch's version and build read from its files. torch's
        thread count is known only once torch is imported (``None`` until then)."""
        if "torch" in sys.modules:
            return self.probe(telemetry=telemetry)
        build = torchbuild.read()
        facts = {
            "torch": build.version if build else "not installed",
            "torch_build": build_label(build) if build else "none",
            "torch_threads": None,
            "cuda_runtime": build.toolkit("cuda") if build else None,
        }
        note = "torch was not imported: its thread count is not probed (anydevice info --torch)."
        return self._probe(telemetry, facts, (note,))

    def _probe(self, telemetry: bool, torch_facts: dict[str, Any], notes: tuple[str, ...]) -> Probe:
        import psutil  # light, but only needed when someone looks

        fixed = _fixed_facts()
        vm = psutil.virtual_memory()
        limit = cgroup_memory_limit()
        total = min(vm.total, limit) if limit else vm.total
        available = min(vm.available, total)
        quota = cgroup_cpu_quota()
        usable = _usable_cores(fixed.cores_logical, quota)
        utilization = temperature = None
        if telemetry:
            utilization = psutil.cpu_percent(interval=0.05)
            temperature = _cpu_temperature(psutil)
        device = DeviceInfo(
            kind="cpu",
            index=None,
            name=fixed.model,
            memory_total=total,
            memory_free=available,
            memory_used=total - available,
            bf16=fixed.bf16,
            tf32=False,
            utilization=utilization,
            temperature=temperature,
        )
        host: dict[str, Any] = {
            "hostname": platform.node(),
            "os": fixed.os,
            "python": fixed.python,
            **torch_facts,
            "cpu_model": fixed.model,
            "cores_logical": fixed.cores_logical,
            "cores_physical": fixed.cores_physical,
            "cores_usable": usable,
            "cpu_quota": quota,
            "memory_total": total,
            "memory_available": available,
            "memory_limit": limit,
        }
        return Probe(devices=(device,), host=host, notes=notes)


class _Fixed(NamedTuple):
    """The host facts that stay as they are while the process runs."""

    model: str
    bf16: bool | None
    cores_logical: int
    cores_physical: int | None
    os: str
    python: str


@functools.cache
def _fixed_facts() -> _Fixed:
    """The CPU's model, native bf16, core counts, the OS and Python: read once per process
    (``/proc/cpuinfo`` and the CPU topology files are read on the first call only)."""
    import psutil

    return _Fixed(
        model=cpu_model(),
        bf16=_native_bf16(_cpu_flags()),
        cores_logical=os.cpu_count() or 1,
        cores_physical=psutil.cpu_count(logical=False),
        os=platform.platform(),
        python=f"{platform.python_implementation()} {platform.python_version()}",
    )


def torch_build() -> str:
    """What this torch was built for: ``"CUDA 12.8"``, ``"ROCm 6.2"``, ``"MPS"``, ``"CPU"``.

    >>> torch_build() in ("CPU", "MPS") or torch_build().startswith(("CUDA", "ROCm", "XPU"))
    True
    """
    import torch

    build = torchbuild.read()
    label = build_label(build) if build is not None else CpuBackend.label
    if label == CpuBackend.label and torch.backends.mps.is_built():
        return "MPS"
    return label


def usable_cores() -> int:
    """Cores this process may use: its affinity, capped by its cgroup's CPU quota.

    >>> usable_cores() >= 1
    True
    """
    return _usable_cores(os.cpu_count() or 1, cgroup_cpu_quota())


def core_ids() -> list[int]:
    """The cores this process may run on (its affinity; every core where the OS has none).

    >>> len(core_ids()) >= 1
    True
    """
    try:
        ids = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        ids = []
    return ids or list(range(os.cpu_count() or 1))


def busy_seconds(cores: Sequence[int]) -> float:
    """CPU seconds every process together has spent on ``cores`` (since boot): two readings
    apart, over the wall time between them, are the cores kept busy meanwhile.

    >>> busy_seconds(core_ids()) > 0.0
    True
    """
    import psutil  # light, but only needed when someone looks

    per_cpu = psutil.cpu_times(percpu=True)
    busy = 0.0
    for i in cores:
        if i < len(per_cpu):
            t = per_cpu[i]
            busy += sum(t) - t.idle - getattr(t, "iowait", 0.0)
    return busy


def _usable_cores(logical: int, quota: float | None) -> int:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        usable = logical
    if quota is not None:
        usable = min(usable, max(1, math.ceil(quota)))
    return usable


def cgroup_cpu_quota(root: Path = _CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in cores (``2.5``), or None when unlimited.

    Reads cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``.
    """
    for base in _cgroup_dirs(root, "cpu"):
        v2 = base / "cpu.max"
        if v2.is_file():
            fields = v2.read_text().split()
            if len(fields) == 2 and fields[0] != "max":
                return int(fields[0]) / int(fields[1])
            return None
        q, p = base / "cpu.cfs_quota_us", base / "cpu.cfs_period_us"
        if q.is_file() and p.is_file():
            quota = int(q.read_text())
            return None if quota <= 0 else quota / int(p.read_text())
    return None


def cgroup_memory_limit(root: Path = _CGROUP) -> int | None:
    """The memory limit of this process's cgroup in bytes, or None when unlimited."""
    for base in _cgroup_dirs(root, "memory"):
        for name in ("memory.max", "memory.limit_in_bytes"):
            f = base / name
            if f.is_file():
                text = f.read_text().strip()
                if text == "max":
                    return None
                value = int(text)
                # cgroup v1 reports "unlimited" as a huge page-aligned number.
                return None if value >= 2**60 else value
    return None


def _cgroup_dirs(root: Path, controller: str) -> list[Path]:
    """This process's cgroup directories for ``controller``, most specific first."""
    dirs: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return dirs
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" or controller in controllers.split(","):
            base = root if controllers == "" else root / controller
            if not base.is_dir() and controllers:
                base = root / controllers
            dirs.append(base / path.lstrip("/"))
            dirs.append(base)
    return dirs


def cpu_model() -> str:
    """The CPU's marketing name, as the OS reports it."""
    if sys.platform.startswith("linux"):
        try:
            info = Path("/proc/cpuinfo").read_text()
        except OSError:
            info = ""
        for key in ("model name", "Hardware", "Model", "cpu model"):
            for line in info.splitlines():
                if line.startswith(key) and ":" in line:
                    return line.split(":", 1)[1].strip()
    elif sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=2,
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _cpu_flags() -> frozenset[str]:
    if not sys.platform.startswith("linux"):
        return frozenset()
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in info.splitlines():
        if line.startswith(("flags", "Features")) and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _native_bf16(flags: frozenset[str]) -> bool | None:
    """Native bf16 arithmetic: AVX512-BF16 or AMX on x86, the BF16 extension on Arm."""
    if flags:
        return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    if sys.platform == "darwin" and platform.machine() == "arm64":
        # Apple M2 and later implement FEAT_BF16; M1 does not.
        try:
            out = subprocess.run(
                ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"],
                capture_output=True,
                text=True,
                timeout=2,
            )
            return out.stdout.strip() == "1"
        except (OSError, subprocess.SubprocessError):
            return None
    return None


def _cpu_temperature(psutil: Any) -> float | None:
    reader = getattr(psutil, "sensors_temperatures", None)
    if reader is None:
        return None
    try:
        sensors = reader()
    except (OSError, RuntimeError):
        return None
    for chip in ("coretemp", "k10temp", "zenpower", "cpu_thermal", "acpitz"):
        if sensors.get(chip):
            return float(sensors[chip][0].current)
    return None


def _cache_size(index_dir: Path) -> int:
    try:
        text = (index_dir / "size").read_text().strip().upper()
    except OSError:
        return 0
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    digits = text.rstrip("KMG")
    return int(digits) * scale if digits.isdigit() else 0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # musl and others: nothing to trim with
        return None
    trim = getattr(libc, "malloc_trim", None)
    return None if trim is None else lambda pad: int(trim(ctypes.c_size_t(pad)))


def rss() -> int:
    """This process's resident bytes (``/proc/self/statm`` on Linux, psutil elsewhere)."""
    if sys.platform.startswith("linux"):
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss() -> int | None:
    """The process's lifetime high-water mark of resident memory, kept by the kernel.

    On Linux it is ``VmHWM`` of ``/proc/self/status``: the mark of this process's own
    address space. ``getrusage``'s ``ru_maxrss`` survives ``execve``, so a process started
    from a large parent (a test runner, a notebook) would read the parent's size there.
    """
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        return getattr(psutil.Process().memory_info(), "peak_wset", None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes / KiB
