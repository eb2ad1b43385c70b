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

One implementation for every device with streams (CUDA, XPU, privateuse1 backends):
streams, the current stream and its switching come from the device's backend, which
does them through ``torch.Stream`` and ``torch.accelerator`` (see
:class:`anydevice.hardware.backends.Backend`). The CPU, MPS and XLA have no side streams: there
``side_stream()`` is a no-op.

Streams are created once per device and reused: CUDA hands out one of 32 pooled streams
round-robin, and each stream keeps its own allocator pool, so a new stream per call (or
per epoch) strands cached memory. The cache is process-wide, per
device and role (``side_stream()``'s, and the copy stream every ``DeviceLoader`` on a
device shares), filled lazily, and emptied in a child made by ``fork``: the parent's
streams are not the child's, and a lock held by another thread at the fork is replaced.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from anydevice.hardware.backends import runtime
from anydevice.hardware.spec import DeviceLike

__all__ = ["copy_stream", "side_stream", "stream_device", "stream_for"]

#: What a cached stream is for: ``side_stream()``'s, or the loaders' copies.
Role = Literal["side", "copy"]


class StreamCache:
    """Objects made once per key and reused by this process, forgotten in a forked child.

    ``make(where, priority)`` creates the stream for a key the first time it is asked for
    (``where``: the device, with its index). Tested with plain objects on the CPU: the
    logic needs no device.
    """

    def __init__(self, make: Callable[[Any, int], Any]) -> None:
        self._make = make
        self._items: dict[tuple[Hashable, int, Role], Any] = {}
        self._lock = threading.Lock()
        self._watching_fork = False

    def get(self, where: Hashable, priority: int = 0, role: Role = "side") -> Any:
        """The object for ``(where, priority, role)``, made on first use."""
        key = (where, priority, role)
        with self._lock:
            item = self._items.get(key)
            if item is None:
                item = self._make(where, priority)
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


def _new_stream(device: torch.device, priority: int) -> torch.Stream:
    return runtime(device.type).new_stream(device, priority)


def _new_side(device: torch.device, priority: int) -> _Side:
    return _Side(_new_stream(device, priority))


# One stream per (device, priority, role), for the whole process: streams are a process
# resource that torch itself pools, and reusing ours keeps one allocator pool and one
# ordering per role.
_STREAMS = StreamCache(_new_stream)
_SIDES = StreamCache(_new_side)


def stream_device(device: DeviceLike | None) -> torch.device | None:
    """The device ``device`` means, with its index, when its work runs on streams here;
    None where it has none (the CPU, MPS, XLA, meta, a kind that is not torch's current
    accelerator). ``None`` means torch's current accelerator.

    >>> stream_device("cpu") is None
    True
    """
    if device is None:
        dev = torch.accelerator.current_accelerator(check_available=True)
        if dev is None:
            return None
    elif isinstance(device, torch.device):
        dev = device
    else:
        from anydevice.hardware.selection import device as resolve

        dev = resolve(device)
    return runtime(dev.type).stream_device(dev)


def stream_for(device: torch.device, priority: int = 0) -> torch.Stream:
    """The side stream :func:`side_stream` uses on ``device`` (created once, then reused);
    ``device`` as :func:`stream_device` gives it."""
    return _SIDES.get(device, priority, "side").stream  # type: ignore[no-any-return]


def copy_stream(device: torch.device) -> torch.Stream:
    """The stream every :class:`~anydevice.DeviceLoader` on ``device`` copies on.

    One per device for the whole process, apart from :func:`side_stream`'s, so that copies
    never queue behind work a user put on a side stream, and a loader built per epoch
    reuses the blocks the previous one freed (one allocator pool, not one per epoch).
    ``device`` as :func:`stream_device` gives it (with its index).
    """
    return _STREAMS.get(device, 0, "copy")  # type: ignore[no-any-return]


@contextmanager
def side_stream(
    device: DeviceLike | None = None, *, priority: int = 0
) -> Iterator[torch.Stream | None]:
    """Run a block on a side stream, ordered with the current stream both ways.

    On entry the side stream waits for the work already queued on the current stream (so
    it reads what was written before) and on the streams earlier blocks were entered from
    (so memory freed there is not reused under their reads); on exit the current stream
    waits for the side stream (so tensors made inside are safe to use outside). The same
    code for CUDA, XPU and every other accelerator with streams (``torch.Stream`` and
    ``torch.accelerator``); on the CPU, MPS and XLA a no-op context that yields None.

    >>> import torch, anydevice as ad
    >>> with ad.side_stream("cpu") as s:
    ...     y = torch.ones(3) * 2
    >>> s is None, y.sum().item()
    (True, 6.0)

    Args:
        device: the device (any spec); default: torch's current accelerator when it has
            streams, else a no-op.
        priority: stream priority (lower is more urgent, as in ``torch.cuda.Stream``).

    Yields:
        The side stream, a ``torch.Stream``; None on the CPU, MPS and XLA.
    """
    dev = stream_device(device)
    if dev is None:
        yield None
        return
    backend = runtime(dev.type)
    side = _SIDES.get(dev, priority, "side")
    stream = side.stream
    current = backend.current_stream(dev)
    side.enter_from(current)
    try:
        with backend.use_stream(stream):
            yield stream
    finally:
        current.wait_stream(stream)
