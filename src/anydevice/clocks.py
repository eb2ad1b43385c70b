"""Device clocks: waiting for a device (:func:`synchronize`), which device is in use, and
the two clocks :func:`~anydevice.timing.timeit` reads: CUDA events, or a host clock with the
device synchronised around each sample. Also the cache flush for cold-cache timings.

>>> synchronize(torch.device("cpu"))  # nothing to wait for on the CPU
>>> active_device().type in ("cpu", "cuda", "mps", "xpu")
True
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from anydevice.selection import DeviceLike

__all__ = [
    "FALLBACK_FLUSH_BYTES",
    "active_device",
    "clock_for",
    "device_of_arguments",
    "flush_bytes",
    "flusher",
    "in_use",
    "resolve_device",
    "synchronize",
    "xla_step",
]

#: Bytes zeroed to flush a cache when its size cannot be read (triton's choice).
FALLBACK_FLUSH_BYTES = 256 * 2**20


def synchronize(device: torch.device | None = None) -> None:
    """Wait until the work queued on ``device`` is done; nothing to wait for on the CPU.

    ``None`` waits for every accelerator this process has started using: on CUDA, every
    GPU this process has a context on, not only the current one, so model-parallel and
    ``DataParallel`` work is inside the wait. A CUDA or XPU device the process has not
    used yet has nothing queued: no context is created to wait. On CUDA that is asked per
    GPU, so waiting for ``cuda:1`` in a process that used only ``cuda:0`` creates no
    context (~500 MB) on GPU 1.

    >>> synchronize(torch.device("cpu"))
    """
    if device is None:
        for d in in_use():
            synchronize(d)
        return
    if device.type in ("cpu", "meta"):
        return
    if device.type in ("cuda", "xpu") and not getattr(torch, device.type).is_initialized():
        return  # nothing can be queued yet, and waiting would create a context
    if device.type == "cuda":
        from anydevice.backends.cuda import has_primary_context

        index = torch.cuda.current_device() if device.index is None else device.index
        if has_primary_context(index):  # else nothing was queued there, and waiting would
            torch.cuda.synchronize(index)  # create a context on that GPU
    elif device.type == "xla":
        _synchronize_xla()
    elif device.type in ("mps", "xpu"):
        torch.accelerator.synchronize(device)
    else:  # any other accelerator torch knows (npu, ...): where its backend can
        _synchronize_generic(device)


def xla_step() -> None:
    """Cut torch_xla's lazy graph here and run it: ``torch_xla.sync()`` (``mark_step``
    before torch_xla 2.6). What a training step on XLA ends with."""
    import torch_xla  # only where torch_xla is installed

    sync = getattr(torch_xla, "sync", None)
    if sync is not None:
        sync()
    else:  # torch_xla < 2.6
        import torch_xla.core.xla_model as xm

        xm.mark_step()


def _synchronize_xla() -> None:
    """Run what is traced on XLA and wait for it: ``wait_device_ops`` alone waits only for
    graphs already sent, and ops since the last graph cut are not sent until one, so a
    timer around them would measure their tracing (a 4096³ matmul "took" 6 µs)."""
    import torch_xla.core.xla_model as xm

    xla_step()
    xm.wait_device_ops()


def _synchronize_generic(device: torch.device) -> None:
    """Wait through the backend's ``synchronize``, else ``torch.accelerator``'s; warn when
    the backend cannot wait (times then cover only what ran before each call returned)."""
    from anydevice.backends.generic import module

    wait = getattr(module(device.type), "synchronize", None) or torch.accelerator.synchronize
    try:
        wait(device)
    except (RuntimeError, ValueError) as e:
        warnings.warn(
            f"cannot wait for {device}: its torch backend does not synchronise ({e}). Times "
            "include only the work that finished before each call returned.",
            RuntimeWarning,
            stacklevel=3,
        )


def in_use() -> list[torch.device]:
    """Every accelerator device this process may have queued work on.

    CUDA: each GPU this process has a context on, torch's current device first, read from
    the driver without creating one (work is queued only through a context). XPU: the
    current device. MPS: the one device.
    """
    found = []
    for d in _current_accelerators():
        found += _cuda_in_use(d) if d.type == "cuda" else [d]
    return found


def _cuda_in_use(current: torch.device) -> list[torch.device]:
    from anydevice.backends.cuda import has_primary_context

    others = [i for i in range(torch.cuda.device_count()) if i != current.index]
    return [
        torch.device("cuda", i) for i in (current.index, *others) if has_primary_context(int(i))
    ]


def _current_accelerators() -> list[torch.device]:
    """The current device of each accelerator this process has initialised (or MPS)."""
    found = []
    if torch.cuda.is_initialized():
        found.append(torch.device("cuda", torch.cuda.current_device()))
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_initialized():
        found.append(torch.device("xpu", xpu.current_device()))
    if torch.backends.mps.is_available():  # MPS has no lazy initialisation to look at
        found.append(torch.device("mps"))
    return found + _generic_in_use()


def _generic_in_use() -> list[torch.device]:
    """The current device of each other accelerator torch knows, once initialised."""
    from anydevice.backends.generic import kinds, module

    found = []
    for kind in kinds():
        mod = module(kind)
        initialized = getattr(mod, "is_initialized", None)
        current = getattr(mod, "current_device", None)
        if initialized is not None and current is not None and initialized():
            found.append(torch.device(kind, int(current())))
    return found


def active_device() -> torch.device:
    """The accelerator this process is already using, else the CPU.

    Used when no device is given: a function that runs on a GPU has initialised it by the
    time it has been called once, and looking creates no CUDA context.

    >>> active_device().type in ("cpu", "cuda", "mps", "xpu")
    True
    """
    found = _current_accelerators()
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


def resolve_device(device: DeviceLike) -> torch.device:
    """A device spec as a ``torch.device`` with its index; a bare ``"cuda"`` is torch's
    current CUDA device once CUDA is in use (where the work goes), as in torch."""
    from anydevice.selection import device as select_device
    from anydevice.selection import parse_spec

    spec = parse_spec(device)
    module = getattr(torch, spec.kind, None) if spec.kind in ("cuda", "xpu") else None
    if spec.index is None and module is not None and module.is_initialized():
        return torch.device(spec.kind, module.current_device())
    return select_device(device)


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


class _XlaClock(_HostClock):
    """The host clock on XLA, with the lazy graph cut after every call.

    torch_xla traces ops and runs, at a graph cut, only what live tensors need: a call whose
    result is dropped before the cut is never computed. So each call's result is kept until
    the graph is cut right after it (one graph per call, as one per training step), and the
    device is waited for at the end of the sample.
    """

    def measure(self, fn: Callable[[], object], number: int) -> float:
        synchronize(self.device)
        t0 = self.now()
        for _ in itertools.repeat(None, number):
            result = fn()
            xla_step()  # runs what ``result`` needs while it is still alive
            del result
        synchronize(self.device)
        return self.now() - t0


class _EventClock:
    """Timing events on one stream; the host waits once, after the last sample.

    Through ``torch.Event`` and ``torch.accelerator`` for XPU and any other accelerator
    whose events time (see :func:`_event_stream`); CUDA is :class:`_CudaEventClock`. Each
    event is recorded once and every one is waited for: a backend need not keep an event's
    state straight across re-records (torch's OpenReg backend, which runs each stream on a
    thread of its own, then failed two runs in twelve with "Both events must be completed").
    """

    name = "event"
    #: Record each event once before timing, so its creation stays out of the timed window
    #: (CUDA creates an event's handle on its first record); re-records it then.
    _prime = False

    def __init__(self, device: torch.device, stream: torch.Stream) -> None:
        self.device = device
        self.stream = stream

    def _event(self) -> Any:
        return torch.Event(enable_timing=True)

    def _wait(self, pairs: list[tuple[Any, Any]]) -> None:
        for start, end in pairs:
            start.synchronize()
            end.synchronize()

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
        self._wait(pairs)
        return [start.elapsed_time(end) / 1000.0 for start, end in pairs]


class _CudaEventClock(_EventClock):
    """CUDA events on the current stream; the host waits for the device once, at the end."""

    name = "cuda-event"
    _prime = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, torch.cuda.current_stream(device))

    def _event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def _wait(self, pairs: list[tuple[Any, Any]]) -> None:
        torch.cuda.synchronize(self.device)


def _event_stream(device: torch.device) -> torch.Stream | None:
    """The current stream of ``device`` when its events can time work, else None.

    Only torch's current accelerator (other than CUDA, MPS, XLA) qualifies, and only once
    a pair of timing events has been recorded, waited for and read there: a backend
    without event timing (torch's python privateuse1 backend) gets the host clock.
    """
    from anydevice.backends.generic import _current_type

    if device.type in ("cpu", "meta", "cuda", "mps", "xla") or _current_type(torch) != device.type:
        return None
    try:
        index = device.index if device.index is not None else None
        stream = torch.accelerator.current_stream(index)
        start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
        start.record(stream)
        end.record(stream)
        end.synchronize()
        start.elapsed_time(end)
    except (RuntimeError, NotImplementedError, ValueError):
        return None
    return stream


def clock_for(device: torch.device, clock: Callable[[], float] | None) -> _Clock:
    if device.type == "xla":
        now = clock or time.perf_counter
        return _XlaClock(device, now, clock_name(now))
    if clock is not None:
        return _HostClock(device, clock, clock_name(clock))
    if device.type == "cuda":
        return _CudaEventClock(device)
    stream = _event_stream(device)
    if stream is not None:
        return _EventClock(device, stream)
    return _HostClock(device, time.perf_counter, "perf_counter")


def clock_name(clock: Callable[[], float]) -> str:
    return str(getattr(clock, "__name__", type(clock).__name__))


def flush_bytes(device: torch.device) -> int:
    """Bytes to overwrite to flush ``device``'s last-level cache.

    Twice the cache's size, so that no line survives whatever the replacement policy, and
    (on a GPU) the flush keeps the device busy while the host queues the timed call behind
    it, so launch gaps stay out of cold-cache times. CUDA: the L2 size from the device
    properties (as torch inductor's benchmarker reads it); CPU: the largest cache in
    ``/sys/devices/system/cpu/cpu0/cache``. Elsewhere, or when the size cannot be read,
    256 MiB (triton's ``do_bench`` choice).

    >>> flush_bytes(torch.device("cpu")) > 0
    True
    """
    size = 0
    if device.type == "cuda":
        size = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    elif device.type == "cpu":
        sizes = [_cache_size(p) for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")]
        size = max(sizes, default=0)
    return 2 * size if size else FALLBACK_FLUSH_BYTES


def _cache_size(index_dir: Path) -> int:
    try:
        text = (index_dir / "size").read_text().strip().upper()
    except OSError:
        return 0
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    digits = text.rstrip("KMG")
    return int(digits) * scale if digits.isdigit() else 0


def flusher(device: torch.device) -> Callable[[], None]:
    # int32, as triton and inductor do: zero_ on it is a plain memset kernel.
    buffer = torch.empty(flush_bytes(device) // 4, dtype=torch.int32, device=device)

    def flush() -> None:
        buffer.zero_()

    return flush
