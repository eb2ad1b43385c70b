"""Where the device sat idle in a profiler trace, and what it was waiting for.

:func:`idle_time` reads the events of a Chrome trace that ``torch.profiler`` wrote (what
:func:`~anydevice.measure.profiling.profile` exports) and answers the question people run
Holistic Trace Analysis for: what share of the recorded time did the device do nothing,
and why.

1. The **window** is the span of the recorded steps (``ProfilerStep#N``), or of every host
   event when the block had no steps.
2. The device is **busy** during the union of its kernels, copies and sets (several
   streams at once count once); the rest of the window is **idle**.
3. Each idle gap ends with the device's next piece of work, launched by a host call
   (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ... matched by its correlation id). From the
   gap's start until that call began, the device had nothing queued: it **waited on the
   host**. Of that, the time the host spent in ``DataLoader.__next__`` is **waiting on
   data**; the rest is the host being slow to launch (**launch-bound**: Python overhead,
   small kernels, a synchronisation). Idle time after the launch call began is **other**:
   launch latency, or work queued behind an event or another stream. The gap after the
   last piece of work, to the window's end, is all host time.

Without device activity (a CPU trace) only the host's share waiting on data is known.

>>> events = [
...     {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100},
...     {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 40, "dur": 5,
...      "args": {"correlation": 7}},
...     {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 50, "dur": 50,
...      "args": {"correlation": 7}},
... ]
>>> t = idle_time(events)
>>> round(t.idle_share, 2), round(t.host_wait / t.idle, 2), round(t.other / t.idle, 2)
(0.5, 0.8, 0.2)
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["IdleTime", "idle_time", "read_trace"]

#: Event categories of device work in torch's Chrome traces (CUDA, ROCm, XPU alike).
DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
#: Host calls that launch device work.
LAUNCHES = frozenset({"cuda_runtime", "cuda_driver", "xpu_runtime", "xpu_driver"})
#: Host annotations of waiting for the next batch.
DATA_PREFIXES = ("enumerate(DataLoader)",)

Interval = tuple[float, float]


@dataclass(frozen=True)
class IdleTime:
    """The device's idle time in a trace and what it waited for, in seconds.

    ``host_wait``, ``data_wait`` and ``other`` add up to ``idle`` (``data_wait`` is part of
    the host's time, kept apart). Without device activity ``active`` and the device's
    parts are None and ``data_wait`` is the host's time in ``DataLoader.__next__``.
    """

    window: float  #: seconds recorded
    active: float | None  #: the device was busy (None: no device activity in the trace)
    host_wait: float | None = None  #: idle, nothing queued, host not loading data (launch-bound)
    data_wait: float = 0.0  #: idle, nothing queued, host in DataLoader.__next__
    other: float | None = None  #: idle with work already launched (latency, dependencies)

    @property
    def idle(self) -> float | None:
        return None if self.active is None else max(0.0, self.window - self.active)

    @property
    def idle_share(self) -> float | None:
        """Share of the window the device did nothing."""
        idle = self.idle
        return None if idle is None or self.window <= 0 else idle / self.window

    def summary(self) -> str:
        """One line for people."""
        from anydevice.measure.samples import format_time

        span = format_time(self.window)
        if self.active is None or self.idle_share is None:
            data = self.data_wait / self.window if self.window > 0 else 0.0
            return (
                f"No accelerator activity recorded; the host waited on data (DataLoader) "
                f"{data:.1%} of the {span} recorded."
            )
        parts = [
            f"waiting on the host (launch-bound) {self._share(self.host_wait)}",
            f"on data {self._share(self.data_wait)}",
            f"other {self._share(self.other)}",
        ]
        return f"Device idle {self.idle_share:.1%} of the {span} recorded: " + ", ".join(parts)

    def _share(self, part: float | None) -> str:
        return "?" if part is None or self.window <= 0 else f"{part / self.window:.1%}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "active": self.active,
            "idle": self.idle,
            "idle_share": self.idle_share,
            "host_wait": self.host_wait,
            "data_wait": self.data_wait,
            "other": self.other,
        }


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    opener: Any = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def idle_time(events: Iterable[Mapping[str, Any]]) -> IdleTime | None:
    """Where the device sat idle in these trace events (see the module's docstring).

    Returns:
        An :class:`IdleTime`, or None when the trace has no complete event to time.
    """
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    if not spans:
        return None
    steps = [_interval(e) for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")]
    host = [_interval(e) for e in spans if e.get("cat") not in DEVICE_WORK]
    frame = steps or host or [_interval(e) for e in spans]
    start, end = min(s for s, _ in frame), max(e for _, e in frame)
    data = _union(
        _clip(_interval(e), start, end)
        for e in spans
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(DATA_PREFIXES)
    )
    window = end - start
    work = [e for e in spans if e.get("cat") in DEVICE_WORK]
    if not work:
        return IdleTime(window=window / 1e6, active=None, data_wait=_length(data) / 1e6)
    launched = {
        e["args"]["correlation"]: float(e["ts"])
        for e in spans
        if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})
    }
    # Busy intervals inside the window, each with the launch time of the work that starts it.
    starts: dict[float, float | None] = {}
    for e in work:
        s = float(e["ts"])
        launch = launched.get(e.get("args", {}).get("correlation"))
        known = starts.get(s)
        if s not in starts or (launch is not None and (known is None or launch < known)):
            starts[s] = launch
    busy = _union(_clip(_interval(e), start, end) for e in work)
    host_wait = data_wait = other = 0.0
    cursor = start
    for b_start, b_end in [*busy, (end, end)]:
        if b_start > cursor:  # an idle gap [cursor, b_start]
            if b_start >= end:  # after the last work: the device waits for the host
                waited_until = b_start
            else:
                launch = _launch_of(b_start, starts)
                waited_until = b_start if launch is None else min(max(launch, cursor), b_start)
            host_part = waited_until - cursor
            on_data = _overlap((cursor, waited_until), data)
            data_wait += on_data
            host_wait += host_part - on_data
            other += (b_start - cursor) - host_part
        cursor = max(cursor, b_end)
    active = _length(busy)
    return IdleTime(
        window=window / 1e6,
        active=active / 1e6,
        host_wait=host_wait / 1e6,
        data_wait=data_wait / 1e6,
        other=other / 1e6,
    )


def _interval(e: Mapping[str, Any]) -> Interval:
    s = float(e["ts"])
    return s, s + float(e["dur"])


def _clip(iv: Interval, lo: float, hi: float) -> Interval:
    return max(iv[0], lo), min(iv[1], hi)


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time (empty ones dropped)."""
    out: list[Interval] = []
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: Sequence[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def _overlap(iv: Interval, union: Sequence[Interval]) -> float:
    return sum(max(0.0, min(iv[1], e) - max(iv[0], s)) for s, e in union)


def _launch_of(busy_start: float, starts: Mapping[float, float | None]) -> float | None:
    """When the host launched the work that starts a busy interval (clipped starts: the
    nearest work starting at or before it)."""
    if busy_start in starts:
        return starts[busy_start]
    earlier = [s for s in starts if s <= busy_start]
    return starts[max(earlier)] if earlier else None
