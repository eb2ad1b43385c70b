"""``anydevice top``: the live view, ``--once`` and ``--json``; the keys of the live view.

Read-only by default: nothing is sent to any process unless the view was started with
``--signals``, and then only after a key naming the signal (``T`` SIGTERM, ``K`` SIGKILL,
``I`` SIGINT) and a ``y`` confirming it for the process named, which must still be the
same process (its pid and start time) when the signal goes.

This module imports neither torch nor rich at import time: ``--help`` and ``--json``
stay fast.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from anydevice.hardware.jobs import ProcessReading

__all__ = ["SORT_KEYS", "Screen", "configure", "parse_ranks", "run"]

#: The sort keys (:data:`anydevice.hardware.topview.SORTS`), named without importing rich.
SORT_KEYS = ("job", "pid", "cpu", "rss", "memory", "steps", "stall")

#: The keys that ask for a signal, and the signal.
SIGNAL_KEYS = {"T": signal.SIGTERM, "K": signal.SIGKILL, "I": signal.SIGINT}


def configure(
    p: argparse.ArgumentParser,
    *,
    seconds: Callable[[str], float],
    count: Callable[[str], int],
) -> None:
    """``anydevice top``'s arguments; ``seconds`` and ``count`` read a positive number of
    seconds and of readings (the command line's own checks, shared by its commands)."""
    p.epilog = (
        "Lists every accelerator (NVIDIA through NVML, AMD through amdsmi or the kernel's DRM "
        "files, Intel through DRM and xpu-smi, Apple silicon through ioreg, any other torch "
        "device through the heartbeats of its processes) and every torch process with its "
        "job, rank, steps per second and memory; stalled ranks in red. Live keys: up/down "
        "select, s sort, r reverse, t tree, q quit; T/K/I send SIGTERM/SIGKILL/SIGINT to the "
        "selected process after a confirmation, only with --signals."
    )
    p.add_argument(
        "--interval", type=seconds, default=1.0, metavar="S",
        help="seconds between readings (default 1)",
    )  # fmt: skip
    p.add_argument("--once", action="store_true", help="print one reading and exit (for logs)")
    p.add_argument(
        "--json", action="store_true",
        help="one JSON record per reading, one a line (schema anydevice.top/2, docs/top.md)",
    )  # fmt: skip
    p.add_argument("--count", type=count, default=None, metavar="N", help="stop after N readings")
    p.add_argument(
        "--only", type=parse_ranks, default=None, metavar="RANKS",
        help="only these ranks, e.g. 0,2-3",
    )  # fmt: skip
    p.add_argument("--job", default=None, metavar="ID", help="only the job whose id holds ID")
    p.add_argument(
        "--device", default=None, metavar="DEV",
        help="only this device and its processes: cuda:1, sim, an index, a UUID or PCI prefix",
    )  # fmt: skip
    p.add_argument(
        "--sort", choices=SORT_KEYS, default="job",
        help="order of the processes (default job: by job, then rank)",
    )  # fmt: skip
    p.add_argument(
        "--tree", action="store_true",
        help="show each rank's children (DataLoader workers) as rows of their own",
    )  # fmt: skip
    p.add_argument(
        "--signals", action="store_true",
        help="allow the live view's T/K/I keys to signal the selected process (asks first)",
    )  # fmt: skip
    p.add_argument(
        "--prune", action="store_true",
        help="first remove the heartbeats that ended processes left behind",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run ``anydevice top`` with parsed ``args``; the exit code."""
    from anydevice.hardware.gpuwatch import Watcher

    if args.prune:
        _prune()
    count = 1 if args.once else args.count
    watcher = Watcher()  # the first CPU interval starts: what follows is done within it
    if args.json:
        return _json_lines(watcher, args, count)
    from rich.console import Console

    console = Console()
    if count == 1 or not console.is_terminal:
        return _printed(watcher, args, count, console)
    return _live(watcher, args, count, console)


def _only(reading: Any, args: argparse.Namespace) -> Any:
    if args.only is None and not args.job and not args.device:
        return reading
    return reading.only(ranks=args.only, job=args.job, device=args.device)


def _json_lines(watcher: Any, args: argparse.Namespace, count: int | None) -> int:
    taken = 0
    try:
        while True:
            print(json.dumps(_only(watcher.read(), args).to_dict()), flush=True)
            taken += 1
            if count is not None and taken >= count:
                return 0
            time.sleep(args.interval)
    except (KeyboardInterrupt, BrokenPipeError):
        return 0


def _printed(watcher: Any, args: argparse.Namespace, count: int | None, console: Any) -> int:
    from anydevice.hardware.topview import top_view

    taken = 0
    try:
        while True:
            reading = _only(watcher.read(), args)
            console.print(top_view(reading, sort=args.sort, tree=args.tree))
            taken += 1
            if count is not None and taken >= count:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


class Screen:
    """The live view's state, changed by keys: the selected process, the order, the tree,
    and a signal waiting for its confirmation.

    >>> s = Screen(signals=False)
    >>> s.press("T", [])
    >>> s.message
    'no process selected'
    """

    def __init__(self, *, signals: bool, sort: str = "job", tree: bool = False) -> None:
        self.signals = signals
        self.sort = sort
        self.reverse = False
        self.tree = tree
        self.selected: int | None = None
        self.message = ""
        self.pending: tuple[signal.Signals, int, int] | None = None  # signal, pid, start

    def press(self, key: str, rows: Sequence[ProcessReading]) -> str | None:
        """Act on one key; "quit" when the view should end."""
        if self.pending is not None:
            sig, pid, start = self.pending
            self.pending = None
            self.message = self._send(sig, pid, start) if key in ("y", "Y") else "not sent"
            return None
        pids = [r.pid for r in rows]
        if key in ("q", "Q"):
            return "quit"
        if key in ("up", "k", "down", "j") and pids:
            at = pids.index(self.selected) if self.selected in pids else -1
            step = -1 if key in ("up", "k") else 1
            self.selected = pids[max(0, min(len(pids) - 1, at + step))]
        elif key == "s":
            self.sort = SORT_KEYS[(SORT_KEYS.index(self.sort) + 1) % len(SORT_KEYS)]
            self.message = f"sorted by {self.sort}"
        elif key == "r":
            self.reverse = not self.reverse
        elif key == "t":
            self.tree = not self.tree
        elif key in SIGNAL_KEYS:
            self._ask(SIGNAL_KEYS[key], rows)
        return None

    def _ask(self, sig: signal.Signals, rows: Sequence[ProcessReading]) -> None:
        row = next((r for r in rows if r.pid == self.selected), None)
        if row is None:
            self.message = "no process selected"
            return
        if not self.signals:
            self.message = f"read-only: start with --signals to send {sig.name}"
            return
        start = _start_ticks(row.pid)
        if start is None:
            self.message = f"pid {row.pid} has ended"
            return
        who = f"rank {row.rank} of job {row.job}" if row.rank is not None else row.command[:40]
        self.pending = (sig, row.pid, start)
        self.message = f"send {sig.name} to pid {row.pid} ({who})? y/N"

    @staticmethod
    def _send(sig: signal.Signals, pid: int, start: int) -> str:
        if _start_ticks(pid) != start:
            return f"not sent: pid {pid} is no longer the process selected"
        try:
            os.kill(pid, sig)
        except OSError as e:
            return f"{sig.name} to pid {pid} failed: {e.strerror}"
        return f"sent {sig.name} to pid {pid}"

    def footer(self) -> str:
        keys = f"↑/↓ select  s sort ({self.sort})  r reverse  t tree  q quit  "
        keys += "T/K/I signal" if self.signals else "read-only (--signals to send)"
        return keys + (f"   {self.message}" if self.message else "")


def _live(watcher: Any, args: argparse.Namespace, count: int | None, console: Any) -> int:
    from rich.live import Live

    from anydevice.hardware.topview import History, top_view, visible_rows

    history = History()
    screen = Screen(signals=args.signals, sort=args.sort, tree=args.tree)
    taken = 0
    with _keys() as keys, Live(console=console, auto_refresh=False) as live:

        def draw(reading: Any) -> list[Any]:
            rows = visible_rows(reading, sort=screen.sort, reverse=screen.reverse, tree=screen.tree)
            live.update(
                top_view(
                    reading,
                    history=history,
                    sort=screen.sort,
                    reverse=screen.reverse,
                    selected=screen.selected,
                    tree=screen.tree,
                    footer=screen.footer(),
                ),
                refresh=True,
            )
            return rows

        try:
            while True:
                reading = _only(watcher.read(), args)
                history.record(reading)
                rows = draw(reading)
                taken += 1
                if count is not None and taken >= count:
                    return 0
                deadline = time.monotonic() + args.interval
                while True:  # keys are read at least once a cycle, also one that overran
                    for key in keys(max(0.0, deadline - time.monotonic())):
                        if screen.press(key, rows) == "quit":
                            return 0
                        rows = draw(reading)
                    if time.monotonic() >= deadline:
                        break
        except KeyboardInterrupt:
            return 0


@contextmanager
def _keys() -> Iterator[Any]:
    """A function that waits up to its argument for keys and returns them; the terminal in
    cbreak mode meanwhile (keys arrive unbuffered, unechoed), restored after."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:

        def wait(left: float) -> list[str]:
            time.sleep(left)
            return []

        yield wait
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield lambda left: _read_keys(fd, left)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


_ARROWS = {"\x1b[A": "up", "\x1b[B": "down", "\x1bOA": "up", "\x1bOB": "down"}


def _read_keys(fd: int, timeout: float) -> list[str]:
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return []
    data = os.read(fd, 64).decode(errors="replace")
    out, i = [], 0
    while i < len(data):
        arrow = next((a for a in _ARROWS if data.startswith(a, i)), None)
        if arrow is not None:
            out.append(_ARROWS[arrow])
            i += len(arrow)
        else:
            out.append(data[i])
            i += 1
    return out


def _start_ticks(pid: int) -> int | None:
    from anydevice.hardware.processes import ProcessReader

    sample = ProcessReader().sample(pid, deep=False)
    return None if sample is None else sample.start_ticks


def _prune() -> None:
    from anydevice import heartbeat
    from anydevice.hardware.gpuwatch import heartbeat_folders

    removed = 0
    for place in heartbeat_folders():
        before = {b.path for b in heartbeat.read_all(place, prune=False) if not b.alive}
        heartbeat.read_all(place, prune=True)
        removed += sum(1 for p in before if p is not None and not p.exists())
    print(f"anydevice top: removed {removed} heartbeat(s) of ended processes", file=sys.stderr)


def parse_ranks(text: str) -> frozenset[int]:
    """``"0,2-3"`` -> ``{0, 2, 3}``.

    >>> sorted(parse_ranks("0,2-3"))
    [0, 2, 3]

    Raises:
        argparse.ArgumentTypeError: what is not a rank or a range of ranks, with the text.
    """
    out: set[int] = set()
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()) or (sep and int(high) < int(low)):
            raise argparse.ArgumentTypeError(f"{text!r} is not a list of ranks, e.g. 0,2-3")
        out.update(range(int(low), int(high or low) + 1))
    return frozenset(out)
