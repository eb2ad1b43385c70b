"""The launcher's hang watch: each rank's state read every second, one verdict when the
job stops progressing.

Each worker publishes the collective it is in and where it is in its heartbeat
(:mod:`~anydevice.launching.progress`, from torch's flight recorder: nothing is added to a
collective's path). A thread of the launcher (:class:`HangWatch`) reads its own workers'
records every :data:`INTERVAL` seconds and judges them (:func:`~anydevice.launching.
verdict.diagnose`):

* a **mismatch** (ranks at the same collective of a group call different ones) stops the
  job at once: the launch fails with the verdict (``WorkerFailedError``, exit code 1), as
  no wait can resolve it; restarts (``max_restarts``) are not tried;
* a **stall**, a **deadlock**, a **rank gone**, a collective **stuck** — held once a rank
  has waited ``hang_after`` seconds in one collective — prints the verdict and lets the job
  run (a slow rank is not stopped): it ends at the collectives' own timeout, or when the
  user stops it. The verdict is printed again only when it changes, and a line says when
  the ranks progress again. ``hang_after`` adapts to the job: at least twice the longest
  gap between two collectives any rank has shown;
* when the launch is stopped (Ctrl-C, SIGTERM, a scheduler's time limit) or fails (a
  collective's timeout), the verdict of that moment goes with the message.

Across nodes, each node's watch publishes its ranks' states in the rendezvous store (when
they change) and reads the others' while one of its ranks waits, so the verdict covers
every rank; the node that claims it first in the store (``compare_set``) prints it, the
others do not; for a mismatch it waits until the others have seen its claim before it
ends its own workers (their workers would otherwise fail first of a lost peer). The wait
times compare wall clocks: the nodes' clocks are taken to agree within a second or two
(NTP).

A rank whose own watcher thread stopped ticking (native code holding the GIL) is asked
for its stack by a signal (``faulthandler``, :data:`~anydevice.launching.progress.
LIVE_SIGNAL`), which works wherever its main thread is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from anydevice import heartbeat
from anydevice.errors import WorkerFailedError
from anydevice.launching import progress, reaper
from anydevice.launching.verdict import (
    Call,
    Group,
    RankState,
    Verdict,
    adaptive_hang_after,
    diagnose,
)

__all__ = ["FINAL_AFTER", "INTERVAL", "STOP_AFTER", "HangWatch"]

logger = logging.getLogger("anydevice")

INTERVAL = 1.0  #: seconds between two looks
STALE = 3.0  #: seconds without a tick of a rank's watcher before its stack is asked by signal
FINAL_AFTER = 2.0  #: a rank that waited this long when the launch failed is judged
STOP_AFTER = 5.0  #: ... and this long when a signal stopped it (a slow step is not a hang)
MISMATCH_AFTER = 1.0  #: both ranks seen this long in their collectives: a mismatch
HEED_WAIT = 20.0  #: at most this long the node that stops a job waits for the others to see it
_KEY = "anydevice/hang"  #: the store's keys of the watch, per rendezvous round
_NONE = RankState(-1)


class HangWatch:
    """The watch of one node's workers (see the module docstring). ``hang_after`` None or
    0 turns it off. ``say`` prints a verdict (default: the ``anydevice`` logger's warning);
    ``clock`` gives wall-clock seconds (the heartbeats' times are wall-clock)."""

    def __init__(
        self,
        hang_after: float | None,
        *,
        launch_dir: str | None = None,
        say: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.hang_after = hang_after
        self.launch_dir = launch_dir
        self._say = say or (lambda text: logger.warning("anydevice: %s", text))
        self._clock = clock
        self._workers: Callable[[], Mapping[int, int]] = dict
        self._lock = threading.Lock()
        self._looking = threading.Lock()  # one look at a time: the thread's, or a stop's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Any = None
        self._node = 0
        self._nodes = 1
        self._host = socket.gethostname()
        self._published = ""
        self._seen: dict[int, RankState] = {}  # the last state of each local rank
        self._remote: dict[int, RankState] = {}
        self._groups: dict[str, Group] = {}
        self._snapshot: tuple[dict[int, RankState], dict[str, Group]] = ({}, {})
        self._said: tuple[object, ...] | None = None  # the verdict printed last, anywhere
        self._said_here = False  # ... by this node
        self.stopped: Verdict | None = None  #: the mismatch that stopped the job
        self.stopped_by: str = ""  #: the node whose verdict stopped it, when not this one

    @property
    def on(self) -> bool:
        return self.hang_after is not None and self.hang_after > 0

    # ----------------------------------------------------------------------- life

    def start(self, workers: Callable[[], Mapping[int, int]]) -> None:
        """Watch the workers ``workers()`` names (global rank -> pid), read on every look."""
        self._workers = workers
        if not self.on or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="anydevice-hangwatch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def join(self, store: Any, node: int, nodes: int) -> None:
        """Share states with the other nodes through ``store`` (the rendezvous' store of
        this round; a clone of it is used, from this thread only)."""
        if not self.on or nodes < 2:
            return
        try:
            mine = store.clone()
            mine.set_timeout(_seconds(5))
        except Exception:  # a store that cannot be cloned: this node judges its own ranks
            return
        with self._lock:
            self._store, self._node, self._nodes = mine, node, nodes
            self._published, self._remote, self._said, self._said_here = "", {}, None, False

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL):
            try:
                self.look()
            except Exception as e:  # the watch must never take the launch down
                logger.debug("hang watch: %s", e)

    # ----------------------------------------------------------------------- looking

    def look(self) -> Verdict | None:
        """One look: read the states, judge, print or stop. Returns the verdict."""
        with self._looking:
            return self._look()

    def _look(self) -> Verdict | None:
        now = self._clock()
        local = self._read_local(now)
        store = self._store
        if store is not None:
            self._publish(store, local, now)
            waiting = any(
                s.call is not None and s.call.waited >= MISMATCH_AFTER for s in local.values()
            )
            if waiting or (self.stopped is None and self._said is not None):
                self._remote = self._read_remote(store, now)
            if self._heed_others(store):
                return self.stopped
        states = {**self._remote, **local}
        groups = dict(self._groups)
        gone = any(s.gone for s in states.values())
        with self._lock:
            # Kept for a stop or a failure: the last look where a rank waited, until the
            # ranks progress again (ranks that end after it keep it).
            if any(_waits(s, FINAL_AFTER) for s in states.values()):
                self._snapshot = (states, groups)
            elif not gone:
                self._snapshot = ({}, {})
        threshold = self.threshold(states)
        found = diagnose(states, groups, hang_after=threshold, mismatch_after=MISMATCH_AFTER)
        if found is None:
            if self._said is not None and not gone:
                if self._said_here:
                    self._say(
                        "the ranks progress again; the hang watch now waits "
                        f"{threshold:.0f} s (--hang-after {self.hang_after:g} s, or twice the "
                        "longest gap between collectives)."
                    )
                self._said, self._said_here = None, False
            return None
        if found.certain:
            if self.stopped is None and self._claim(found, store):
                self.stopped = found
                self._await_heed(store)
                self._end_workers()
            return found
        if found.signature != self._said:
            self._said, self._said_here = found.signature, False
            # A worker of this node that ended fails the launch at once, with the verdict.
            ours = found.kind == "gone" and any(local.get(r, _NONE).gone for r in found.blamed)
            if not ours and self._claim(found, store):
                found = self._with_stacks(found, states, groups, threshold) or found
                self._say(self._live_text(found, threshold))
                self._said_here = True
        return found

    def threshold(self, states: Mapping[int, RankState]) -> float:
        """``hang_after``, adapted to the longest gap between collectives seen."""
        return adaptive_hang_after(self.hang_after or 0.0, (s.gap for s in states.values()))

    def _read_local(self, now: float) -> dict[int, RankState]:
        folder = heartbeat.folder()
        states: dict[int, RankState] = {}
        for rank, pid in sorted(self._workers().items()):
            running = _running(pid)
            beat = heartbeat.read_file(folder / f"{pid}.beat")
            if beat is not None and beat.pid == pid:
                state = self._state(rank, beat, now)
                for name, info in (beat.details.get("groups") or {}).items():
                    with contextlib.suppress(TypeError, ValueError):
                        ranks = tuple(int(r) for r in info.get("ranks", ()))
                        self._groups[str(name)] = Group(str(name), ranks, str(info.get("desc", "")))
            elif rank in self._seen and self._seen[rank].pid == pid:
                state = self._seen[rank]  # its record is gone with it: its last state
            else:
                state = RankState(rank, pid=pid, host=self._host, known=False)
            if not running:
                state = replace(state, gone=state.gone or _ended(pid), known=True)
            self._seen[rank] = state
            states[rank] = state
        return states

    def _state(self, rank: int, beat: heartbeat.Beat, now: float) -> RankState:
        details = beat.details
        call: Call | None = None
        if beat.collective is not None:
            c = beat.collective
            info = details.get("call") or {}
            same = info.get("group") == c.group and info.get("seq") == c.seq
            call = Call(
                op=c.op,
                seq=c.seq,
                group=c.group,
                waited=max(0.0, now - c.entered),
                fingerprint=c.fingerprint,
                shapes=tuple(tuple(s) for s in info.get("shapes", ())) if same else (),
                dtypes=tuple(info.get("dtypes", ())) if same else (),
                at=str(info.get("at", "")) if same else "",
                code=str(info.get("code", "")) if same else "",
            )
        where = details.get("where") or {}
        stale = bool(beat.watched) and now - beat.watched > STALE
        return RankState(
            rank=rank,
            pid=beat.pid,
            host=str(details.get("host", self._host)),
            call=call,
            seqs={str(k): int(v) for k, v in (details.get("seqs") or {}).items()},
            at=str(where.get("at", "")) if not stale else "",
            code=str(where.get("code", "")) if not stale else "",
            stack=tuple(where.get("stack", ())) if not stale else (),
            gap=float(details.get("gap", 0.0) or 0.0),
        )

    def _with_stacks(
        self,
        found: Verdict,
        states: dict[int, RankState],
        groups: dict[str, Group],
        threshold: float,
    ) -> Verdict | None:
        """Ask the blamed local ranks whose watcher is silent for their stacks (by signal),
        then judge again with them."""
        asked = False
        for rank in found.blamed:
            s = states.get(rank)
            if s is None or s.gone or s.call is not None or s.at or rank in self._remote:
                continue
            stack = self._ask_stack(rank, s.pid)
            if stack:
                at, code, lines = stack
                states[rank] = replace(s, at=at, code=code, stack=lines, known=True)
                asked = True
        if not asked:
            return found
        return diagnose(states, groups, hang_after=threshold, mismatch_after=MISMATCH_AFTER)

    def _ask_stack(self, rank: int, pid: int) -> tuple[str, str, tuple[str, ...]] | None:
        if self.launch_dir is None or progress.LIVE_SIGNAL is None:
            return None
        if not _catches(pid, progress.LIVE_SIGNAL):
            return None  # not (yet, or any more) listening: the signal would end it
        path = progress.live_stacks_file(self.launch_dir, rank)
        try:
            path.write_text("")
            os.kill(pid, progress.LIVE_SIGNAL)
        except OSError:
            return None
        deadline = time.monotonic() + 2.0
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            text = path.read_text(errors="replace")
            if text.endswith("\n\n") or ("Current thread" in text and text.endswith("\n")):
                time.sleep(0.05)
                if path.read_text(errors="replace") == text:
                    break
        mine = progress.user_frames(_faulthandler_frames(text))
        if not mine:
            return None
        where = progress.describe_frames(mine)
        return where["at"], where["code"], tuple(where["stack"])

    # ----------------------------------------------------------------------- words

    def _live_text(self, found: Verdict, threshold: float) -> str:
        after = f"{threshold:.0f} s" if threshold != self.hang_after else f"{threshold:g} s"
        return (
            f"the job makes no progress: {found.text()}\n"
            f"  The job goes on (a slow rank is not stopped; the watch waits {after}, "
            "--hang-after): it ends at its collectives' timeout, or stop it (Ctrl-C)."
        )

    def at_stop(self, sig: signal.Signals) -> None:
        """Print the verdict of this moment, if the ranks were held (called when a signal
        stops the launch)."""
        if not self.on:
            return
        with self._looking:  # what the ranks do now, before they are stopped
            now = self._clock()
            before = dict(self._seen)
            # A rank that ended since the last look ended of this signal (Ctrl-C reaches
            # the workers too): as it was, not as gone.
            states = {
                r: replace(s, gone="") if s.gone and not before.get(r, s).gone else s
                for r, s in {**self._remote, **self._read_local(now)}.items()
            }
            if any(_waits(s, FINAL_AFTER) for s in states.values()):
                with self._lock:
                    self._snapshot = (states, dict(self._groups))
        found = self._final({}, STOP_AFTER)
        if found is not None:
            self._say(f"stopped by {sig.name} while the job made no progress: {found.text()}")

    def at_failure(self, exitcodes: Mapping[int, int]) -> list[str]:
        """Lines for a failed launch's message: what held the ranks when it failed
        (``exitcodes``: global rank -> exit code, negative for a signal)."""
        found = self._final(exitcodes)
        if found is None:
            return []
        # The stacks are above already: each rank stopped dumps its own.
        found = replace(found, stacks=())
        return ["", f"What the ranks were doing (the hang watch): {found.text()}"]

    def _final(self, exitcodes: Mapping[int, int], after: float = FINAL_AFTER) -> Verdict | None:
        if not self.on:
            return None
        with self._lock:
            states, groups = dict(self._snapshot[0]), dict(self._snapshot[1])
        for rank, code in exitcodes.items():
            s = states.get(rank)
            if s is not None and code < 0 and -code != signal.SIGTERM:
                states[rank] = replace(s, gone=_signal_text(-code))  # what the agent saw
        return diagnose(states, groups, hang_after=after, mismatch_after=MISMATCH_AFTER)

    def stopped_error(self, result: Any) -> WorkerFailedError:
        """The error of a launch this watch stopped (``result``: the agent's, with each
        worker's exit code): exit code 1, the first blamed rank."""
        codes = {int(r): f.exitcode for r, f in getattr(result, "failures", {}).items()}
        if self.stopped is not None:
            message = (
                f"{self.stopped.summary}. The job was stopped: no wait resolves this.\n"
                + "\n".join(f"  {line}" for line in self.stopped.lines)
            )
            rank = self.stopped.blamed[0] if self.stopped.blamed else -1
        else:
            message = (
                f"The job was stopped by the hang watch of {self.stopped_by}, whose output "
                "has the verdict: the ranks call different collectives."
            )
            rank = min(codes, default=-1)
        return WorkerFailedError(message, rank=rank, exitcode=1, traceback="", failures=codes)

    # ----------------------------------------------------------------------- stopping

    def _end_workers(self) -> None:
        """SIGTERM to each local worker (each dumps its stacks and exits); the agent then
        sees them fail."""
        for pid in self._workers().values():
            if _running(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)

    # ----------------------------------------------------------------------- nodes

    def _publish(self, store: Any, local: Mapping[int, RankState], now: float) -> None:
        payload = json.dumps(
            {
                "node": self._node,
                "ranks": [_encode(s, now) for s in local.values()],
                "groups": {g.name: [list(g.ranks), g.desc] for g in self._groups.values()},
            },
            sort_keys=True,
        )
        if payload != self._published:
            with contextlib.suppress(Exception):
                store.set(f"{_KEY}/node{self._node}", payload)
                self._published = payload

    def _read_remote(self, store: Any, now: float) -> dict[int, RankState]:
        out: dict[int, RankState] = {}
        for node in range(self._nodes):
            key = f"{_KEY}/node{node}"
            if node == self._node:
                continue
            try:
                if not store.check([key]):
                    continue
                data = json.loads(store.get(key))
            except Exception:
                continue
            for item in data.get("ranks", []):
                with contextlib.suppress(Exception):
                    s = _decode(item, now)
                    out[s.rank] = s
            for name, (ranks, desc) in (data.get("groups") or {}).items():
                self._groups.setdefault(name, Group(name, tuple(ranks), desc))
        return out

    def _claim(self, found: Verdict, store: Any) -> bool:
        """Whether this node prints ``found``: alone, always; else the first node to put
        it in the store."""
        if store is None:
            return True
        key = f"{_KEY}/said"
        mine = json.dumps(
            {
                "sig": repr(found.signature),
                "node": self._node,
                "host": self._host,
                "kind": found.kind,
            }
        )
        try:
            old = store.get(key).decode() if store.check([key]) else ""
            if old and json.loads(old).get("sig") == repr(found.signature):
                return False
            now = store.compare_set(key, old, mine)
        except Exception:
            return True  # the store is gone: say it here rather than nowhere
        return bool(now.decode() == mine) if isinstance(now, bytes) else now == mine

    def _heed_others(self, store: Any) -> bool:
        """Whether another node stopped the job (a mismatch it claimed): stop here too."""
        if self.stopped is not None or self.stopped_by:
            return bool(self.stopped_by)
        key = f"{_KEY}/said"
        try:
            if not store.check([key]):
                return False
            said = json.loads(store.get(key))
        except Exception:
            return False
        if said.get("kind") != "mismatch" or said.get("node") == self._node:
            return False
        self.stopped_by = f"node {said.get('node')} ({said.get('host', '?')})"
        with contextlib.suppress(Exception):
            store.set(f"{_KEY}/heeded/node{self._node}", "1")
        self._end_workers()
        return True

    def _await_heed(self, store: Any) -> None:
        """Before this node ends its workers, the other nodes see its verdict: else their
        workers fail first of a lost peer, and their launches say that instead. At most
        ``HEED_WAIT`` s (a node that no longer looks)."""
        if store is None or self._nodes < 2:
            return
        keys = [f"{_KEY}/heeded/node{n}" for n in range(self._nodes) if n != self._node]
        deadline = time.monotonic() + HEED_WAIT
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                if store.check(keys):
                    return
            except Exception:  # the store is gone: nobody is left to tell
                return
            time.sleep(0.1)


# ----------------------------------------------------------------------------- internals


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` of /proc/<pid>/status):
    a real-time signal it does not catch ends it. False where that cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
        return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return False


def _waits(s: RankState, seconds: float) -> bool:
    """Whether rank ``s`` runs and has waited ``seconds`` in a collective it names."""
    return s.call is not None and s.call.known and not s.gone and s.call.waited >= seconds


def _seconds(s: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=s)


def _running(pid: int) -> bool:
    proc = reaper.entry(pid)
    if proc is None:
        if reaper.PROC:
            return False
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    return proc.state not in "ZX"


def _ended(pid: int) -> str:
    """How process ``pid`` ended, while it is a zombie (its exit status in
    ``/proc/PID/stat``); ``"ended"`` once it is reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        status = int(fields[49])
    except (OSError, ValueError, IndexError):
        return "ended"
    if os.WIFSIGNALED(status):
        return _signal_text(os.WTERMSIG(status))
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    return "ended"


def _signal_text(number: int) -> str:
    try:
        return f"killed by {signal.Signals(number).name}"
    except ValueError:
        return f"killed by signal {number}"


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')


def _faulthandler_frames(text: str) -> list[tuple[str, int, str]]:
    """The main thread's frames (outermost first) from a ``faulthandler`` dump."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    chosen = next(
        (b for b in blocks if b.startswith("Current thread")), blocks[-1] if blocks else ""
    )
    frames = []
    for line in chosen.splitlines()[1:]:
        m = _FRAME.match(line)
        if m:
            frames.append((m["file"], int(m["line"]), m["name"]))
    return frames[::-1]  # faulthandler lists the most recent call first


def _encode(s: RankState, now: float) -> dict[str, Any]:
    call = None
    if s.call is not None:
        c = s.call
        call = [
            c.op,
            c.seq,
            c.group,
            now - c.waited,
            c.fingerprint,
            c.shapes,
            c.dtypes,
            c.at,
            c.code,
        ]
    return {
        "rank": s.rank,
        "pid": s.pid,
        "host": s.host,
        "gone": s.gone,
        "call": call,
        "seqs": dict(s.seqs),
        "at": s.at,
        "code": s.code,
        "stack": list(s.stack),
        "gap": s.gap,
        "known": s.known,
    }


def _decode(item: Mapping[str, Any], now: float) -> RankState:
    call = None
    if item.get("call"):
        op, seq, group, entered, fp, shapes, dtypes, at, code = item["call"]
        call = Call(
            str(op),
            int(seq),
            str(group),
            max(0.0, now - float(entered)),
            int(fp),
            tuple(tuple(int(x) for x in shape) for shape in shapes),
            tuple(str(d) for d in dtypes),
            str(at),
            str(code),
        )
    return RankState(
        rank=int(item["rank"]),
        pid=int(item.get("pid", 0)),
        host=str(item.get("host", "")),
        gone=str(item.get("gone", "")),
        call=call,
        seqs={str(k): int(v) for k, v in (item.get("seqs") or {}).items()},
        at=str(item.get("at", "")),
        code=str(item.get("code", "")),
        stack=tuple(str(x) for x in item.get("stack", ())),
        gap=float(item.get("gap", 0.0)),
        known=bool(item.get("known", True)),
    )
