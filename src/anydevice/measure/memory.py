"""Device memory: what is in use, what a block needed, and giving cached memory back.

* :func:`memory` -> :class:`MemoryStats`: the allocator's counters and the device's free and
  total memory (the process's resident memory and the system's RAM on the CPU).
* :func:`track_memory` -> :class:`MemoryUsage`: the peak and the net change during a block.
* :func:`free_memory`: collect garbage and give cached blocks back to the device.

:func:`~anydevice.measure.batch_size.fit_batch_size`, the largest batch that fits, builds on these.

Reading memory never creates a CUDA context: the allocator's counters are read from torch
(zeros before the process has used the GPU), free and total from NVML. Each device's
readings are in :mod:`anydevice.measure.memory_readings`; an accelerator beyond the named kinds
(``npu``, ...) is read through ``torch.accelerator`` where its backend implements the
allocator API, and is a ``MeasurementError`` saying so where it does not.

>>> m = memory("cpu")
>>> m.allocated > 0 and m.total >= m.free > 0
True
"""

from __future__ import annotations

import contextvars
import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anydevice.errors import MeasurementError
from anydevice.hardware.backends import runtime
from anydevice.hardware.facts import format_bytes
from anydevice.hardware.selection import resolve
from anydevice.hardware.spec import DeviceLike
from anydevice.measure.clocks import active_device, synchronize
from anydevice.measure.memory_history import History
from anydevice.measure.memory_readings import (
    counts_peaks,
    device_free_total,
    empty_cache,
    initialized,
    peak_rss,
    read_counters,
    reset_peak,
    rss,
    system_memory,
)
from anydevice.measure.pinned import read_pinned, release_pinned

__all__ = [
    "MemoryStats",
    "MemoryUsage",
    "free_memory",
    "memory",
    "track_memory",
]

#: ``fragmented`` needs at least this much reserved but unused ...
FRAGMENTED_BYTES = 2**30
#: ... and reserved at least this many times allocated.
FRAGMENTED_RATIO = 2.0


def _is_host(device: torch.device) -> bool:
    """Whether ``device`` is the host, whose memory is the process's resident set."""
    return runtime(device.type).is_host


def _resolve_memory_device(device: DeviceLike | None) -> torch.device:
    dev = active_device() if device is None else resolve(device)
    if not runtime(dev.type).holds_data:
        raise ValueError("the meta device holds no data, so it has no memory to read")
    return dev


# ----------------------------------------------------------------------------- memory()


@dataclass(frozen=True, repr=False)
class MemoryStats:
    """Memory on one device, in bytes; ``None`` where this device cannot tell.

    On an accelerator ``allocated`` is what live tensors hold, ``reserved`` what torch's
    caching allocator holds from the device (allocated plus cached blocks), ``free`` and
    ``total`` are the whole device's (every process). On the CPU ``allocated`` is this
    process's resident memory (RSS), ``peak`` its lifetime high-water mark, ``free`` the
    system's available RAM and ``total`` its RAM (within a cgroup limit, if any).

    >>> s = MemoryStats("cuda:0", allocated=2**30, reserved=6 * 2**30, free=None, total=None)
    >>> s.fragmented, format_bytes(s.cached)
    (True, '5.0 GiB')
    """

    device: str
    allocated: int | None
    reserved: int | None = None
    peak: int | None = None  #: most ``allocated`` since the peak counter was last reset
    peak_reserved: int | None = None
    free: int | None = None
    total: int | None = None
    alloc_retries: int | None = None  #: allocations that needed the cache flushed first
    ooms: int | None = None  #: out-of-memory errors the allocator raised
    pinned: int | None = None  #: pinned host bytes torch's host allocator holds (in use + cached)
    pinned_active: int | None = None  #: of those, bytes in use
    notes: tuple[str, ...] = field(default=())  #: how the numbers were read, what is unknown

    @property
    def cached(self) -> int | None:
        """Reserved but not allocated: blocks the allocator keeps for reuse."""
        if self.reserved is None or self.allocated is None:
            return None
        return max(0, self.reserved - self.allocated)

    @property
    def other(self) -> int | None:
        """Device memory used outside this process's allocator: the CUDA context, other
        libraries, other processes. None on the CPU and when free/total are unknown."""
        if self.total is None or self.free is None or self.reserved is None:
            return None
        return max(0, self.total - self.free - self.reserved)

    @property
    def fragmented(self) -> bool:
        """Reserved is much larger than allocated (>= 2x, and >= 1 GiB unused)."""
        cached = self.cached
        if cached is None or self.reserved is None or self.allocated is None:
            return False
        return cached >= FRAGMENTED_BYTES and self.reserved >= FRAGMENTED_RATIO * self.allocated

    def to_dict(self) -> dict[str, Any]:
        """Plain types for JSON, bytes throughout."""
        return {
            "device": self.device,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "peak": self.peak,
            "peak_reserved": self.peak_reserved,
            "free": self.free,
            "total": self.total,
            "cached": self.cached,
            "other": self.other,
            "alloc_retries": self.alloc_retries,
            "ooms": self.ooms,
            "pinned": self.pinned,
            "pinned_active": self.pinned_active,
            "fragmented": self.fragmented,
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        b = format_bytes
        if _is_host(torch.device(self.device)):
            head = (
                f"process {b(self.allocated)} resident, peak {b(self.peak)}; "
                f"system {b(self.free)} available of {b(self.total)}"
            )
        else:
            head = f"{b(self.allocated)} allocated, {b(self.reserved)} reserved"
            if self.peak is not None:
                head += f", peak {b(self.peak)}"
            head += f"; device {b(self.free)} free of {b(self.total)}"
            if self.other:
                head += f" ({b(self.other)} used outside this process's allocator)"
        if self.pinned:
            head += f"; pinned host {b(self.pinned)}"
            if self.pinned_active is not None:
                head += f" ({b(self.pinned_active)} in use)"
        lines = [f"MemoryStats({self.device}: {head})"]
        if self.fragmented:
            ratio = (self.reserved or 0) / max(self.allocated or 0, 1)
            lines.append(
                f"  WARNING: reserved is {ratio:.1f}x allocated: {b(self.cached)} is cached "
                "by the allocator but not in use (a cache or fragmentation). Other processes "
                "cannot use it; ad.free_memory() gives it back, and "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces fragmentation."
            )
        if self.alloc_retries:
            lines.append(
                f"  note: {self.alloc_retries} allocation(s) needed the cache flushed and "
                "retried: the device was close to full."
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def memory(device: DeviceLike | None = "auto") -> MemoryStats:
    """Memory on ``device`` now: this process's allocator counters, and the device's free/total.

    Never creates a CUDA context. Free and total GPU memory come from NVML; without NVML
    they are read from CUDA only when this process already has a context on that device,
    and are None otherwise (asking CUDA would create one, ~500 MB, just to look).

    >>> s = memory("cpu")
    >>> s.device, s.peak >= s.allocated > 0
    ('cpu', True)

    Args:
        device: any device spec (``"auto"``: the device ``ad.device()`` picks); None:
            the accelerator this process is using, else the CPU.

    Returns:
        A :class:`MemoryStats`.

    Raises:
        DeviceNotFoundError: no such device here.
    """
    dev = _resolve_memory_device(device)
    c = read_counters(dev)
    notes: list[str] = []
    free: int | None
    total: int | None
    if _is_host(dev):
        free, total = system_memory()
        notes.append("allocated is the resident set size; peak the process's lifetime maximum")
    else:
        free, total, more = device_free_total(dev)
        notes += more
        if not initialized(dev):
            notes.append(f"this process has not used {dev.type} yet: its counters are zero")
        if not counts_peaks(dev):
            notes.append(f"{dev.type} keeps no peak counter; track_memory() samples it")
    return MemoryStats(
        device=str(dev),
        allocated=c.allocated,
        reserved=c.reserved,
        peak=c.peak,
        peak_reserved=c.peak_reserved,
        free=free,
        total=total,
        alloc_retries=c.retries,
        ooms=c.ooms,
        notes=tuple(notes),
        **_pinned_fields(),
    )


def _pinned_fields() -> dict[str, int | None]:
    pinned = read_pinned()
    if pinned is None:
        return {}
    return {"pinned": pinned.held, "pinned_active": pinned.active}


# ----------------------------------------------------------------------------- track_memory


class MemoryUsage:
    """What a :func:`track_memory` block used; the numbers are filled in when it ends.

    ``peak`` is the most memory in use during the block (allocated bytes on an accelerator,
    resident bytes on the CPU), ``net`` what the block left behind, ``peak_increase`` how
    much more than at its start it needed. ``exact`` says whether the peak was read from a
    counter (True) or sampled (False: a lower bound).
    """

    def __init__(self, device: torch.device, start: int, method: str) -> None:
        self.device = device
        self.start = start  #: bytes in use when the block began
        self.method = method  #: how the peak was read, for people
        self._end: int | None = None
        self._peak: int | None = None
        self.exact = False
        self._inner_peak = 0  # reported by blocks nested in this one
        self.snapshot: Path | None = None  #: the allocator history written, with snapshot=

    def _get(self, value: int | None, name: str) -> int:
        if value is None:
            raise MeasurementError(f"MemoryUsage.{name}: the track_memory block has not ended yet.")
        return value

    @property
    def end(self) -> int:
        """Bytes in use when the block ended."""
        return self._get(self._end, "end")

    @property
    def peak(self) -> int:
        """Most bytes in use at any time during the block."""
        return self._get(self._peak, "peak")

    @property
    def net(self) -> int:
        """``end - start``: what the block left allocated (negative when it freed)."""
        return self.end - self.start

    @property
    def peak_increase(self) -> int:
        """``peak - start``: how much more than at its start the block needed."""
        return self.peak - self.start

    def __repr__(self) -> str:
        if self._peak is None:
            return f"MemoryUsage({self.device}: running)"
        sign = "+" if self.net >= 0 else "-"
        return (
            f"MemoryUsage({self.device}: peak {format_bytes(self.peak)} "
            f"(+{format_bytes(self.peak_increase)} over the start), net {sign}"
            f"{format_bytes(abs(self.net))}; {self.method})"
        )


#: The track_memory blocks open in this context, innermost last. A block that resets the
#: allocator's peak counter reports the peak it saw to the blocks around it on exit, so
#: nesting never loses an enclosing block's peak.
_open: contextvars.ContextVar[tuple[MemoryUsage, ...]] = contextvars.ContextVar(
    "anydevice_open_trackers", default=()
)


@contextmanager
def track_memory(
    device: DeviceLike | None = None,
    *,
    interval: float = 0.001,
    snapshot: str | os.PathLike[str] | None = None,
) -> Iterator[MemoryUsage]:
    """Track the peak and the net change of memory during a block.

    **CUDA, XPU and other accelerators with allocator counters** (read through
    ``torch.accelerator``): the caching allocator's peak counter is reset on entry and
    read on exit, so the peak is exact. torch can reset that counter but not set it, so after the
    block ``torch.cuda.max_memory_allocated()`` counts from the block's start; enclosing
    ``track_memory`` blocks are not affected (an inner block reports its peak, and the
    peak before it, to them), so their peak stays the maximum over their whole block.

    **CPU** (and MPS, which has no peak counter): a background thread samples the resident
    memory every ``interval`` seconds, and on exit the kernel's high-water mark
    (``getrusage``'s ``ru_maxrss``) is compared with its value on entry. If the block
    raised it, the block reached it: the peak is exact. Otherwise the sampled maximum is a
    lower bound that misses spikes shorter than the interval (about 5 ms while Python code
    holds the GIL). Resident memory also includes what the allocator keeps after tensors
    are freed, so ``net`` can stay positive after a block that freed everything.

    >>> import torch
    >>> with track_memory("cpu") as m:
    ...     x = torch.ones(2**24)  # 64 MiB
    ...     del x
    >>> m.peak >= m.start
    True

    **snapshot** (CUDA): torch's allocator records every allocation and free of the block,
    with its Python stack, and on exit (also after an error) the history is written to
    ``snapshot`` (open it in https://pytorch.org/memory_viz) and, beside it, an ``.html``
    timeline of the same data (:mod:`anydevice.measure.memory_history`). Recording is process-wide
    and off after the block. Other devices keep no history: ``MeasurementError``.

    Args:
        device: any device spec; None: the accelerator this process is using, else the CPU.
        interval: seconds between samples where the peak is sampled.
        snapshot: where to write the allocator history of the block (CUDA only).

    Yields:
        A :class:`MemoryUsage`, filled in when the block ends.
    """
    if not interval > 0:
        raise ValueError(f"interval must be > 0 seconds, not {interval}")
    dev = _resolve_memory_device(device)
    history = None if snapshot is None else History(dev, snapshot)  # refuses before anything
    counted = counts_peaks(dev)
    if counted:
        before = read_counters(dev)
        usage = MemoryUsage(dev, before.allocated, "read from the allocator's peak counter")
        previous_peak = before.peak or 0
        reset_peak(dev)
        sampler = None
    else:
        current = _Reader(dev)
        usage = MemoryUsage(dev, current(), "")
        previous_peak = 0
        high_water = peak_rss() if _is_host(dev) else None
        sampler = _Sampler(current, interval)
    token = _open.set((*_open.get(), usage))
    if history is not None:
        history.start()
    try:
        yield usage
    finally:
        _open.reset(token)
        if history is not None:
            usage.snapshot = history.stop()
        if sampler is None:
            after = read_counters(dev)
            usage._end = after.allocated
            usage._peak = max(after.peak or 0, usage._inner_peak, usage.start, after.allocated)
            usage.exact = True
            report = max(usage._peak, previous_peak)
        else:
            sampled = sampler.stop()
            usage._end = current()
            current.close()
            new_high = peak_rss() if _is_host(dev) else None
            if high_water is not None and new_high is not None and new_high > high_water:
                usage._peak, usage.exact = new_high, True
                usage.method = "exact: the block set the process's high-water mark"
            else:
                usage._peak = max(sampled, usage._inner_peak, usage.start, usage._end)
                usage.method = f"sampled every {interval * 1000:g} ms (a lower bound)"
            report = usage._peak
        for outer in _open.get():
            if outer.device == dev:
                outer._inner_peak = max(outer._inner_peak, report)


class _Reader:
    """Bytes in use now, cheap enough to sample every millisecond: on Linux the CPU's comes
    from one open ``/proc/self/statm`` (2 µs a read, against 15 µs through psutil)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._fd: int | None = None
        if _is_host(device) and sys.platform.startswith("linux"):
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
            self._page = os.sysconf("SC_PAGE_SIZE")

    def __call__(self) -> int:
        if self._fd is not None:
            return int(os.pread(self._fd, 64, 0).split()[1]) * self._page
        if _is_host(self.device):
            return rss()
        return read_counters(self.device).allocated

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _Sampler:
    """A daemon thread that keeps the largest value ``read()`` returns until stopped."""

    def __init__(self, read: Callable[[], int], interval: float) -> None:
        self.read = read
        self.interval = interval
        self.peak = read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="anydevice-memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.read())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.read())


# ----------------------------------------------------------------------------- free_memory


def free_memory(device: DeviceLike | None = None) -> int:
    """Collect garbage and give the allocator's cached blocks back; return the bytes released.

    Accelerators: ``gc.collect()``, then the device's ``empty_cache()``; the bytes are the
    drop in reserved memory. CPU: ``gc.collect()``, then glibc's ``malloc_trim(0)`` (which
    returns freed heap pages to the system); the bytes are the drop in resident memory.
    Either way, cached pinned host memory is released too (:mod:`anydevice.measure.pinned`), and
    counted on an accelerator (on the CPU it is part of the resident memory).

    >>> free_memory("cpu") >= 0
    True

    Args:
        device: any device spec; None: the accelerator this process is using, else the CPU.

    Returns:
        Bytes given back (0 when nothing was).
    """
    dev = _resolve_memory_device(device)
    held = _held_reader(dev)
    before = held()
    gc.collect()
    synchronize(dev)  # blocks still in use by queued work are not released
    empty_cache(dev)
    pinned = release_pinned()
    return max(0, before - held()) + (0 if _is_host(dev) else pinned)


def _held_reader(device: torch.device) -> Callable[[], int]:
    """What giving memory back lowers: resident memory (CPU), reserved memory (others)."""
    if _is_host(device):
        return rss

    def held() -> int:
        c = read_counters(device)
        return c.reserved if c.reserved is not None else c.allocated

    return held
