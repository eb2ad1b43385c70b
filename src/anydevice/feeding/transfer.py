"""Host-to-device transfers for :class:`~anydevice.DeviceLoader`: what to pin, the events
that order and time each copy, and keeping a batch's memory for the stream that reads it.

Everything here decides *which* tensors and *when*; the CUDA calls themselves are few and
plain (``pin_memory``, ``record_stream``), so the decisions are tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from anydevice.hardware.backends.torch_private import coo_parts
from anydevice.placement.mismatch import walk
from anydevice.placement.move import _EMPTY, _Mover

__all__ = ["BatchEvents", "CopyTimes", "buffers_of", "keep_for", "nbytes_off", "pin_leaves"]


class _Event(Protocol):
    """What :class:`CopyTimes` needs of an event (``torch.cuda.Event(enable_timing=True)``)."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end_event: Any) -> float: ...


class BatchEvents:
    """One batch's event pair and where it stands."""

    __slots__ = ("end", "handed_out", "start", "timed")

    def __init__(self, start: Any, end: Any) -> None:
        self.start = start
        self.end = end  #: what the consumer's stream waits on before using the batch
        self.handed_out = False  #: the consumer's wait on ``end`` has been issued
        self.timed = False  #: the copy finished and its time was added


class CopyTimes:
    """The event pairs that bracket each batch's copy, and the device time they measured.

    A pair goes back to the free list only when its batch was handed out — the consumer's
    stream already issued its wait on ``end``, which uses the event as recorded at that
    call — *and* its copy has finished (its time is read). Re-recording an event still to
    be waited on would make the consumer wait for a later copy instead of its own.

    With ``reuse=False`` every copy gets a new pair and finished pairs are dropped: for
    backends whose wait reads the event when the waiting stream gets to it, not when the
    wait was issued (torch's OpenReg backend), where re-recording an event that a stream is
    yet to wait on can deadlock that stream against the copy stream. CUDA reuses.

    The events are any objects with ``query()``, ``synchronize()`` and
    ``elapsed_time(end)`` in milliseconds; ``make_event`` creates one. The bookkeeping is
    tested on the CPU with plain objects of that shape.
    """

    def __init__(self, make_event: Callable[[], _Event], *, reuse: bool = True) -> None:
        self._make = make_event
        self.reuse = reuse
        self.seconds = 0.0  #: device seconds of the copies timed so far
        self.pending: list[BatchEvents] = []  #: issued, not yet back on the free list
        self.free: list[BatchEvents] = []

    def take(self) -> BatchEvents:
        """An event pair for the next copy: a recycled one, or a new one."""
        self.collect(block=False)
        slot = self.free.pop() if self.free else BatchEvents(self._make(), self._make())
        slot.handed_out = slot.timed = False
        self.pending.append(slot)
        return slot

    def discard(self, slot: BatchEvents) -> None:
        """Forget a pair whose copy was never issued (the move raised before recording)."""
        self.pending = [s for s in self.pending if s is not slot]

    def handed_out(self, slot: BatchEvents) -> None:
        """The consumer's stream has issued its wait on ``slot.end``."""
        slot.handed_out = True

    def collect(self, *, block: bool) -> None:
        """Add the time of finished copies (all of them, waiting, when ``block``); free the
        pairs that are both finished and handed out."""
        keep = []
        for slot in self.pending:
            if not slot.timed:
                if block:
                    slot.end.synchronize()
                if block or slot.end.query():
                    self.seconds += slot.start.elapsed_time(slot.end) / 1000.0
                    slot.timed = True
            if slot.timed and slot.handed_out:
                if self.reuse:
                    self.free.append(slot)
            else:
                keep.append(slot)
        self.pending = keep


# ----------------------------------------------------------------------------- pinning


class _Pinner(_Mover):
    """Walks a batch as :func:`anydevice.to` does, pinning dense CPU tensors on the way.

    Every other leaf stays as it is: tensors on a device (a batch may mix them), sparse
    tensors, modules. Objects with a ``pin_memory()`` method are pinned by it, as the
    DataLoader does; mappings are walked into even when they have a ``.to`` (a
    tokenizer's ``BatchEncoding``); other objects with their own ``.to`` are left to it.
    Containers are rebuilt as ``to`` rebuilds them, so a dataclass's tensors are pinned too.
    """

    __slots__ = ("already", "nbytes", "pin")

    def __init__(self, device: torch.device, pin: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(device, False, _EMPTY)
        self.pin = pin
        self.nbytes = 0  #: bytes of the CPU tensors seen (what the copy will move)
        self.already = True  #: every dense CPU tensor came pinned

    def tensor(self, x: torch.Tensor, src: torch.device | None = None) -> torch.Tensor:
        if not x.is_cpu:
            return x  # on a device already (this one or another): ad.to handles it
        hit = self.memo.get(id(x))
        if hit is not None:
            return hit
        self.nbytes += _nbytes(x)
        out = x
        if x.layout is torch.strided and not x.is_pinned():
            self.already = False
            out = self.pin(x)
        self.memo[id(x)] = out
        if self.keep is None:
            self.keep = []
        self.keep.append(x)
        return out

    def other(self, obj: Any, t: type) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, (nn.Module, torch.optim.Optimizer, type)):
            return obj
        if callable(getattr(t, "pin_memory", None)):
            return obj.pin_memory()  # the DataLoader's rule for custom batch types
        if isinstance(obj, Mapping):
            return self.mapping(obj, t)  # a tokenizer's BatchEncoding too, though it has .to
        if callable(getattr(t, "to", None)):
            return obj  # moved by its own .to, which anydevice.to calls
        return super().other(obj, t)


def pin_leaves(
    batch: Any,
    device: torch.device,
    pin: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.pin_memory,
) -> tuple[Any, int, bool]:
    """``batch`` with each dense CPU tensor pinned, the bytes of its CPU tensors, and
    whether they all came pinned.

    Leaf by leaf, so a batch that mixes CPU and CUDA tensors works (the DataLoader's
    ``pin_memory`` raises on it) and tensors inside dataclasses are pinned too (it leaves
    them pageable, so their copy blocks the host). ``device`` is where the batch is going.

    >>> import torch
    >>> batch = {"x": torch.ones(2), "y": [torch.zeros(3, dtype=torch.int64)]}
    >>> out, nbytes, already = pin_leaves(batch, torch.device("meta"), pin=torch.Tensor.clone)
    >>> nbytes, already, out["x"] is batch["x"]
    (32, False, False)
    """
    pinner = _Pinner(device, pin)
    out = pinner.move(batch)
    return out, pinner.nbytes, pinner.already


def buffers_of(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors that hold ``t``'s memory: itself, or a sparse tensor's parts.

    >>> i = torch.tensor([[0, 2]]); v = torch.tensor([1.0, 2.0])
    >>> [b.dtype for b in buffers_of(torch.sparse_coo_tensor(i, v, (3,)))]
    [torch.int64, torch.float32]
    """
    layout = t.layout
    if layout is torch.strided:
        return (t,)
    if layout is torch.sparse_coo:
        return coo_parts(t)
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    return (t,)


def _nbytes(t: torch.Tensor) -> int:
    return sum(b.numel() * b.element_size() for b in buffers_of(t))


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    return (t for _, t in walk(obj))


def nbytes_off(batch: Any, device: torch.device) -> int:
    """Bytes of the tensors in ``batch`` that are not on ``device`` (what a move copies)."""
    return sum(_nbytes(t) for t in _tensors(batch) if t.device != device)


# ----------------------------------------------------------------------------- hand-out


def keep_for(batch: Any, stream: Any, device: torch.device) -> int:
    """Keep the memory of ``batch``'s tensors on ``device`` for ``stream``; return how many
    buffers were marked.

    ``record_stream`` on each buffer: when the tensor is freed, the caching allocator
    reuses its block only after the work ``stream`` had queued by then is done. Needed for
    a consumer on a stream other than the one the copy stream waits for.
    """
    marked = 0
    for t in _tensors(batch):
        if t.device == device:
            for b in buffers_of(t):
                b.record_stream(stream)
                marked += 1
    return marked
