"""Terminal rendering with rich, for the CLI. Imported only by ``anydevice.cli``."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from anydevice.inventory import DeviceInfo, HostInfo, Inventory, format_bytes

if TYPE_CHECKING:
    from collections.abc import Iterator

    from anydevice.doctor import Report
    from anydevice.doctor.measure import Measurements, Progress
    from anydevice.doctor.results import DeviceSummary
    from anydevice.gpuwatch import Reading

__all__ = ["measuring", "render_inventory", "render_measurements", "render_report", "top_view"]

_STATUS_STYLE = {
    "ok": ("✔ ok", "green"),
    "info": ("ℹ info", "cyan"),
    "warn": ("▲ warn", "yellow"),
    "fail": ("✖ fail", "bold red"),
    "skip": ("– skip", "dim"),
}


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

    if d.kind == "cuda":
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


def render_inventory(inv: Inventory, console: Console) -> None:
    console.print(Panel(host_table(inv.host), title="[bold]host[/]", title_align="left"))
    for d in inv.devices:
        console.print(device_table(d))
    for note in inv.notes:
        console.print(Text(f"note: {note}", style="yellow"))


# ----------------------------------------------------------------------------- top


def _share(used: float | None, total: float | None) -> str:
    if used is None or not total:
        return "?"
    return f"{used / total:.0%}"


def _reading(value: float | None, fmt: str) -> Text | str:
    return _unknown() if value is None else fmt.format(value)


def top_view(r: Reading) -> Group:
    """One screen of ``anydevice top``: the host, each GPU, and the processes on them."""
    from datetime import datetime

    h = r.host
    load = "" if h.load is None else " — load " + " ".join(f"{x:.2f}" for x in h.load)
    when = datetime.fromtimestamp(r.time).strftime("%H:%M:%S")
    host = Text.assemble(
        (h.hostname, "bold"),
        f"  {when}  CPU {h.cpu_percent:.0f}% of {h.cores} cores{load}  RAM ",
        f"{format_bytes(h.memory_used)} / {format_bytes(h.memory_total)} "
        f"({_share(h.memory_used, h.memory_total)})",
    )
    parts: list[Any] = [host]
    if r.gpus:
        gpus = Table(title="GPUs", title_justify="left")
        for name in ("cuda", "smi", "name", "memory used / total", "util", "temp", "power"):
            gpus.add_column(name, justify="left" if name == "name" else "right", no_wrap=True)
        procs = Table(title="processes", title_justify="left")
        for name in ("smi", "pid", "name", "GPU memory"):
            procs.add_column(name, justify="left" if name == "name" else "right")
        for g in r.gpus:
            cap = f" / {g.power_limit:.0f}" if g.power_limit else ""
            gpus.add_row(
                Text("-", style="dim") if g.cuda_index is None else f"cuda:{g.cuda_index}",
                str(g.smi_index),
                g.name,
                f"{format_bytes(g.memory_used)} / {format_bytes(g.memory_total)} "
                f"({_share(g.memory_used, g.memory_total)})",
                _reading(g.utilization, "{:.0f}%"),
                _reading(g.temperature, "{:.0f} °C"),
                _unknown() if g.power is None else f"{g.power:.0f}{cap} W",
            )
            for p in g.processes or ():
                procs.add_row(str(g.smi_index), str(p.pid), p.name or "?", format_bytes(p.memory))
        parts.append(gpus)
        if procs.row_count:
            parts.append(procs)
        else:
            parts.append(Text("no process is using a GPU", style="dim"))
    for note in r.notes:
        parts.append(Text(note, style="yellow"))
    return Group(*parts)


def checks_table(report: Report) -> Table:
    table = Table(title="checks", title_justify="left", show_lines=False)
    table.add_column("", no_wrap=True)
    table.add_column("check", style="bold")
    table.add_column("finding and fix", overflow="fold")
    for c in report.checks:
        label, style = _STATUS_STYLE[c.status]
        body = Text(c.summary)
        if c.fix:
            body.append("\n→ " + c.fix, style="bold")
        table.add_row(Text(label, style=style), c.title, body)
    return table


def render_report(report: Report, console: Console) -> None:
    render_inventory(report.inventory, console)
    console.print(checks_table(report))
    counts = {s: sum(c.status == s for c in report.checks) for s in _STATUS_STYLE}
    verdict = "no check failed" if report.ok else f"{counts['fail']} check(s) failed"
    console.print(
        Text(
            f"{verdict}: {counts['ok']} ok, {counts['info']} info, {counts['warn']} warn, "
            f"{counts['fail']} fail, {counts['skip']} skipped.",
            style="green" if report.ok else "bold red",
        )
    )
    if report.measurements is not None:
        render_measurements(report.measurements, console)


# ----------------------------------------------------------------------------- measurements

_VERDICT_STYLE = {
    "use": ("✔ use", "green"),
    "no-gain": ("– no gain", "dim"),
    "slower": ("✖ slower", "yellow"),
    "n/a": ("– n/a", "dim"),
}


def format_rate(value: float | None, unit: str) -> str:
    """``1.2e5 GFLOP/s`` reads ``120 TFLOP/s``; ``None`` reads ``-``."""
    if value is None:
        return "-"
    if unit == "GFLOP/s" and value >= 1000:
        return f"{value / 1000:.3g} TFLOP/s"
    return f"{value:.3g} {unit}"


def _seconds(value: float | None) -> str:
    from anydevice.timing import format_time

    return "-" if value is None else format_time(value)


def results_table(m: Measurements) -> Table:
    table = Table(title="measured", title_justify="left")
    table.add_column("device", no_wrap=True)
    table.add_column("what", style="bold")
    table.add_column("result", justify="right", no_wrap=True)
    table.add_column("of peak", justify="right", no_wrap=True)
    table.add_column("how", overflow="fold", style="dim")
    for r in m.results:
        share = "-" if r.fraction is None else f"{r.fraction:.0%}"
        peak = "" if r.peak is None else f"{r.peak_source}: {format_rate(r.peak, r.unit)}; "
        result = Text(format_rate(r.value, r.unit))
        if r.noisy:
            result.append(" (noisy)", style="yellow")
        if r.conditions:  # the threads it was measured with, and whether others were busy
            result.append(f"\n{r.conditions}", style="yellow" if r.busy else "dim")
        table.add_row(r.device, r.title, result, share, peak + r.detail)
    return table


def levers_table(m: Measurements) -> Table:
    table = Table(title="what each lever buys here (interleaved A/B samples)", title_justify="left")
    table.add_column("device", no_wrap=True)
    table.add_column("lever", overflow="fold", ratio=1, min_width=20)
    table.add_column("speed-up (spread)\nwithout → with", justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for lv in m.levers:
        label, style = _VERDICT_STYLE[lv.verdict]
        if lv.verdict == "no-gain" and not lv.clear:
            label = "– no clear\n  difference" if lv.pairs >= 3 else "– too few\n  pairs"
        if lv.noisy:
            label += "\n(noisy)"
        what = Text(lv.title, style="bold")
        what.append(f"\n{lv.workload if lv.verdict != 'n/a' else lv.note}", style="dim")
        speedup = Text("-" if lv.speedup is None else f"{lv.speedup:.2f}x")
        if lv.spread is not None:
            speedup.append(f" ±{lv.spread:.0%}" if lv.pairs >= 3 else f" ({lv.pairs} pair(s))",
                           style="dim")  # fmt: skip
        if lv.speedup is not None:
            speedup.append(f"\n{_seconds(lv.baseline)} → {_seconds(lv.lever)}", style="dim")
        table.add_row(lv.device, what, speedup, Text(label, style=style))
    return table


def _tflops(value: float | None) -> str:
    return "-" if value is None else f"{value / 1000:.3g}"


def _mfu(d: DeviceSummary) -> str:
    """The best step's model FLOPs utilisation, and the fp32 step's where they differ;
    "invalid" where one would exceed 100 % (the advice says why)."""
    if d.mfu_best is None:
        return "invalid" if d.mfu_invalid else "-"
    if d.mode == "fp32" or d.mfu_fp32 is None:
        return f"{d.mfu_best:.1%}"
    return f"{d.mfu_best:.1%} ({d.mfu_fp32:.1%} fp32)"


def devices_table(m: Measurements) -> Table:
    table = Table(title=f"side by side: {m.step}; matmuls in TFLOP/s", title_justify="left")
    # short two-line headers, so 80 columns hold them whole; the matmul rates are the
    # device's, measured apart from the step, and say so
    for name in ("device", "step\nfp32", "step\nbest", "x CPU", "step\nMFU",
                 "matmul\nfp32", "matmul\nbest", "memory\nGB/s", "H2D\nGB/s"):  # fmt: skip
        table.add_column(name, justify="left" if name == "device" else "right")
    for d in m.devices:
        table.add_row(
            d.device,
            _seconds(d.step_fp32),
            f"{_seconds(d.step_best)} {d.mode}",
            "-" if d.vs_cpu is None else f"{d.vs_cpu:.3g}x",
            _mfu(d),
            _tflops(d.matmul_fp32),
            f"{_tflops(d.matmul_best)} {d.best_dtype}",
            "-" if d.memory is None else f"{d.memory:.3g}",
            "-" if d.h2d is None else f"{d.h2d:.3g}",
        )
    return table


def render_measurements(m: Measurements, console: Console) -> None:
    if m.load is not None:
        style = "bold yellow" if m.load.busy else "dim"
        console.print(Text(f"machine load while measuring: {m.load.summary}", style=style))
    console.print(results_table(m))
    console.print(levers_table(m))
    console.print(devices_table(m))
    for line in m.advice:
        console.print(Text("→ " + line, style="bold"))
    for note in m.notes:
        console.print(Text(f"note: {note}", style="yellow"))
    console.print(
        Text(f"measured in {m.seconds:.1f} s ({m.plan} plan, budget {m.budget:g} s)", style="dim")
    )


class _ProgressLine:
    """What a notebook shows of the measuring: text, or HTML with a ``<progress>`` bar."""

    def __init__(self, done: int, total: int, title: str, left: float, took: float) -> None:
        self.done, self.total, self.title, self.left, self.took = done, total, title, left, took

    def __repr__(self) -> str:
        if self.title == "done":
            return f"measured {self.total} steps in {self.took:.0f} s"
        return (
            f"measuring {self.done}/{self.total or '?'} ({self.took:.0f} s, at most "
            f"{self.left:.0f} s left) {self.title}"
        )

    def _repr_html_(self) -> str:
        from html import escape

        bar = f"<progress value='{self.done}' max='{max(self.total, 1)}'></progress> "
        return f"<div>{bar}{escape(repr(self))}</div>"


@contextlib.contextmanager
def _notebook_progress() -> Iterator[Progress]:
    """Progress as a display that each step replaces (no widgets needed)."""
    import importlib
    import time

    display = importlib.import_module("IPython.display").display  # there in any notebook
    start = time.monotonic()
    handle = display(_ProgressLine(0, 0, "starting", 0.0, 0.0), display_id=True)

    def update(done: int, total: int, title: str, left: float) -> None:
        handle.update(_ProgressLine(done, total, title, left, time.monotonic() - start))

    yield update


@contextlib.contextmanager
def measuring(console: Console) -> Iterator[Progress]:
    """A progress bar on ``console`` (when it is a terminal; in a notebook, one line that
    updates in place) and the callback that moves it; it shows the seconds of the time
    budget left."""
    if console.is_jupyter:  # rich's live bar needs ipywidgets there, and is off without
        with _notebook_progress() as step:
            yield step
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("[bold]measuring[/]"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("[dim]at most {task.fields[left]} left[/]"),
        TextColumn("{task.description}"),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    task = bar.add_task("", total=None, left="?")

    def update(done: int, total: int, title: str, left: float) -> None:
        bar.update(task, completed=done, total=total, description=title, left=f"{left:.0f} s")

    with bar:
        yield update
