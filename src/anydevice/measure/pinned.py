"""Pinned (page-locked) host memory: what torch's host caching allocator holds, and releasing it.

Batches copied to a GPU asynchronously come from pinned host memory (``DeviceLoader``
pins them, as ``DataLoader(pin_memory=True)`` does). torch keeps freed pinned blocks in a
cache for reuse, so the pinned memory of a process only grows until that cache is emptied;
the host's RAM it holds cannot be swapped out. :func:`read_pinned` reads the host
allocator's counters (``torch.cuda.host_memory_stats``, through the accelerator's backend),
:func:`release_pinned` empties its cache (``torch.accelerator.empty_host_cache``). Both need
a process that has used its accelerator: before that, no pinned memory exists and nothing is
read (no CUDA context is created).

>>> read_pinned() is None or read_pinned().held >= 0
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from anydevice.hardware.backends import runtime
from anydevice.hardware.backends.torch_private import host_empty_cache

__all__ = ["Pinned", "read_pinned", "release_pinned"]


@dataclass(frozen=True)
class Pinned:
    """Pinned host bytes held by torch's host allocator."""

    held: int  #: blocks the allocator owns: in use plus cached for reuse
    active: int | None  #: blocks handed out and not yet reusable
    peak: int | None  #: most ``held`` so far


def _host_stats() -> Mapping[str, Any] | None:
    """The host allocator's counters, as the backend of torch's accelerator reads them
    (``torch.cuda.host_memory_stats``); None before that accelerator is in use (no
    pinned memory can exist yet, and no context is made to ask)."""
    accelerator = torch.accelerator.current_accelerator()
    return None if accelerator is None else runtime(accelerator.type).host_memory_stats()


def read_pinned() -> Pinned | None:
    """The host allocator's pinned bytes, or None where torch keeps no such counters here."""
    stats = _host_stats()
    if stats is None:
        return None
    if "reserved_bytes.current" in stats:  # older torch: reserved = held, allocated = in use
        held, active, peak = "reserved_bytes", "allocated_bytes", "reserved_bytes"
    else:  # torch 2.13: allocated = held (active + cached), active = in use
        held, active, peak = "allocated_bytes", "active_bytes", "allocated_bytes"
    if f"{held}.current" not in stats:
        return None
    return Pinned(
        held=int(stats[f"{held}.current"]),
        active=_int(stats.get(f"{active}.current")),
        peak=_int(stats.get(f"{peak}.peak")),
    )


def _int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


def release_pinned() -> int:
    """Give the host allocator's cached pinned blocks back to the system; return the bytes."""
    before = read_pinned()
    if before is None:
        return 0
    empty = host_empty_cache()
    if empty is None:
        return 0
    empty()
    after = read_pinned()
    return max(0, before.held - (after.held if after is not None else 0))
