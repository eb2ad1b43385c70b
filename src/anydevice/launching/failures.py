"""Why a launch failed: each worker's own record, and the root cause among them.

Two halves, one on each side of the process boundary:

* **In the worker**, :func:`record` writes the exception to the worker's error file
  (``TORCHELASTIC_ERROR_FILE``, in torch's own format, so torchrun reads it too) with what
  torch leaves out: the time to the microsecond, and whether the error is a
  *consequence* — a peer's connection closed, a collective timed out — or the worker's
  own. The first record of a process wins: ``ad.distributed`` writes it the moment the
  exception leaves its block, before the group is torn down and the peers start failing.
* **In the launcher**, :func:`worker_failed` reads every local rank's record (torch's
  monitor reports only the failures it saw before stopping the rest) and the Python stacks
  that ranks still running dumped when they were stopped (``faulthandler`` on SIGTERM,
  armed by :mod:`~anydevice.launching.runner`).

Why the root cause is deterministic: a worker's own error is recorded before its group
closes, so it exists whenever its consequences do, whatever order the monitor saw them in.
The rule is a ranking, not a race:

1. a worker's own error (not a consequence), or an exit code of its own (``sys.exit(3)``,
   a crash), earliest first, then by rank;
2. when every error is a consequence and some ranks were stopped while still running
   outside any collective, those ranks never arrived: they are named, with their stacks;
3. otherwise the earliest consequence.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import time
import traceback as tb
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from anydevice.errors import DistributedTimeoutError, WorkerFailedError

__all__ = [
    "flight_summary",
    "is_consequence",
    "preempted",
    "preemption",
    "read_stacks",
    "record",
    "record_preemption",
    "stacks_file",
    "worker_failed",
]

#: How gloo, NCCL and the stores say that a peer died or did not come: a consequence.
_CONSEQUENCES = re.compile(
    r"remote worker crashing|Connection closed by peer|Connection reset by peer|"
    r"Broken pipe|Timed out waiting|timed out|Socket Timeout|"
    r"remote process exited|NCCL communicator was aborted|Connection refused",
    re.IGNORECASE,
)

#: torch.distributed's own error types: raised by a collective or a store, never by the
#: user's code — a consequence of what a peer did.
_DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")

#: The C++ source location gloo puts before its messages.
_SOURCE_LINE = re.compile(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ")

#: Frames of the machinery that runs a rank (shown below the rank's own in a stack).
_LAUNCHER_FRAMES = (
    "anydevice/launching/runner.py",
    "torch/distributed/elastic/",
    "torch/multiprocessing/",
    "<frozen runpy>",
    '"<string>"',
)

#: Frames that start a rank and run its code, before the user's own: left off the top of
#: a recorded traceback (a traceback of nothing else keeps them).
_STARTING_FRAMES = (
    "anydevice/launching/runner.py",
    "anydevice/training/context.py",
    "/contextlib.py",
    "<frozen runpy>",
    "/runpy.py",
    "torch/distributed/elastic/",
    "/multiprocessing/",
    "<string>",
)

#: The frames that write a rank's output in whole lines (left off the bottom of a trace).
_WRITING_FRAME = "anydevice/launching/output.py"

#: What a rank that NCCL's watchdog aborted (SIGABRT, with a flight recorder dump) says.
_WATCHDOG = "NCCL's watchdog aborted it: a collective timed out (its flight record was dumped)"

#: Stack lines shown per stuck rank.
_STACK_LINES = 24


def is_consequence(error: BaseException) -> bool:
    """True when ``error`` (or what caused it) says a peer failed or did not arrive.

    >>> is_consequence(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]"))
    True
    >>> is_consequence(ValueError("bad batch"))
    False
    """
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, DistributedTimeoutError) or type(seen).__name__ in _DIST_ERRORS:
            return True
        if _CONSEQUENCES.search(str(seen)) and not _own_io(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def record(error: BaseException, path: str | None = None) -> bool:
    """Write ``error`` to this worker's error file (default ``TORCHELASTIC_ERROR_FILE``)
    unless the process already recorded one. Returns whether it wrote.

    The format is torch's (``message.message``, ``message.extraInfo.py_callstack``,
    ``...timestamp`` in whole seconds) with an ``anydevice`` entry: ``time`` (seconds, as
    ``time.time()``), ``consequence`` and ``pid``. The traceback starts at the user's
    first frame: the frames that started the rank (the runner, ``runpy``, the
    ``ad.distributed`` block's own) are left off its top, and those that wrote its output
    for it (:mod:`~anydevice.launching.output`) off its bottom: a print to a closed
    stdout ends at the ``print``, as it would without them.
    """
    exception = tb.TracebackException(type(error), error, _users_frames(error))
    while len(exception.stack) > 1 and _WRITING_FRAME in exception.stack[-1].filename.replace(
        "\\", "/"
    ):
        exception.stack.pop()
    trace = "".join(exception.format())
    return _write(
        path,
        f"{type(error).__name__}: {error}",
        trace,
        {"consequence": is_consequence(error)},
    )


def record_preemption(sig: signal.Signals, received: signal.Signals | None) -> bool:
    """Write to this worker's error file that it stops for a preemption: the ranks agreed
    on ``sig``, ``on_preempt`` ran, and it exits with ``128 + sig``; ``received`` is the
    signal this rank itself received (``None``: only another rank did). Returns whether
    it wrote (only under a launcher, and only a process's first record)."""
    message = f"Preempted by {sig.name}: on_preempt ran and the rank exits with code {128 + sig}."
    preemption = {"signal": sig.name, "received": None if received is None else received.name}
    return _write(None, message, "", {"consequence": True, "preempted": preemption})


def preemption(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The preemption a worker recorded in its error file (:func:`record_preemption`):
    ``{"signal": "SIGTERM", "received": "SIGTERM" or None}``; ``None`` if it did not."""
    data = _read(Path(path)) or {}
    info = (data.get("anydevice") or {}).get("preempted")
    return info if isinstance(info, dict) else None


def preempted(
    files: dict[int, str],
    *,
    signalled: signal.Signals | None = None,
    took: float | None = None,
) -> tuple[int, str] | None:
    """``(exit code, report)`` when the workers stopped for a preemption: each recorded
    (:func:`record_preemption`) that ``on_preempt`` ran. ``files`` is each local worker's
    error file (global rank -> path), ``signalled`` the signal the launcher received,
    if any, ``took`` the seconds from it to the workers' exit. ``None`` when no worker
    stopped for a preemption, or (without a signal to the launcher) one failed otherwise.
    """
    records = {r: info for r, path in files.items() if (info := preemption(path)) is not None}
    if not records or (signalled is None and len(records) < len(files)):
        return None
    sig = signal.Signals[str(records[min(records)].get("signal", "SIGTERM"))]
    code = 128 + int(sig)
    saved = ", ".join(map(str, sorted(records)))
    if signalled is not None:
        head = f"stopped by {signalled.name}, which was passed on to the workers"
    else:
        reached = sorted(r for r, info in records.items() if info.get("received"))
        where = f"rank(s) {', '.join(map(str, reached))}" if reached else "a rank on another node"
        head = f"preempted: {sig.name} reached {where}"
    after = f" {took:.1f} s after the signal" if took is not None else ""
    report = f"{head}; on_preempt ran on rank(s) {saved}, which exited with code {code}{after}"
    missing = sorted(set(files) - set(records))
    if missing:
        report += (
            f"; rank(s) {', '.join(map(str, missing))} did not finish it and were stopped "
            "(give them longer: grace=, --grace)"
        )
    return code, report + "."


def stacks_file(launch_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` dumps its Python stacks when the launcher stops it."""
    return Path(launch_dir) / "stacks" / f"rank{rank}.txt"


def read_stacks(path: Path) -> str:
    """The stopped thread's stack from a ``faulthandler`` dump (most recent call first),
    or ``""`` when the rank was never stopped (it finished, or failed on its own)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    current = [b for b in blocks if b.startswith("Current thread")]
    chosen = (current or blocks)[0] if text.strip() else ""
    lines = chosen.splitlines()
    if len(lines) > _STACK_LINES + 1:
        lines = [*lines[: _STACK_LINES + 1], "  ..."]
    return "\n".join(lines)


@dataclass(frozen=True)
class _Failure:
    """One worker as the launcher sees it afterwards."""

    rank: int
    local_rank: int
    pid: int | None
    exitcode: int
    message: str
    trace: str
    time: float
    consequence: bool
    signal: str = ""

    @property
    def own(self) -> bool:
        """The worker's own failure: its own error, or an exit code nobody imposed."""
        if self.trace or self.message:
            return not self.consequence
        return self.exitcode != -signal.SIGTERM


def worker_failed(
    err: Any,
    *,
    nprocs: int,
    launch_dir: str | os.PathLike[str] | None = None,
    keep: object = None,
    hang: list[str] | None = None,
) -> WorkerFailedError:
    """A :class:`WorkerFailedError` from the agent's failures (``err.failures``, rank ->
    torch ``ProcessFailure``): the root cause with its traceback, the ranks that never
    arrived with their stacks, and the other ranks that failed. ``nprocs`` is the number
    of local ranks, ``launch_dir`` where they dumped their stacks, ``keep`` the log
    directory kept for the user, if any, ``hang`` the hang watch's lines on what held
    the ranks (:meth:`~anydevice.launching.hangwatch.HangWatch.at_failure`)."""
    failures = _failures(err, nprocs, launch_dir)
    stopped = {f.local_rank for f in failures if not (f.trace or f.message or f.own)}
    stuck = _stuck(err, nprocs, launch_dir, {f.local_rank for f in failures} - stopped)
    own = [f for f in failures if f.own]
    idle = {r: s for r, s in stuck.items() if not _in_collective(s)}
    if own or not idle:
        first = min(own or failures, key=lambda f: (f.time, f.rank))
        lines = _blame(first)
    else:
        # The waiting ranks' errors decide the exit code, never a rank the launcher
        # stopped (its SIGTERM would read as 143, a signal the user sent).
        waited = [f for f in failures if f.local_rank not in stopped] or failures
        first = min(waited, key=lambda f: (f.time, f.rank))
        lines = _never_arrived(idle, failures)
    if first.exitcode == -signal.SIGTERM and (first.trace or first.message):
        # It raised, then the launcher stopped it before it exited (it stops the others
        # as soon as one has exited): Python's exit code for an error, not the signal's.
        first = replace(first, exitcode=1)
    blamed = sorted(idle) if not own and idle else [first.rank]
    others = sorted(
        f.rank for f in failures if f.rank not in blamed and f.local_rank not in stopped
    )
    if not own and idle:
        others = []  # named above, as the ranks that waited
    if others:
        lines += ["", f"Also failed after it: rank(s) {', '.join(map(str, others))}."]
    lines += hang or []
    if launch_dir is not None:
        lines += flight_summary(Path(launch_dir) / "flight")
    lines += [
        "",
        "The other workers were stopped. "
        + (
            f"Worker logs are in {keep}."
            if keep
            else "Pass log_dir= (--log-dir) to keep each worker's logs."
        ),
    ]
    codes = {f.rank: f.exitcode for f in failures}
    codes.update(dict.fromkeys(idle, -signal.SIGTERM))
    return WorkerFailedError(
        "\n".join(lines),
        rank=blamed[0],
        exitcode=first.exitcode,
        traceback=first.trace if blamed == [first.rank] else idle[blamed[0]],
        failures=codes,
    )


def flight_summary(folder: Path) -> list[str]:
    """Lines on the last collective each rank reached, from the dumps of torch's NCCL
    flight recorder (``TORCH_FR_DUMP_TEMP_FILE=<folder>/rank``, written on a timeout);
    ``[]`` when there are none (gloo, or no timeout).

    Each dump is torch's pickle: ``{"entries": [{"collective_seq_id", "profiling_name",
    "state", ...}, ...], ...}``. The ranks with the lowest sequence number are behind.
    """
    reached: dict[int, tuple[int, str, str]] = {}
    for path in sorted(folder.glob("rank*")) if folder.is_dir() else []:
        digits = path.name[len("rank") :]
        if not digits.isdigit():
            continue
        try:
            data = pickle.loads(path.read_bytes())  # written by this launch's own workers
        except Exception:  # a dump cut short by the stop: skip it
            continue
        entries = data.get("entries", []) if isinstance(data, dict) else []
        entries = [e for e in entries if isinstance(e, dict)]
        if entries:
            last = max(entries, key=lambda e: int(e.get("collective_seq_id", 0)))
            reached[int(digits)] = (
                int(last.get("collective_seq_id", 0)),
                str(last.get("profiling_name", "?")),
                str(last.get("state", "?")),
            )
    if not reached:
        return []
    lines = ["", "NCCL flight recorder, the last collective of each rank:"]
    lines += [
        f"  rank {r}: #{seq} {name} ({state})" for r, (seq, name, state) in sorted(reached.items())
    ]
    low = min(seq for seq, _, _ in reached.values())
    if low < max(seq for seq, _, _ in reached.values()):
        behind = sorted(r for r, (seq, _, _) in reached.items() if seq == low)
        lines.append(f"  rank(s) {', '.join(map(str, behind))} are behind the others.")
    return lines


# ----------------------------------------------------------------------------- internals


def _in_collective(stack: str) -> bool:
    """Whether the innermost frame of a dumped stack is torch.distributed's (waiting in a
    collective or a store), rather than the rank's own code."""
    frames = [line for line in stack.splitlines()[1:] if line.strip().startswith("File ")]
    return bool(frames) and "torch/distributed/" in frames[0].replace("\\", "/")


def _blame(first: _Failure) -> list[str]:
    if first.trace or first.pid is None:
        how = "raised"
    elif first.exitcode < 0:
        how = f"was killed by signal {-first.exitcode} ({first.signal})"
    else:
        how = f"exited with code {first.exitcode}"
    pid = f", pid {first.pid}" if first.pid is not None else ""
    said = f": {first.message}" if first.message else "."
    lines = [f"Rank {first.rank} (local rank {first.local_rank}{pid}) {how}{said}"]
    if first.trace:
        lines += ["", first.trace.rstrip()]
    elif first.exitcode > 0:
        lines += [
            "",
            "It left no Python traceback: it called sys.exit() or os._exit(), or died in "
            "native code. Raise an exception instead to see where.",
        ]
    return lines


def _never_arrived(idle: dict[int, str], failures: list[_Failure]) -> list[str]:
    waiting = sorted((f for f in failures if f.rank not in idle), key=lambda f: (f.time, f.rank))
    said = _SOURCE_LINE.sub("", waiting[0].message) if waiting else ""
    names = ", ".join(map(str, sorted(idle)))
    lines = [
        f"Rank(s) {names} never arrived: rank(s) "
        f"{', '.join(str(f.rank) for f in sorted(waiting, key=lambda f: f.rank))} "
        f"waited for them and gave up ({said or 'a collective failed'})."
    ]
    for rank, stack in sorted(idle.items()):
        frames = []
        for line in stack.splitlines()[1:]:
            if any(mark in line.replace("\\", "/") for mark in _LAUNCHER_FRAMES):
                break  # what started the rank, not where it was
            frames.append(line)
        lines += ["", f"Where rank {rank} was when it was stopped (most recent call first):"]
        lines += ["  " + line.strip() for line in frames]
    return lines


def _failures(
    err: Any, nprocs: int, launch_dir: str | os.PathLike[str] | None = None
) -> list[_Failure]:
    """Every local rank that left a record or a failing exit code."""
    reported = {int(r): f for r, f in err.failures.items()}
    rank, failure = next(iter(reported.items()))
    base = rank - failure.local_rank
    attempt = Path(str(failure.error_file)).parent.parent
    found: dict[int, _Failure] = {}
    for local in range(nprocs):
        data = _read(attempt / str(local) / "error.json")
        if data is not None:
            found[local] = _from_record(base + local, local, data, reported.get(base + local))
        elif base + local in reported:
            found[local] = _from_monitor(base + local, reported[base + local])
            if found[local].exitcode == -signal.SIGABRT and launch_dir is not None:
                dump = Path(launch_dir) / "flight" / f"rank{base + local}"
                if dump.exists():  # NCCL's watchdog aborted it on a collective's timeout
                    found[local] = replace(
                        found[local], message=_WATCHDOG, consequence=True, trace=""
                    )
    if not found:  # error files elsewhere than torch's layout: trust the monitor
        found = {f.local_rank: _from_monitor(r, f) for r, f in reported.items()}
    return list(found.values())


def _stuck(
    err: Any, nprocs: int, launch_dir: str | os.PathLike[str] | None, failed: set[int]
) -> dict[int, str]:
    """Ranks that were still running when the agent stopped them: their stacks."""
    if launch_dir is None:
        return {}
    rank, failure = next(iter(err.failures.items()))
    base = int(rank) - failure.local_rank
    out = {}
    for local in range(nprocs):
        if local in failed:
            continue
        stack = read_stacks(stacks_file(launch_dir, base + local))
        if stack:
            out[base + local] = stack
    return out


def _write(path: str | None, message: str, trace: str, extra: dict[str, Any]) -> bool:
    path = path or os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return False
    now = time.time()
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": trace, "timestamp": str(int(now))},
        },
        "anydevice": {"time": now, "pid": os.getpid(), **extra},
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w") as f:
        json.dump(data, f)
    os.replace(partial, path)  # the launcher never reads half a record
    return True


def _users_frames(error: BaseException) -> TracebackType | None:
    """``error``'s traceback from its first frame that did not start the rank."""
    first = error.__traceback__
    frame = first
    while frame is not None:
        name = frame.tb_frame.f_code.co_filename.replace("\\", "/")
        if not any(mark in name for mark in _STARTING_FRAMES):
            return frame
        frame = frame.tb_next
    return first


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _own_io(error: BaseException) -> bool:
    """Whether ``error`` is one of Python's own ``OSError`` types (its own I/O failed): a
    print to a closed stdout, a socket of the user's. A peer's failure reaches a rank
    through torch's errors (``DistBackendError``, gloo's ``RuntimeError``), never as one."""
    return isinstance(error, OSError) and type(error).__module__ == "builtins"


def _from_record(rank: int, local: int, data: dict[str, Any], reported: Any) -> _Failure:
    message = data.get("message", {})
    if not isinstance(message, dict):
        message = {"message": str(message), "extraInfo": {}}
    info = message.get("extraInfo", {}) or {}
    ours = data.get("anydevice", {}) or {}
    text = str(message.get("message", "")).strip()
    trace = str(info.get("py_callstack", ""))
    stamp = ours.get("time", info.get("timestamp", 0)) or 0
    pid = ours.get("pid") if reported is None else reported.pid
    return _Failure(
        rank=rank,
        local_rank=local,
        pid=pid if isinstance(pid, int) else None,
        exitcode=1 if reported is None else reported.exitcode,
        message=text,
        trace=trace,
        time=float(stamp),
        consequence=bool(ours.get("consequence", _CONSEQUENCES.search(text + trace))),
        signal="",
    )


def _from_monitor(rank: int, failure: Any) -> _Failure:
    message, trace = _failure_text(failure)
    return _Failure(
        rank=rank,
        local_rank=failure.local_rank,
        pid=failure.pid,
        exitcode=failure.exitcode,
        message=message,
        trace=trace,
        time=float(failure.timestamp),
        consequence=bool(_CONSEQUENCES.search(message + trace)),
        signal=failure.signal_name() if failure.exitcode < 0 else "",
    )


def _failure_text(failure: Any) -> tuple[str, str]:
    """(one-line message, traceback) of a torch ``ProcessFailure``."""
    data = failure.error_file_data or {}
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        trace = str(msg.get("extraInfo", {}).get("py_callstack", ""))
        return str(msg.get("message", "")).strip(), trace
    if isinstance(msg, str) and msg.strip() and msg.strip() != "<NONE>":
        return msg.strip().splitlines()[-1], msg
    text = failure.message if isinstance(failure.message, str) else str(failure.message)
    if "elastic/errors.html" in text or text.strip() == "<NONE>" or "Signal " in text:
        text = ""  # torch's placeholders
    return text.strip(), ""
