"""AMD GPUs through AMD SMI (``amdsmi``, ROCm's management library), where installed.

What ``rocm-smi``/``amd-smi`` show, read in process: each GPU's PCI slot, UUID, market
name, VRAM in use and in all (``amdsmi_get_gpu_vram_usage``, in MiB), GFX activity,
edge temperature, socket power, and the processes with their VRAM
(``amdsmi_get_gpu_process_list``). A value the GPU does not report (``"N/A"``, an error)
is None; a GPU that cannot be read at all is left out with a note. Without amdsmi the
kernel's DRM interface (:mod:`anydevice.hardware.backends.drm`) is read instead.

Tested on records shaped as amdsmi's Python interface returns them (ROCm 6.x); untested
on AMD hardware.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AmdGpu", "AmdsmiUnavailable", "read"]

_MIB = 2**20


class AmdsmiUnavailable(Exception):
    """amdsmi is not installed or does not start; the message says why."""


@dataclass(frozen=True)
class AmdGpu:
    """One AMD GPU as amdsmi reports it (None: not reported)."""

    index: int
    pdev: str | None
    uuid: str | None
    name: str
    memory_total: int | None = None
    memory_used: int | None = None
    utilization: float | None = None
    temperature: float | None = None
    power: float | None = None
    processes: dict[int, int] = field(default_factory=dict)  #: pid -> VRAM bytes


def read(library: Any | None = None) -> tuple[list[AmdGpu], list[str]]:
    """Every AMD GPU amdsmi sees, and notes on those it could not read.

    Raises:
        AmdsmiUnavailable: amdsmi is not installed, or does not initialise (no driver).
    """
    lib: Any = library
    if lib is None:
        try:
            lib = importlib.import_module("amdsmi")
        except ImportError as e:
            raise AmdsmiUnavailable(f"amdsmi is not installed ({e})") from e
    try:
        flags = getattr(getattr(lib, "AmdSmiInitFlags", None), "INIT_AMD_GPUS", None)
        lib.amdsmi_init(flags) if flags is not None else lib.amdsmi_init()
    except Exception as e:  # amdsmi raises its own AmdSmiException tree
        raise AmdsmiUnavailable(f"amdsmi did not initialise ({e})") from e
    gpus, notes = [], []
    try:
        for index, handle in enumerate(lib.amdsmi_get_processor_handles()):
            try:
                gpus.append(_gpu(lib, index, handle))
            except Exception as e:
                notes.append(f"AMD GPU {index} could not be read through amdsmi ({e}).")
    finally:
        _maybe(lib.amdsmi_shut_down)
    return gpus, notes


def _gpu(lib: Any, index: int, h: Any) -> AmdGpu:
    asic = _maybe(lambda: lib.amdsmi_get_gpu_asic_info(h)) or {}
    vram = _maybe(lambda: lib.amdsmi_get_gpu_vram_usage(h)) or {}
    activity = _maybe(lambda: lib.amdsmi_get_gpu_activity(h)) or {}
    power = _maybe(lambda: lib.amdsmi_get_power_info(h)) or {}
    temp = None
    kinds = getattr(lib, "AmdSmiTemperatureType", None)
    metric = getattr(lib, "AmdSmiTemperatureMetric", None)
    if kinds is not None and metric is not None:
        temp = _maybe(lambda: lib.amdsmi_get_temp_metric(h, kinds.EDGE, metric.CURRENT))
    processes: dict[int, int] = {}
    for p in _maybe(lambda: lib.amdsmi_get_gpu_process_list(h)) or []:
        if isinstance(p, dict) and _num(p.get("pid")) is not None:
            used = _num((p.get("memory_usage") or {}).get("vram_mem"))
            processes[int(p["pid"])] = int(used) if used is not None else 0
    total, used = _num(vram.get("vram_total")), _num(vram.get("vram_used"))
    watts = _num(power.get("current_socket_power"))
    if not watts:  # 0 or N/A where a GPU reports only the average
        watts = _num(power.get("average_socket_power"))
    name = asic.get("market_name")
    return AmdGpu(
        index=index,
        pdev=str(lib.amdsmi_get_gpu_device_bdf(h)),  # who it is: unreadable without it
        uuid=_maybe(lambda: str(lib.amdsmi_get_gpu_device_uuid(h))),
        name=str(name) if name and name != "N/A" else f"AMD GPU {index}",
        memory_total=None if total is None else int(total * _MIB),
        memory_used=None if used is None else int(used * _MIB),
        utilization=_num(activity.get("gfx_activity")),
        temperature=_num(temp),
        power=watts,
        processes=processes,
    )


def _num(value: Any) -> float | None:
    """amdsmi's numbers; its ``"N/A"`` (and anything else not a number) is None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _maybe(fn: Any) -> Any:
    try:
        return fn()
    except Exception:  # a reading this GPU or driver does not support
        return None
