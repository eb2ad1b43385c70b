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
stream's pool. When it is freed later, after uses queued on the current stream, its block
may be handed out again only to an allocation on the same side stream — and every use of
the side stream through ``side_stream()`` starts by waiting for the current stream, so it
waits for those uses too. No ``record_stream`` is needed (and none is made; its delayed,
polled frees have grown memory in other libraries).

Streams are created once per device and reused: ``torch.cuda.Stream()`` hands out one of
32 pooled streams round-robin, and each stream keeps its own allocator pool, so a new
stream per call (or per epoch) strands cached memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from anydevice.selection import DeviceLike

__all__ = ["side_stream", "stream_for"]

# One side stream per (device index, priority). Streams are a process resource that torch
# itself pools; keeping ours means every side_stream() on a device shares one allocator
# pool and one ordering.
_STREAMS: dict[tuple[int, int], Any] = {}
_LOCK = threading.Lock()


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


def stream_for(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """The side stream anydevice uses on a CUDA ``device`` (created once, then reused)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), priority)
    with _LOCK:
        stream = _STREAMS.get(key)
        if stream is None:
            stream = torch.cuda.Stream(device=key[0], priority=priority)
            _STREAMS[key] = stream
    return stream


@contextmanager
def side_stream(
    device: DeviceLike | None = None, *, priority: int = 0
) -> Iterator[torch.cuda.Stream | None]:
    """Run a block on a side stream, ordered with the current stream both ways.

    On entry the side stream waits for the work already queued on the current stream (so
    it reads what was written before); on exit the current stream waits for the side
    stream (so tensors made inside are safe to use outside). Without CUDA this is a no-op
    context that yields None.

    >>> import torch, anydevice as ad
    >>> with ad.side_stream("cpu") as s:
    ...     y = torch.ones(3) * 2
    >>> s is None, y.sum().item()
    (True, 6.0)

    Args:
        device: the CUDA device (any spec); default: the current CUDA device, or a no-op
            without CUDA.
        priority: stream priority (lower is more urgent, as in ``torch.cuda.Stream``).

    Yields:
        The side ``torch.cuda.Stream``, or None without CUDA.
    """
    dev = _cuda_device(device)
    if dev is None:
        yield None
        return
    stream = stream_for(dev, priority)
    current = torch.cuda.current_stream(dev)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            yield stream
    finally:
        current.wait_stream(stream)
