"""Side streams that are ordered with the current stream, so they cannot race it.

The classic race (PyTorch's CUDA semantics notes)::

    A = torch.empty(n, device="cuda").normal_()   # queued on the current stream
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        B = torch.sum(A)                          # may read A before normal_ ran

``side_stream()`` makes the side stream wait for the current one on entry, and the current
stream wait for the side stream on exit::

    with ad.side_stream():
        B = torch.sum(A)      # sees A's values
    C = B * 2                 # sees B's value

Why this is also safe for memory: a tensor made inside the block is allocated from the side
stream's pool. When it is freed later, after uses queued on the stream the block was
entered from, its block may be handed out again only to an allocation on the same side
stream — and every use of the side stream through ``side_stream()`` starts by waiting for
the current stream *and every stream it was entered from before*, so it waits for those
uses too, whichever stream they were on. No ``record_stream`` is needed (and none is made;
its delayed, polled frees have grown memory in other libraries).

Streams are created once per device and reused: ``torch.cuda.Stream()`` hands out one of
32 pooled streams round-robin, and each stream keeps its own allocator pool, so a new
stream per call (or per epoch) strands cached memory. The cache is process-wide, per
device and role (``side_stream()``'s, and the copy stream every ``DeviceLoader`` on a
device shares), filled lazily, and emptied in a child made by ``fork``: the parent's
streams are not the child's, and a lock held by another thread at the fork is replaced.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from anydevice.selection import DeviceLike

__all__ = ["copy_stream", "generic_stream_device", "side_stream", "stream_for"]

#: What a cached stream is for: ``side_stream()``'s, or the loaders' copies.
Role = Literal["side", "copy"]


class StreamCache:
    """Objects made once per key and reused by this process, forgotten in a forked child.

    ``make(index, priority)`` creates the stream for a key the first time it is asked for.
    Tested with plain objects on the CPU: the logic needs no GPU.
    """

    def __init__(self, make: Callable[[int, int], Any]) -> None:
        self._make = make
        self._items: dict[tuple[int, int, Role], Any] = {}
        self._lock = threading.Lock()
        self._watching_fork = False

    def get(self, index: int, priority: int = 0, role: Role = "side") -> Any:
        """The object for ``(index, priority, role)``, made on first use."""
        key = (index, priority, role)
        with self._lock:
            item = self._items.get(key)
            if item is None:
                item = self._make(index, priority)
                self._items[key] = item
                if not self._watching_fork:
                    # Registered on first use, not at import; the handler runs in the child
                    # right after fork, while it has one thread.
                    os.register_at_fork(after_in_child=self._forget)
                    self._watching_fork = True
        return item

    def _forget(self) -> None:
        self._items = {}
        self._lock = threading.Lock()  # the parent's may have been held by another thread

    def __len__(self) -> int:
        return len(self._items)


class _Side:
    """A side stream and the streams ``side_stream()`` was entered from on it."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.homes: list[Any] = []  #: few: one per stream that ever entered it
        self.lock = threading.Lock()

    def enter_from(self, current: Any) -> None:
        """Order the side stream after ``current`` and after every earlier home."""
        with self.lock:
            if all(current != h for h in self.homes):
                self.homes.append(current)
            homes = list(self.homes)
        for home in homes:
            self.stream.wait_stream(home)


def _new_stream(index: int, priority: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index, priority=priority)


def _new_side(index: int, priority: int) -> _Side:
    return _Side(_new_stream(index, priority))


# One stream per (device index, priority, role), for the whole process: streams are a
# process resource that torch itself pools, and reusing ours keeps one allocator pool
# and one ordering per role.
_STREAMS = StreamCache(_new_stream)
_SIDES = StreamCache(_new_side)


def _new_generic_stream(index: int, priority: int) -> torch.Stream:
    kind = _stream_kind()
    assert kind is not None  # only made for a device generic_stream_device gave
    return torch.Stream(torch.device(kind, index), priority=priority)


def _new_generic_side(index: int, priority: int) -> _Side:
    return _Side(_new_generic_stream(index, priority))


# XPU and other accelerators with streams: only torch's current accelerator type has them
# through torch.Stream and torch.accelerator, so the device index is the whole key.
_GENERIC_SIDES = StreamCache(_new_generic_side)
_GENERIC_STREAMS = StreamCache(_new_generic_stream)


def _stream_kind() -> str | None:
    """torch's current accelerator type when it has side streams here (XPU, or another
    accelerator torch knows beyond the named kinds); None on CUDA builds (CUDA has its own
    path), MPS (one queue), XLA (no eager streams) and the CPU."""
    from anydevice.backends.generic import _current_type

    kind = _current_type(torch)
    if kind is None or kind in ("cuda", "mps", "xla", "cpu"):
        return None
    return kind


def generic_stream_device(device: DeviceLike | None) -> torch.device | None:
    """The stream-capable non-CUDA device ``device`` means, with its index; None when it
    has no streams here (the CPU, MPS, XLA, CUDA, or a kind that is not torch's current
    accelerator)."""
    kind = _stream_kind()
    if kind is None or not torch.accelerator.is_available():
        return None
    if device is None:
        return torch.device(kind, torch.accelerator.current_device_index())
    from anydevice.selection import device as resolve

    dev = device if isinstance(device, torch.device) else resolve(device)
    if dev.type != kind:
        return None
    index = torch.accelerator.current_device_index() if dev.index is None else dev.index
    return torch.device(kind, index)


def _cuda_device(device: DeviceLike | None) -> torch.device | None:
    """The CUDA device ``device`` means, or None when it is not a CUDA device."""
    if device is None:
        if not torch.cuda.is_available():
            return None
        return torch.device("cuda", torch.cuda.current_device())
    from anydevice.selection import device as resolve

    dev = device if isinstance(device, torch.device) else resolve(device)
    if dev.type != "cuda":
        return None
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def stream_for(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """The side stream :func:`side_stream` uses on a CUDA ``device`` (created once, then reused)."""
    return _SIDES.get(_index(device), priority, "side").stream  # type: ignore[no-any-return]


def copy_stream(device: torch.device) -> torch.cuda.Stream | torch.Stream:
    """The stream every :class:`~anydevice.DeviceLoader` on ``device`` copies on.

    One per device for the whole process, apart from :func:`side_stream`'s, so that copies
    never queue behind work a user put on a side stream, and a loader built per epoch
    reuses the blocks the previous one freed (one allocator pool, not one per epoch). A
    ``torch.cuda.Stream`` on CUDA; a ``torch.Stream`` on XPU and any other accelerator
    with streams (``device`` as :func:`generic_stream_device` gives it).
    """
    if device.type == "cuda":
        return _STREAMS.get(_index(device), 0, "copy")  # type: ignore[no-any-return]
    assert device.index is not None  # generic_stream_device() always gives the index
    return _GENERIC_STREAMS.get(device.index, 0, "copy")  # type: ignore[no-any-return]


@contextmanager
def side_stream(
    device: DeviceLike | None = None, *, priority: int = 0
) -> Iterator[torch.cuda.Stream | torch.Stream | None]:
    """Run a block on a side stream, ordered with the current stream both ways.

    On entry the side stream waits for the work already queued on the current stream (so
    it reads what was written before) and on the streams earlier blocks were entered from
    (so memory freed there is not reused under their reads); on exit the current stream
    waits for the side stream (so tensors made inside are safe to use outside). On XPU and
    any other accelerator with streams, the same through ``torch.Stream`` and
    ``torch.accelerator``; on the CPU, MPS and XLA a no-op context that yields None.

    >>> import torch, anydevice as ad
    >>> with ad.side_stream("cpu") as s:
    ...     y = torch.ones(3) * 2
    >>> s is None, y.sum().item()
    (True, 6.0)

    Args:
        device: the device (any spec); default: the current CUDA device, else torch's
            current accelerator when it has streams, else a no-op.
        priority: stream priority (lower is more urgent, as in ``torch.cuda.Stream``).

    Yields:
        The side ``torch.cuda.Stream``; on XPU and other accelerators with streams, a
        ``torch.Stream``; None on the CPU, MPS and XLA.
    """
    dev = _cuda_device(device)
    if dev is None:
        generic = generic_stream_device(device)
        if generic is None:
            yield None
            return
        with _generic_side_stream(generic, priority) as s:
            yield s
        return
    side = _SIDES.get(_index(dev), priority, "side")
    stream = side.stream
    current = torch.cuda.current_stream(dev)
    side.enter_from(current)
    try:
        with torch.cuda.stream(stream):
            yield stream
    finally:
        current.wait_stream(stream)


@contextmanager
def _generic_side_stream(dev: torch.device, priority: int) -> Iterator[torch.Stream]:
    """:func:`side_stream` through ``torch.Stream`` and ``torch.accelerator``."""
    index = dev.index if dev.index is not None else torch.accelerator.current_device_index()
    side = _GENERIC_SIDES.get(index, priority, "side")
    stream = side.stream
    current = torch.accelerator.current_stream(index)
    side.enter_from(current)
    try:
        with stream:
            yield stream
    finally:
        current.wait_stream(stream)
