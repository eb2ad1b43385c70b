"""``DeviceLoader``: batches that arrive on the device, copied while the last one computes.

How the CUDA path keeps copies and compute overlapped *and* ordered:

1. A background thread takes batches from the source (so data loading with
   ``num_workers=0`` overlaps the step too) and pins those that are not pinned yet —
   pinning on the main thread is slower than a plain pageable copy, pinning off it is what
   makes the copy asynchronous.
2. Handing out batch k first issues batch k+1: on one side stream, created once per
   loader, the side stream waits for the work queued so far on the consumer's stream, then
   copies (``non_blocking``, from pinned memory), runs ``transform`` and records an event.
   The copy engine runs it while the GPU computes batch k.
3. The consumer's stream waits on batch k's event before batch k is returned, so no kernel
   reads it early.

Memory needs no ``record_stream``: batch k+1 is allocated from the side stream's pool, and
when the consumer frees it (after queuing its uses), the block can be reused only by a later
allocation on the side stream — which always comes after step 2's wait for the consumer's
stream, so after those uses. One stream per loader means one pool: reserved memory stays
flat across epochs (a stream per epoch strands each epoch's cached blocks).

On other accelerators (MPS, XLA, XPU) the background thread still fetches ahead and the
move is a plain ``anydevice.to``. On the CPU there is nothing to copy, so by default no
thread either: a batch costs a few microseconds more than iterating the source itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import torch

from anydevice.mismatch import walk
from anydevice.placement import to
from anydevice.selection import DeviceLike
from anydevice.selection import device as resolve_device

__all__ = ["DeviceLoader", "LoaderStats"]

T = TypeVar("T")
logger = logging.getLogger("anydevice")

_INPUT_BOUND = 0.20  #: waiting share above which a run is called input-bound
_COPY_BOUND = 0.80  #: copy-time share of the step above which it is called copy-bound
_POLL = 0.1  #: seconds between checks of the stop flag while blocked


@dataclass(frozen=True)
class LoaderStats:
    """How a pass over a :class:`DeviceLoader` went: is the step waiting for data?

    Times are seconds of wall clock on the consuming thread. ``copy_seconds`` is device
    time of the host-to-device copies (CUDA events), None where it is not measured.
    """

    batches: int
    bytes_moved: int  #: bytes of tensors copied to another device
    wait_seconds: float  #: time the consumer was blocked waiting for the next batch
    total_seconds: float  #: wall time from the first batch asked for to the latest
    copy_seconds: float | None
    device: str
    num_workers: int | None  #: the source DataLoader's, None for other sources
    pinned: bool | None  #: whether the source delivered pinned batches (CUDA only)

    @property
    def wait_fraction(self) -> float:
        """Share of the wall time spent waiting for data, 0..1."""
        return self.wait_seconds / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def bandwidth(self) -> float | None:
        """Effective host-to-device bandwidth in bytes/s, where copies are timed."""
        if not self.copy_seconds or not self.bytes_moved:
            return None
        return self.bytes_moved / self.copy_seconds

    @property
    def verdict(self) -> str:
        """One line: input-bound, copy-bound, or compute-bound — and what to do."""
        if self.batches == 0:
            return "no batch delivered yet"
        share = self.wait_fraction
        if share >= _INPUT_BOUND:
            fixes = []
            if self.num_workers is not None:
                fixes.append(f"raise num_workers (now {self.num_workers})")
            else:
                fixes.append("make the source faster")
            if self.pinned is False:
                fixes.append("pin memory (DataLoader(pin_memory=True))")
            return f"input-bound: {share:.0%} of the step waiting for data — {', or '.join(fixes)}"
        if self.copy_seconds is not None and self.total_seconds > 0:
            copy_share = self.copy_seconds / self.total_seconds
            if copy_share >= _COPY_BOUND:
                return (
                    f"copy-bound: host-to-device copies take {copy_share:.0%} of the step — "
                    "send smaller dtypes (e.g. uint8) and convert on the device with transform="
                )
        return f"compute-bound: the next batch was ready {1 - share:.0%} of the time"

    def __repr__(self) -> str:
        from anydevice.inventory import format_bytes

        step = self.total_seconds / self.batches if self.batches else 0.0
        parts = [
            f"{self.batches} batches on {self.device}",
            f"{step * 1e3:.2f} ms/step",
            f"waiting {self.wait_fraction:.0%}",
            f"{format_bytes(self.bytes_moved)} moved",
        ]
        if self.bandwidth is not None:
            parts.append(f"{self.bandwidth / 1e9:.1f} GB/s")
        return f"LoaderStats({', '.join(parts)}: {self.verdict})"


class _Counters:
    """Mutable tallies of one pass; ``LoaderStats`` is their snapshot."""

    def __init__(self) -> None:
        self.batches = 0
        self.bytes_moved = 0
        self.wait = 0.0
        self.start: float | None = None
        self.last = 0.0
        self.copy = 0.0
        self.pinned: bool | None = None
        self.timings: list[tuple[Any, Any]] = []  #: (start, end) CUDA events not yet read


class DeviceLoader(Generic[T]):
    """Wrap any iterable of batches so each batch arrives on ``device``.

    ``len()``, re-iteration once per epoch and ``set_epoch`` work as on the source, and any
    other attribute is the source's (``loader.dataset``, ``loader.sampler``). On CUDA
    the next batch is pinned off the main thread and copied on a side stream while the
    current one computes (see the module docstring for why that is safe); elsewhere the
    next batch is fetched ahead and moved with :func:`anydevice.to`.

    >>> import torch, anydevice as ad
    >>> loader = ad.DeviceLoader([torch.zeros(2), torch.ones(2)], "cpu")
    >>> [b.sum().item() for b in loader], len(loader)
    ([0.0, 2.0], 2)

    Args:
        loader: a DataLoader or any iterable of batches (tensors, nested containers,
            dataclasses, objects with ``.to``).
        device: any device spec; resolved once, here.
        transform: called on each batch after it reached the device (on the side stream on
            CUDA), e.g. ``lambda b: (b[0].float() / 255, b[1])``: send uint8, get float.
        prefetch: fetch the next batch in a background thread. ``"auto"``: on
            accelerators, where the thread pins batches and overlaps their copy with
            compute; not on the CPU, where there is no copy to hide and the thread only
            competes with the step for the GIL (measured: 13 % slower on a small step).
            Pass False when the source must be read from the calling thread (e.g. it
            holds a sqlite3 connection); True to prefetch on the CPU anyway.
        depth: how many host batches the background thread may hold ready.

    Attributes:
        stats: :class:`LoaderStats` of the current (or last) pass.
    """

    def __init__(
        self,
        loader: Iterable[T],
        device: DeviceLike = "auto",
        transform: Callable[[Any], Any] | None = None,
        prefetch: bool | Literal["auto"] = "auto",
        *,
        depth: int = 2,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.loader = loader
        self.device = resolve_device(device)
        self.transform = transform
        if prefetch not in (True, False, "auto"):
            raise ValueError(f"prefetch must be True, False or 'auto', not {prefetch!r}")
        self.prefetch: bool = self.device.type != "cpu" if prefetch == "auto" else bool(prefetch)
        self.depth = depth
        self._stream: Any = None  # the side stream, created on first CUDA pass
        self._counters = _Counters()
        self._epoch = 0
        self._epoch_set = False
        self._active: _Pass | None = None

    # ------------------------------------------------------------------ source-like API

    def __len__(self) -> int:
        try:
            return len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"the wrapped {type(self.loader).__name__} has no len(); DeviceLoader can only "
                "report the length of a source that has one"
            ) from None

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch`` to the source's sampler (e.g. a DistributedSampler).

        Without a call, each new pass sets the next epoch number itself, so a
        DistributedSampler reshuffles every epoch (it repeats one order otherwise).
        """
        self._epoch = epoch
        self._epoch_set = True
        self._set_sampler_epoch(epoch)

    def _set_sampler_epoch(self, epoch: int) -> None:
        targets = [self.loader, getattr(self.loader, "sampler", None)]
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        targets += [batch_sampler, getattr(batch_sampler, "sampler", None)]
        seen: set[int] = set()
        for t in targets:
            fn = getattr(t, "set_epoch", None)
            if t is not None and callable(fn) and id(t) not in seen and t is not self:
                seen.add(id(t))
                fn(epoch)

    @property
    def stats(self) -> LoaderStats:
        c = self._counters
        _read_timings(c, block=True)
        total = (c.last - c.start) if c.start is not None else 0.0
        return LoaderStats(
            batches=c.batches,
            bytes_moved=c.bytes_moved,
            wait_seconds=c.wait,
            total_seconds=total,
            copy_seconds=c.copy if self.device.type == "cuda" else None,
            device=str(self.device),
            num_workers=getattr(self.loader, "num_workers", None),
            pinned=c.pinned,
        )

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        if self._active is not None:
            self._active.close()  # a new pass ends the previous one
        if not self._epoch_set:
            self._set_sampler_epoch(self._epoch)
        self._epoch_set = False
        self._epoch += 1
        self._counters = _Counters()
        run = _Pass(self)
        self._active = run
        try:
            while True:
                batch = run.next()
                if batch is _END:
                    return
                yield batch
        finally:
            run.close()
            if self._active is run:
                self._active = None

    def __getattr__(self, name: str) -> Any:
        # Anything DeviceLoader does not define is the source's: ``loader.dataset``,
        # ``loader.sampler``, ``loader.batch_size`` read as on the DataLoader it wraps.
        source = self.__dict__.get("loader")
        if name.startswith("__") or source is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(source, name)

    def __repr__(self) -> str:
        return (
            f"DeviceLoader({type(self.loader).__name__}, device={str(self.device)!r}, "
            f"prefetch={self.prefetch})"
        )


_END: Any = object()  # end of the source
_ERROR = object()  # the producer raised


class _Producer:
    """A thread that takes batches from the source and, for CUDA, pins them."""

    def __init__(self, source: Iterator[Any], pin_device: torch.device | None, depth: int):
        self.source = source
        self.pin_device = pin_device
        self.queue: queue.Queue[tuple[object, Any, int, bool | None]] = queue.Queue(depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="anydevice-prefetch", daemon=True)
        self.thread.start()

    def _put(self, item: tuple[object, Any, int, bool | None]) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            if self.pin_device is not None:
                torch.cuda.set_device(self.pin_device)  # else pinning makes a context on GPU 0
            for batch in self.source:
                if self.stop.is_set():
                    return
                nbytes, pinned = 0, None
                if self.pin_device is not None:
                    batch, nbytes, pinned = _pin(batch)
                if not self._put((batch, None, nbytes, pinned)):
                    return
            self._put((_END, None, 0, None))
        except BaseException as e:  # handed to the consumer, which raises it there
            self._put((_ERROR, e, 0, None))
        finally:
            self.source = iter(())  # drop the source iterator (DataLoader shuts its workers)

    def get(self) -> tuple[object, Any, int, bool | None]:
        return self.queue.get()

    def close(self, timeout: float = 10.0) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout
        while self.thread.is_alive() and time.monotonic() < deadline:
            while True:  # unblock a producer waiting to put
                try:
                    self.queue.get_nowait()
                except queue.Empty:
                    break
            self.thread.join(_POLL)
        if self.thread.is_alive():
            logger.warning(
                "the prefetch thread is still inside the source's next() after %.0f s; it "
                "stops when that batch is produced (it is a daemon thread)",
                timeout,
            )


class _Pass:
    """One pass over the source: the producer, the issued-ahead batch, the counters."""

    def __init__(self, owner: DeviceLoader[Any]) -> None:
        self.owner = owner
        self.device = owner.device
        self.counters = owner._counters
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.source: Iterator[Any] = iter(owner.loader)  # on the main thread (DataLoader wants it)
        self.producer: _Producer | None = None
        if owner.prefetch:
            pin = self.device if self.cuda else None
            self.producer = _Producer(self.source, pin, owner.depth)
        self.ready: tuple[Any, Any] | None = None  # (batch on device, its event) issued ahead
        self.done = False
        self.events: list[tuple[Any, Any]] = []  # free (start, end) event pairs
        self.error: BaseException | None = None  # raised by the source after batch k was issued
        if self.cuda and owner._stream is None:
            # One stream per loader, never per pass: each stream has its own allocator pool.
            owner._stream = torch.cuda.Stream(self.device)

    # -- fetching on the host

    def _fetch(self) -> tuple[Any, int, bool | None]:
        """The next host batch (or _END), with its byte count and whether it came pinned."""
        c = self.counters
        t0 = time.perf_counter()
        if c.start is None:
            c.start = t0
        try:
            if self.producer is not None:
                batch, error, nbytes, pinned = self.producer.get()
                if batch is _ERROR:
                    raise error
                return batch, nbytes, pinned
            try:
                batch = next(self.source)
            except StopIteration:
                return _END, 0, None
            if self.cuda:  # no pinning on the main thread: it costs more than it saves
                return batch, _nbytes_off(batch, self.device), False
            return batch, 0, None
        finally:
            c.wait += time.perf_counter() - t0

    # -- issuing on the device

    def _issue(self) -> None:
        """Fetch the next host batch and start moving it; set ``self.ready``."""
        batch, nbytes, pinned = self._fetch()
        if batch is _END:
            self.ready = None
            self.done = True
            return
        c = self.counters
        c.bytes_moved += nbytes
        if pinned is not None:
            c.pinned = pinned if c.pinned is None else (c.pinned and pinned)
        if not self.cuda:
            moved = to(batch, self.device)
            if self.owner.transform is not None:
                moved = self.owner.transform(moved)
            if self.device.type != "cpu" and nbytes == 0:
                c.bytes_moved += _nbytes_off(batch, self.device)
            self.ready = (moved, None)
            return
        stream = self.owner._stream
        start, end = self._event_pair()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            start.record(stream)
            moved = to(batch, self.device, non_blocking=True)
            if self.owner.transform is not None:
                moved = self.owner.transform(moved)
            end.record(stream)
        c.timings.append((start, end))
        self.ready = (moved, end)

    def _event_pair(self) -> tuple[Any, Any]:
        _read_timings(self.counters, block=False, free=self.events)
        if self.events:
            return self.events.pop()
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def next(self) -> Any:
        if self.error is not None:
            error, self.error = self.error, None
            self.done = True
            raise error
        if self.ready is None and not self.done:
            self._issue()  # first call: batch 0
        if self.ready is None:
            self.counters.last = time.perf_counter()
            return _END
        batch, event = self.ready
        self.ready = None
        try:
            self._issue()  # batch k+1 starts moving before batch k is handed out
        except Exception as e:  # the source failed on batch k+1: deliver k, raise next time
            self.error = e
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        c = self.counters
        c.batches += 1
        c.last = time.perf_counter()
        return batch

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        self.source = iter(())  # release the source iterator (a DataLoader's stops its workers)
        self.ready = None
        self.done = True


def _read_timings(c: _Counters, *, block: bool, free: list[tuple[Any, Any]] | None = None) -> None:
    """Add finished copies' device time to ``c.copy``; recycle their events into ``free``."""
    pending = []
    for start, end in c.timings:
        if block:
            end.synchronize()
        if block or end.query():
            c.copy += start.elapsed_time(end) / 1000.0
            if free is not None:
                free.append((start, end))
        else:
            pending.append((start, end))
    c.timings = pending


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    return (t for _, t in walk(obj))


def _pin(batch: Any) -> tuple[Any, int, bool]:
    """Pin the CPU tensors of ``batch`` that are not pinned; count their bytes.

    Pinning follows the DataLoader's own rules (tensors, mappings, sequences, named
    tuples, objects with a ``pin_memory()`` method); tensors inside other objects (a
    dataclass) are copied from pageable memory, which is correct, only not asynchronous.
    """
    from torch.utils.data._utils.pin_memory import pin_memory

    tensors = [t for t in _tensors(batch) if t.device.type == "cpu"]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    already = all(t.is_pinned() for t in tensors)
    return (batch if already else pin_memory(batch)), nbytes, already


def _nbytes_off(batch: Any, device: torch.device) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(batch) if t.device != device)
