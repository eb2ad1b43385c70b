"""Device clocks: waiting for a device (:func:`synchronize`), which device is in use, and
the two clocks :func:`~anydevice.measure.timing.timeit` reads: CUDA events, or a host clock with the
device synchronised around each sample. Also the cache flush for cold-cache timings.

>>> synchronize(torch.device("cpu"))  # nothing to wait for on the CPU
>>> active_device().type in ("cpu", "cuda", "mps", "xpu")
True
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch

from anydevice.hardware.backends import get as get_backend, probe_order, runtime

__all__ = [
    "FALLBACK_FLUSH_BYTES",
    "active_device",
    "clock_for",
    "device_of_arguments",
    "flush_bytes",
    "flusher",
    "in_use",
    "synchronize",
]

#: Bytes zeroed to flush a cache when its size cannot be read (triton's choice).
FALLBACK_FLUSH_BYTES = 256 * 2**20


def synchronize(device: torch.device | None = None) -> None:
    """Wait until the work queued on ``device`` is done; nothing to wait for on the CPU.

    ``None`` waits for every accelerator this process has started using: on CUDA, every
    GPU this process has a context on, not only the current one, so model-parallel and
    ``DataParallel`` work is inside the wait. A device the process has not used yet has
    nothing queued: no context is created to wait (on CUDA asked per GPU, so waiting for
    ``cuda:1`` in a process that used only ``cuda:0`` creates no context on GPU 1). Each
    device's backend waits (:meth:`anydevice.hardware.backends.Backend.synchronize`).

    >>> synchronize(torch.device("cpu"))
    """
    if device is None:
        for d in in_use():
            synchronize(d)
        return
    runtime(device.type).synchronize(device)


def in_use() -> list[torch.device]:
    """Every accelerator device this process may have queued work on, each kind's backend
    asked in turn (CUDA: each GPU with a context, the current one first; MPS: the one
    device; others: the current device once initialised). Asking initialises nothing.
    """
    found: list[torch.device] = []
    for kind in probe_order():
        found += get_backend(kind).in_use()
    return found


def active_device() -> torch.device:
    """The accelerator this process is already using, else the CPU.

    Used when no device is given: a function that runs on a GPU has initialised it by the
    time it has been called once, and looking creates no CUDA context.

    >>> active_device().type in ("cpu", "cuda", "mps", "xpu")
    True
    """
    found = in_use()
    return found[0] if found else torch.device("cpu")


def device_of_arguments(values: Iterator[object], depth: int = 0) -> torch.device | None:
    """The device of the first tensor (or module parameter) among ``values``."""
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
        if isinstance(v, torch.nn.Module):
            p = next(v.parameters(), None)
            if p is not None:
                return p.device
        elif depth < 2 and isinstance(v, (list, tuple)):
            found = device_of_arguments(iter(v), depth + 1)
            if found is not None:
                return found
        elif depth < 2 and isinstance(v, Mapping):
            found = device_of_arguments(iter(v.values()), depth + 1)
            if found is not None:
                return found
    return None


class _Clock(Protocol):
    name: str

    def measure(self, fn: Callable[[], object], number: int) -> float: ...

    def run(
        self, fn: Callable[[], object], number: int, repeat: int, flush: Callable[[], None] | None
    ) -> list[float]: ...


class _HostClock:
    """A host clock with the device synchronised before and after every sample."""

    def __init__(self, device: torch.device, now: Callable[[], float], name: str) -> None:
        self.device = device
        self.now = now
        self.name = name

    def measure(self, fn: Callable[[], object], number: int) -> float:
        synchronize(self.device)
        t0 = self.now()
        for _ in itertools.repeat(None, number):  # no int per call, as timeit does
            fn()
        synchronize(self.device)
        return self.now() - t0

    def run(
        self, fn: Callable[[], object], number: int, repeat: int, flush: Callable[[], None] | None
    ) -> list[float]:
        out = []
        for _ in range(repeat):
            if flush is not None:
                flush()  # measure() synchronises before reading the clock: outside the window
            out.append(self.measure(fn, number))
        return out


class _LazyClock(_HostClock):
    """The host clock on a lazy device (XLA), with the graph cut after every call.

    torch_xla traces ops and runs, at a graph cut, only what live tensors need: a call whose
    result is dropped before the cut is never computed. So each call's result is kept until
    the graph is cut right after it (one graph per call, as one per training step), and the
    device is waited for at the end of the sample.
    """

    def __init__(self, device: torch.device, now: Callable[[], float], name: str) -> None:
        super().__init__(device, now, name)
        self.backend = runtime(device.type)

    def measure(self, fn: Callable[[], object], number: int) -> float:
        synchronize(self.device)
        t0 = self.now()
        for _ in itertools.repeat(None, number):
            result = fn()
            self.backend.end_step()  # runs what ``result`` needs while it is still alive
            del result
        synchronize(self.device)
        return self.now() - t0


class _EventClock:
    """Timing events on the current stream; the host waits once, after the last sample.

    The same code for every device whose events time (CUDA, XPU, privateuse1 backends with
    ``elapsedTime``): the backend's ``torch.Event``s on its current stream. Where events are
    reused (CUDA) each is recorded once before timing, so its creation (CUDA creates an
    event's handle on its first record) stays out of the timed window. Elsewhere each event
    is recorded once: a backend need not keep an event's state straight across re-records
    (torch's OpenReg backend, which runs each stream on a thread of its own, then failed two
    runs in twelve with "Both events must be completed"). Every event is waited for.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.backend = runtime(device.type)
        self.stream = self.backend.current_stream(device)
        self.name = f"{device.type}-event"
        self._prime = self.backend.reuses_events

    def _event(self) -> Any:
        return self.backend.new_event(self.device, timing=True)

    def measure(self, fn: Callable[[], object], number: int) -> float:
        return self.run(fn, number, 1, None)[0]

    def run(
        self, fn: Callable[[], object], number: int, repeat: int, flush: Callable[[], None] | None
    ) -> list[float]:
        pairs = [(self._event(), self._event()) for _ in range(repeat)]
        if self._prime:
            for start, end in pairs:  # creates the events now, not inside a timed window
                start.record(self.stream)
                end.record(self.stream)
        for start, end in pairs:
            if flush is not None:
                flush()  # queued before the start event: outside the timed window
            start.record(self.stream)
            for _ in itertools.repeat(None, number):
                fn()
            end.record(self.stream)
        for start, end in pairs:
            start.synchronize()
            end.synchronize()
        return [start.elapsed_time(end) / 1000.0 for start, end in pairs]


def clock_for(device: torch.device, clock: Callable[[], float] | None) -> _Clock:
    if runtime(device.type).lazy:
        now = clock or time.perf_counter
        return _LazyClock(device, now, clock_name(now))
    if clock is not None:
        return _HostClock(device, clock, clock_name(clock))
    backend = runtime(device.type)
    dev = backend.stream_device(device)
    if dev is not None and backend.event_timing(dev):
        return _EventClock(dev)
    return _HostClock(device, time.perf_counter, "perf_counter")


def clock_name(clock: Callable[[], float]) -> str:
    return str(getattr(clock, "__name__", type(clock).__name__))


def flush_bytes(device: torch.device) -> int:
    """Bytes to overwrite to flush ``device``'s last-level cache.

    Twice the cache's size, so that no line survives whatever the replacement policy, and
    (on a GPU) the flush keeps the device busy while the host queues the timed call behind
    it, so launch gaps stay out of cold-cache times. The size is the backend's (CUDA: the
    L2 size from the device properties; CPU: the largest cache in
    ``/sys/devices/system/cpu/cpu0/cache``). Elsewhere, or when the size cannot be read,
    256 MiB (triton's ``do_bench`` choice).

    >>> flush_bytes(torch.device("cpu")) > 0
    True
    """
    size = runtime(device.type).cache_bytes(device)
    return 2 * size if size else FALLBACK_FLUSH_BYTES


def flusher(device: torch.device) -> Callable[[], None]:
    # int32, as triton and inductor do: zero_ on it is a plain memset kernel.
    buffer = torch.empty(flush_bytes(device) // 4, dtype=torch.int32, device=device)

    def flush() -> None:
        buffer.zero_()

    return flush
