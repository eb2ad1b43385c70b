"""Time budgets and self-sizing: how the doctor stays bounded on any device.

The doctor cannot know how fast a device is before it has timed it: the same 2048³ bf16
matmul takes 2 ms on a GPU, 30 ms on a CPU with AMX, and 65 s on one that emulates bf16.
So no size is trusted. Every measurement starts small and grows its problem, one size at a
time, while the next size is predicted (from the last call and the work ratio) to fit the
time left, stopping once a call is long enough to time well or the largest size is
reached; then it takes as many samples as fit. The only time that can run past a budget is
one call whose prediction was wrong, and each prediction comes from a call at the size
below it.

:class:`Budget` is the run's clock and deadline; :meth:`Budget.slot` carves a step's share.
:func:`sized` grows and samples one or more variants of a workload, interleaving their
samples (A, B, A, B, ...) so that a disturbance hits both; :class:`Comparison` turns the
pairs into a speed-up with a spread.

>>> import torch
>>> budget = Budget(1.0)
>>> timed = sized(lambda n: (lambda: torch.ones(n).sum(),), [2**10, 2**14], budget.slot(0.5))
>>> timed.size in (2**10, 2**14), len(timed.times[0]) >= 1
(True, True)
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from anydevice.measure.clocks import clock_for

__all__ = ["Budget", "Comparison", "Deadline", "Timed", "compare", "sized"]

#: Most samples taken of one variant, however much time is left.
MAX_SAMPLES = 15
#: Samples a timing aims for before it grows the problem further.
MIN_SAMPLES = 5
#: A call this many times ``sample`` long is large enough: the problem stops growing.
LONG_ENOUGH = 20


class Budget:
    """The seconds a run may spend, read from one clock; steps take shares of what is left.

    >>> b = Budget(10.0)
    >>> 0 < b.left() <= 10.0, b.spent() >= 0
    (True, True)
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        if not seconds > 0:
            raise ValueError(f"a time budget must be > 0 seconds, not {seconds}")
        self.seconds = seconds
        self.clock = clock
        self.start = clock()

    def spent(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return max(0.0, self.seconds - self.spent())

    def slot(self, share: float) -> Deadline:
        """A deadline ``share`` (0 to 1) of the time left from now."""
        return Deadline(self.clock, self.clock() + max(0.0, share) * self.left())


@dataclass(frozen=True)
class Deadline:
    """One step's deadline on the run's clock."""

    clock: Callable[[], float]
    deadline: float

    def left(self) -> float:
        return max(0.0, self.deadline - self.clock())


@dataclass(frozen=True)
class Timed:
    """What :func:`sized` measured: the size reached and each variant's seconds per call."""

    size: int  #: the problem size the samples were taken at
    times: tuple[tuple[float, ...], ...]  #: per variant, seconds per call, one per sample
    capped: bool  #: stopped below the largest size because the next would not fit in time

    def median(self, variant: int = 0) -> float:
        return _quantile(sorted(self.times[variant]), 0.5)

    def relative_iqr(self, variant: int = 0) -> float:
        ordered = sorted(self.times[variant])
        mid = _quantile(ordered, 0.5)
        return (_quantile(ordered, 0.75) - _quantile(ordered, 0.25)) / mid if mid > 0 else 0.0

    def noisy(self, variant: int = 0) -> bool:
        return len(self.times[variant]) < 3 or self.relative_iqr(variant) > NOISY


#: Relative spread above which a number is called noisy (torch.utils.benchmark's 10 %).
NOISY = 0.10


def sized(
    make: Callable[[int], Sequence[Callable[[], object]]],
    sizes: Sequence[int],
    slot: Deadline,
    *,
    device: torch.device | None = None,
    sample: float = 0.01,
    work: Callable[[int], float] = float,
    settings: Sequence[Callable[[], contextlib.AbstractContextManager[Any]]] = (),
) -> Timed:
    """Grow a workload through ``sizes`` while it fits ``slot``, then sample its variants.

    ``make(size)`` returns the variants to time at that size (one, or two for an A/B
    comparison); each is called with no arguments. At each size every variant is called
    once to warm up, then timed (the fastest of up to three calls, while they are short, so
    one call slowed by another process does not stop the growth); the next size is tried
    only when the slowest
    variant, scaled by ``work(next) / work(size)``, predicts that its calls there and
    :data:`MIN_SAMPLES` samples still fit, and while a call is shorter than
    :data:`LONG_ENOUGH` x ``sample`` (large problems are what users run; tiny ones time
    launch overheads).
    Then rounds of samples, one per variant in turn, each sample at least ``sample`` long,
    until the slot's time or :data:`MAX_SAMPLES` rounds run out. When not even one round
    fits, the timed probe calls are the samples.

    Args:
        make: the workload at a size.
        sizes: increasing sizes; the last is the largest allowed.
        slot: the deadline.
        device: where the work runs (synchronised around each sample; CUDA events on CUDA).
        sample: seconds a sample should last at least.
        work: the work at a size, for the prediction (``n ** 3`` for an n x n matmul).
        settings: per variant, a context entered around each of its samples, outside the
            timed window (matmul precision flags cost more to set than a small call).
    """
    if not sizes:
        raise ValueError("sized() needs at least one size")
    timer = clock_for(device or torch.device("cpu"), None)

    def setting(k: int) -> contextlib.AbstractContextManager[Any]:
        return settings[k]() if settings else contextlib.nullcontext()

    def probe(k: int, fn: Callable[[], object]) -> tuple[float, float]:
        """(fastest, slowest) of the timed calls: the first for growing, the second for
        predicting what the time left can hold."""
        with setting(k):
            first = timer.measure(fn, 1)  # allocation, kernel choice, caches
            times: list[float] = []
            spent = first
            while len(times) < 3:
                # one timed call unless the first took a quarter of the time left; up to
                # three while they are short
                if spent > (slot.left() / 4 if not times else min(sample, slot.left() / 4)):
                    break
                times.append(timer.measure(fn, 1))
                spent += times[-1]
        return (min(times), max(times)) if times else (first, first)

    size, capped = sizes[0], False
    fns: tuple[Callable[[], object], ...] = ()
    probes: list[tuple[float, float]] = []
    for i, size in enumerate(sizes):
        fns = tuple(make(size))
        probes = [probe(k, fn) for k, fn in enumerate(fns)]
        if i + 1 == len(sizes) or max(p[0] for p in probes) >= LONG_ENOUGH * sample:
            break
        ratio = work(sizes[i + 1]) / max(work(size), 1e-30)
        per_round = sum(max(p[1] * ratio, sample) for p in probes)
        if 2 * ratio * sum(p[1] for p in probes) + MIN_SAMPLES * per_round > slot.left():
            capped = True
            break
    numbers = [max(1, math.ceil(sample / p[0])) if p[0] > 0 else 1 for p in probes]
    per_round = sum(n * p[1] for n, p in zip(numbers, probes, strict=True))
    samples: list[list[float]] = [[] for _ in fns]
    while len(samples[0]) < MAX_SAMPLES and per_round <= slot.left():
        start = slot.clock()
        for k, (fn, number) in enumerate(zip(fns, numbers, strict=True)):
            with setting(k):
                samples[k].append(timer.measure(fn, number) / number)
        per_round = max(per_round, slot.clock() - start)  # the slowest round so far
    if not samples[0]:
        samples = [[p[0]] for p in probes]
    return Timed(size, tuple(tuple(s) for s in samples), capped)


def _quantile(ordered: Sequence[float], q: float) -> float:
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Comparison:
    """A speed-up from interleaved A/B samples: the median ratio and its spread.

    Each pair ``(without, with)`` was taken back to back, so a disturbance that slows one
    sample of a pair tends to slow its partner too; the ratio of each pair is a speed-up,
    and the range of the middle 80 % of them (10th to 90th percentile) is the spread: a
    verdict needs all of it on one side of 1x, so a few disturbed pairs cannot make one.
    With fewer than five pairs the spread is the lowest to the highest ratio.

    >>> c = compare((2.0, 2.1, 1.9, 2.0), (1.0, 1.0, 1.0, 1.0))
    >>> round(c.speedup, 2), c.clear
    (2.0, True)
    """

    speedup: float  #: median of without / with
    low: float  #: the spread's lower end
    high: float  #: its upper end
    pairs: int

    @property
    def spread(self) -> float:
        """Half the spread, as a share of the speed-up (0.05 reads ±5 %)."""
        return (self.high - self.low) / 2 / self.speedup if self.speedup > 0 else math.inf

    @property
    def clear(self) -> bool:
        """Three pairs or more, all of the spread on one side of 1x: a real difference."""
        return self.pairs >= 3 and (self.low > 1.0 or self.high < 1.0)

    @property
    def noisy(self) -> bool:
        return self.pairs < 3 or 2 * self.spread > NOISY


def compare(without: Sequence[float], with_: Sequence[float]) -> Comparison:
    """The :class:`Comparison` of paired samples (seconds per call without and with)."""
    ratios = sorted(a / b for a, b in zip(without, with_, strict=False) if b > 0)
    if not ratios:
        raise ValueError("compare() needs at least one pair of positive times")
    if len(ratios) < 5:
        low, high = ratios[0], ratios[-1]
    else:
        low, high = _quantile(ratios, 0.1), _quantile(ratios, 0.9)
    return Comparison(_quantile(ratios, 0.5), low, high, len(ratios))
