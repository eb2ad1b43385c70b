"""How well the hardware is used: peaks per dtype, and the :class:`Throughput` meter.

MFU (model FLOPs utilisation) is the FLOP/s a step reaches divided by what the device could
do at best, in the dtype the math ran in. The best comes from one of two places, and is
always named:

* the vendor's datasheet (dense math, boost clock) for a GPU in
  :mod:`anydevice.doctor.peaks`: "H100 SXM datasheet, dense bf16";
* otherwise a square matmul measured here, in that dtype (the CPU, MPS, a GPU the table
  does not know): "measured: fp32 matmul 2048^3 on cpu". It is measured once per process
  and device and dtype, in about a second, and is what this device reaches on dense
  matmuls, so an MFU against it reads "share of the best this device did".

No peak is ever guessed: a dtype the table lacks for a listed GPU (fp8) has none, and an
MFU is then None.

>>> import torch
>>> meter = Throughput(samples_per_step=32, flops_per_step=1e9, peak=2.0, device="cpu")
>>> for _ in range(3):
...     meter.step()
>>> stats = meter.compute()
>>> stats.steps, stats.samples_per_s > 0, 0 < stats.mfu
(2, True, True)
"""

from __future__ import annotations

import collections
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anydevice.clocks import active_device, resolve_device
from anydevice.errors import MeasurementError
from anydevice.matmul import MathSettings, strict_fp32
from anydevice.selection import DeviceLike

if TYPE_CHECKING:
    from anydevice.flops import FlopCount

__all__ = ["Peak", "Throughput", "ThroughputStats", "dtype_name", "peak_tflops", "rates_for"]

#: A measured peak grows the matmul until one call lasts this long (larger sizes only
#: approach the same rate) ...
_MEASURE_CALL_S = 0.05
#: ... or reaches this size (the CPU's, and an accelerator's).
_MEASURE_MAX_N = {"cpu": 4096}
_MEASURE_MAX_N_ACCELERATOR = 8192
_DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


@dataclass(frozen=True)
class Peak:
    """The best dense TFLOP/s of a device in one dtype, and where that number comes from.

    >>> Peak(989.4, "bf16", "H100 SXM datasheet, dense bf16")
    Peak(tflops=989.4, dtype='bf16', source='H100 SXM datasheet, dense bf16')
    """

    tflops: float
    dtype: str  #: "fp32", "tf32", "bf16", "fp16", ...
    source: str  #: the datasheet, or the matmul measured here

    @property
    def measured(self) -> bool:
        """True when measured on this machine rather than read from a datasheet."""
        return self.source.startswith("measured")


def dtype_name(dtype: torch.dtype, device: DeviceLike = "cpu", *, tf32: bool = False) -> str:
    """The peak table's name of a dtype: ``"fp32"``, ``"tf32"`` (fp32 on CUDA with TF32
    allowed), ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp64"``.

    >>> dtype_name(torch.bfloat16), dtype_name(torch.float32, "cpu", tf32=True)
    ('bf16', 'fp32')
    """
    kind = resolve_device(device).type if not isinstance(device, torch.device) else device.type
    if dtype == torch.float32:
        return "tf32" if tf32 and kind == "cuda" else "fp32"
    if dtype.is_floating_point and dtype.itemsize == 1:
        return "fp8"
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def peak_tflops(device: DeviceLike | None, dtype: str) -> Peak | None:
    """The device's best dense TFLOP/s in ``dtype``: datasheet, else measured, else None.

    >>> p = peak_tflops("cpu", "fp32")
    >>> p.measured, p.tflops > 0, p.source.startswith("measured: fp32 matmul")
    (True, True, True)

    Args:
        device: any device spec; None: the accelerator this process uses, else the CPU.
        dtype: a name as :func:`dtype_name` gives.

    Returns:
        A :class:`Peak`, or None when no peak is known for this dtype here.
    """
    dev = active_device() if device is None else resolve_device(device)
    if dev.type == "meta":
        return None
    if dev.type == "cuda":
        from anydevice.doctor.peaks import gpu_peak
        from anydevice.selection import describe

        table = gpu_peak(describe(dev, telemetry=False))
        if table is not None:
            value = table.tflops.get(dtype)
            if value is None:
                return None  # a listed GPU without this dtype in its datasheet: no guess
            return Peak(value, dtype, f"{table.model} datasheet, dense {dtype}")
    if dtype not in _DTYPES or (dtype == "tf32" and dev.type != "cuda"):
        return None
    tflops, n = _measured_peak(str(dev), dtype)
    return Peak(tflops, dtype, f"measured: {dtype} matmul {n}^3 on {dev}")


@functools.cache
def _measured_peak(device: str, dtype: str) -> tuple[float, int]:
    """The best TFLOP/s of square matmuls of growing size, and the size that reached it.

    Sizes double from 256 until one call lasts ``_MEASURE_CALL_S`` (so a CPU without native
    bf16, ~0.3 GFLOP/s, stops at the first size) or reach the cap. Kept for the process:
    the hardware does not change under it.
    """
    from anydevice.matmul import fast_matmul
    from anydevice.timing import timeit

    dev = torch.device(device)
    cap = _MEASURE_MAX_N.get(dev.type, _MEASURE_MAX_N_ACCELERATOR)
    best, best_n, n = 0.0, 0, 256
    while n <= cap:
        a = torch.randn(n, n, device=dev).to(_DTYPES[dtype])
        b = torch.randn(n, n, device=dev).to(_DTYPES[dtype])
        with fast_matmul() if dtype == "tf32" else strict_fp32():
            seconds = timeit(torch.mm, a, b, warmup=1, min_time=0.1, device=dev).median
        del a, b
        rate = 2 * n**3 / seconds / 1e12
        if rate > best:
            best, best_n = rate, n
        if seconds >= _MEASURE_CALL_S:
            break
        n *= 2
    return best, best_n


def rates_for(
    counted: int | float | FlopCount, dev: torch.device, args: tuple[Any, ...]
) -> dict[str, Any]:
    """The ``flops`` and ``peak`` fields of a :class:`~anydevice.timing.Measurement`: a
    number of FLOPs runs in the dtype in use at the call, a ``FlopCount`` in its own."""
    if isinstance(counted, (int, float)):
        dtype = _dtype_in_use(dev, args)
        total = int(counted)
    else:
        dtype = counted.dtype or dtype_name(torch.float32, dev)
        total = counted.total
    return {"flops": total, "peak": peak_tflops(dev, dtype) if dev.type != "meta" else None}


def _dtype_in_use(dev: torch.device, args: tuple[Any, ...]) -> str:
    """What autocast sets now on ``dev``, else the dtype of the first floating tensor."""
    if dev.type in ("cuda", "cpu", "xpu", "mps") and torch.is_autocast_enabled(dev.type):
        return dtype_name(torch.get_autocast_dtype(dev.type), dev)
    dtype = torch.float32
    for value in args:
        tensors = value.parameters() if isinstance(value, torch.nn.Module) else (value,)
        first = next(
            (t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()), None
        )
        if first is not None:
            dtype = first.dtype
            break
    tf32 = dev.type == "cuda" and MathSettings.capture().matmul_precision != "highest"
    return dtype_name(dtype, dev, tf32=tf32)


# ----------------------------------------------------------------------------- Throughput


@dataclass(frozen=True, repr=False)
class ThroughputStats:
    """Rates over a :class:`Throughput` meter's window; None where not given or not known.

    Summed over ranks when ``world_size > 1`` (rates add up; the MFU is the FLOP/s of all
    ranks over the peaks of all ranks).
    """

    steps: int  #: steps in the window
    seconds: float  #: the window's duration (the slowest rank's, when distributed)
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None  #: achieved TFLOP/s
    mfu: float | None = None  #: ``tflops`` over the peak
    peak: Peak | None = None  #: one device's peak (per rank)
    world_size: int = 1
    clock: str = "perf_counter"

    @property
    def step_time(self) -> float:
        """Seconds per step over the window."""
        return self.seconds / self.steps

    def to_dict(self) -> dict[str, Any]:
        """Plain types for JSON."""
        return {
            "steps": self.steps,
            "seconds": self.seconds,
            "step_time": self.step_time,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops": self.tflops,
            "mfu": self.mfu,
            "peak_tflops": None if self.peak is None else self.peak.tflops,
            "peak_source": None if self.peak is None else self.peak.source,
            "world_size": self.world_size,
            "clock": self.clock,
        }

    def __repr__(self) -> str:
        from anydevice.timing import format_time

        parts = [f"{self.steps} steps, {format_time(self.step_time)}/step"]
        if self.samples_per_s is not None:
            parts.append(f"{self.samples_per_s:.4g} samples/s")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.4g} tokens/s")
        if self.tflops is not None:
            parts.append(f"{self.tflops:.4g} TFLOP/s")
        if self.mfu is not None and self.peak is not None:
            parts.append(f"MFU {self.mfu:.1%} of {self.peak.tflops:.4g} ({self.peak.source})")
        ranks = f" over {self.world_size} ranks" if self.world_size > 1 else ""
        return f"ThroughputStats({', '.join(parts)}{ranks})"


class Throughput:
    """A training-loop meter: samples/s, tokens/s, TFLOP/s and MFU over a sliding window.

    Call :meth:`step` once per iteration, after the step's work is queued; call
    :meth:`compute` when you log. On CUDA (XPU, MPS, and any accelerator whose events
    time) :meth:`step` records a timing event on the current stream and returns at once,
    so the meter adds no synchronisation to the loop: only :meth:`compute` waits, for the
    newest event, and reads the elapsed device time between the oldest and newest event in
    the window. On the CPU the work is
    done when :meth:`step` is called, and it reads ``time.perf_counter``.

    When a ``torch.distributed`` process group with more than one rank is initialised,
    :meth:`compute` sums the rates of all ranks (an all-reduce of four numbers): every rank
    must call it at the same step.

    >>> meter = Throughput(samples_per_step=8, tokens_per_step=8 * 128, device="cpu")
    >>> for _ in range(5):
    ...     meter.step()
    >>> s = meter.compute()
    >>> s.steps, s.tokens_per_s == 128 * s.samples_per_s, s.mfu is None
    (4, True, True)

    Args:
        flops_per_step: FLOPs of one step (``ad.flops(step).total``), for TFLOP/s and MFU.
        samples_per_step: samples per step (the batch size).
        tokens_per_step: tokens per step (batch size x sequence length).
        window: steps the rates are computed over (the newest ones).
        device: where the steps run; None: the accelerator this process uses at the first
            :meth:`step`, else the CPU.
        peak: the per-device peak for the MFU: ``"auto"`` looks it up for ``dtype``
            (:func:`peak_tflops`), a number is TFLOP/s you trust, a :class:`Peak`, or None.
        dtype: the dtype the step's math runs in, as :func:`dtype_name` names it
            (``ad.flops(step).dtype`` tells); used with ``peak="auto"``.
        clock: seconds for the host clock (tests); forces host timing on any device.
    """

    def __init__(
        self,
        *,
        flops_per_step: float | None = None,
        samples_per_step: float | None = None,
        tokens_per_step: float | None = None,
        window: int = 100,
        device: DeviceLike | None = None,
        peak: Peak | float | str | None = "auto",
        dtype: str = "fp32",
        clock: Callable[[], float] | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 step, not {window}")
        for name, value in (
            ("flops_per_step", flops_per_step),
            ("samples_per_step", samples_per_step),
            ("tokens_per_step", tokens_per_step),
        ):
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, not {value}")
        if isinstance(peak, str) and peak != "auto":
            raise ValueError(
                f"peak must be 'auto', a number of TFLOP/s, a Peak or None, not {peak!r}"
            )
        self._device = None if device is None else resolve_device(device)
        self.flops_per_step = flops_per_step
        self.samples_per_step = samples_per_step
        self.tokens_per_step = tokens_per_step
        self.window = window
        self.dtype = dtype
        self._peak_arg = peak
        self._peak: Peak | bool | None = False  # False: not looked up yet
        self._clocked = clock is not None
        self._events: Any = None if self._device is None else self._event_class()
        self._now = clock or time.perf_counter
        # (mark, samples, tokens, flops) per step; the oldest mark starts the window
        self._marks: collections.deque[tuple[Any, float, float, float]] = collections.deque(
            maxlen=window + 1
        )

    @property
    def device(self) -> torch.device:
        """Where the steps run: given, else the accelerator in use at the first step."""
        return self._resolve()

    def _resolve(self) -> torch.device:
        if self._device is None:  # at the first step, after the model went to its device
            self._device = active_device()
            self._events = self._event_class()
        return self._device

    def _event_class(self) -> Any:
        return None if self._clocked else _event_class(self.device)

    @property
    def clock(self) -> str:
        return "perf_counter" if self._events is None else f"{self.device.type}-event"

    def step(
        self,
        *,
        samples: float | None = None,
        tokens: float | None = None,
        flops: float | None = None,
    ) -> None:
        """Mark the end of one step; ``samples``/``tokens``/``flops`` override the per-step
        numbers for this step (a last, smaller batch)."""
        self._resolve()
        if self._events is None:
            mark: Any = self._now()
        else:
            full = len(self._marks) == self._marks.maxlen
            # The event leaving the window is waited on by no one: record it again.
            mark = self._marks.popleft()[0] if full else self._events(enable_timing=True)
            mark.record()
        self._marks.append(
            (
                mark,
                _pick(samples, self.samples_per_step),
                _pick(tokens, self.tokens_per_step),
                _pick(flops, self.flops_per_step),
            )
        )

    def reset(self) -> None:
        """Forget every step (after an evaluation pause, say)."""
        self._marks.clear()

    def compute(self) -> ThroughputStats:
        """The rates over the window: waits for the newest step's work on the device.

        Raises:
            MeasurementError: fewer than two steps were marked (one step has no duration).
        """
        if len(self._marks) < 2:
            raise MeasurementError(
                f"Throughput.compute(): {len(self._marks)} step(s) marked; the rates need at "
                "least 2 calls to step() (the first marks the start)."
            )
        marks = list(self._marks)
        first, last = marks[0][0], marks[-1][0]
        if self._events is None:
            seconds = last - first
        else:
            last.synchronize()
            seconds = first.elapsed_time(last) / 1000.0
        steps = len(marks) - 1
        totals = [math.fsum(m[i] for m in marks[1:]) for i in (1, 2, 3)]
        peak = self._resolve_peak()
        rates = [t / seconds if seconds > 0 else math.inf for t in totals]
        peak_flops = peak.tflops * 1e12 if peak is not None else 0.0
        (samples, tokens, flop_rate, peak_flops), world, seconds = _across_ranks(
            [*rates, peak_flops], seconds
        )
        return ThroughputStats(
            steps=steps,
            seconds=seconds,
            samples_per_s=samples if self.samples_per_step is not None else None,
            tokens_per_s=tokens if self.tokens_per_step is not None else None,
            tflops=flop_rate / 1e12 if self.flops_per_step is not None else None,
            mfu=flop_rate / peak_flops if self.flops_per_step is not None and peak_flops else None,
            peak=peak,
            world_size=world,
            clock=self.clock,
        )

    def _resolve_peak(self) -> Peak | None:
        if self._peak is False:
            arg = self._peak_arg
            if arg is None or self.flops_per_step is None:
                self._peak = None
            elif isinstance(arg, Peak):
                self._peak = arg
            elif isinstance(arg, str):
                self._peak = peak_tflops(self.device, self.dtype)
            else:
                self._peak = Peak(float(arg), self.dtype, "given")
        return self._peak if isinstance(self._peak, Peak) else None

    def __repr__(self) -> str:
        steps = max(0, len(self._marks) - 1)
        return f"Throughput({self.device}, {steps} steps in a window of {self.window})"


def _across_ranks(values: list[float], seconds: float) -> tuple[list[float], int, float]:
    """Each value summed over the ranks, the world size, and the longest window."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return values, 1, seconds
    on = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
        on = torch.device("cuda", torch.cuda.current_device())
    sums = torch.tensor(values, dtype=torch.float64, device=on)
    longest = torch.tensor([seconds], dtype=torch.float64, device=on)
    dist.all_reduce(sums)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    return [float(v) for v in sums.tolist()], dist.get_world_size(), float(longest)


def _pick(value: float | None, default: float | None) -> float:
    if value is not None:
        return float(value)
    return 0.0 if default is None else float(default)


def _event_class(device: torch.device) -> Any:
    """The timing-event class of the device's stream, None where the host clock is right."""
    if device.type == "cuda":
        return torch.cuda.Event
    if device.type == "xpu":
        return torch.xpu.Event
    if device.type == "mps":
        return torch.mps.event.Event
    from anydevice.clocks import _event_stream

    if _event_stream(device) is not None:  # another accelerator whose events time work
        return torch.Event
    return None
