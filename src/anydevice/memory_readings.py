"""How each device's memory is read, and how its cache is given back.

:mod:`anydevice.memory` builds :func:`~anydevice.memory`, ``track_memory`` and
``free_memory`` on these readings: the allocator's counters of CUDA and XPU, MPS's two
numbers, torch_xla's memory info, any other accelerator's through ``torch.accelerator``
(where its backend implements the allocator API), and the CPU's resident set.

>>> read(torch.device("cpu")).allocated > 0
True
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from anydevice.errors import MeasurementError

__all__ = [
    "Counters",
    "device_free_total",
    "empty_cache",
    "initialized",
    "is_generic",
    "peak_rss",
    "read",
    "reset_peak",
    "rss",
    "system_memory",
]


@dataclass(frozen=True)
class Counters:
    """One reading of a device's counters, in bytes."""

    allocated: int
    reserved: int | None = None
    peak: int | None = None
    peak_reserved: int | None = None
    retries: int | None = None
    ooms: int | None = None


def _caching_allocator(module: Any) -> Callable[[torch.device], Counters]:
    """torch.cuda and torch.xpu share the caching allocator and its counters' names."""

    def read(device: torch.device) -> Counters:
        s = module.memory_stats(device)  # {} before the process used the device: no init
        return Counters(
            allocated=int(s.get("allocated_bytes.all.current", 0)),
            reserved=int(s.get("reserved_bytes.all.current", 0)),
            peak=int(s.get("allocated_bytes.all.peak", 0)),
            peak_reserved=int(s.get("reserved_bytes.all.peak", 0)),
            retries=s.get("num_alloc_retries"),
            ooms=s.get("num_ooms"),
        )

    return read


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


def _cpu(device: torch.device) -> Counters:
    now = rss()
    # The kernel's per-thread RSS counters are synced lazily, so the high-water mark can
    # trail the current reading by a few pages.
    return Counters(allocated=now, peak=max(now, peak_rss() or 0))


def _mps(device: torch.device) -> Counters:
    return Counters(
        allocated=int(torch.mps.current_allocated_memory()),
        reserved=int(torch.mps.driver_allocated_memory()),
    )


def _xla(device: torch.device) -> Counters:
    import torch_xla.core.xla_model as xm

    try:
        info = xm.get_memory_info(device)
    except RuntimeError as e:  # the CPU PJRT client: "GetAllocatorStats is not supported"
        raise MeasurementError(
            f"cannot read memory on {device}: torch_xla's {_pjrt_type()} runtime keeps no "
            f"allocator statistics ({str(e).strip().splitlines()[-1][:200]}). On a TPU it "
            "does; ad.timeit and ad.DeviceLoader work without them."
        ) from e
    used = info.get("bytes_used", 1024 * (info.get("kb_total", 0) - info.get("kb_free", 0)))
    peak = info.get("peak_bytes_used")
    return Counters(allocated=int(used), peak=None if peak is None else int(peak))


def _pjrt_type() -> str:
    import torch_xla.runtime as xr

    try:
        return str(xr.device_type())
    except RuntimeError:
        return "PJRT"


@functools.cache  # the same modules for the whole process: built once, not per reading
def _readers() -> dict[str, Callable[[torch.device], Counters]]:
    return {
        "cuda": _caching_allocator(torch.cuda),
        "xpu": _caching_allocator(getattr(torch, "xpu", None)),
        "mps": _mps,
        "cpu": _cpu,
        "xla": _xla,
    }


def read(device: torch.device) -> Counters:
    """The counters of ``device`` now; ``MeasurementError`` where they cannot be read."""
    reader = _readers().get(device.type)
    if reader is not None:
        return reader(device)
    if is_generic(device):
        return _generic(device)
    from anydevice.backends.generic import kinds

    known = ", ".join(("cpu", "cuda", "mps", "xpu", "xla", *kinds()))
    raise MeasurementError(
        f"cannot read memory on {device}: torch knows no {device.type!r} accelerator in this "
        f"process (memory is read on {known})."
    )


def is_generic(device: torch.device) -> bool:
    """Whether ``device`` is an accelerator torch knows beyond the named kinds (``npu``)."""
    from anydevice.backends.generic import kinds

    return device.type not in _readers() and device.type in kinds()


#: What a backend raises for an allocator call it does not implement.
_UNSUPPORTED = (RuntimeError, NotImplementedError, AttributeError)


def _allocator_modules(device: torch.device) -> list[Any]:
    """Where a generic accelerator's allocator API lives: its device module, then
    ``torch.accelerator`` (which speaks for torch's current accelerator only)."""
    from anydevice.backends.generic import _current_type, module

    found = [m for m in (module(device.type),) if m is not None]
    if _current_type(torch) == device.type:
        found.append(torch.accelerator)
    return found


def _generic(device: torch.device) -> Counters:
    """The caching-allocator counters (CUDA's names) of any other accelerator, where its
    backend implements ``memory_stats``; a clear error where it does not."""
    reasons = []
    for source in _allocator_modules(device):
        stats = getattr(source, "memory_stats", None)
        if stats is None:
            continue
        try:
            return _caching_allocator(source)(device)
        except _UNSUPPORTED as e:
            reasons.append(str(e).strip().splitlines()[-1][:200])
    why = f" ({reasons[0]})" if reasons else ""
    raise MeasurementError(
        f"cannot read memory on {device}: torch's {device.type} backend keeps no allocator "
        f"statistics{why}. Its free and total memory, where the backend reports them, are "
        "in ad.inventory(); ad.timeit and ad.DeviceLoader work without them."
    )


def reset_peak(device: torch.device) -> None:
    """Restart the allocator's peak counter of ``device`` (CUDA, XPU, or a generic
    accelerator whose backend has one); nothing before the device is in use."""
    if device.type in ("cuda", "xpu"):
        if initialized(device):
            getattr(torch, device.type).reset_peak_memory_stats(device)
        return
    for source in _allocator_modules(device):
        reset = getattr(source, "reset_peak_memory_stats", None)
        if reset is not None:
            reset(device)
            return


def initialized(device: torch.device) -> bool:
    module = getattr(torch, device.type, None)
    return bool(module is not None and module.is_initialized())


def system_memory() -> tuple[int, int]:
    from anydevice.backends import get

    cpu = get("cpu").probe(telemetry=False).devices[0]
    return int(cpu.memory_free or 0), int(cpu.memory_total or 0)


def device_free_total(device: torch.device) -> tuple[int | None, int | None, list[str]]:
    from anydevice.backends import get

    probe = get(device.type).probe(telemetry=False)
    index = device.index if device.index is not None else 0
    info = next((d for d in probe.devices if d.kind == device.type and d.index == index), None)
    free = None if info is None else info.memory_free
    total = None if info is None else info.memory_total
    if free is not None or device.type != "cuda":
        return free, total, []
    from anydevice.backends.cuda import has_primary_context

    if has_primary_context(index):
        free, total = (int(v) for v in torch.cuda.mem_get_info(index))
        return free, total, ["free and total read from CUDA (NVML unavailable)"]
    return (
        None,
        total,
        [
            f"free memory unknown: NVML is unavailable, and asking CUDA would create a context "
            f"(~500 MB) on cuda:{index}; it is read once this process uses the device"
        ],
    )


def empty_cache(device: torch.device) -> None:
    if device.type == "cpu":
        trim = _malloc_trim()
        if trim is not None:
            trim(0)
    elif device.type in ("cuda", "xpu", "mps"):
        getattr(torch, device.type).empty_cache()  # each is a no-op before first use
    elif is_generic(device):
        for source in _allocator_modules(device):
            try:
                source.empty_cache()
                return
            except _UNSUPPORTED:  # no cache to give back through this module
                continue


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
