"""The rank's side of the hang watch: which collective it is in, since when, called from
where, published in its heartbeat (:mod:`anydevice.heartbeat`) for the launcher to judge.

Nothing is added to a collective's own path. torch's flight recorder already notes every
collective a process group runs — from ``torch.distributed``'s functions, ``ad.all_reduce``
and DDP's reducer in C++ alike, on gloo as on NCCL — with torch's own sequence number per
group (the same on every rank), the op, the shapes and dtypes, and the Python frames that
called it. A thread of this process (:func:`watch`) reads it every :data:`TICK` seconds:

* **Each tick** (a few microseconds): each group's last collective entered and the last
  to complete. While the last entered is beyond the highest completed seen, it is the
  collective the rank is in; the heartbeat says so at once (op unknown yet), with the
  time it was first seen.
* **Once a collective has lasted** :data:`DETAIL_AFTER` seconds, and
  :data:`DETAIL_SHARE` times as long as reading the details took the last time (so the
  reading costs at most 1/20 of the time spent waiting, and nothing when collectives are
  short; at most :data:`DETAIL_AT_MOST` seconds on a machine that reads slowly), the
  recorder's entries are read once for it (again later where it is not in them yet): the
  op, the shapes and dtypes (and their fingerprint, equal on ranks that call the same
  collective); the user's file:line and stack are the main thread's, which waits in it (or
  in the backward whose DDP reduction it is). The recorder's own stacks are not read:
  torch symbolises them for seconds on first use.
* **Outside any collective** for :data:`WHERE_AFTER` seconds, the main thread's place
  (``sys._current_frames()``: the user's innermost frame and the stack) is published,
  when it changes.

A thread blocked in a collective has released the GIL, so this thread runs while the
rank waits. A rank stuck in native code that holds the GIL stops this thread's ticks too;
the launcher sees its ``watched`` time stop and asks the rank's ``faulthandler`` instead.

The thread starts where a process group can form: in every worker of ``anydevice
launch`` and ``ad.launch`` (:mod:`~anydevice.launching.runner`), and in
``ad.distributed`` under any launcher (torchrun, srun, mpirun). It holds no process group
(a group freed from this thread could hang as gloo's threads are joined).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import hashlib
import linecache
import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from anydevice import heartbeat

__all__ = [
    "DETAIL_AFTER",
    "DETAIL_AT_MOST",
    "DETAIL_SHARE",
    "LIVE_SIGNAL",
    "TICK",
    "WHERE_AFTER",
    "Watcher",
    "describe_frames",
    "fingerprint",
    "live_stacks_file",
    "user_frames",
    "watch",
]

TICK = 0.5  #: seconds between two looks at the flight recorder
DETAIL_AFTER = 1.0  #: seconds a collective lasts before its details are read
DETAIL_SHARE = 20.0  #: ... and this many times as long as reading them took last time
DETAIL_AT_MOST = 10.0  #: ... but no more than this (a loaded machine reads slowly)
WHERE_AFTER = 1.0  #: seconds outside any collective before the main thread's place is said

#: Ops whose input shapes agree on every rank: different shapes are a mismatch.
SYMMETRIC = frozenset(
    {
        "all_reduce",
        "allreduce",
        "allreduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "allgather",
        "_allgather_base",
        "all_gather_into_tensor_coalesced",
        "allgather_into_tensor_coalesced",
        "reduce_scatter",
        "_reduce_scatter_base",
        "reduce_scatter_tensor_coalesced",
        "barrier",
    }
)

_STACK_FRAMES = 12  #: user frames kept in a published stack

#: The signal on which a launched worker dumps its Python stacks and goes on (a real-time
#: signal: SIGUSR1 and SIGUSR2 belong to schedulers and programs); None where there are
#: none (not Linux).
LIVE_SIGNAL: int | None = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None


def watch(launch_dir: str | None = None) -> bool:
    """Start this process's collective watch (once per process: a forked child starts its
    own). With ``launch_dir`` (a launched worker), also dump the Python stacks into
    :func:`live_stacks_file` on :data:`LIVE_SIGNAL`, for a launcher whose questions this
    thread cannot answer. Returns False where there is no heartbeat to publish in
    (``ANYDEVICE_HEARTBEAT=0``, no writable folder)."""
    global _watcher
    with _lock:
        if _watcher is not None and _watcher.pid == os.getpid():
            return True
        if launch_dir is not None and LIVE_SIGNAL is not None:
            path = live_stacks_file(launch_dir, int(os.environ.get("RANK", "0") or 0))
            path.parent.mkdir(parents=True, exist_ok=True)
            # Appended to: the launcher empties it before it asks. Held open for good.
            dump = path.open("a")
            faulthandler.register(LIVE_SIGNAL, file=dump, all_threads=True, chain=False)
        beat = heartbeat.mine()
        if beat is None:
            return False
        _watcher = Watcher(beat)
        _watcher.start()
        atexit.register(_watcher.stop)
        return True


def live_stacks_file(launch_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` dumps its stacks on :data:`LIVE_SIGNAL` and goes on."""
    return Path(launch_dir) / "stacks" / f"rank{rank}.live"


class Watcher:
    """The thread that reads the flight recorder and the main thread's place into
    ``beat``. :meth:`look` is one tick; ``clock`` gives wall-clock seconds."""

    def __init__(
        self, beat: heartbeat.Heartbeat, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.beat = beat
        self.pid = os.getpid()
        self._clock = clock
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._groups: dict[str, dict[str, Any]] = {}
        self._asked: set[str] = set()  # the group names looked up in torch's registry
        self._seqs: dict[str, int] = {}
        self._done: dict[str, int] = {}  # per group, the highest "completed" seen
        self._last_new = 0.0  # when a new collective was last seen entered
        self._gap = 0.0
        self._call: tuple[str, int] | None = None  # (group, seq) of the one it is in
        self._call_since = 0.0
        self._detailed = False
        self._detail_cost = 0.0
        self._missed = 0.0  # when the details of the current call were last not found
        self._where: dict[str, Any] | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="anydevice-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (at exit: before the interpreter's finalisation)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * TICK)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.look()
            except Exception:  # never let the watch disturb the rank; try again
                pass
            self._stop.wait(TICK)

    def look(self) -> None:
        """One tick: publish what the flight recorder and the main thread say now."""
        now = self._clock()
        self.beat.tick(now)
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        from anydevice.hardware.backends.torch_private import flight_record

        record = flight_record(entries=False)
        if record is None:
            return
        status = _status(record.get("pg_status"))
        news: dict[str, Any] = {}
        if set(status) - self._asked:
            self._asked |= set(status)
            groups = _groups()
            if groups != self._groups:
                self._groups = groups
                news["groups"] = groups
        seqs = {name: entered for name, (entered, _) in status.items()}
        if seqs != self._seqs:
            if sum(seqs.values()) > sum(self._seqs.values()):
                if self._last_new:
                    self._gap = max(self._gap, now - self._last_new)
                self._last_new = now
            self._seqs = seqs
            news.update(seqs=seqs, gap=round(self._gap, 3))
        # The collective a rank is in is the last it entered: the recorder's "completed"
        # is the last collective to complete, not the count of those completed (on gloo,
        # DDP's construction broadcasts complete out of order), so done + 1 named one of
        # them for as long as the rank then waited in its backward's all_reduce. The
        # highest "completed" seen is kept for the same reason (until a group of the same
        # name starts its numbers again: a process group made anew).
        for name, (entered, done) in status.items():
            before = self._done.get(name, done)
            self._done[name] = done if entered < before else max(done, before)
        outstanding = sorted(
            (name, entered) for name, (entered, _) in status.items() if entered > self._done[name]
        )
        if outstanding:
            self._inside(outstanding, now, news)
        else:
            self._outside(status, now, news)
        if news:
            self.beat.describe(**news)

    # ----------------------------------------------------------------------- inside

    def _inside(self, outstanding: list[tuple[str, int]], now: float, news: dict[str, Any]) -> None:
        if self._call not in outstanding:
            self._call, self._call_since, self._detailed = outstanding[0], now, False
            group, seq = self._call
            self.beat.enter("", seq, group, 0, entered=now)
            if self._where is not None:
                self._where = None
                news["where"] = None
        wait = min(max(DETAIL_AFTER, DETAIL_SHARE * self._detail_cost), DETAIL_AT_MOST)
        if not self._detailed and now - max(self._call_since, self._missed) >= wait:
            started = time.perf_counter()
            call = self._details(*self._call)
            self._detail_cost = time.perf_counter() - started
            if call is None:  # not in the recorder's entries yet: look again later
                self._missed = now
            else:
                self._detailed = True
                group, seq = self._call
                self.beat.enter(
                    call["op"], seq, group, call["fingerprint"], entered=call.pop("entered")
                )
                news["call"] = call

    def _details(self, group: str, seq: int) -> dict[str, Any] | None:
        from anydevice.hardware.backends.torch_private import flight_record

        record = flight_record(entries=True) or {}
        for entry in reversed(record.get("entries") or []):
            if not isinstance(entry, dict) or entry.get("is_p2p"):
                continue
            name = (entry.get("process_group") or ("",))[0]
            if str(name) != group or int(entry.get("collective_seq_id", -1)) != seq:
                continue
            op = str(entry.get("profiling_name", "")).rpartition(":")[2] or "collective"
            shapes = [list(s) for s in entry.get("input_sizes") or []]
            dtypes = [str(d) for d in entry.get("input_dtypes") or []]
            created = entry.get("time_created_ns")
            return {
                "op": op,
                "seq": seq,
                "group": group,
                "shapes": shapes,
                "dtypes": dtypes,
                "fingerprint": fingerprint(op, shapes, dtypes),
                # Where the main thread waits: the call of a collective from Python, or
                # the backward whose DDP reduction it waits for.
                **self._main_place(),
                "entered": created / 1e9 if isinstance(created, (int, float)) else self._call_since,
            }
        return None

    # ----------------------------------------------------------------------- outside

    def _outside(
        self, status: Mapping[str, tuple[int, int]], now: float, news: dict[str, Any]
    ) -> None:
        if self._call is not None:
            self._call = None
            self.beat.leave(done=sum(max(0, done) for _, done in status.values()))
            news["call"] = None
        if now - self._last_new < WHERE_AFTER:
            return
        where = self._main_place()
        if where["at"] and where != self._where:
            self._where = where
            news["where"] = where

    def _main_place(self) -> dict[str, Any]:
        """:func:`describe_frames` of the main thread's user frames, now."""
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        if frame is None:
            return describe_frames([])
        try:
            stack = traceback.extract_stack(frame)
        finally:
            del frame
        return describe_frames(user_frames((f.filename, f.lineno or 0, f.name) for f in stack))


def fingerprint(op: str, shapes: list[list[int]], dtypes: list[str]) -> int:
    """A number equal on ranks that call the same collective: the op and dtypes, and the
    shapes where every rank passes the same (:data:`SYMMETRIC` ops). Stable across
    processes (not Python's salted ``hash``).

    >>> fingerprint("all_reduce", [[4]], ["Float"]) == fingerprint("all_reduce", [[4]], ["Float"])
    True
    >>> fingerprint("all_reduce", [[4]], ["Float"]) == fingerprint("all_reduce", [[8]], ["Float"])
    False
    """
    key = repr((op, shapes if op in SYMMETRIC else None, dtypes)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def describe_frames(frames: list[tuple[str, int, str]]) -> dict[str, Any]:
    """``at`` (``file:line`` of the innermost of ``frames``, the path relative to the
    working directory where it is under it), ``code`` (that line's text), ``function``
    and ``stack`` (traceback lines, most recent call last, of the innermost 12).

    >>> describe_frames([])["at"]
    ''
    """
    at, code, function = _place(frames)
    return {"at": at, "code": code, "function": function, "stack": _format(frames)}


def user_frames(frames: Any) -> list[tuple[str, int, str]]:
    """The frames of ``frames`` (``(file, line, function)``, outermost first) that are the
    user's: not torch's, anydevice's or the standard library's. Outermost first."""
    return [f for f in frames if not _machinery(f[0])]


# ----------------------------------------------------------------------------- internals

_watcher: Watcher | None = None
_lock = threading.Lock()


def _roots() -> tuple[str, ...]:
    import torch

    paths = sysconfig.get_paths()
    found = [
        os.path.dirname(torch.__file__),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # anydevice's folder
        paths.get("stdlib", ""),
        paths.get("platstdlib", ""),
    ]
    return tuple(os.path.join(p, "") for p in found if p)


def _machinery(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen runpy>, <string>
        return True
    global _ROOTS
    if _ROOTS is None:
        _ROOTS = _roots()
    return filename.startswith(_ROOTS)


_ROOTS: tuple[str, ...] | None = None


def _place(frames: list[tuple[str, int, str]]) -> tuple[str, str, str]:
    """(``file:line``, that line's text, the function) of the innermost user frame."""
    if not frames:
        return "", "", ""
    filename, line, function = frames[-1]
    return f"{_shown(filename)}:{line}", linecache.getline(filename, line).strip(), function


def _format(frames: list[tuple[str, int, str]]) -> list[str]:
    """Traceback lines (most recent call last) of the innermost user frames."""
    lines = []
    for filename, line, function in frames[-_STACK_FRAMES:]:
        lines.append(f'File "{_shown(filename)}", line {line}, in {function}')
        code = linecache.getline(filename, line).strip()
        if code:
            lines.append(f"  {code}")
    return lines


def _shown(filename: str) -> str:
    """A path as the user would write it: relative to the working directory when under it."""
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(filename)
        if not rel.startswith(os.pardir):
            return rel
    return filename


def _status(raw: object) -> dict[str, tuple[int, int]]:
    """``pg_status`` as ``{group name: (last entered, last completed)}`` (-1: none)."""
    out: dict[str, tuple[int, int]] = {}
    if not isinstance(raw, dict):
        return out
    for name, info in raw.items():
        if isinstance(info, dict):
            entered = int(info.get("last_enqueued_collective", -1))
            done = int(info.get("last_completed_collective", -1))
            if entered > 0:
                out[str(name)] = (entered, max(done, 0))
    return out


def _groups() -> dict[str, dict[str, Any]]:
    """``{name: {"ranks": [...], "desc": ...}}`` of this process's groups. The groups are
    let go of before this returns (see the module docstring)."""
    import torch.distributed as dist

    from anydevice.hardware.backends.torch_private import process_groups

    out: dict[str, dict[str, Any]] = {}
    groups = process_groups()
    try:
        for pg in groups:
            with contextlib.suppress(Exception):
                out[str(pg.group_name)] = {
                    "ranks": list(dist.get_process_group_ranks(pg)),
                    "desc": str(pg.group_desc),
                }
    finally:
        groups.clear()
    return out
