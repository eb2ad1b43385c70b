"""The streams and events a :class:`~anydevice.DeviceLoader` pass copies with.

The loader's ordering (see :mod:`anydevice.feeding.loader`) needs five things of a device: a copy
stream, the streams the consumer frees memory on (its *homes*), the stream current now,
events to record after each copy, and pinned host memory. Every device with streams
(CUDA, XPU, privateuse1 backends) has them as ``torch.Stream``/``torch.Event`` and
``torch.accelerator``, through its backend (:class:`anydevice.hardware.backends.Backend`);
:func:`copier_for` builds one :class:`Copier` from them, the same code for each, or gives
None where a move is a plain synchronous ``to`` (the CPU, MPS, XLA, a backend without
streams). What differs is a backend's flags, not a code path: CUDA reuses its events,
marks batches with ``record_stream`` and treats a failure to pin as an error.

What a backend lacks is left out, not faked: events that cannot time (no
``elapsedTime``) still order the copies, with ``copy_seconds`` None; a backend that cannot
pin host memory gets pageable copies, and the stats say the batches were not pinned.

A batch read on a stream other than the home: where the backend has ``record_stream``
(CUDA), the batch's tensors are marked with it (the allocator then holds their blocks
until that stream is past the free). Elsewhere the consumer's stream becomes one more home
instead: every later copy waits for it before allocating, so a block freed after reads
queued there is reused only after them. That needs no ``record_stream``, which backends do
not all have (torch's OpenReg test backend has none), and costs no overlap: the copy of
batch k+1 then waits for the compute of batch k-1, as it waits on the home stream.

The home is the stream current when the pass starts (the consumer's; the default stream
unless the loop runs inside another stream): torch's accelerator API has no default
stream, and a pass started inside a stream is read there.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch

from anydevice.feeding.streams import copy_stream, stream_device
from anydevice.feeding.transfer import BatchEvents, CopyTimes, keep_for
from anydevice.hardware.backends import Backend, runtime
from anydevice.hardware.backends.base import UNSUPPORTED

__all__ = ["Copier", "copier_for"]

logger = logging.getLogger("anydevice")


class Copier:
    """One pass's copy stream, the stream it is ordered after, and an event pair per batch,
    all through the device's backend (its streams, events and flags).

    Args:
        backend: the backend of ``device``'s kind.
        device: the device copied to, with its index.
        stream: the copy stream (one per device for the process: :func:`copy_stream`).

    The home is the stream current when the copier is made (the consumer's). A batch
    handed out on another stream is marked with ``record_stream`` where the backend has it
    (CUDA, :attr:`Backend.records_streams`); else that stream joins the homes every later
    copy waits for. Events time each copy where the device's events can time
    (:meth:`Backend.event_timing`), else only order them. Pinning is part of a backend that
    says so (:attr:`Backend.pins_surely`): a failure to pin is then an error, not a
    backend without pinned memory.
    """

    def __init__(self, backend: Backend, device: torch.device, stream: Any) -> None:
        self.backend = backend
        self.device = device
        self.stream = stream
        self.homes = [backend.current_stream(device)]  #: the home, then each other stream read on
        #: Event pairs that time each copy, or None where events cannot time. Without reuse,
        #: new events for every copy: a backend may read an event when the waiting stream
        #: gets to the wait, not when it was issued; re-recording one could then deadlock.
        self.times = (
            CopyTimes(lambda: backend.new_event(device, timing=True), reuse=backend.reuses_events)
            if backend.event_timing(device)
            else None
        )
        self._pins = True  #: host memory can be pinned for this device (until it fails)

    def current(self) -> Any:
        """The stream current on the calling thread now (the consumer's)."""
        return self.backend.current_stream(self.device)

    def enter(self, stream: Any) -> AbstractContextManager[Any]:
        """Make ``stream`` current for a block."""
        return self.backend.use_stream(stream)

    def set_device(self) -> None:
        """Make the device current on the calling thread (the pinning thread's: else
        pinning makes a context on device 0)."""
        self.backend.set_device(self.device)

    @property
    def home(self) -> Any:
        """The stream the pass started on (CUDA: the default stream)."""
        return self.homes[0]

    def wait_for_homes(self) -> None:
        """Order the copy stream after what is queued on every home now (their last reads
        of the batches they freed). Nothing else is waited for."""
        for home in self.homes:
            self.stream.wait_stream(home)

    def keep(self, batch: Any, consumer: Any) -> None:
        """Keep ``batch``'s memory for ``consumer``, a stream that is not the home."""
        if self.backend.records_streams:
            keep_for(batch, consumer, self.device)
        elif all(consumer != h for h in self.homes):
            self.homes.append(consumer)

    def slot(self) -> BatchEvents:
        """The events for the next copy: a timing pair, else a fresh ordering event."""
        if self.times is not None:
            return self.times.take()
        return BatchEvents(None, self.backend.new_event(self.device))

    def discard(self, slot: BatchEvents) -> None:
        """The copy for ``slot`` was never issued."""
        if self.times is not None:
            self.times.discard(slot)

    def handed_out(self, slot: BatchEvents) -> None:
        """The consumer's stream has issued its wait on ``slot.end``."""
        if self.times is not None:
            self.times.handed_out(slot)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in pinned memory, or ``t`` itself where the backend cannot pin (said once)."""
        if self.backend.pins_surely:
            return t.pin_memory()
        if not self._pins:
            return t
        try:
            return t.pin_memory()
        except UNSUPPORTED as e:
            self._pins = False
            logger.info(
                "%s cannot pin host memory (%s): batches are copied from pageable memory",
                self.device.type,
                str(e).splitlines()[0],
            )
            return t


def copier_for(device: torch.device) -> Copier | None:
    """The :class:`Copier` for ``device``, or None where moves are synchronous."""
    dev = stream_device(device)
    if dev is None:
        return None
    try:
        return _copier(dev)
    except UNSUPPORTED as e:  # the backend names streams but cannot make them
        logger.info("no copy stream on %s (%s): batches are moved synchronously", dev, e)
        return None


def _copier(device: torch.device) -> Copier:
    """Through the backend's streams and events (``torch.Stream``/``torch.Event``)."""
    return Copier(runtime(device.type), device, copy_stream(device))
