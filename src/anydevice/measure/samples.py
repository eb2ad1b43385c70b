"""Samples of device time, and what they say: :class:`Measurement`, :func:`autorange`,
:func:`sample`.

The statistics know no device: a :class:`Measurement` is seconds per call, with the
metadata to read them (FLOPs and a peak, where given, annotate it from outside).
:func:`sample` is the loop under :func:`~anydevice.timeit`: calls per sample chosen by
:func:`autorange`, each sample bracketed by the device's clock
(:mod:`anydevice.measure.clocks`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anydevice.measure.clocks import clock_for, flusher, synchronize

if TYPE_CHECKING:
    from anydevice.hardware.peaks import Peak

__all__ = ["Calibration", "Measurement", "autorange", "format_time", "sample"]


#: Relative IQR above which a measurement is called noisy (torch.utils.benchmark's 10%).
NOISY = 0.10


#: Relative IQR above which the noise is gross (torch.utils.benchmark's 50%).
VERY_NOISY = 0.50


#: Most calls autorange puts into one sample; enough for any real function.
MAX_NUMBER = 10_000_000


def format_time(seconds: float) -> str:
    """A duration in the unit that suits it.

    >>> format_time(0.0000123), format_time(0.25), format_time(3.0)
    ('12.3 us', '250 ms', '3 s')
    """
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's and torch's default)."""
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, repr=False)
class Measurement:
    """Timings of one function: every sample, their statistics, and how they were taken.

    Times are in seconds per call (``unit`` is ``"s"``); a sample is ``number`` calls timed
    together, divided by ``number``. The repr picks a readable unit and warns when the run
    was noisy (interquartile range above 10% of the median), as torch.utils.benchmark does.

    >>> m = Measurement(times=(1e-3, 1.1e-3, 0.9e-3, 1e-3), number=10, label="step")
    >>> format_time(m.median), m.count, m.noisy
    ('1 ms', 4, False)
    """

    times: tuple[float, ...]  #: seconds per call, one value per sample
    number: int = 1  #: calls timed together in each sample
    label: str = ""
    device: str = "cpu"  #: where the work ran and was synchronised
    clock: str = "perf_counter"  #: "cuda-event", "perf_counter", or an injected clock's name
    flush_l2: bool = False  #: the cache was flushed before every sample (cold-cache times)
    warmup: int = 0  #: calls made before anything was measured
    overhead: float = 0.0  #: seconds an empty sample takes on this clock (the timing floor)
    flops: int | None = None  #: FLOPs of one call, when given or counted
    peak: Peak | None = None  #: the device's peak in the dtype the FLOPs ran in, if known

    def __post_init__(self) -> None:
        if not self.times:
            raise ValueError("a Measurement needs at least one sample")
        if self.number < 1:
            raise ValueError(f"number (calls per sample) must be >= 1, not {self.number}")

    @property
    def unit(self) -> str:
        """The unit of every time here: seconds."""
        return "s"

    @functools.cached_property
    def _sorted(self) -> tuple[float, ...]:
        return tuple(sorted(self.times))

    @property
    def count(self) -> int:
        """Number of samples."""
        return len(self.times)

    @property
    def calls(self) -> int:
        """Calls that were timed: ``count * number``."""
        return self.count * self.number

    @property
    def median(self) -> float:
        return _quantile(self._sorted, 0.5)

    @property
    def mean(self) -> float:
        return math.fsum(self.times) / len(self.times)

    @property
    def min(self) -> float:
        return self._sorted[0]

    @property
    def max(self) -> float:
        return self._sorted[-1]

    @property
    def iqr(self) -> float:
        """Interquartile range: the spread of the middle half of the samples."""
        return self.quantile(0.75) - self.quantile(0.25)

    @property
    def relative_iqr(self) -> float:
        """``iqr / median``; above 0.1 the measurement is noisy."""
        return self.iqr / self.median if self.median > 0 else math.inf

    @property
    def noisy(self) -> bool:
        return self.relative_iqr > NOISY

    @property
    def tflops(self) -> float | None:
        """Achieved TFLOP/s at the median time; None without ``flops``."""
        if self.flops is None:
            return None
        return self.flops / self.median / 1e12 if self.median > 0 else math.inf

    @property
    def mfu(self) -> float | None:
        """``tflops`` as a share of the peak (model FLOPs utilisation), never above 1; None
        when either is unknown, or when the rate exceeds the peak (:attr:`mfu_invalid` says
        why). ``peak.source`` says whether the peak is a datasheet's or measured here."""
        tflops = self.tflops
        if tflops is None or self.peak is None:
            return None
        return self.peak.share(tflops)[0]

    @property
    def mfu_invalid(self) -> str | None:
        """Why there is no MFU although FLOPs and a peak are known: a rate above the peak
        means the two were not measured alike (a peak measured under load, TF32 or bf16
        math set against an fp32 peak). None otherwise."""
        tflops = self.tflops
        if tflops is None or self.peak is None:
            return None
        return self.peak.share(tflops)[1]

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the samples (0.5 is the median), linearly interpolated."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile q must be within [0, 1], not {q}")
        return _quantile(self._sorted, q)

    @property
    def warnings(self) -> tuple[str, ...]:
        """What makes this measurement less trustworthy, for people."""
        out = []
        if self.count >= 4 and self.noisy:
            how = "grossly noisy" if self.relative_iqr > VERY_NOISY else "noisy"
            out.append(
                f"{how}: the IQR is {100 * self.relative_iqr:.1f}% of the median. Something "
                "else is using the machine, clocks are changing, or the function varies; "
                "close other work, raise min_time, or compare medians of several runs."
            )
        elif self.count < 4:
            out.append(f"only {self.count} sample(s): no spread can be judged; raise repeat.")
        if not self.flush_l2 and self.overhead > 0.01 * self.median * self.number:
            out.append(
                f"the clock costs {format_time(self.overhead)} per sample, over 1% of a "
                f"sample ({format_time(self.median * self.number)}); raise number."
            )
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """Plain types for JSON: the fields, and the statistics in seconds."""
        return {
            "label": self.label,
            "device": self.device,
            "clock": self.clock,
            "flush_l2": self.flush_l2,
            "warmup": self.warmup,
            "number": self.number,
            "count": self.count,
            "unit": self.unit,
            "median": self.median,
            "mean": self.mean,
            "iqr": self.iqr,
            "min": self.min,
            "max": self.max,
            "overhead": self.overhead,
            "flops": self.flops,
            "tflops": self.tflops,
            "mfu": self.mfu,
            "mfu_invalid": self.mfu_invalid,
            "peak_tflops": None if self.peak is None else self.peak.tflops,
            "peak_source": None if self.peak is None else self.peak.source,
            "times": list(self.times),
        }

    def __repr__(self) -> str:
        f = format_time
        head = (
            f"Measurement({self.label!r}, {self.device})"
            if self.label
            else (f"Measurement({self.device})")
        )
        lines = [
            f"{head}: median {f(self.median)} per call, IQR {f(self.iqr)} "
            f"({100 * self.relative_iqr:.1f}%), min {f(self.min)}, max {f(self.max)}",
            f"  {self.count} samples x {self.number} call{'s' if self.number != 1 else ''}, "
            f"{self.clock} clock, {self.warmup} warm-up call{'s' if self.warmup != 1 else ''}, "
            f"{'cache flushed before each sample' if self.flush_l2 else 'warm cache'}",
        ]
        if self.tflops is not None:
            rate = f"  {self.tflops:.4g} TFLOP/s ({self.flops:.4g} FLOP per call)"
            if self.mfu is not None and self.peak is not None:
                rate += f", MFU {self.mfu:.1%} of {self.peak.tflops:.4g} ({self.peak.source})"
            elif self.mfu_invalid is not None:
                rate += f", MFU not given: {self.mfu_invalid}"
            else:
                rate += ", MFU unknown: no peak is known for this device and dtype"
            lines.append(rate)
        lines += [f"  WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)


@dataclass(frozen=True)
class Calibration:
    """What :func:`autorange` chose: calls per sample, samples, and what it saw."""

    number: int  #: calls per sample
    repeat: int  #: samples
    overhead: float  #: seconds an empty sample takes
    estimate: float  #: seconds per call seen while choosing ``number``


def autorange(
    measure: Callable[[int], float],
    *,
    min_time: float = 0.2,
    number: int | None = None,
    repeat: int | None = None,
    max_overhead: float = 1e-3,
    max_samples: int = 1000,
    min_samples: int = 5,
    per_sample_cost: float = 0.0,
) -> Calibration:
    """Choose how many calls go into one sample, and how many samples to take.

    ``measure(n)`` runs the function ``n`` times as one sample and returns the seconds it
    took, clock and synchronisation included. The choice:

    1. The **overhead** ``o`` is the median of five empty samples, ``measure(0)``: the
       cost of reading the clock and synchronising, paid once per sample whatever ``n``.
    2. A sample must last at least ``target = max(o / max_overhead, min_time / max_samples)``.
       The first term bounds the clock's share of every sample (0.1% by default), so a
       1 µs function is not timed by a 10 µs synchronisation; the second caps the number
       of samples that fit in ``min_time``.
    3. ``n`` starts at 1 and grows, at most tenfold per step, towards the ``n`` that the
       last sample predicts will reach ``1.2 * target``, until a sample reaches ``target``.
       Unless three samples would take more than ``min_time``, the median of three
       decides, so one disturbed sample (a page fault, another process) neither stops the
       growth early nor sets the number of samples. These calibration samples also warm
       the function further, as in torch.utils.benchmark's ``blocked_autorange``; their
       times are not kept.
    4. ``repeat`` is as many such samples as fit in ``min_time``, at least ``min_samples`` so
       that a median and an IQR mean something, at most ``max_samples``.

    Why this gives honest numbers: the per-call time reported is ``(n * t + o) / n``,
    so the bias from the clock is ``o / n <= max_overhead * t`` by step 2, and ``n`` is fixed
    before measuring, so every sample is the same experiment. Because ``measure`` is the
    only source of time, the logic is tested with a fake clock.

    A function that takes 2 µs on a clock that costs 0.1 µs per sample: 60 calls per
    sample (the clock is 0.08% of one), and 833 samples fill 0.1 s.

    >>> plan = autorange(lambda n: n * 2e-6 + 1e-7, min_time=0.1)
    >>> plan.number, plan.repeat
    (60, 833)

    Args:
        measure: runs one sample of ``n`` calls and returns its seconds.
        min_time: seconds of samples to collect in all (when ``repeat`` is None).
        number: calls per sample; None chooses as above.
        repeat: samples; None chooses as above.
        max_overhead: largest share of a sample the clock may take.
        max_samples: most samples chosen automatically.
        min_samples: fewest samples chosen automatically.
        per_sample_cost: seconds spent between samples outside the clock (a cache flush),
            counted against ``min_time``.

    Returns:
        A :class:`Plan`.
    """
    overhead = _median_of([measure(0) for _ in range(5)])
    target = max(overhead / max_overhead, min_time / max_samples)
    n = number or 1
    while True:
        t = measure(n)
        if number is None and t < target and n < MAX_NUMBER:
            n = _grow(n, t, target)
            continue
        if 3 * (t + per_sample_cost) <= min_time:  # affordable: do not trust one sample
            t = _median_of([t, measure(n), measure(n)])
            if number is None and t < target and n < MAX_NUMBER:
                n = _grow(n, t, target)
                continue
        break
    if repeat is None:
        per_sample = t + per_sample_cost
        fit = math.ceil(min_time / per_sample) if per_sample > 0 else max_samples
        repeat = min(max(fit, min_samples), max_samples)
    return Calibration(number=n, repeat=repeat, overhead=overhead, estimate=t / n)


def _grow(n: int, t: float, target: float) -> int:
    """The next calls-per-sample: aim at 1.2x the target, at most tenfold, at least n + 1."""
    want = math.ceil(1.2 * n * target / t) if t > 0 else 10 * n
    return min(10 * n, max(n + 1, want), MAX_NUMBER)


def _median_of(values: Sequence[float]) -> float:
    return _quantile(sorted(values), 0.5)


def sample(
    call: Callable[[], object],
    device: torch.device,
    *,
    label: str,
    warmup: int,
    min_time: float = 0.2,
    number: int | None = None,
    repeat: int | None = None,
    flush_l2: bool = False,
    clock: Callable[[], float] | None = None,
    **rates: Any,
) -> Measurement:
    """Time ``call`` (already warmed up ``warmup`` times) on ``device``: the device is
    waited for, :func:`autorange` chooses calls per sample and samples, and each sample is
    timed by the device's clock (``clock`` instead, where given); with ``flush_l2`` the
    last-level cache is overwritten before each sample of one call. ``rates`` (``flops``,
    ``peak``) go to the :class:`Measurement` as they are."""
    synchronize(device)  # the warm-up's queued work ends before anything is timed
    timer = clock_for(device, clock)
    flush = flusher(device) if flush_l2 else None
    chosen = autorange(
        lambda n: timer.measure(call, n),
        min_time=min_time,
        number=1 if flush_l2 else number,
        repeat=repeat,
        per_sample_cost=0.0 if flush is None else timer.measure(flush, 1),
    )
    samples = timer.run(call, chosen.number, chosen.repeat, flush)
    return Measurement(
        times=tuple(t / chosen.number for t in samples),
        number=chosen.number,
        label=label,
        device=str(device),
        clock=timer.name,
        flush_l2=flush_l2,
        warmup=warmup,
        overhead=chosen.overhead,
        **rates,
    )
