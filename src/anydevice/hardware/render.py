"""Rich tables of the hardware: the host and each device, as an inventory shows them
(text, and HTML in a notebook: :class:`~anydevice.hardware.inventory.Inventory` lays them
out). ``anydevice top``'s screen is :mod:`anydevice.hardware.topview`'s."""

from __future__ import annotations

from typing import Any

from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from anydevice.hardware.backends.cuda import CudaBackend
from anydevice.hardware.facts import DeviceInfo, HostInfo, format_bytes

__all__ = ["device_table", "host_panel", "host_table"]


def _unknown() -> Text:
    return Text("unknown", style="dim")


def _kv_table(title: str | None = None) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False, title=title, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    return table


def host_table(h: HostInfo) -> Table:
    t = _kv_table()
    t.add_row("host", f"{h.hostname} — {h.os}")
    t.add_row("python", h.python)
    t.add_row("torch", f"{h.torch} ({h.torch_build})")
    if h.cuda_runtime:
        libs = [f"CUDA runtime {h.cuda_runtime}"]
        if h.cudnn:
            libs.append(f"cuDNN {h.cudnn}")
        if h.nccl:
            libs.append(f"NCCL {h.nccl}")
        t.add_row("libraries", ", ".join(libs))
    if h.driver or h.nvidia_gpus:
        t.add_row(
            "NVIDIA driver",
            f"{h.driver or '?'} (supports CUDA {h.driver_cuda or '?'}), "
            f"{h.nvidia_gpus if h.nvidia_gpus is not None else '?'} GPU(s) in the machine",
        )
    quota = f", cgroup quota {h.cpu_quota:g}" if h.cpu_quota is not None else ""
    threads = (
        "torch's threads not probed" if h.torch_threads is None
        else f"torch uses {h.torch_threads} threads"
    )  # fmt: skip
    t.add_row(
        "CPU",
        f"{h.cpu_model}: {h.cores_logical} logical / {h.cores_physical or '?'} physical cores, "
        f"{h.cores_usable} usable here{quota}; {threads}",
    )
    limit = f" (cgroup limit {format_bytes(h.memory_limit)})" if h.memory_limit else ""
    t.add_row(
        "RAM",
        f"{format_bytes(h.memory_available)} available of {format_bytes(h.memory_total)}{limit}",
    )
    return t


def device_table(d: DeviceInfo) -> Panel:
    t = _kv_table()

    def row(label: str, value: Any) -> None:
        t.add_row(label, _unknown() if value is None else str(value))

    if d.kind == CudaBackend.kind:  # nvidia-smi's rows
        smi = "?" if d.smi_index is None else str(d.smi_index)
        guess = " (CUDA's FASTEST_FIRST guess)" if d.index_guessed else ""
        row("index", f"{d.spec}; nvidia-smi GPU {smi}{guess}")
        row("UUID", d.uuid)
        row("PCI bus", d.pci_bus_id)
        if d.mig_parent:
            row("MIG of", d.mig_parent)
    if d.memory_total is not None:
        used = f", {format_bytes(d.memory_used)} used" if d.memory_used is not None else ""
        row(
            "memory",
            f"{format_bytes(d.memory_free)} free of {format_bytes(d.memory_total)}{used}",
        )
    else:
        row("memory", None)
    if d.is_accelerator:
        cc = d.compute_capability
        row("compute capability", None if cc is None else f"{cc[0]}.{cc[1]}")
        row("multiprocessors", d.multiprocessors)
    row("native bf16 / tf32", f"{_yes(d.bf16)} / {_yes(d.tf32)}")
    if d.pcie_generation:
        row("PCIe link (max)", f"gen {d.pcie_generation} x{d.pcie_width or '?'}")
    live = []
    if d.utilization is not None:
        live.append(f"{d.utilization:.0f}% busy")
    if d.temperature is not None:
        live.append(f"{d.temperature:.0f} °C")
    if d.power is not None:
        cap = f" / {d.power_limit:.0f} W" if d.power_limit else ""
        live.append(f"{d.power:.0f} W{cap}")
    if live:
        row("now", ", ".join(live))
    if d.processes is not None:
        procs = ", ".join(
            f"{p.pid} {p.name or '?'} ({format_bytes(p.memory)})" for p in d.processes
        )
        row("processes", procs or "none")
    for note in d.notes:
        t.add_row("note", Text(note, style="dim"))
    return Panel(t, title=f"[bold]{d.spec}[/] {d.name}", title_align="left", expand=False)


def _yes(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def host_panel(h: HostInfo) -> Panel:
    """:func:`host_table` in its titled panel, as the inventory shows it."""
    return Panel(host_table(h), title="[bold]host[/]", title_align="left")
