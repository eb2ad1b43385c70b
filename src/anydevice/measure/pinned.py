"""Pinned (page-locked) host memory: what torch's host caching allocator holds, and releasing it.

Batches copied to a GPU asynchronously come from pinned host memory (``DeviceLoader``
pins them, as ``DataLoader(pin_memory=True)`` does). torch keeps freed pinned blocks in a
cache for reuse, so the pinned memory of a process only grows until that cache is emptied;
the host's RAM it holds cannot be swapped out. :func:`read_pinned` reads the host
allocator's counters (``torch.cuda.host_memory_stats``), :func:`release_pinned` empties its
cache (``torch.accelerator.empty_host_cache``). Both need a process that has used CUDA:
before that, no pinned memory exists and nothing is read (no CUDA context is created).

>>> read_pinned() is None or read_pinned().held >= 0
True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anydevice.hardware.backends.torch_private import host_empty_cache

__all__ = ["Pinned", "read_pinned", "release_pinned"]


@dataclass(frozen=True)
class Pinned:
    """Pinned host bytes held by torch's host allocator."""

    held: int  #: blocks the allocator owns: in use plus cached for reuse
    active: int | None  #: blocks handed out and not yet reusable
    peak: int | None  #: most ``held`` so far


def _in_use() -> bool:
    """Whether this process could hold pinned memory: CUDA initialised (no context made)."""
    return torch.cuda.is_initialized() and hasattr(torch.cuda, "host_memory_stats")


def read_pinned() -> Pinned | None:
    """The host allocator's pinned bytes, or None where torch keeps no such counters here."""
    if not _in_use():
        return None
    stats = torch.cuda.host_memory_stats()
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
