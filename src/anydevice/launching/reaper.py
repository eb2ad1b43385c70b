"""Nothing outlives a launch: every process the workers start ends with it.

Workers start processes of their own — a DataLoader's workers, a tokenizer server,
``subprocess.Popen``, a daemon that double-forks, a child in a session of its own — and
those would hold the launch's output open (``anydevice launch ... | cat`` would end only
when they do), its ports and its devices. Three parts see that they end, however the
launch ends:

* **The launcher** is a *child subreaper* for the launch (Linux ``PR_SET_CHILD_SUBREAPER``,
  :func:`subreaper`): a process orphaned under it — the child of a worker that ended —
  is re-parented to the launcher instead of to init, so the launch's processes stay one
  tree under it. When the launch ends (exit 0,
  a failure, a raise, SIGTERM, SIGINT) the launcher freezes that tree (SIGSTOP, so nothing
  forks while it looks), ends it (SIGKILL), reaps what became its children, and says in
  one line how many it ended.
* **Each worker** is a child subreaper too (:mod:`~anydevice.launching.runner`), so what
  it starts stays under it, and it is *stopped* (SIGSTOP through ``PR_SET_PDEATHSIG``) the
  moment the launcher dies, even by SIGKILL: it starts nothing more, and its tree stays
  whole — a daemon that double-forked a moment ago with an empty environment included —
  for the guardian to end. (Killed there and then, it would have left that daemon to
  init, with nothing to tie it to the launch.)
* **The guardian** (:func:`guard`), a small process the launcher starts first, ends them
  when the launcher cannot: killed with SIGKILL. While the launch runs it notes the
  launcher's tree twice a second; when the launcher is gone without having said that it
  was done, it ends every process whose environment carries the launch's mark
  (``ANYDEVICE_LAUNCH_DIR=<the launch's directory>``: the workers, and what they start
  unless it clears its environment) and those it noted, each with its whole tree — the
  stopped workers' trees are all the workers started — then removes the launch's
  directory. What a worker that had ended left to the launcher goes to init with the
  launcher; the guardian noted it, and ends it with what is under it when it looks.

Spared: the launcher's children from before the launch (``ad.launch`` runs in the user's
own process) with their trees, the guardian, and Python's own helpers (multiprocessing's
resource tracker and fork server). A process is named by its pid and its start time
(``/proc/PID/stat``), so a pid reused meanwhile by another process is never signalled.
Elsewhere than Linux (no subreaper, no ``/proc``) the workers alone are ended, by the agent.

This module imports the standard library only: the guardian runs it as a script
(``python -I -S reaper.py DIR LAUNCHER_PID``) without torch's seconds of start-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import NamedTuple

__all__ = [
    "MARK",
    "Entry",
    "become_subreaper",
    "end",
    "entry",
    "guard",
    "subreaper",
    "table",
    "tree",
]

logger = logging.getLogger("anydevice")

#: The variable every worker (and whatever it starts) inherits: the launch's directory.
MARK = "ANYDEVICE_LAUNCH_DIR"

#: What the launcher writes to the guardian once it has ended the launch's processes.
DONE = b"done\n"

#: Linux, with ``/proc``: what this module needs.
PROC = sys.platform.startswith("linux") and os.path.isdir("/proc/self")
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37

#: Python's helper processes, kept for the life of the process that started them.
_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")

#: How often the guardian notes the launcher's tree (seconds).
_NOTE_EVERY = 0.5


class Entry(NamedTuple):
    """One process as ``/proc/PID/stat`` shows it."""

    ppid: int
    start: int  #: clock ticks after boot: with the pid, names the process for good
    state: str  #: ``R``, ``S``, ``D``, ``T``, ``Z`` (a zombie: ended, not yet reaped), ...
    name: str  #: the executable's name (``comm``)


def table() -> dict[int, Entry]:
    """Every process this machine has now (``{}`` without ``/proc``)."""
    found: dict[int, Entry] = {}
    if not PROC:
        return found
    for name in os.listdir("/proc"):
        if name.isdigit() and (proc := entry(int(name))) is not None:
            found[int(name)] = proc
    return found


def tree(roots: Iterable[int], processes: dict[int, Entry]) -> set[int]:
    """The descendants of ``roots`` in ``processes`` (the roots themselves excluded).

    >>> t = {2: Entry(1, 0, "S", "a"), 3: Entry(2, 0, "S", "b"), 4: Entry(1, 0, "S", "c")}
    >>> sorted(tree([2], t))
    [3]
    """
    children: dict[int, list[int]] = {}
    for pid, proc in processes.items():
        children.setdefault(proc.ppid, []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def marked(launch_dir: str, processes: dict[int, Entry]) -> set[int]:
    """The processes whose environment says ``ANYDEVICE_LAUNCH_DIR=<launch_dir>`` (those of
    this user: others' environments cannot be read)."""
    needle = b"\0" + f"{MARK}={launch_dir}".encode() + b"\0"
    found = set()
    for pid in processes:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in b"\0" + f.read() + b"\0":
                    found.add(pid)
        except OSError:
            continue
    return found


def end(found: dict[int, int], *, spare: Iterable[int] = ()) -> Counter[str]:
    """End the processes ``found`` (pid -> start time) and every descendant they have;
    return how many of each name were running.

    Freezes first (SIGSTOP), looking again until nothing new appears, so a process cannot
    fork a child past the sweep; then SIGKILL; then reaps those that became this process's
    children (a subreaper's duty) for up to 5 s. Each look waits until the processes
    signalled have stopped: a fork under way when the signal came has then completed,
    and its child is in the next look.
    """
    spare = set(spare)
    stopped: dict[int, Entry] = {}
    for _ in range(50):
        now = table()
        wanted = {p: s for p, s in found.items() if p in now and now[p].start == s}
        wanted.update({p: now[p].start for p in tree(wanted, now) - spare})
        found = wanted
        fresh = [p for p in wanted if p not in stopped and now[p].state not in "ZX"]
        if not fresh:
            break
        for pid in fresh:
            if _signal(pid, now[pid].start, signal.SIGSTOP):
                stopped[pid] = now[pid]
        _until_stopped({p: stopped[p] for p in fresh if p in stopped})
    for pid, proc in stopped.items():
        _signal(pid, proc.start, signal.SIGKILL)  # ends a stopped process too
    _reap(stopped)
    return Counter(e.name for e in stopped.values())


def describe(ended: Counter[str]) -> str:
    """How many processes of which names.

    >>> describe(Counter({"sleep": 2, "python3": 1}))
    '3 process(es): sleep ×2, python3 ×1'
    """
    names = ", ".join(f"{name} ×{n}" for name, n in ended.most_common())
    return f"{sum(ended.values())} process(es): {names}"


@contextlib.contextmanager
def subreaper(launch_dir: str, *, spare: Iterable[int] = ()) -> Iterator[None]:
    """Be a child subreaper for the block; then end every process left under this one or
    marked with ``launch_dir``, and log how many (see the module docstring).

    Children this process already had, and their trees, are spared, as are ``spare`` and
    Python's helpers. Signals wait while the sweep runs (a second Ctrl-C must not cut it
    short).
    """
    if not PROC:
        yield
        return
    me = os.getpid()
    before = {pid for pid, e in table().items() if e.ppid == me} | set(spare)
    libc = ctypes.CDLL(None, use_errno=True)
    was = become_subreaper()
    try:
        yield
    finally:
        with _signals_held():
            now = table()
            kept = before | tree(before, now) | {me}
            left = (tree([me], now) | marked(launch_dir, now)) - kept
            left = {p for p in left if not _is_helper(p, now, me)}
            ended = end({p: now[p].start for p in left}, spare=kept)
            if not was:
                libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        if ended:
            logger.warning("anydevice: the workers left %s; ended them.", describe(ended))


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux): a process orphaned anywhere under it
    is re-parented to it, not to init. Returns whether it was one already."""
    libc = ctypes.CDLL(None, use_errno=True)
    was = ctypes.c_int(0)
    libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    return bool(was.value)


def guard(launch_dir: str, launcher: int) -> None:
    """The guardian's life: note the launcher's tree until its stdin closes; then, unless
    the launcher said it was done, end what it noted and what carries the launch's mark;
    remove ``launch_dir``."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    me = os.getpid()
    first = table()
    before = {p for p, e in first.items() if e.ppid == launcher and p != me}
    before |= tree(before, first)
    noted: dict[int, int] = {}
    said = b""
    while True:
        ready, _, _ = select.select([0], [], [], _NOTE_EVERY)
        if ready:
            data = os.read(0, 64)
            if not data:
                break
            said += data
            continue
        now = table()
        under = tree([launcher], now) - before - {me}
        noted = {p: now[p].start for p in under if not _is_helper(p, now, launcher)}
    if DONE not in said and PROC:
        now = table()
        mine = {p for p in marked(launch_dir, now) if not _is_helper(p, now, None)}
        noted.update({p: now[p].start for p in mine - {me}})
        ended = end(noted, spare={me})
        if ended:
            print(
                f"anydevice launch: the launcher was killed; its workers left "
                f"{describe(ended)}; ended them.",
                file=sys.stderr,
                flush=True,
            )
    for _ in range(20):
        shutil.rmtree(launch_dir, ignore_errors=True)
        if not os.path.exists(launch_dir):
            break
        time.sleep(0.25)


# ----------------------------------------------------------------------------- internals


def entry(pid: int) -> Entry | None:
    """Process ``pid`` as ``/proc/PID/stat`` shows it; ``None`` when there is none (or no
    ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    head, _, rest = text.rpartition(")")  # the name may hold spaces and parentheses
    fields = rest.split()
    if len(fields) < 20:
        return None
    return Entry(int(fields[1]), int(fields[19]), fields[0], head.partition("(")[2])


def _signal(pid: int, start: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``pid`` if it is still the process that started at ``start``."""
    proc = entry(pid)
    if proc is None or proc.start != start:
        return False
    try:
        os.kill(pid, sig)
    except OSError:
        return False
    return True


def _until_stopped(signalled: dict[int, Entry], seconds: float = 1.0) -> None:
    """Wait (up to ``seconds``) until each of ``signalled`` shows as stopped, ended or gone.
    A process in the kernel (``D``) stops when it leaves; the bound keeps one that never
    does from holding up the sweep."""
    deadline = time.monotonic() + seconds
    left = dict(signalled)
    while left and time.monotonic() < deadline:
        for pid, was in list(left.items()):
            now = entry(pid)
            if now is None or now.start != was.start or now.state in "TtZX":
                del left[pid]
        if left:
            time.sleep(0.002)


def _reap(stopped: dict[int, Entry]) -> None:
    me = os.getpid()
    deadline = time.monotonic() + 5
    left = dict(stopped)
    while left and time.monotonic() < deadline:
        for pid, was in list(left.items()):
            now = entry(pid)
            if now is None or now.start != was.start:
                del left[pid]  # reaped
            elif now.state in "ZX":
                if now.ppid != me:
                    del left[pid]  # ended; its own parent reaps it
                    continue
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
        if left:
            time.sleep(0.01)


def _is_helper(pid: int, processes: dict[int, Entry], parent: int | None) -> bool:
    """Python's resource tracker or fork server (of ``parent``, when given)."""
    if parent is not None and processes[pid].ppid != parent:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return any(h in cmdline for h in _HELPERS)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP for the block: one that comes meanwhile is acted on
    (by the handler there was) after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            if handler is not None:
                signal.signal(s, handler)
        for signum in came[:1]:
            signal.raise_signal(signum)


if __name__ == "__main__":
    guard(sys.argv[1], int(sys.argv[2]))
