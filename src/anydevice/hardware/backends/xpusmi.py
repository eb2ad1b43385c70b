"""Intel data-center and Arc GPUs through ``xpu-smi`` (Intel's XPU Manager), where installed.

``xpu-smi discovery -j`` lists the GPUs (``device_list``: ``device_id``, ``device_name``,
``pci_bdf_address``, ``uuid``); ``xpu-smi discovery -d N -j`` gives one GPU's properties,
among them ``memory_physical_size_byte`` and ``memory_free_size_byte`` (as text). The
kernel's DRM interface (:mod:`anydevice.hardware.backends.drm`) adds what each process
uses. Commands that fail or time out leave their fields None.

Tested on output shaped as xpu-smi 1.2 prints it; untested on Intel hardware.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["IntelGpu", "parse_device", "parse_list", "read"]

Runner = Callable[..., subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class IntelGpu:
    """One GPU as xpu-smi reports it."""

    index: int
    name: str
    pdev: str | None = None
    uuid: str | None = None
    memory_total: int | None = None
    memory_free: int | None = None

    @property
    def memory_used(self) -> int | None:
        """Bytes in use (total less free), where both are known."""
        if self.memory_total is None or self.memory_free is None:
            return None
        return self.memory_total - self.memory_free


def read(run: Runner = subprocess.run) -> list[IntelGpu]:
    """Every GPU xpu-smi lists (run through ``run``), with its memory; [] where xpu-smi is
    not installed."""
    if run is subprocess.run and shutil.which("xpu-smi") is None:
        return []
    listed = parse_list(_json(run, "discovery", "-j"))
    return [parse_device(g, _json(run, "discovery", "-d", str(g.index), "-j")) for g in listed]


def parse_list(data: Any) -> list[IntelGpu]:
    """``xpu-smi discovery -j``'s GPUs.

    >>> gpus = parse_list({"device_list": [{"device_id": 0, "device_name": "Intel(R) Arc(TM)"}]})
    >>> [(g.index, g.name) for g in gpus]
    [(0, 'Intel(R) Arc(TM)')]
    """
    rows = data.get("device_list") if isinstance(data, dict) else data
    out = []
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        if not isinstance(row, dict):
            continue
        index = _int(row.get("device_id"))
        out.append(
            IntelGpu(
                index=i if index is None else index,
                name=str(row.get("device_name") or f"Intel GPU {i}"),
                pdev=row.get("pci_bdf_address"),
                uuid=row.get("uuid"),
            )
        )
    return out


def parse_device(gpu: IntelGpu, data: Any) -> IntelGpu:
    """``gpu`` with the memory of its ``xpu-smi discovery -d N -j``."""
    if not isinstance(data, dict):
        return gpu
    from dataclasses import replace

    return replace(
        gpu,
        pdev=gpu.pdev or data.get("pci_bdf_address"),
        memory_total=_int(data.get("memory_physical_size_byte")),
        memory_free=_int(data.get("memory_free_size_byte")),
    )


def _json(run: Runner, *args: str) -> Any:
    try:
        done = run(["xpu-smi", *args], capture_output=True, text=True, timeout=3)
        return json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None
