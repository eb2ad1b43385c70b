"""Is the machine busy? Other processes' use of this process's cores, while measuring.

Timings taken while other processes keep the cores busy are slower and noisier, and a
torch that runs more threads than there are free cores is slower still: its threads wait
for each other at every parallel region (a nanoGPT-style loop ran 14x faster with one
thread than with two on a busy 2-core machine). The doctor reads, around every step, the
CPU time spent on the cores this process may use (``psutil``) minus its own, so "busy"
means *others* were running, whatever this process did.

:class:`Load` is the verdict, a pure function of its numbers.

>>> Load(usable=8, others=0.2, torch_threads=8).busy
False
>>> Load(usable=2, others=1.4, torch_threads=2).advice
'torch.set_num_threads(1) (or OMP_NUM_THREADS=1 before starting Python)'
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from anydevice.hardware.backends.cpu import busy_seconds, core_ids

__all__ = ["CpuClock", "Load"]

#: Cores of other processes' work above which the machine counts as busy.
BUSY_CORES = 0.5


@dataclass(frozen=True)
class Load:
    """Other processes' CPU use on this process's cores, and what it means for torch."""

    usable: int  #: cores this process may use
    others: float  #: cores other processes kept busy, on average (the most seen in a step)
    torch_threads: int  #: torch.get_num_threads()
    loadavg: float | None = None  #: the 1-minute load average, where the OS has one
    measured_with: int | None = None  #: torch threads the doctor measured with, if not all
    #: whole cores free when the run started (what the measuring threads and the threads
    #: lever go by); ``free`` is over the whole run
    free_at_start: int | None = None

    @property
    def free(self) -> int:
        """Whole cores left for this process (at least 1)."""
        return max(1, math.floor(self.usable - self.others + 0.25))

    @property
    def busy(self) -> bool:
        return self.others >= BUSY_CORES

    @property
    def advice(self) -> str | None:
        """What to set when torch runs more threads than there are free cores."""
        if not self.busy or self.torch_threads <= self.free:
            return None
        n = self.free
        return f"torch.set_num_threads({n}) (or OMP_NUM_THREADS={n} before starting Python)"

    @property
    def summary(self) -> str:
        load = f"; load average {self.loadavg:.2f}" if self.loadavg is not None else ""
        if not self.busy:
            return f"quiet: other processes used {self.others:.1f} of {self.usable} cores{load}."
        fewer = (
            f"; measured with {self.measured_with} thread(s), not torch's {self.torch_threads}"
            if self.measured_with is not None and self.measured_with != self.torch_threads
            else ""
        )
        return (
            f"busy: other processes used {self.others:.1f} of the {self.usable} cores this "
            f"process may use{load}; numbers taken meanwhile are marked noisy{fewer}."
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "free": self.free, "busy": self.busy, "advice": self.advice}


class CpuClock:
    """Reads CPU time on this process's cores: all processes', and this process's own.

    >>> clock = CpuClock()
    >>> mark = clock.read()
    >>> clock.others_since(mark) >= 0.0
    True
    """

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.cores = core_ids()

    def read(self) -> tuple[float, float, float]:
        """(wall seconds, busy CPU seconds on the usable cores, this process's CPU seconds)."""
        busy = busy_seconds(self.cores)
        own = self.process.cpu_times()
        return time.perf_counter(), busy, own.user + own.system

    def others_since(self, mark: tuple[float, float, float]) -> float:
        """Cores other processes kept busy, on average, since ``mark``."""
        wall, busy, own = self.read()
        elapsed = wall - mark[0]
        if elapsed <= 0:
            return 0.0
        return max(0.0, ((busy - mark[1]) - (own - mark[2])) / elapsed)


def loadavg() -> float | None:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
