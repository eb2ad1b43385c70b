"""Every accelerator of this machine, read live for ``anydevice top``, each through the best
reader present, as :class:`~anydevice.hardware.facts.DeviceReading` s.

* NVIDIA: NVML (:mod:`~anydevice.hardware.backends.nvml`), every physical GPU and MIG
  device with nvidia-smi's index and CUDA's in this shell (``CUDA_VISIBLE_DEVICES`` and
  ``CUDA_DEVICE_ORDER`` applied), its processes' memory and SM utilisation.
* AMD: amdsmi where installed (:mod:`~anydevice.hardware.backends.amdsmi`), else the
  kernel's DRM cards; each process's VRAM and engine time from its DRM fdinfo
  (:mod:`~anydevice.hardware.backends.drm`).
* Intel: the kernel's DRM cards and fdinfo; names and memory from ``xpu-smi`` where
  installed (:mod:`~anydevice.hardware.backends.xpusmi`).
* Apple silicon: the I/O Registry (:mod:`~anydevice.hardware.backends.ioreg`).

Each reader is asked only where its hardware may be (a driver's files, the platform), so a
machine without it pays nothing. This is the one module that knows which vendor reader
serves which hardware; what it returns is vendor-neutral. Devices known only from the
heartbeats of the processes using them (the simulated accelerator, any ``torch.accelerator``
backend) are added by :mod:`anydevice.hardware.gpuwatch`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from anydevice.hardware.backends import drm
from anydevice.hardware.facts import DeviceReading, DeviceUse

__all__ = ["DeviceWatch", "nvidia_readings"]


class DeviceWatch:
    """Reads the accelerators; keeps each DRM client's last counters, so a process's busy
    share is measured between two readings (the first reading primes them).

    Args:
        environ: where ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` are read.
        nvml: the NVML binding (pynvml when None); amdsmi: the amdsmi module (imported
            when None, where AMD hardware is present).
        proc, drm_root: the procfs and ``/sys/class/drm`` to read.
        run: runs ``xpu-smi`` and ``ioreg``.
    """

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        nvml: Any | None = None,
        amdsmi: Any | None = None,
        proc: str = "/proc",
        drm_root: str = "/sys/class/drm",
        run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
        platform: str = sys.platform,
    ) -> None:
        self.environ = os.environ if environ is None else environ
        self._nvml = nvml
        self._amdsmi = amdsmi
        self._proc = proc
        self._drm_root = drm_root
        self._run = run
        self._platform = platform
        self._clients: dict[tuple[int, str | None, int | None], tuple[drm.DrmClient, float]] = {}
        self._intel: list[Any] | None = None  # xpu-smi's GPUs, read once

    def prime(self) -> None:
        """Read the DRM clients' counters now, so the next :meth:`read` has busy shares."""
        if drm.cards(self._drm_root):
            self._drm_usage(drm.clients(proc=self._proc))

    def read(self) -> tuple[list[DeviceReading], list[str]]:
        """Every accelerator now, and notes on what could not be read."""
        devices, notes = nvidia_readings(self.environ, self._nvml)
        absent = notes[:1] if not devices else []  # why no NVIDIA GPU: said if none at all
        notes = notes if devices else []
        cards = drm.cards(self._drm_root)
        if cards or os.path.exists("/dev/kfd"):
            usage = self._drm_usage(drm.clients(proc=self._proc)) if cards else {}
            more, why = self._amd(cards, usage)
            devices += more
            notes += why
            devices += self._intel_readings(cards, usage)
        if self._platform == "darwin":
            devices += _apple(self._run)
        if not devices:
            notes.insert(0, "no GPU: " + (absent[0] if absent else "none found."))
        return devices, notes

    def _drm_usage(self, clients: list[drm.DrmClient]) -> dict[str, list[DeviceUse]]:
        """Each card's processes (by PCI slot): memory now, busy share since last time."""
        now = time.monotonic()
        seen: dict[tuple[int, str | None, int | None], tuple[drm.DrmClient, float]] = {}
        by_card: dict[str, dict[int, DeviceUse]] = {}
        for c in clients:
            key = (c.pid, c.pdev, c.client_id)
            before = self._clients.get(key)
            busy = drm.busy_percent(before[0], c, now - before[1]) if before else None
            seen[key] = (c, now)
            procs = by_card.setdefault(c.pdev or "", {})
            old = procs.get(c.pid, DeviceUse(c.pid, 0, None))
            util = busy if old.utilization is None else max(old.utilization, busy or 0.0)
            procs[c.pid] = DeviceUse(c.pid, (old.memory or 0) + c.device_memory, util)
        self._clients = seen
        return {pdev: list(p.values()) for pdev, p in by_card.items()}

    def _amd(
        self, cards: list[drm.DrmCard], usage: dict[str, list[DeviceUse]]
    ) -> tuple[list[DeviceReading], list[str]]:
        from anydevice.hardware.backends import amdsmi

        amd_cards = [c for c in cards if c.vendor == "AMD"]
        try:
            gpus, notes = amdsmi.read(self._amdsmi)
        except amdsmi.AmdsmiUnavailable:
            return [_card(c, usage) for c in amd_cards], []
        out = []
        for g in gpus:
            drm_procs = {u.pid: u for u in usage.get(g.pdev or "", [])}
            procs = tuple(
                DeviceUse(pid, mem, drm_procs[pid].utilization if pid in drm_procs else None)
                for pid, mem in g.processes.items()
            ) + tuple(u for pid, u in drm_procs.items() if pid not in g.processes)
            out.append(
                DeviceReading(
                    key=f"amdsmi:{g.uuid or g.pdev or g.index}",
                    vendor="AMD",
                    source="amdsmi",
                    name=g.name,
                    index=g.index,
                    uuid=g.uuid,
                    pci_bus_id=g.pdev,
                    memory_used=g.memory_used,
                    memory_total=g.memory_total,
                    utilization=g.utilization,
                    temperature=g.temperature,
                    power=g.power,
                    processes=procs,
                )
            )
        return out, notes

    def _intel_readings(
        self, cards: list[drm.DrmCard], usage: dict[str, list[DeviceUse]]
    ) -> list[DeviceReading]:
        intel = [c for c in cards if c.vendor == "Intel"]
        if not intel:
            return []
        if self._intel is None:
            from anydevice.hardware.backends import xpusmi

            self._intel = xpusmi.read(self._run)
        by_slot = {g.pdev: g for g in self._intel if g.pdev}
        out = []
        for c in intel:
            r = _card(c, usage)
            g = by_slot.get(c.pdev)
            if g is not None:
                r = replace(
                    r,
                    name=g.name,
                    uuid=g.uuid,
                    index=g.index,
                    source="drm+xpu-smi",
                    memory_total=g.memory_total,
                    memory_used=g.memory_used,
                )
            elif r.memory_used is None and r.processes:
                used = sum(p.memory or 0 for p in r.processes)
                r = replace(r, memory_used=used)
            out.append(r)
        return out


def _card(c: drm.DrmCard, usage: dict[str, list[DeviceUse]]) -> DeviceReading:
    procs = tuple(usage.get(c.pdev, ()))
    return DeviceReading(
        key=f"drm:{c.pdev or c.card}",
        vendor=c.vendor,
        source="drm",
        name=c.name or f"{c.vendor} GPU [{c.pci_id}]",
        index=int(c.card[4:]),
        pci_bus_id=c.pdev,
        memory_used=c.memory_used,
        memory_total=c.memory_total,
        utilization=c.utilization,
        temperature=c.temperature,
        power=c.power,
        processes=procs,
    )


def _apple(run: Callable[..., subprocess.CompletedProcess[str]]) -> list[DeviceReading]:
    from anydevice.hardware.backends import ioreg

    return [
        DeviceReading(
            key=f"ioreg:{i}",
            vendor="Apple",
            source="ioreg",
            name=g.name + (f" ({g.cores} GPU cores)" if g.cores else ""),
            index=i,
            memory_used=g.memory_used,
            utilization=g.utilization,
            notes=("unified memory: the GPU's share of RAM; per-process figures need sudo",),
        )
        for i, g in enumerate(ioreg.read(run))
    ]


def nvidia_readings(
    environ: Mapping[str, str], library: Any | None = None
) -> tuple[list[DeviceReading], list[str]]:
    """Every NVIDIA GPU and MIG device NVML sees, each MIG device after its GPU, with
    nvidia-smi's index and CUDA's name in this shell; notes on what is missing."""
    from anydevice.hardware.backends import nvml

    reader = nvml.NvmlReader(library) if library is not None else nvml.reader()
    if reader.library is None and not _nvidia_driver_here():
        return [], ["NVML library not found (no NVIDIA driver here)"]
    try:
        driver = reader.read(telemetry=True)
    except nvml.NvmlUnavailable as e:
        return [], [f"{e}."]
    if not driver.gpus:
        return [], ["NVML sees no NVIDIA GPU in this machine.", *driver.notes]
    readings, notes = nvidia_records(driver.gpus, environ)
    return readings, [*driver.notes, *notes]


def _nvidia_driver_here() -> bool:
    """Whether NVML may find a driver: not on Linux without the driver's files (so a
    machine without NVIDIA GPUs does not load the NVML binding to learn it)."""
    if not sys.platform.startswith("linux"):
        return True
    from anydevice.hardware.backends.nvml import driver_present

    return driver_present() or any(
        os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/dxg", "/proc/driver/nvidia")
    )


def nvidia_records(
    gpus: Sequence[Any], environ: Mapping[str, str]
) -> tuple[list[DeviceReading], list[str]]:
    """NVML's records as readings (pure).

    >>> from anydevice.hardware.backends.nvml import GpuRecord
    >>> a = GpuRecord(smi_index=0, uuid="GPU-a", name="A", pci_bus_id="0000:01:00.0")
    >>> b = GpuRecord(smi_index=1, uuid="GPU-b", name="A", pci_bus_id="0000:02:00.0")
    >>> [g.torch_name for g in nvidia_records([a, b], {"CUDA_VISIBLE_DEVICES": "1"})[0]]
    [None, 'cuda:0']
    """
    from anydevice.hardware.backends.cuda import CudaBackend, visible_devices

    vis = visible_devices(
        gpus, environ.get("CUDA_VISIBLE_DEVICES"), environ.get("CUDA_DEVICE_ORDER")
    )
    cuda_index = {r.uuid: i for i, r in enumerate(vis.devices)}
    out = []
    for g in gpus:
        for r in (g, *g.mig_devices):
            index = cuda_index.get(r.uuid)
            util = r.process_utilization or {}
            procs = None
            if r.processes is not None:
                procs = tuple(DeviceUse(p.pid, p.memory, util.get(p.pid)) for p in r.processes)
            out.append(
                DeviceReading(
                    key=f"nvml:{r.uuid}",
                    vendor="NVIDIA",
                    source="nvml",
                    name=r.name,
                    index=r.smi_index,
                    torch_name=None if index is None else f"{CudaBackend.kind}:{index}",
                    uuid=r.uuid,
                    pci_bus_id=r.pci_bus_id,
                    memory_used=r.memory_used,
                    memory_total=r.memory_total,
                    utilization=r.utilization,
                    temperature=r.temperature,
                    power=r.power,
                    power_limit=r.power_limit,
                    mig_parent=r.mig_parent,
                    processes=procs,
                )
            )
    return out, list(vis.notes)
