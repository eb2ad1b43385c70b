"""Live readings of every NVIDIA GPU and of the host, for ``anydevice top``.

NVML and psutil only: no torch, no CUDA context, so watching never disturbs what it
watches. Every physical GPU is listed, with nvidia-smi's index and, where CUDA shows it to
this process, CUDA's index (``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` applied).

The JSON form of a :class:`Reading` is one record per interval: memory in bytes, power in
watts, temperature in degrees Celsius, utilisation in percent, ``null`` when unknown.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anydevice.hardware.facts import ProcessInfo

if TYPE_CHECKING:
    from anydevice.hardware.backends.nvml import GpuRecord

__all__ = ["GpuReading", "HostReading", "Reading", "Watcher", "gpu_readings"]

SCHEMA = "anydevice.top/1"


@dataclass(frozen=True)
class GpuReading:
    """One GPU (or MIG device) now."""

    smi_index: int  #: nvidia-smi's index (of the parent GPU, for a MIG device)
    cuda_index: int | None  #: ``cuda:N`` in this process; None when CUDA hides it
    uuid: str
    name: str
    memory_used: int | None = None
    memory_total: int | None = None
    utilization: float | None = None
    temperature: float | None = None
    power: float | None = None
    power_limit: float | None = None
    processes: tuple[ProcessInfo, ...] | None = None  #: None when unknown, () when none
    mig_parent: str | None = None  #: the parent GPU's UUID, for a MIG device

    def to_dict(self) -> dict[str, Any]:
        """Plain types, memory in bytes."""
        out = dataclasses.asdict(self)
        if self.processes is not None:
            out["processes"] = [dataclasses.asdict(p) for p in self.processes]
        return out


@dataclass(frozen=True)
class HostReading:
    """The host now: CPU busy share since the last reading, load, and RAM."""

    hostname: str
    cpu_percent: float  #: all cores together, since the previous reading
    cores: int
    load: tuple[float, float, float] | None  #: 1, 5 and 15 minute load averages
    memory_total: int
    memory_available: int

    @property
    def memory_used(self) -> int:
        """RAM in use (total less available)."""
        return self.memory_total - self.memory_available

    def to_dict(self) -> dict[str, Any]:
        """Plain types, memory in bytes."""
        out = dataclasses.asdict(self)
        out["load"] = None if self.load is None else list(self.load)
        out["memory_used"] = self.memory_used
        return out


@dataclass(frozen=True)
class Reading:
    """Everything ``anydevice top`` shows at one moment."""

    time: float  #: seconds since the epoch
    host: HostReading
    gpus: tuple[GpuReading, ...]
    notes: tuple[str, ...] = ()  #: why no GPU is listed, or what is unknown

    def to_dict(self) -> dict[str, Any]:
        """The JSON record: ``{"schema", "time", "host", "gpus", "notes"}``."""
        return {
            "schema": SCHEMA,
            "time": self.time,
            "host": self.host.to_dict(),
            "gpus": [g.to_dict() for g in self.gpus],
            "notes": list(self.notes),
        }


class Watcher:
    """Takes :class:`Reading` s; CPU busy shares are measured between consecutive calls.

    >>> w = Watcher(environ={"CUDA_VISIBLE_DEVICES": ""})
    >>> w.read().host.cores >= 1
    True

    Args:
        environ: where ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` are read (default:
            this process's environment).
        clock: wall clock in seconds, for the reading's time stamp.
    """

    #: The first CPU share is measured over at least this long, so it means something.
    FIRST_SAMPLE_S = 0.1

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        import psutil

        self._psutil = psutil
        self._environ = os.environ if environ is None else environ
        self._clock = clock
        self._primed_at = time.monotonic()
        psutil.cpu_percent(interval=None)  # starts the first interval

    def read(self) -> Reading:
        """Read the host and every GPU now."""
        gpus, notes = self._gpus()
        wait = self.FIRST_SAMPLE_S - (time.monotonic() - self._primed_at)
        if wait > 0:
            time.sleep(wait)
        return Reading(time=self._clock(), host=self._host(), gpus=gpus, notes=notes)

    def _host(self) -> HostReading:
        ps = self._psutil
        vm = ps.virtual_memory()
        try:
            load: tuple[float, float, float] | None = os.getloadavg()
        except (AttributeError, OSError):  # Windows has no load average
            load = None
        return HostReading(
            hostname=platform.node(),
            cpu_percent=float(ps.cpu_percent(interval=None)),
            cores=os.cpu_count() or 1,
            load=load,
            memory_total=int(vm.total),
            memory_available=int(vm.available),
        )

    def _gpus(self) -> tuple[tuple[GpuReading, ...], tuple[str, ...]]:
        from anydevice.hardware.backends import nvml

        try:
            driver = nvml.read(telemetry=True)
        except nvml.NvmlUnavailable as e:
            return (), (f"no GPU: {e}.",)
        if not driver.gpus:
            return (), ("no GPU: NVML sees no NVIDIA GPU in this machine.", *driver.notes)
        readings, notes = gpu_readings(driver.gpus, self._environ)
        return readings, (*driver.notes, *notes)


def gpu_readings(
    gpus: Sequence[GpuRecord], environ: Mapping[str, str]
) -> tuple[tuple[GpuReading, ...], tuple[str, ...]]:
    """NVML's records as readings, each MIG device after its GPU, with CUDA's index (pure).

    >>> from anydevice.hardware.backends.nvml import GpuRecord
    >>> a = GpuRecord(smi_index=0, uuid="GPU-a", name="A", pci_bus_id="0000:01:00.0")
    >>> b = GpuRecord(smi_index=1, uuid="GPU-b", name="A", pci_bus_id="0000:02:00.0")
    >>> [g.cuda_index for g in gpu_readings([a, b], {"CUDA_VISIBLE_DEVICES": "1"})[0]]
    [None, 0]
    """
    from anydevice.hardware.backends.cuda import visible_devices

    vis = visible_devices(
        gpus, environ.get("CUDA_VISIBLE_DEVICES"), environ.get("CUDA_DEVICE_ORDER")
    )
    cuda_index = {r.uuid: i for i, r in enumerate(vis.devices)}
    out = []
    for g in gpus:
        for r in (g, *g.mig_devices):
            out.append(
                GpuReading(
                    smi_index=r.smi_index,
                    cuda_index=cuda_index.get(r.uuid),
                    uuid=r.uuid,
                    name=r.name,
                    memory_used=r.memory_used,
                    memory_total=r.memory_total,
                    utilization=r.utilization,
                    temperature=r.temperature,
                    power=r.power,
                    power_limit=r.power_limit,
                    processes=r.processes,
                    mig_parent=r.mig_parent,
                )
            )
    return tuple(out), vis.notes
