"""This process's heartbeat, fed: steps counted where they happen, and the device's
allocator counters read at most once a second.

:mod:`anydevice.heartbeat` is the record; this module is what the library's own step
points call to keep it current, so a training loop publishes what ``anydevice top`` and the
launcher read without a line of its own:

* ``DeviceLoader`` ticks once per batch handed out (:func:`tick` ``source="batch"``);
* the optimizer step ticks once per step: ``p.step(opt)`` of ``ad.precision``
  (``"optimizer"``) and ``Throughput.step()`` (``"meter"``);
* ``ad.distributed`` says who this process is (:func:`identify`): its rank, its device.

One process may have several step points (a loader and an optimizer step, with gradient
accumulation several batches per step), so the heartbeat counts the steps of one source
only: an optimizer step, once one is seen, else a batch; of two step points of one rank
the first that ticks owns the count (``p.step`` and ``Throughput.step`` in one loop count
once). The record's ``step_unit`` says which it is.

Why it costs nothing that matters per step: a tick adds one to a count and reads the
clock; the count goes to the heartbeat (a seqlock write into shared memory, about a
microsecond) at most every :data:`PUBLISH_EVERY_S` (the newest steps are that much late
in the record, far below a stall's 5 s), and the allocator's counters are read through the
device's backend (``Backend.memory``: torch's device-generic API) at most every
:data:`MEMORY_EVERY_S`. ``benchmarks/bench_heartbeat.py`` times it.
A device whose memory is the host's (the CPU) publishes none: ``anydevice top`` reads the
process's resident set itself. Publishing is off with ``ANYDEVICE_HEARTBEAT=0``.

>>> import os, torch
>>> tick("batch", torch.device("cpu"))
>>> mine = heartbeat.read_file(heartbeat.mine().path)
>>> mine.pid == os.getpid() and mine.steps >= 1
True
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

from anydevice import heartbeat

if TYPE_CHECKING:
    import torch

__all__ = ["MEMORY_EVERY_S", "PUBLISH_EVERY_S", "SOURCES", "flush", "identify", "tick"]

#: Seconds between two readings of a device's allocator counters.
MEMORY_EVERY_S = 1.0
#: Seconds between two writes of the step count into the record (a tick in between counts).
PUBLISH_EVERY_S = 0.1

#: The step points, by how surely one of their ticks is one training step.
SOURCES: dict[str, int] = {"batch": 0, "optimizer": 1, "meter": 1}


class _State:
    """What this process publishes through; one per process (a forked child starts anew)."""

    def __init__(self) -> None:
        self.beat: heartbeat.Heartbeat | None = None
        self.off = False
        self.owner: str | None = None  # the source whose ticks are counted
        self.pending = 0  # steps counted, not yet written into the record
        self.due = 0.0  # when the next write may happen (wall seconds)
        self.next_memory = 0.0
        self.devices: list[str] = []
        self.unreadable: set[str] = set()  # devices whose backend keeps no counters
        self.lock = threading.Lock()


_state = _State()


def _reset_in_child() -> None:
    global _state
    _state = _State()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


def tick(source: str, device: torch.device | None = None) -> None:
    """One step of ``source`` (a key of :data:`SOURCES`) on ``device``, whose allocator's
    counters are published at most once every :data:`MEMORY_EVERY_S` seconds."""
    s = _state
    if source != s.owner and not _take(s, source):
        return  # off, or another step point counts this process's steps (and memory)
    s.pending += 1
    now = time.time()  # every step: a count read only every few steps could lag a slow one
    if now >= s.due:
        _publish(s, now, device)


def flush() -> None:
    """Write the steps counted since the last write now (they would be written at the
    next tick :data:`PUBLISH_EVERY_S` after the last write)."""
    s = _state
    if s.pending and not s.off:
        _publish(s, time.time(), None)


def _take(s: _State, source: str) -> bool:
    """Whether ``source`` counts the steps now: the first to tick, or one surer than the
    source that counted so far (an optimizer step over a batch)."""
    if s.off or (s.owner is not None and SOURCES[source] <= SOURCES[s.owner]):
        return False
    beat = s.beat or _start(s)
    if beat is None:
        return False
    with s.lock:
        pending, s.pending, s.owner = s.pending, 0, source
    if pending:  # the steps of the source counted so far are kept
        beat.step(count=pending)
    beat.describe(step_unit=source)
    return True


def _publish(s: _State, now: float, device: torch.device | None) -> None:
    """Write the steps counted since the last write, and, when due, the device's memory."""
    beat = s.beat or _start(s)
    if beat is None:
        return
    s.due = now + PUBLISH_EVERY_S
    with s.lock:
        pending, s.pending = s.pending, 0
    if pending:
        beat.step(now, count=pending)
    if device is not None and now >= s.next_memory:
        s.next_memory = now + MEMORY_EVERY_S
        _publish_memory(s, beat, device, now)


def identify(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    device: torch.device,
    **details: Any,
) -> None:
    """Say who this process is (``ad.distributed`` knows once the world is joined), with
    ``details`` (the launcher, the collective backend) merged into the record's text."""
    s = _state
    if s.off:
        return
    beat = s.beat or _start(s)
    if beat is None:
        return
    beat.identify(
        rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size
    )
    _see_device(s, beat, device, **details)


def _start(s: _State) -> heartbeat.Heartbeat | None:
    with s.lock:
        if s.beat is None and not s.off:
            s.beat = heartbeat.mine()
            s.off = s.beat is None
        return s.beat


def _see_device(s: _State, beat: heartbeat.Heartbeat, device: torch.device, **more: Any) -> None:
    name = str(device)
    if name not in s.devices or more:
        if name not in s.devices:
            s.devices.append(name)
        beat.describe(device=s.devices[0], devices=list(s.devices), **more)


def _publish_memory(s: _State, beat: heartbeat.Heartbeat, device: torch.device, now: float) -> None:
    """The allocator's counters of ``device``, through its backend (torch's generic API)."""
    name = str(device)
    if name not in s.devices:
        _see_device(s, beat, device)
    if name in s.unreadable:
        return
    from anydevice.errors import MeasurementError
    from anydevice.hardware.backends import runtime

    backend = runtime(device.type)
    if backend.is_host or not backend.holds_data:
        s.unreadable.add(name)  # the host's memory is the process's: top reads it itself
        return
    try:
        c = backend.memory(device)
    except MeasurementError:
        s.unreadable.add(name)
        return
    beat.memory(c.allocated, c.reserved or 0, c.peak or 0, now)
