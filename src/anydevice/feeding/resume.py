"""Resuming a pass over a loader mid-epoch: where it was, and how to get there again.

A job preempted at batch 700 of 1000 should go on at batch 700, in the same order, not
start the epoch again. :class:`~anydevice.DeviceLoader` keeps the epoch, the batches
handed out in it and, for a ``RandomSampler`` with a generator, that generator's state at
the start of the pass (:meth:`~anydevice.DeviceLoader.state_dict`); a resumed pass skips
what was seen:

* a DataLoader with torch's ``BatchSampler`` (any map-style dataset with a ``batch_size``)
  skips at the sampler: the first ``k * batch_size`` indices are never drawn, so nothing
  is loaded for them, with worker processes too;
* any other source (an iterable dataset, a list, a generator, a custom batch sampler) is
  iterated and the first ``k`` batches discarded — they are loaded, then dropped.

The order is the same where the sampler's is: a ``DistributedSampler`` (seed and epoch), a
``RandomSampler`` with a ``generator`` (its state is restored), a sequential one. A
``RandomSampler`` without one draws its order from torch's global RNG, which the caller
must restore (``torch.set_rng_state``) for the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["LoaderState", "sampler_generator", "skip_at_sampler"]

#: The keys of a loader's state: epoch, batches handed out in it, whether the user set the
#: epoch, and the sampler generator's state at the start of the pass (or None).
LoaderState = dict[str, Any]


class _SkipFirst:
    """A sampler whose first ``n`` indices are left out (a resumed pass's)."""

    def __init__(self, sampler: Any, n: int) -> None:
        self.sampler = sampler
        self.n = n

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), self.n, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.n)


def skip_at_sampler(loader: Any, batches: int) -> Any | None:
    """Make ``loader``'s next iterator start ``batches`` batches in, at the sampler, where
    it has torch's ``BatchSampler``; returns the undo (call it once the iterator has drawn
    its first indices, or on error), or None where the source must be skipped by hand."""
    bs = getattr(loader, "batch_sampler", None)
    if batches <= 0 or type(bs) is not torch.utils.data.BatchSampler:
        return None
    original = bs.sampler
    bs.sampler = _SkipFirst(original, batches * bs.batch_size)

    def undo() -> None:
        bs.sampler = original

    return undo


def sampler_generator(loader: Any) -> torch.Generator | None:
    """The ``generator`` of ``loader``'s ``RandomSampler``, whose state fixes a pass's
    order; None for other samplers (a DistributedSampler's order is its seed and epoch)."""
    sampler = getattr(loader, "sampler", None)
    generator = getattr(sampler, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None
