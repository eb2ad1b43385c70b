"""Hand-built machines for policy tests: inventories and NVML records with chosen GPUs.

Only the selection, visibility and doctor policies are tested this way; they are pure
functions of this data. Everything that touches hardware is tested on the real machine.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from anydevice.hardware.backends.nvml import GpuRecord
from anydevice.hardware.facts import DeviceInfo, HostInfo, ProcessInfo
from anydevice.hardware.inventory import Inventory

GiB = 2**30

MODELS: dict[str, dict[str, Any]] = {
    "H100": {"name": "NVIDIA H100 80GB HBM3", "cc": (9, 0), "sms": 132, "mem": 80 * GiB},
    "A100": {"name": "NVIDIA A100-SXM4-40GB", "cc": (8, 0), "sms": 108, "mem": 40 * GiB},
    "V100": {"name": "Tesla V100-SXM2-16GB", "cc": (7, 0), "sms": 80, "mem": 16 * GiB},
    "T4": {"name": "Tesla T4", "cc": (7, 5), "sms": 40, "mem": 15 * GiB},
}


def record(smi: int, model: str = "H100", *, free: int | None = None, **kw: Any) -> GpuRecord:
    """One physical GPU at PCI bus ``smi + 1``, with UUID ``GPU-<smi>000...``."""
    m = MODELS[model]
    total = m["mem"]
    free = total if free is None else free
    base: dict[str, Any] = dict(
        smi_index=smi,
        uuid=f"GPU-{smi}{smi}{smi}{smi}aaaa-0000-0000-0000-{smi:012d}",
        name=m["name"],
        pci_bus_id=f"00000000:{smi + 1:02X}:00.0",
        memory_total=total,
        memory_free=free,
        memory_used=total - free,
        compute_capability=m["cc"],
        multiprocessors=m["sms"],
        utilization=0.0,
        processes=(),
    )
    base.update(kw)
    return GpuRecord(**base)


def mig(parent: GpuRecord, *slices: int) -> GpuRecord:
    """``parent`` in MIG mode with one MIG device per slice count given (1g, 2g, ...)."""
    migs = tuple(
        replace(
            parent,
            uuid=f"MIG-{parent.smi_index}{j}{j}{j}bbbb-0000-0000-0000-{j:012d}",
            name=f"{parent.name} MIG {s}g",
            memory_total=s * 10 * GiB,
            memory_free=s * 10 * GiB,
            memory_used=0,
            multiprocessors=s * 14,
            mig_parent=parent.uuid,
            mig_gi=j + 1,
            mig_ci=0,
        )
        for j, s in enumerate(slices)
    )
    return replace(parent, mig_enabled=True, mig_devices=migs)


def host(**kw: Any) -> HostInfo:
    base: dict[str, Any] = dict(
        hostname="testbox",
        os="Linux-test",
        python="CPython 3.11.7",
        torch="2.13.0+cu128",
        torch_build="CUDA 12.8",
        cpu_model="Test CPU",
        cores_logical=16,
        cores_physical=8,
        cores_usable=16,
        memory_total=64 * GiB,
        memory_available=48 * GiB,
        torch_threads=8,
        cuda_runtime="12.8",
        driver="570.86.15",
        driver_cuda="12.8",
        nvidia_gpus=0,
    )
    base.update(kw)
    return HostInfo(**base)


def cpu_device(**kw: Any) -> DeviceInfo:
    base: dict[str, Any] = dict(
        kind="cpu", index=None, name="Test CPU", memory_total=64 * GiB, memory_free=48 * GiB
    )
    base.update(kw)
    return DeviceInfo(**base)


def gpu(
    index: int,
    model: str = "H100",
    *,
    free: int | None = None,
    util: float = 0.0,
    smi: int | None = None,
    procs: tuple[ProcessInfo, ...] = (),
    **kw: Any,
) -> DeviceInfo:
    m = MODELS[model]
    total = m["mem"]
    free = total if free is None else free
    base: dict[str, Any] = dict(
        kind="cuda",
        index=index,
        name=m["name"],
        uuid=f"GPU-{index}{index}{index}{index}aaaa-0000-0000-0000-{index:012d}",
        smi_index=index if smi is None else smi,
        memory_total=total,
        memory_free=free,
        memory_used=total - free,
        compute_capability=m["cc"],
        multiprocessors=m["sms"],
        bf16=m["cc"] >= (8, 0),
        tf32=m["cc"] >= (8, 0),
        utilization=util,
        processes=procs,
    )
    base.update(kw)
    return DeviceInfo(**base)


def machine(
    *gpus: DeviceInfo,
    notes: tuple[str, ...] = (),
    others: tuple[DeviceInfo, ...] = (),
    **host_kw: Any,
) -> Inventory:
    """An inventory with these GPUs (plus ``others``) and the CPU last."""
    host_kw.setdefault("nvidia_gpus", len([g for g in gpus if g.kind == "cuda"]))
    return Inventory(host=host(**host_kw), devices=(*gpus, *others, cpu_device()), notes=notes)
