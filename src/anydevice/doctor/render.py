"""The doctor's report as rich tables: checks, measurements, levers, the devices side by
side, and the progress line (one line that updates in place, in a terminal or a notebook)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from anydevice.measure.samples import format_time

if TYPE_CHECKING:
    from collections.abc import Iterator

    from anydevice.doctor.results import DeviceSummary, Measurements, Report
    from anydevice.doctor.workloads import Progress

__all__ = ["measuring", "render_measurements", "render_report"]

_STATUS_STYLE = {
    "ok": ("✔ ok", "green"),
    "info": ("ℹ info", "cyan"),
    "warn": ("▲ warn", "yellow"),
    "fail": ("✖ fail", "bold red"),
    "skip": ("– skip", "dim"),
}


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
    console.print(report.inventory)
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
    "noisy": ("? noisy:\n  measure\n  again", "yellow"),
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
        if lv.noisy and lv.verdict != "noisy":
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
