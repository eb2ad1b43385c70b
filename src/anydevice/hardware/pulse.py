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

Why it costs nothing that matters per step: a tick is a time stamp, a comparison and the
heartbeat's ``step`` (a seqlock write into shared memory); the allocator's counters are
read through the device's backend (``Backend.memory``: torch's device-generic API) only
when a second has passed since the last reading. ``benchmarks/bench_heartbeat.py`` times it.
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

__all__ = ["MEMORY_EVERY_S", "SOURCES", "identify", "tick"]

#: Seconds between two readings of a device's allocator counters.
MEMORY_EVERY_S = 1.0

#: The step points, by how surely one of their ticks is one training step.
SOURCES: dict[str, int] = {"batch": 0, "optimizer": 1, "meter": 1}


class _State:
    """What this process publishes through; one per process (a forked child starts anew)."""

    def __init__(self) -> None:
        self.beat: heartbeat.Heartbeat | None = None
        self.off = False
        self.owner: str | None = None  # the source whose ticks are counted
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
    if s.off:
        return
    beat = s.beat or _start(s)
    if beat is None:
        return
    now = time.time()
    if s.owner != source and (s.owner is None or SOURCES[source] > SOURCES[s.owner]):
        with s.lock:
            s.owner = source
        beat.describe(step_unit=source)
    if s.owner == source:
        beat.step(now)
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
