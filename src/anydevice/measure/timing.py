"""Timing device code correctly: :func:`timeit`, :class:`Timer` and :class:`Measurement`.

Work on an accelerator is asynchronous: a kernel launch returns long before the kernel
ends, so a host clock read around it times the launch, not the work. :func:`timeit` times
CUDA code with CUDA events recorded on the current stream, and waits once at the end;
everywhere else it reads ``time.perf_counter`` with the device synchronised on both sides
of every sample (``torch.accelerator`` for MPS and XPU, nothing for the CPU).

>>> import torch
>>> m = timeit(torch.add, torch.ones(8), 1, min_time=0.01)
>>> m.device, m.clock, m.median > 0
('cpu', 'perf_counter', True)
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anydevice.errors import MeasurementError
from anydevice.hardware.selection import DeviceLike, resolve
from anydevice.measure.clocks import (
    active_device,
    clock_for,
    clock_name,
    device_of_arguments,
    flusher,
    synchronize,
)

if TYPE_CHECKING:
    from anydevice.measure.flops import FlopCount
    from anydevice.measure.throughput import Peak

__all__ = ["Measurement", "Plan", "Timer", "autorange", "format_time", "timeit"]

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


# ----------------------------------------------------------------------------- autorange


@dataclass(frozen=True)
class Plan:
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
) -> Plan:
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
    return Plan(number=n, repeat=repeat, overhead=overhead, estimate=t / n)


def _grow(n: int, t: float, target: float) -> int:
    """The next calls-per-sample: aim at 1.2x the target, at most tenfold, at least n + 1."""
    want = math.ceil(1.2 * n * target / t) if t > 0 else 10 * n
    return min(10 * n, max(n + 1, want), MAX_NUMBER)


def _median_of(values: Sequence[float]) -> float:
    return _quantile(sorted(values), 0.5)


# ----------------------------------------------------------------------------- timeit


def timeit(
    fn: Callable[..., object],
    *args: Any,
    warmup: int = 3,
    repeat: int | None = None,
    number: int | None = None,
    min_time: float = 0.2,
    flush_l2: bool = False,
    device: DeviceLike | None = None,
    label: str | None = None,
    clock: Callable[[], float] | None = None,
    flops: int | float | FlopCount | bool | None = None,
    **kwargs: Any,
) -> Measurement:
    """Time ``fn(*args, **kwargs)`` on its device, correctly, and return every sample.

    1. **Warm-up**: ``warmup`` calls first, so one-time costs are not measured:
       ``torch.compile`` compilation and autotuning, CUDA graph recording
       (``mode="reduce-overhead"`` records on the second or third call), cuDNN benchmark
       search, lazy initialisation, allocator growth.
    2. **Calibration** (:func:`autorange`): how many calls per sample keep the clock's own
       cost under 0.1% of a sample, and how many samples fill ``min_time``.
    3. **Samples**: on CUDA, a pair of CUDA events on the current stream brackets each
       sample and the host waits once at the end, so back-to-back samples keep the GPU
       busy as real code does; with ``flush_l2=True`` a buffer twice the size of the L2
       cache is zeroed before each sample, outside the timed window, for cold-cache times
       (as triton's ``do_bench`` does), and each sample is a single call. Elsewhere
       ``time.perf_counter`` with the device synchronised on both sides of each sample.

    Work that ``fn`` queues on other CUDA streams must be joined to the current stream
    inside ``fn``, or the events do not see it.

    With ``flops`` the measurement also has ``.tflops`` and ``.mfu``: ``flops=True`` counts
    the FLOPs of the first warm-up call (:func:`~anydevice.measure.flops.flops`, an extra call when
    ``warmup=0``) and the dtype they ran in; a :class:`~anydevice.measure.flops.FlopCount` brings
    both; a number is taken as FLOPs per call, in the dtype autocast sets at this call, else
    that of the first floating tensor among the arguments (TF32 for fp32 on CUDA where
    torch's matmul setting resolves to TF32: :func:`~anydevice.numerics.matmul.fast_matmul`,
    ``torch.backends.cuda.matmul.fp32_precision = "tf32"``, the legacy flags). The peak is
    the datasheet's, else a matmul measured once here
    (:func:`~anydevice.measure.throughput.peak_tflops`). A rate above the peak gives no MFU:
    ``mfu`` is None and ``mfu_invalid`` says why.

    >>> import torch
    >>> a = torch.randn(64, 64)
    >>> m = timeit(torch.mm, a, a, min_time=0.01, label="mm 64")
    >>> m.label, m.device, m.warmup, m.count >= 5
    ('mm 64', 'cpu', 3, True)

    Args:
        fn: the function; ``args`` and ``kwargs`` are passed to it. Keyword arguments with
            the names below go to ``timeit``: wrap ``fn`` in a lambda or
            ``functools.partial`` to pass such names to it. ``device=`` also goes to an
            ``fn`` that takes it (``ad.timeit(torch.ones, n, device="cuda")`` allocates
            on the GPU it times); where ``fn`` takes one of the others too, ``timeit``
            refuses with a ``TypeError`` rather than guess whose it is.
        warmup: calls before anything is measured.
        repeat: samples; None collects about ``min_time`` seconds of them (5 to 1000).
        number: calls per sample; None chooses so the clock costs under 0.1% of a sample.
        min_time: seconds of samples to collect when ``repeat`` is None.
        flush_l2: flush the last-level cache before each sample (cold-cache numbers).
        device: where ``fn`` runs, any device spec. None: the device of the first tensor
            (or module) among the arguments, else the accelerator this process is using
            after the warm-up, else the CPU.
        label: a name for the repr.
        clock: a function returning seconds, used instead of CUDA events and
            ``perf_counter`` (for tests with a fake clock).
        flops: FLOPs per call (a number, a ``FlopCount``), or True to count them.

    Returns:
        A :class:`Measurement` (seconds per call).

    Raises:
        ValueError: a negative ``warmup``, ``min_time``, or a ``number``/``repeat`` below 1.
        TypeError: ``fn`` is not callable, or takes a keyword of ``timeit``'s own (not
            ``device``) that was given.
        DeviceNotFoundError: ``device`` names a device that is not here.
    """
    if not callable(fn):
        raise TypeError(
            f"timeit's fn must be the function to time, not {type(fn).__name__} ({fn!r}); "
            "pass it with its arguments, as in ad.timeit(model, x) or ad.timeit(torch.mm, a, b)"
        )
    _check_counts(warmup=warmup, repeat=repeat, number=number, min_time=min_time)
    if device is not None and "device" not in kwargs and _takes(fn, "device"):
        kwargs["device"] = device  # ad.timeit(torch.ones, n, device="cuda"): where both run
    _refuse_shared_keywords(
        fn,
        label=label,
        number=number,
        repeat=repeat,
        clock=clock,
        flops=flops,
        **({"warmup": warmup} if warmup != 3 else {}),
        **({"min_time": min_time} if min_time != 0.2 else {}),
        **({"flush_l2": flush_l2} if flush_l2 else {}),
    )
    call: Callable[[], object] = functools.partial(fn, *args, **kwargs) if args or kwargs else fn
    found = None if device is not None else device_of_arguments(iter((*args, *kwargs.values())))
    from anydevice.measure.throughput import rates_for

    counted: int | float | FlopCount | None = None
    if flops is True:
        from anydevice.measure.flops import flops as count_flops

        counted = count_flops(call)
    elif flops is not None and flops is not False:
        if isinstance(flops, (int, float)) and not flops >= 0:
            raise ValueError(f"flops must be >= 0 FLOPs per call, not {flops}")
        counted = flops
    for _ in range(warmup - 1 if flops is True and warmup else warmup):
        call()
    dev = resolve(device) if device is not None else found or active_device()
    synchronize(dev)  # the warm-up's queued work ends before anything is timed
    timer = clock_for(dev, clock)
    flush = flusher(dev) if flush_l2 else None
    plan = autorange(
        lambda n: timer.measure(call, n),
        min_time=min_time,
        number=1 if flush_l2 else number,
        repeat=repeat,
        per_sample_cost=0.0 if flush is None else timer.measure(flush, 1),
    )
    samples = timer.run(call, plan.number, plan.repeat, flush)
    return Measurement(
        times=tuple(t / plan.number for t in samples),
        number=plan.number,
        label=label if label is not None else _name(fn),
        device=str(dev),
        clock=timer.name,
        flush_l2=flush_l2,
        warmup=warmup,
        overhead=plan.overhead,
        **({} if counted is None else rates_for(counted, dev, (*args, *kwargs.values()))),
    )


#: What each of timeit's own keywords means, for the message when ``fn`` takes it too.
_OWN = {
    "label": "the measurement's name",
    "number": "calls per sample",
    "repeat": "samples",
    "warmup": "calls before timing",
    "min_time": "seconds of samples",
    "flush_l2": "cold-cache samples",
    "clock": "the clock",
    "flops": "FLOPs per call",
}


def _takes(fn: Callable[..., object], name: str) -> bool:
    """Whether ``fn`` takes keyword ``name`` and a ``functools.partial`` does not bind it."""
    bound = set(fn.keywords) if isinstance(fn, functools.partial) else set()
    return name not in bound and name in _keywords_of(fn)


def _refuse_shared_keywords(fn: Callable[..., object], **given: object) -> None:
    """Refuse a keyword of timeit's own, other than ``device``, that ``fn`` takes too
    (``label=``, ``number=``, ...): whose it is cannot be told. ``given`` holds the
    keywords the caller set (None: not set); a ``functools.partial`` that already binds
    the name is not ambiguous."""
    names = {k for k, v in given.items() if v is not None}
    if not names:
        return
    clash = sorted(n for n in names if _takes(fn, n))
    if not clash:
        return
    name = clash[0]
    inner = getattr(fn, "func", fn)
    fn_name = getattr(inner, "__name__", None) or _name(fn) or "fn"
    raise TypeError(
        f"ad.timeit({fn_name}, ..., {name}={given[name]!r}): {name}= is timeit's own "
        f"({_OWN[name]}) and {fn_name} takes one too. Give {fn_name} its own as "
        f"functools.partial({fn_name}, {name}={given[name]!r}), and timeit's besides if "
        "you want both."
    )


def _keywords_of(fn: Callable[..., object]) -> set[str]:
    """The keyword names ``fn`` takes by name, where they can be known: its signature, or
    for torch's builtins the signature their docstring opens with. Empty for a function
    with ``**kwargs`` (anything may be meant) or one that says nothing."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        first = (getattr(fn, "__doc__", None) or "").strip().split("\n", 1)[0]
        return set(re.findall(r"\b(\w+)=", first))
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return set()
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in by_name}


def _check_counts(*, warmup: int, repeat: int | None, number: int | None, min_time: float) -> None:
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0 calls, not {warmup}")
    if repeat is not None and repeat < 1:
        raise ValueError(f"repeat must be >= 1 sample, not {repeat}")
    if number is not None and number < 1:
        raise ValueError(f"number must be >= 1 call per sample, not {number}")
    if not min_time >= 0:
        raise ValueError(f"min_time must be >= 0 seconds, not {min_time}")


def _name(fn: object) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    if isinstance(inner, torch.nn.Module):
        return type(inner).__name__
    name = getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None)
    if name is None or "<lambda>" in name:
        return ""
    if name.startswith("_"):  # torch builtins: "_VariableFunctionsClass.mm" -> "mm"
        return str(getattr(inner, "__name__", name))
    return str(name)


# ----------------------------------------------------------------------------- Timer


class Timer:
    """Times a block of code, with the device synchronised when it starts and ends.

    Like ``timeit.Timer`` it takes its clock as an argument; unlike a bare
    ``perf_counter()`` pair it waits for the device, so the GPU work the block queued is
    inside the time. Every block timed is kept, so one Timer can time each step of a loop.

    >>> t = Timer("cpu")
    >>> with t:
    ...     _ = sum(range(1000))
    >>> t.elapsed > 0, len(t.laps)
    (True, 1)

    Args:
        device: the device to synchronise, any device spec; None synchronises whatever
            accelerator the process is using at each end (nothing on a CPU-only run).
        clock: a function returning seconds (default ``time.perf_counter``).
        label: a name for :meth:`measurement`.
    """

    def __init__(
        self,
        device: DeviceLike | None = None,
        *,
        clock: Callable[[], float] | None = None,
        label: str = "",
    ) -> None:
        self._device = None if device is None else resolve(device)
        self._now = clock or time.perf_counter
        self._clock_name = "perf_counter" if clock is None else clock_name(clock)
        self.label = label
        self._start: float | None = None
        self._laps: list[float] = []

    @property
    def device(self) -> torch.device | None:
        """The device synchronised, None when it is whichever is in use."""
        return self._device

    def start(self) -> Timer:
        """Synchronise the device and start the clock."""
        if self._start is not None:
            raise MeasurementError("Timer.start(): this Timer is already running; stop() it first.")
        synchronize(self._device)
        self._start = self._now()
        return self

    def stop(self) -> float:
        """Synchronise the device, stop the clock, keep the lap and return it in seconds."""
        if self._start is None:
            raise MeasurementError("Timer.stop(): this Timer was not started; call start() first.")
        synchronize(self._device)
        lap = self._now() - self._start
        self._start = None
        self._laps.append(lap)
        return lap

    def __enter__(self) -> Timer:
        return self.start()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.stop()
        else:
            self._start = None  # a failed block is not a lap; do not synchronise over its error

    @property
    def running(self) -> bool:
        return self._start is not None

    @property
    def elapsed(self) -> float:
        """Seconds the last block took."""
        if not self._laps:
            raise MeasurementError("Timer.elapsed: no block has been timed yet.")
        return self._laps[-1]

    @property
    def laps(self) -> tuple[float, ...]:
        """Seconds of every block timed, in order."""
        return tuple(self._laps)

    @property
    def total(self) -> float:
        """Seconds of all blocks together."""
        return math.fsum(self._laps)

    def reset(self) -> None:
        """Forget every lap."""
        self._laps.clear()
        self._start = None

    def measurement(self) -> Measurement:
        """The laps as a :class:`Measurement` (one call per sample, no warm-up)."""
        if not self._laps:
            raise MeasurementError("Timer.measurement(): no block has been timed yet.")
        device = self._device or active_device()
        return Measurement(
            times=tuple(self._laps), label=self.label, device=str(device), clock=self._clock_name
        )

    def __repr__(self) -> str:
        where = "in-use device" if self._device is None else str(self._device)
        if not self._laps:
            return f"Timer({where}: not run yet)"
        return f"Timer({where}: last {format_time(self._laps[-1])}, {len(self._laps)} laps)"
