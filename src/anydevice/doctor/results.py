"""What ``anydevice doctor`` found and measured, as frozen data: the :class:`Report`, each
check's verdict, the numbers, levers, the table, advice.

A lever's verdict comes from interleaved A/B samples (:mod:`anydevice.doctor.budget`): it
says "use" or "slower" only when the whole spread of the pairs' speed-ups lies on one side
of 1x; when the spread straddles 1x it says "no clear difference (±x %)", whatever the
median.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from anydevice.doctor.load import Load
    from anydevice.hardware.inventory import Inventory

__all__ = [
    "SCHEMA",
    "Check",
    "DeviceSummary",
    "Interrupted",
    "Lever",
    "Measured",
    "Measurements",
    "Report",
    "Verdict",
    "find",
]

Verdict = Literal["use", "no-gain", "slower", "noisy", "n/a"]
USE = 1.10  #: a lever that saves at least 10 % is worth turning on
SLOWER = 0.95  #: one that costs more than 5 % is worth leaving off
#: Half-spread, as a share of the speed-up, beyond which the pairs say nothing to act on
#: ("9.02x ±83 %" came from one disturbed run): the verdict is "noisy", the advice to
#: measure again when the machine is quiet.
MAX_SPREAD = 0.5
QUIET = "measure again when the machine is quiet"


@dataclass(frozen=True)
class Measured:
    """One number measured on one device, with its unit and, where known, its peak."""

    device: str  #: "cpu", "cuda:0"
    name: str  #: stable id: "matmul-bf16", "memory-copy", "h2d-pinned", ...
    title: str  #: what was measured, for people
    value: float
    unit: str  #: "GFLOP/s" or "GB/s"
    peak: float | None = None  #: the device's best, in ``unit``
    peak_source: str = ""  #: where ``peak`` comes from
    detail: str = ""  #: sizes and timing
    noisy: bool = False  #: the samples spread widely, or other processes were busy
    size: int = 0  #: the problem size the timing reached (n of a matmul, bytes of a copy)
    threads: int | None = None  #: torch's intra-op threads it was measured with
    busy: bool = False  #: other processes kept cores busy while it was measured

    @property
    def fraction(self) -> float | None:
        """``value`` as a share of ``peak``."""
        return self.value / self.peak if self.peak else None

    @property
    def conditions(self) -> str:
        """How it was measured, where that changes the number: ``"1 thread, busy"``."""
        parts = [] if self.threads is None else [f"{self.threads} thread(s)"]
        return ", ".join([*parts, "busy"] if self.busy else parts)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fraction": self.fraction}

    def __repr__(self) -> str:
        peak = f", {self.fraction:.0%} of {self.peak_source}" if self.fraction else ""
        how = f" ({self.conditions})" if self.conditions else ""
        return f"Measured({self.device} {self.name}: {self.value:.4g} {self.unit}{how}{peak})"


@dataclass(frozen=True)
class Lever:
    """What one technique buys on one device: interleaved times without it and with it."""

    device: str
    name: str  #: "pinned-memory", "overlap", "autocast", "fast-matmul", "channels-last"
    title: str
    workload: str  #: what was timed
    how: str  #: the code that turns it on
    baseline: float | None = None  #: median seconds per operation without the lever
    lever: float | None = None  #: with it
    note: str = ""  #: why it does not apply here, when it does not
    low: float | None = None  #: the spread of the pairs' speed-ups (10th percentile)
    high: float | None = None  #: its upper end (90th percentile)
    noisy: bool = False  #: a wide spread, few pairs, or other processes were busy
    pairs: int = 0  #: interleaved A/B pairs behind the spread

    @property
    def speedup(self) -> float | None:
        if self.baseline is None or not self.lever:
            return None
        return self.baseline / self.lever

    @property
    def spread(self) -> float | None:
        """Half the spread as a share of the speed-up (0.05 reads ±5 %)."""
        s = self.speedup
        if s is None or self.low is None or self.high is None:
            return None
        return (self.high - self.low) / 2 / s

    @property
    def clear(self) -> bool:
        """Three pairs or more, and their spread on one side of 1x (no spread known, as
        for a hand-built lever: judged by the speed-up alone)."""
        if self.low is None or self.high is None:
            return True
        return self.pairs >= 3 and (self.low > 1.0 or self.high < 1.0)

    @property
    def verdict(self) -> Verdict:
        """``use`` or ``slower`` where the whole spread is on that side of 1x and no wider
        than ±:data:`MAX_SPREAD`; ``noisy`` where it is wider; else ``no-gain``."""
        s = self.speedup
        if s is None:
            return "n/a"
        spread = self.spread
        if spread is not None and self.pairs >= 3 and spread > MAX_SPREAD:
            return "noisy"
        if not self.clear:
            return "no-gain"
        return "use" if s >= USE else "slower" if s < SLOWER else "no-gain"

    @property
    def advice(self) -> str:
        s = self.speedup
        if s is None:
            return self.note
        spread = f" (±{self.spread:.0%})" if self.spread is not None and self.pairs >= 3 else ""
        if self.low is not None and self.pairs < 3:
            spread = f" ({self.pairs} pair(s) only)"
        if self.verdict == "noisy":
            return f"{s:.2f}x{spread}: noisy: {QUIET}."
        if not self.clear:
            return f"{s:.2f}x: no clear difference{spread} on {self.device}."
        if self.verdict == "use":
            return f"{s:.2f}x faster here{spread}: {self.how}"
        if self.verdict == "slower":
            return f"{s:.2f}x, slower here{spread}: leave it off on {self.device}."
        return f"{s:.2f}x, no gain here{spread}: not worth the change on {self.device}."

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "unit": "s",
            "speedup": self.speedup,
            "spread": self.spread,
            "verdict": self.verdict,
            "advice": self.advice,
        }


@dataclass(frozen=True)
class DeviceSummary:
    """One device's row of the side-by-side table."""

    device: str
    name: str
    step_fp32: float | None  #: seconds per training step in fp32
    step_best: float | None  #: seconds per step in the device's precision mode
    mode: str  #: that mode ("bf16", "fp16", "fp32")
    matmul_fp32: float | None  #: GFLOP/s
    matmul_best: float | None  #: GFLOP/s in the fastest dtype
    best_dtype: str
    memory: float | None  #: GB/s, memory copy
    h2d: float | None  #: GB/s, host to device from pinned memory
    vs_cpu: float | None  #: how many times faster its step is than the CPU's
    step_flops: float | None = None  #: FLOPs of one step (FlopCounterMode, on meta)
    mfu_fp32: float | None = None  #: the fp32 step's share of the device's fp32 peak
    mfu_best: float | None = None  #: the best-mode step's share of that dtype's peak
    mfu_source: str = ""  #: the peak MFU is taken against
    #: why no MFU is given where one would exceed 100 % (the peak measured under other
    #: load than the step): "" when the MFUs are valid or simply unknown
    mfu_invalid: str = ""
    #: an accelerator, not the host: its row is compared with the CPU's
    accelerator: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Measurements:
    """Everything the doctor measured: numbers, levers, the side-by-side table, advice."""

    plan: str
    seconds: float  #: wall time the measurements took
    results: tuple[Measured, ...] = ()
    levers: tuple[Lever, ...] = ()
    devices: tuple[DeviceSummary, ...] = ()
    advice: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  #: measurements that could not be made, and why
    step: str = ""  #: the training step every device ran
    budget: float = 0.0  #: seconds the plan allowed
    load: Load | None = field(default=None)  #: other processes' use of the cores meanwhile
    interrupted: bool = False  #: stopped by Ctrl-C: what was measured before it

    def result(self, device: str, name: str) -> Measured | None:
        return find(self.results, device, name)

    def _load(self) -> dict[str, Any] | None:
        """The load, its thread advice as the threads lever judged it: withdrawn (None)
        where the lever measured fewer threads and found them no faster."""
        if self.load is None:
            return None
        out = self.load.to_dict()
        lever = _threads_verdict(self.levers)
        if lever is not None and lever.verdict != "use":
            out["advice"] = None
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "seconds": self.seconds,
            "budget": self.budget,
            "step": self.step,
            "load": self._load(),
            "results": [r.to_dict() for r in self.results],
            "levers": [lv.to_dict() for lv in self.levers],
            "devices": [d.to_dict() for d in self.devices],
            "advice": list(self.advice),
            "notes": list(self.notes),
            "interrupted": self.interrupted,
        }


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while the doctor measured: still a ``KeyboardInterrupt``, carrying what was
    measured before it (``measurements``) and, once the checks are added, the ``report``."""

    def __init__(self, measurements: Measurements | None, report: Any = None) -> None:
        super().__init__()
        self.measurements = measurements
        self.report = report  #: the doctor's Report of what was done, where known


def _threads_verdict(levers: Sequence[Lever]) -> Lever | None:
    return next((lv for lv in levers if lv.name == "threads" and lv.speedup), None)


def find(results: Sequence[Measured], device: str, name: str) -> Measured | None:
    """The result of ``device`` named ``name``, or None."""
    return next((r for r in results if r.device == device and r.name == name), None)


Status = Literal["ok", "info", "warn", "fail", "skip"]


@dataclass(frozen=True)
class Check:
    """One verdict: what was found (with the values) and, when something is off, the fix."""

    name: str  #: stable id, e.g. "torch-build"
    title: str  #: what is checked, for people
    status: Status
    summary: str
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SCHEMA = "anydevice.doctor/1"  #: the JSON form's version (``Report.to_dict``)


@dataclass(frozen=True)
class Report:
    """The doctor's findings: the inventory, each check's verdict, and the measurements."""

    inventory: Inventory
    checks: tuple[Check, ...] = field(default=())
    measurements: Measurements | None = None  #: None when nothing was measured

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed)."""
        return not any(c.status == "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "ok": self.ok,
            "checks": [c.to_dict() for c in self.checks],
            "measurements": self.measurements.to_dict() if self.measurements else None,
            "inventory": self.inventory.to_dict(),
        }
