"""``anydevice top``'s screen: the host, the accelerators, the torch processes by job and
rank, the jobs, and what ended processes left; with history sparklines, sorting and
filtering. Rich renderables of a :class:`~anydevice.hardware.gpuwatch.Reading`; plain text
where the output is not a terminal (a log, a notebook's ``!anydevice top --once``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from anydevice.hardware.facts import DeviceReading, format_bytes
from anydevice.hardware.jobs import short_id

if TYPE_CHECKING:
    from anydevice.hardware.gpuwatch import Reading
    from anydevice.hardware.jobs import ProcessReading

__all__ = ["SORTS", "History", "sorted_processes", "sparkline", "top_view", "visible_rows"]

_BARS = "▁▂▃▄▅▆▇█"

#: Sort keys: name -> (key of a process row, descending by default).
SORTS: dict[str, tuple[Callable[[ProcessReading], Any], bool]] = {
    "job": (lambda p: (p.job_key or "~", p.rank if p.rank is not None else 1 << 30, p.pid), False),
    "pid": (lambda p: p.pid, False),
    "cpu": (lambda p: p.cpu_percent or 0.0, True),
    "rss": (lambda p: p.rss or 0, True),
    "memory": (lambda p: p.device_memory or 0, True),
    "steps": (lambda p: p.progress.steps_per_second if p.progress else -1.0, True),
    "stall": (lambda p: p.progress.since_last_step if p.progress else -1.0, True),
}


def sparkline(values: Iterable[float | None], top: float | None = None) -> str:
    """A line of bars, one per value, scaled to ``top`` (default: the largest).

    >>> sparkline([0, 50, 100], top=100)
    '▁▅█'
    """
    seen = list(values)
    known = [v for v in seen if v is not None]
    peak = top if top is not None else max(known, default=0.0)
    out = []
    for v in seen:
        if v is None:
            out.append(" ")
        else:
            share = 0.0 if not peak else max(0.0, min(1.0, v / peak))
            out.append(_BARS[min(len(_BARS) - 1, int(share * (len(_BARS) - 1) + 0.5))])
    return "".join(out)


class History:
    """The last ``length`` values of each series a live view draws (per device, per process).

    >>> h = History(3)
    >>> for v in (1, 2, 3, 4):
    ...     h.add("x", v)
    >>> list(h.get("x"))
    [2, 3, 4]
    """

    def __init__(self, length: int = 20) -> None:
        self.length = length
        self._series: dict[str, collections.deque[float | None]] = {}

    def add(self, key: str, value: float | None) -> None:
        self._series.setdefault(key, collections.deque(maxlen=self.length)).append(value)

    def get(self, key: str) -> list[float | None]:
        return list(self._series.get(key, ()))

    def record(self, r: Reading) -> None:
        """Add one reading: the host's CPU, each device's use and memory, each process's
        steps per second."""
        self.add("host:cpu", r.host.cpu_percent)
        for d in r.devices:
            self.add(f"{d.key}:util", d.utilization)
            share = d.memory_used / d.memory_total if d.memory_used and d.memory_total else None
            self.add(f"{d.key}:mem", None if share is None else 100 * share)
        for p in r.processes:
            self.add(f"{p.pid}:steps", p.progress.steps_per_second if p.progress else None)


def sorted_processes(
    rows: Sequence[ProcessReading], key: str = "job", reverse: bool = False
) -> list[ProcessReading]:
    """Rows by ``key`` (a name of :data:`SORTS`), its default order flipped by ``reverse``."""
    fn, descending = SORTS[key]
    return sorted(rows, key=fn, reverse=descending != reverse)


# ----------------------------------------------------------------------------- drawing


def _unknown() -> Text:
    return Text("?", style="dim")


def _share(used: float | None, total: float | None) -> str:
    return "" if used is None or not total else f" ({used / total:.0%})"


def _seconds(s: float | None) -> str:
    if s is None:
        return "?"
    if s < 100:
        return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"
    return f"{s / 60:.0f} min" if s < 6000 else f"{s / 3600:.1f} h"


def _status(p: ProcessReading) -> Text:
    if p.status == "stalled":
        why = " (stopped)" if p.state in ("stopped", "traced") else ""
        since = "" if p.stalled_for is None else " " + _seconds(p.stalled_for)
        return Text(f"stalled{since}{why}", style="bold red")
    if p.status == "waiting" and p.progress and p.progress.collective:
        c = p.progress.collective
        return Text(f"in {c['op']} #{c['seq']} {_seconds(c['waited'])}", style="yellow")
    if p.status == "stepping":
        return Text("stepping", style="green")
    if p.status == "starting":
        return Text("starting", style="cyan")
    return Text(p.state, style="red" if p.state in ("stopped", "zombie") else "dim")


def _device_label(d: DeviceReading) -> str:
    if d.torch_name:
        return d.torch_name
    return f"{(d.vendor or d.source).lower()}:{d.index}" if d.index is not None else d.key


def _devices_table(devices: Sequence[DeviceReading], history: History | None) -> Table:
    t = _table("devices")
    for name in ("device", "#", "name", "memory used / total", "util", "temp", "power", "via"):
        t.add_column(
            name,
            justify="left" if name in ("name", "device", "via") else "right",
            no_wrap=name != "name",
        )
    if history is not None:
        t.add_column("util history", no_wrap=True)
    for d in devices:
        cap = f" / {d.power_limit:.0f}" if d.power_limit else ""
        memory = (
            f"{format_bytes(d.memory_used)} / {format_bytes(d.memory_total)}"
            f"{_share(d.memory_used, d.memory_total)}"
            if d.memory_total
            else format_bytes(d.memory_used)
        )
        cells: list[Any] = [
            Text(_device_label(d)) if d.torch_name else Text(_device_label(d), style="dim"),
            "-" if d.index is None else str(d.index),
            d.name,
            memory,
            _unknown() if d.utilization is None else f"{d.utilization:.0f}%",
            _unknown() if d.temperature is None else f"{d.temperature:.0f} °C",
            _unknown() if d.power is None else f"{d.power:.0f}{cap} W",
            d.source,
        ]
        if history is not None:
            cells.append(sparkline(history.get(f"{d.key}:util"), top=100))
        t.add_row(*cells)
    return t


def _memory_cell(p: ProcessReading) -> str:
    g = p.progress
    if g is not None and g.reserved is not None:
        return f"{format_bytes(g.allocated)} / {format_bytes(g.reserved)} / {format_bytes(g.peak)}"
    return ""


#: The process table's columns in order, each with its rank when the screen is too
#: narrow for all: the highest rank goes first (0: always shown).
_COLUMNS: tuple[tuple[str, int], ...] = (
    ("pid", 0), ("user", 10), ("job", 1), ("rank", 0), ("status", 0), ("steps/s", 2),
    ("last step", 7), ("CPU", 4), ("RSS", 5), ("device", 8), ("dev mem", 3),
    ("alloc / reserved / peak", 9), ("util", 6), ("command", 0),
)  # fmt: skip
_LEFT = ("user", "job", "status", "device", "command")
_ALWAYS = ("pid", "status", "command")


class _ProcessTable:
    """The processes, with as many columns as the screen's width holds."""

    def __init__(
        self,
        rows: Sequence[ProcessReading],
        devices: Sequence[DeviceReading],
        history: History | None,
        selected: int | None,
        tree: bool,
    ) -> None:
        self.rows, self.history, self.selected, self.tree = rows, history, selected, tree
        self.labels = {d.key: _device_label(d) for d in devices}

    def __rich_console__(self, console: Any, options: Any) -> Any:
        by_pid = {p.pid: p for p in self.rows}
        shown = [p for p in self.rows if self.tree or p.role != "child" or p.ppid not in by_pid]
        cells = [self._cells(p) for p in shown]
        columns = [
            name
            for name, _ in _COLUMNS
            if name in _ALWAYS or any(str(c[name]).strip() for c in cells)
        ]
        # Every column as wide as its widest cell (the job's id cut), the command what is
        # left, at least 12; where that does not fit, the least needed columns go.
        widths = {
            name: max([_width(c[name]) for c in cells] + [len(name.split(" ")[0])])
            for name in columns
        }
        if "job" in widths:
            widths["job"] = min(widths["job"], 16)
        by_need = sorted((rank, name) for name, rank in _COLUMNS if name in widths and rank)
        while True:
            # Each column is padded by one on each inner side and parted by one: 3 each.
            used = sum(w for n, w in widths.items() if n != "command") + 3 * (len(widths) - 1)
            if options.max_width - used >= 12 or not by_need:
                break
            del widths[by_need.pop()[1]]
        columns = [name for name in columns if name in widths]
        widths["command"] = max(12, min(widths["command"], options.max_width - used))
        t = _table("torch processes")
        for name in columns:
            t.add_column(
                name,
                justify="left" if name in _LEFT else "right",
                no_wrap=True,
                overflow="ellipsis",
                width=widths[name],
            )
        for p, row in zip(shown, cells, strict=False):
            t.add_row(
                *(row[name] for name in columns),
                style="reverse" if self.selected == p.pid else None,
            )
        yield t

    def _cells(self, p: ProcessReading) -> dict[str, Any]:
        pid = str(p.pid) + (f" ({p.container_pid})" if p.container_pid else "")
        if p.children and not self.tree:
            pid += f" +{len(p.children)}"
        rank = "" if p.rank is None else f"{p.rank}/{p.world_size or '?'}"
        if p.role == "launcher":
            rank = "launcher"
        elif p.role == "child":
            rank = f"└ {rank}"
        steps = ""
        g = p.progress
        if g is not None and g.steps:
            steps = f"{g.steps_per_second:.1f}"
            if self.history is not None:
                steps = sparkline(self.history.get(f"{p.pid}:steps")[-6:]) + " " + steps
        device = ", ".join(self.labels.get(k, k) for k in p.devices) or ", ".join(p.device_names)
        memory = p.device_memory if p.device_memory is not None else (g.reserved if g else None)
        return {
            "pid": pid,
            "user": p.user or "?",
            "job": short_id(p.job),
            "rank": rank,
            "status": _status(p),
            "steps/s": steps,
            "last step": _seconds(g.since_last_step) if g is not None and g.steps else "",
            "CPU": "" if p.cpu_percent is None else f"{p.cpu_percent:.0f}%",
            "RSS": format_bytes(p.rss),
            "device": device,
            "dev mem": "" if memory is None else format_bytes(memory),
            "alloc / reserved / peak": _memory_cell(p),
            "util": "" if p.utilization is None else f"{p.utilization:.0f}%",
            "command": " ".join(p.command.split()),  # a `python -c` program on one line
        }


def _table(title: str) -> Table:
    """A table as top draws them: a rule under the header, no vertical lines (narrow
    screens, plain terminals over SSH)."""
    return Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
    )


def _width(cell: Any) -> int:
    return cell.cell_len if isinstance(cell, Text) else len(str(cell))


def _jobs_table(r: Reading) -> Table:
    t = _table("jobs")
    for name in ("job", "launcher", "ranks here", "steps/s", "stalled", "hosts", "note"):
        t.add_column(name, overflow="fold")
    for j in r.jobs:
        rates = "" if j.steps_per_second is None else "{:.1f}-{:.1f}".format(*j.steps_per_second)
        who = j.launcher or "?"
        if j.launcher_pid:
            who += f" (pid {j.launcher_pid})"
        t.add_row(
            short_id(j.id),
            who,
            f"{len(j.ranks)}/{j.world_size or '?'}",
            rates,
            Text(",".join(map(str, j.stalled)), style="bold red") if j.stalled else "",
            ", ".join(j.hosts),
            j.note or "",
        )
    return t


def visible_rows(
    r: Reading, *, sort: str = "job", reverse: bool = False, tree: bool = False
) -> list[ProcessReading]:
    """The process rows as drawn, in order (what the selection moves over)."""
    rows = sorted_processes(r.processes, sort, reverse)
    shown = {p.pid for p in rows}
    return [p for p in rows if tree or p.role != "child" or p.ppid not in shown]


def top_view(
    r: Reading,
    *,
    history: History | None = None,
    sort: str = "job",
    reverse: bool = False,
    selected: int | None = None,
    tree: bool = False,
    footer: str | None = None,
) -> Group:
    """One screen of ``anydevice top``."""
    h = r.host
    load = "" if h.load is None else " — load " + " ".join(f"{x:.2f}" for x in h.load)
    when = datetime.fromtimestamp(r.time).strftime("%H:%M:%S")
    spark = ""
    if history is not None:
        spark = " " + sparkline(history.get("host:cpu"), top=100)
    parts: list[Any] = [
        Text.assemble(
            (h.hostname, "bold"),
            f"  {when}  CPU {h.cpu_percent:.0f}% of {h.cores} cores{spark}{load}  RAM ",
            f"{format_bytes(h.memory_used)} / {format_bytes(h.memory_total)}"
            f"{_share(h.memory_used, h.memory_total)}",
        )
    ]
    if r.devices:
        parts.append(_devices_table(r.devices, history))
    rows = sorted_processes(r.processes, sort, reverse)
    if rows:
        parts.append(_ProcessTable(rows, r.devices, history, selected, tree))
    else:
        parts.append(Text("no torch process here", style="dim"))
    if r.jobs:
        parts.append(_jobs_table(r))
    for x in r.leftovers:
        parts.append(Text(f"left behind: {x.what}", style="yellow"))
    for note in r.notes:
        parts.append(Text(note, style="yellow"))
    skipped = {k: v for k, v in r.skipped.items() if v}
    if skipped.get("unreadable"):
        parts.append(
            Text(
                f"{skipped['unreadable']} process(es) of other users could not be read fully "
                "(their environment, maps): run as root to see their ranks",
                style="dim",
            )
        )
    if footer:
        parts.append(Text(footer, style="dim"))
    return Group(*parts)
