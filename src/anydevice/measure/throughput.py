"""How well the hardware is used: peaks per dtype, and the :class:`Throughput` meter.

MFU (model FLOPs utilisation) is the FLOP/s a step reaches divided by what the device could
do at best, in the dtype the math ran in. The best comes from one of two places, and is
always named:

* the vendor's datasheet (dense math, boost clock) for a GPU in
  :mod:`anydevice.hardware.peaks`: "H100 SXM datasheet, dense bf16";
* otherwise a square matmul measured here, in that dtype (the CPU, MPS, a GPU the table
  does not know): "measured: fp32 matmul 2048^3 on cpu, 2 threads". It is measured once
  per process and device and dtype (and number of threads, on the CPU), in about a second,
  and is what this device reaches on dense matmuls, so an MFU against it reads "share of
  the best this device did".

No peak is ever guessed: a dtype the table lacks for a listed GPU (fp8 on an A100) has
none, and an MFU is then None. Nor is an MFU above 100 % ever given: a rate above the peak
means the two were not measured alike (a peak measured under load, FLOPs counted in
another dtype than the math ran in), so the MFU is None and ``mfu_invalid`` says why.

>>> import torch
>>> meter = Throughput(samples_per_step=32, flops_per_step=1e9, dtype="fp32", device="cpu")
>>> for _ in range(3):
...     meter.step()
>>> stats = meter.compute()
>>> stats.steps, stats.samples_per_s > 0, stats.peak.measured
(2, True, True)
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anydevice.errors import MeasurementError
from anydevice.hardware import pulse
from anydevice.hardware.backends import autocast_kinds, collective_device, facts, runtime
from anydevice.hardware.peaks import Peak
from anydevice.hardware.selection import resolve
from anydevice.hardware.spec import DeviceLike
from anydevice.measure.clocks import active_device
from anydevice.numerics.matmul import MathSettings, strict_fp32

if TYPE_CHECKING:
    from anydevice.measure.flops import FlopCount

__all__ = ["Peak", "Throughput", "ThroughputStats", "dtype_name", "peak_tflops", "rates_for"]

#: A measured peak grows the matmul until one call lasts this long (larger sizes only
#: approach the same rate) ...
_MEASURE_CALL_S = 0.05
#: ... or reaches this size (the host's, and an accelerator's).
_MEASURE_MAX_N_HOST = 4096
_MEASURE_MAX_N_ACCELERATOR = 8192
#: The dtype names peaks are kept under (dtype_name's).
_DTYPE_NAMES = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp64")
_DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


def dtype_name(dtype: torch.dtype, device: DeviceLike = "cpu", *, tf32: bool = False) -> str:
    """The peak table's name of a dtype: ``"fp32"``, ``"tf32"`` (fp32 on CUDA with TF32
    allowed), ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp64"``.

    >>> dtype_name(torch.bfloat16), dtype_name(torch.float32, "cpu", tf32=True)
    ('bf16', 'fp32')
    """
    kind = resolve(device).type if not isinstance(device, torch.device) else device.type
    if dtype == torch.float32:
        return "tf32" if tf32 and facts(kind).tf32 else "fp32"
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
    dev = active_device() if device is None else resolve(device)
    backend = runtime(dev.type)
    if not backend.holds_data:
        return None
    if not backend.is_host:  # an accelerator the datasheet table may list
        from anydevice.hardware.peaks import gpu_peak
        from anydevice.hardware.selection import describe

        table = gpu_peak(describe(dev, telemetry=False))
        if table is not None:
            value = table.tflops.get(dtype)
            if value is None:
                return None  # a listed GPU without this dtype in its datasheet: no guess
            return Peak(value, dtype, f"{table.model} datasheet, dense {dtype}")
    if dtype not in _DTYPES or (dtype == "tf32" and not facts(dev.type).tf32):
        return None
    # The CPU's rate follows torch's thread count: a peak measured with other threads than
    # the step would make a wrong MFU, so each count has its own.
    threads = torch.get_num_threads() if backend.is_host else 0
    tflops, n = _measured_peak(str(dev), dtype, threads)
    on = f"{dev}, {threads} thread{'s' if threads != 1 else ''}" if threads else str(dev)
    return Peak(tflops, dtype, f"measured: {dtype} matmul {n}^3 on {on}")


@functools.cache
def _measured_peak(device: str, dtype: str, threads: int) -> tuple[float, int]:
    """The best TFLOP/s of square matmuls of growing size, and the size that reached it.

    Sizes double from 256 until one call lasts ``_MEASURE_CALL_S`` (so a CPU without native
    bf16, ~0.3 GFLOP/s, stops at the first size) or reach the cap. Kept for the process
    (per number of CPU threads): the hardware does not change under it.
    """
    from anydevice.measure.samples import sample

    dev = torch.device(device)
    cap = _MEASURE_MAX_N_HOST if runtime(dev.type).is_host else _MEASURE_MAX_N_ACCELERATOR
    best, best_n, n = 0.0, 0, 256
    while n <= cap:
        a = torch.randn(n, n, device=dev).to(_DTYPES[dtype])
        b = torch.randn(n, n, device=dev).to(_DTYPES[dtype])
        with _math_for(dev, dtype):
            mm = functools.partial(torch.mm, a, b)
            mm()  # the warm-up: kernel choice, caches
            seconds = sample(mm, dev, label=f"mm {n}", warmup=1, min_time=0.1).median
        del a, b
        rate = 2 * n**3 / seconds / 1e12
        if rate > best:
            best, best_n = rate, n
        if seconds >= _MEASURE_CALL_S:
            break
        n *= 2
    return best, best_n


def _math_for(dev: torch.device, dtype: str) -> contextlib.AbstractContextManager[object]:
    """The fp32 math settings a ``dtype`` peak is measured under: TF32 for "tf32", full
    fp32 for "fp32". Left alone where they already are so (the settings are process-wide:
    another thread's matmul would see them move), and for dtypes they do not touch."""
    from anydevice.numerics.matmul import fast_matmul

    if dtype not in ("fp32", "tf32"):
        return contextlib.nullcontext()
    now = MathSettings.capture()
    governs = facts(dev.type).math  # cuBLAS's, oneDNN's
    if governs is not None:
        current = now.precision("matmul", governs)
    else:  # other backends read the legacy setting
        current = "ieee" if now.matmul_precision == "highest" else "reduced"
    wanted = "tf32" if dtype == "tf32" else "ieee"
    if current == wanted:
        return contextlib.nullcontext()
    return fast_matmul() if dtype == "tf32" else strict_fp32()


def rates_for(
    counted: int | float | FlopCount, dev: torch.device, args: tuple[Any, ...]
) -> dict[str, Any]:
    """The ``flops`` and ``peak`` fields of a :class:`~anydevice.measure.samples.Measurement`: a
    number of FLOPs runs in the dtype in use at the call, a ``FlopCount`` in its own."""
    if isinstance(counted, (int, float)):
        dtype = _dtype_in_use(dev, args)
        total = int(counted)
    else:
        dtype = counted.dtype or dtype_name(torch.float32, dev)
        total = counted.total
    return {"flops": total, "peak": peak_tflops(dev, dtype)}


def _dtype_in_use(dev: torch.device, args: tuple[Any, ...]) -> str:
    """What autocast sets now on ``dev``, else the dtype of the first floating tensor."""
    autocast = _autocast_dtype(dev)
    if autocast is not None:
        return autocast
    dtype = torch.float32
    for value in args:
        tensors = value.parameters() if isinstance(value, torch.nn.Module) else (value,)
        first = next(
            (t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()), None
        )
        if first is not None:
            dtype = first.dtype
            break
    tf32 = facts(dev.type).tf32 and MathSettings.capture().precision("matmul") == "tf32"
    return dtype_name(dtype, dev, tf32=tf32)


def _autocast_dtype(dev: torch.device) -> str | None:
    """The dtype autocast computes in on ``dev``'s type now, None where it is off."""
    kind = dev.type
    if not facts(kind).autocast or not torch.is_autocast_enabled(kind):
        return None
    return dtype_name(torch.get_autocast_dtype(kind), dev)


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
    mfu: float | None = None  #: ``tflops`` over the peak, never above 1
    peak: Peak | None = None  #: one device's peak (per rank)
    world_size: int = 1
    clock: str = "perf_counter"
    #: why ``mfu`` is None although FLOPs were given: the rate exceeds the peak, the dtype
    #: of the step's math is not known, or no peak is known for it
    mfu_invalid: str | None = None

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
            "mfu_invalid": self.mfu_invalid,
            "peak_tflops": None if self.peak is None else self.peak.tflops,
            "peak_source": None if self.peak is None else self.peak.source,
            "world_size": self.world_size,
            "clock": self.clock,
        }

    def __repr__(self) -> str:
        from anydevice.measure.samples import format_time

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
        invalid = f"\n  MFU not given: {self.mfu_invalid}" if self.mfu_invalid else ""
        return f"ThroughputStats({', '.join(parts)}{ranks}){invalid}"


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

    The MFU is set against the peak of the dtype the step's math runs in: ``dtype`` when
    given, else the dtype a :class:`~anydevice.measure.flops.FlopCount` passed as
    ``flops_per_step`` counted, else the dtype autocast computes in where it is on when the
    meter is built or at a :meth:`step`. Where none of these tells, the meter does not
    guess (fp32 against a bf16 step reads ~15x too high on an H100): the MFU is None and
    ``mfu_invalid`` says what to pass.

    Args:
        flops_per_step: FLOPs of one step, for TFLOP/s and MFU: ``ad.flops(step)`` (its
            total, and the dtype it counted), or a number.
        samples_per_step: samples per step (the batch size).
        tokens_per_step: tokens per step (batch size x sequence length).
        window: steps the rates are computed over (the newest ones).
        device: where the steps run; None: the accelerator this process uses at the first
            :meth:`step`, else the CPU.
        peak: the per-device peak for the MFU: ``"auto"`` looks it up for the step's dtype
            (:func:`peak_tflops`), a number is TFLOP/s you trust, a :class:`Peak`, or None.
        dtype: the dtype the step's math runs in, as :func:`dtype_name` names it
            (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"fp64"``); None:
            found out as above.
        clock: seconds for the host clock (tests); forces host timing on any device.

    Raises:
        ValueError: a ``window`` below 1, a negative count, an unknown ``peak`` or ``dtype``.
    """

    def __init__(
        self,
        *,
        flops_per_step: float | FlopCount | None = None,
        samples_per_step: float | None = None,
        tokens_per_step: float | None = None,
        window: int = 100,
        device: DeviceLike | None = None,
        peak: Peak | float | str | None = "auto",
        dtype: str | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        from anydevice.measure.flops import FlopCount

        counted: str | None = None
        if isinstance(flops_per_step, FlopCount):
            counted, flops_per_step = flops_per_step.dtype, flops_per_step.total
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
        if dtype is not None and dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"dtype={dtype!r} is not a dtype name the peaks know: use one of "
                f"{', '.join(map(repr, _DTYPE_NAMES))}, or None to take it from the step."
            )
        self._device = None if device is None else resolve(device)
        self.flops_per_step = flops_per_step
        self.samples_per_step = samples_per_step
        self.tokens_per_step = tokens_per_step
        self.window = window
        self.dtype = dtype
        self._counted_dtype = counted
        # Autocast dtypes seen, per device type: where the meter was built, and at steps.
        self._autocast: dict[str, set[str]] = {}
        self._kind: str | None = ""  # "": the device is not known yet
        for kind in autocast_kinds():
            if self._device is None or self._device.type == kind:
                self._see_autocast(torch.device(kind))
        self._peak_arg = peak
        self._peaks: dict[str, Peak | None] = {}  # looked up, per dtype
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

    def _autocast_kind(self) -> str | None:
        """The device type whose autocast each step looks at (None: one without autocast),
        found when the device is, at the first step, and kept as a string: reading
        ``torch.device.type`` costs as much as the rest of a step on the CPU."""
        if self._kind == "":
            kind = self._resolve().type
            self._kind = kind if facts(kind).autocast else None
        return self._kind

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
        kind = self._autocast_kind()  # resolves the device at the first step
        if kind is not None and torch.is_autocast_enabled(kind):
            self._see_autocast(self.device)
        if self._events is None:
            mark: Any = self._now()
        else:
            full = len(self._marks) == self._marks.maxlen
            # The event leaving the window is waited on by no one: record it again.
            mark = self._marks.popleft()[0] if full else self._events()
            mark.record()
        self._marks.append(
            (
                mark,
                _pick(samples, self.samples_per_step),
                _pick(tokens, self.tokens_per_step),
                _pick(flops, self.flops_per_step),
            )
        )
        pulse.tick("meter", self._device)  # this process's heartbeat: anydevice top

    def _see_autocast(self, dev: torch.device) -> None:
        dtype = _autocast_dtype(dev)
        if dtype is not None:
            self._autocast.setdefault(dev.type, set()).add(dtype)

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
        peak, unknown = self._resolve_peak()
        rates = [t / seconds if seconds > 0 else math.inf for t in totals]
        peak_flops = peak.tflops * 1e12 if peak is not None else 0.0
        (samples, tokens, flop_rate, peak_flops), world, seconds = _across_ranks(
            [*rates, peak_flops], seconds
        )
        mfu, invalid = None, unknown
        if self.flops_per_step is not None and peak is not None and peak_flops:
            # every rank's peak, summed: the MFU of all ranks together
            mfu, invalid = Peak(peak_flops / 1e12, peak.dtype, peak.source).share(flop_rate / 1e12)
        return ThroughputStats(
            steps=steps,
            seconds=seconds,
            samples_per_s=samples if self.samples_per_step is not None else None,
            tokens_per_s=tokens if self.tokens_per_step is not None else None,
            tflops=flop_rate / 1e12 if self.flops_per_step is not None else None,
            mfu=mfu,
            peak=peak,
            world_size=world,
            clock=self.clock,
            mfu_invalid=invalid,
        )

    def _math_dtype(self) -> str | None:
        """The dtype the step's math runs in, as far as the meter can tell: ``dtype``, else
        the counted one, else the one autocast computed in; None where nothing tells, or
        where autocast was seen in more than one dtype."""
        if self.dtype is not None:
            return self.dtype
        if self._counted_dtype is not None:
            return self._counted_dtype
        seen = self._autocast.get(self.device.type, set())
        return next(iter(seen)) if len(seen) == 1 else None

    def _resolve_peak(self) -> tuple[Peak | None, str | None]:
        """The peak to set the rate against, or None and, where FLOPs were given, why."""
        arg = self._peak_arg
        if arg is None or self.flops_per_step is None:
            return None, None
        if isinstance(arg, Peak):
            return arg, None
        dtype = self._math_dtype()
        if isinstance(arg, str):
            if dtype is None:
                return None, self._unknown_dtype()
            if dtype not in self._peaks:
                self._peaks[dtype] = peak_tflops(self.device, dtype)
            found = self._peaks[dtype]
            why = f"no {dtype} peak is known for {self.device}" if found is None else None
            return found, why
        return Peak(float(arg), dtype or "unknown", "given"), None

    def _unknown_dtype(self) -> str:
        seen = sorted(self._autocast.get(self.device.type, ()))
        if len(seen) > 1:
            return (
                f"autocast was seen computing in {' and '.join(seen)} on {self.device.type}: "
                "the step's dtype is not one; pass dtype= the one most FLOPs run in."
            )
        return (
            "the dtype of the step's math is unknown: no autocast was on when the meter was "
            "built or at a step(), and neither dtype= nor flops_per_step=ad.flops(step) was "
            "given. Pass one of them (an fp32 peak against a bf16 step would read ~15x high)."
        )

    def __repr__(self) -> str:
        steps = max(0, len(self._marks) - 1)
        return f"Throughput({self.device}, {steps} steps in a window of {self.window})"


def _across_ranks(values: list[float], seconds: float) -> tuple[list[float], int, float]:
    """Each value summed over the ranks, the world size, and the longest window."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return values, 1, seconds
    on = collective_device()  # NCCL reduces device tensors only
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
    """What makes a timing event on the device's current stream, None where the host clock
    is right (the device's events do not time work)."""
    from anydevice.hardware.backends import runtime

    backend = runtime(device.type)
    if not backend.event_timing(device):
        return None
    return functools.partial(backend.new_event, device, timing=True)
