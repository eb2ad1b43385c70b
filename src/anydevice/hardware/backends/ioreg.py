"""The GPU of an Apple silicon Mac, as the I/O Registry shows it without sudo.

``ioreg -r -d 1 -w 0 -c IOAccelerator`` lists the GPU's accelerator (``AGXAccelerator...``)
with its ``model`` (``"Apple M2 Max"``), ``gpu-core-count`` and a
``"PerformanceStatistics"`` dictionary updated by the driver: ``"Device Utilization %"``
(also ``"Renderer Utilization %"`` and ``"Tiler Utilization %"``), ``"In use system
memory"`` and ``"Alloc system memory"`` (bytes of the unified memory the GPU uses and has
allocated). Per-process GPU figures and the temperature need ``powermetrics`` (sudo), so
they are not read: a torch process's MPS memory comes from its heartbeat.

Tested on output recorded from ``ioreg`` (the format of macOS 13-15); untested on a Mac.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["AppleGpu", "parse", "read"]

COMMAND = ("ioreg", "-r", "-d", "1", "-w", "0", "-c", "IOAccelerator")


@dataclass(frozen=True)
class AppleGpu:
    """One accelerator entry of the I/O Registry."""

    name: str
    cores: int | None = None
    utilization: float | None = None
    memory_used: int | None = None  #: unified memory the GPU uses now
    memory_allocated: int | None = None  #: unified memory the GPU's driver has allocated


def read(run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> list[AppleGpu]:
    """Run ``ioreg`` (through ``run``) and parse it; [] where there is none (not a Mac) or
    it fails."""
    if run is subprocess.run and shutil.which(COMMAND[0]) is None:
        return []
    try:
        done = run(list(COMMAND), capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return []
    return parse(done.stdout) if done.returncode == 0 else []


_ENTRY = re.compile(r"^\+-o (\S+)", re.MULTILINE)


def parse(text: str) -> list[AppleGpu]:
    """Each accelerator of an ``ioreg -c IOAccelerator`` dump (entries start at ``+-o``).

    >>> parse('+-o AGXAcceleratorG13X  <class AGXAcceleratorG13X>\\n  {\\n'
    ...       '    "model" = "Apple M1"\\n'
    ...       '    "PerformanceStatistics" = {"Device Utilization %"=16,'
    ...       '"In use system memory"=2363801600}\\n  }\\n')[0].utilization
    16.0
    """
    out = []
    starts = [m.start() for m in _ENTRY.finditer(text)] or [0]
    for i, start in enumerate(starts):
        block = text[start : starts[i + 1] if i + 1 < len(starts) else len(text)]
        stats = _stats(block)
        model = re.search(r'"model"\s*=\s*"([^"]+)"', block)
        if model is None and not stats:
            continue
        cores = re.search(r'"gpu-core-count"\s*=\s*(\d+)', block)
        util = stats.get("Device Utilization %", stats.get("Renderer Utilization %"))
        out.append(
            AppleGpu(
                name=model.group(1) if model else "Apple GPU",
                cores=int(cores.group(1)) if cores else None,
                utilization=float(util) if util is not None and util <= 100 else None,
                memory_used=stats.get("In use system memory"),
                memory_allocated=stats.get("Alloc system memory"),
            )
        )
    return out


def _stats(block: str) -> dict[str, int]:
    """The integers of the block's ``"PerformanceStatistics" = {...}``, by exact key."""
    found = re.search(r'"PerformanceStatistics"\s*=\s*\{([^}]*)\}', block)
    if found is None:
        return {}
    return {
        key: int(value)
        for key, value in re.findall(r'"([^"]+)"\s*=\s*(\d+)', found.group(1))
        if int(value) < 2**63
    }
