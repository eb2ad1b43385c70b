"""Where device memory went over time: torch's allocator history, as a snapshot and a timeline.

On CUDA (and ROCm) torch's caching allocator can record every allocation and free, with
the Python stack that made it (``torch.cuda.memory._record_memory_history``). A snapshot
of that history opens in https://pytorch.org/memory_viz (drag the ``.pickle`` file in);
next to it an ``.html`` file holds the same snapshot, embedded, in torch's own viewer
(``torch.cuda._memory_viz.trace_plot``: the page loads the viewer's script from torch's
CDN, so it needs a browser with internet access; the data never leaves the file).

* ``ad.track_memory(dev, snapshot="mem.pickle")`` records during its block
  (:class:`History`).
* ``ad.fit_batch_size(..., snapshot_on_oom="oom.pickle")`` records during the search and
  writes one snapshot at the first out-of-memory error (:class:`OomSnapshot`).

Other devices keep no such history: asking there raises
:class:`~anydevice.errors.MeasurementError` at once, before anything runs.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from anydevice.errors import MeasurementError
from anydevice.hardware.backends import runtime
from anydevice.hardware.backends.torch_private import (
    record_memory_history,
    snapshot_memory,
    trace_plot,
)
from anydevice.hardware.selection import resolve
from anydevice.hardware.spec import DeviceLike

__all__ = ["MAX_ENTRIES", "History", "OomSnapshot", "check_history", "html_path", "oom_snapshot"]

T = TypeVar("T")

#: Allocation events kept (a ring: the newest win). Each is a few KB with its stack.
MAX_ENTRIES = 100_000

PathLike = str | os.PathLike[str]


def check_history(device: torch.device) -> None:
    """Raise unless ``device`` keeps an allocator history torch can record."""
    if not runtime(device.type).keeps_history:
        raise MeasurementError(
            f"a memory snapshot needs CUDA's caching allocator, which records allocation "
            f"history; {device} keeps none. Track the peak without snapshot=, or record "
            "allocations in a trace with ad.profile(record_memory=True)."
        )


def html_path(snapshot: PathLike) -> Path:
    """Where the HTML timeline of a snapshot goes: the same name, ``.html``.

    >>> html_path("runs/mem.pickle").as_posix()
    'runs/mem.html'
    """
    return Path(snapshot).with_suffix(".html")


def _start(max_entries: int) -> None:
    record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)


def _stop() -> None:
    record_memory_history(enabled=None)


def _write(path: Path) -> Path:
    """Write the snapshot (pickle) and its HTML timeline; return the snapshot's path."""
    snapshot = snapshot_memory()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    html_path(path).write_text(trace_plot(snapshot), encoding="utf-8")
    return path


class History:
    """Records CUDA's allocator history from :meth:`start` to :meth:`stop`, which writes the
    snapshot and its timeline. Recording is process-wide and is off after :meth:`stop`."""

    def __init__(self, device: torch.device, path: PathLike, max_entries: int = MAX_ENTRIES):
        check_history(device)
        self.path = Path(path)
        self.max_entries = max_entries

    def start(self) -> None:
        _start(self.max_entries)

    def stop(self, write: bool = True) -> Path | None:
        """Stop recording, after writing the snapshot when ``write``."""
        try:
            return _write(self.path) if write else None
        finally:
            _stop()


class OomSnapshot:
    """Records the allocator history and writes one snapshot at the first out-of-memory
    error a wrapped function raises (the allocator's state at that moment, and its history
    up to it). :meth:`close` stops recording."""

    def __init__(self, device: torch.device, path: PathLike, max_entries: int = MAX_ENTRIES):
        check_history(device)
        self.path = Path(path)
        self.written: Path | None = None
        _start(max_entries)

    def wrap(self, fn: Callable[[int], T]) -> Callable[[int], T]:
        from anydevice.measure.memory_readings import is_out_of_memory

        def watched(size: int) -> T:
            try:
                return fn(size)
            except Exception as exc:
                if self.written is None and is_out_of_memory(exc):
                    self.written = _write(self.path)
                raise

        return watched

    def close(self) -> None:
        _stop()


def oom_snapshot(device: DeviceLike | None, path: PathLike) -> OomSnapshot:
    """An :class:`OomSnapshot` for ``device`` (None: the device ``ad.device()`` picks)."""
    from anydevice.hardware.selection import device as select_device

    dev = select_device("auto") if device is None else resolve(device)
    return OomSnapshot(dev, path)
