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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from anydevice.errors import MeasurementError
from anydevice.hardware.selection import resolve
from anydevice.hardware.spec import DeviceLike
from anydevice.measure.clocks import (
    active_device,
    clock_name,
    device_of_arguments,
    synchronize,
)
from anydevice.measure.samples import Measurement, format_time, sample
from anydevice.measure.throughput import rates_for

if TYPE_CHECKING:
    from anydevice.measure.flops import FlopCount

__all__ = ["Measurement", "Timer", "timeit"]


# ----------------------------------------------------------------------------- autorange


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
    return sample(
        call,
        dev,
        label=label if label is not None else _name(fn),
        warmup=warmup,
        min_time=min_time,
        number=number,
        repeat=repeat,
        flush_l2=flush_l2,
        clock=clock,
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
