"""Why a launch failed: the root cause among the failures of its workers.

When one worker raises, its peers fail too — gloo and NCCL see the closed connection —
and the agent stops the rest with SIGTERM. torch reports the failures its monitor saw and
calls the one with the earliest error-file timestamp (whole seconds) the root cause; both
can miss the worker that raised. :func:`worker_failed` reads the error files of every
worker of the attempt and picks the earliest failure that is not a consequence of
another (not SIGTERM, not a peer-gone error), then by timestamp and rank.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anydevice.errors import WorkerFailedError

__all__ = ["worker_failed"]

#: How gloo and NCCL report that a peer died: a consequence, never the root cause.
_PEER_GONE = ("remote worker crashing", "Connection closed by peer", "Connection reset by peer")


@dataclass(frozen=True)
class _Failure:
    """One failed worker, as torch reported it or as its error file tells."""

    rank: int
    local_rank: int
    pid: int | None
    exitcode: int
    message: str
    trace: str
    timestamp: int
    signal: str = ""

    @property
    def consequence(self) -> bool:
        """Stopped by the agent, or failed because a peer died: never the root cause."""
        peer_gone = any(s in self.message + self.trace for s in _PEER_GONE)
        return self.exitcode == -signal.SIGTERM or peer_gone


def worker_failed(err: Any, keep: object = None) -> WorkerFailedError:
    """A :class:`WorkerFailedError` from torch's ``ChildFailedError``: the root cause with
    its traceback, and the other ranks that failed. ``keep`` is the log directory kept
    for the user, if any."""
    failures = [_reported(r, f) for r, f in err.failures.items()]
    failures += _from_error_files(err, {f.local_rank for f in failures})
    first = min(failures, key=lambda f: (f.consequence, f.timestamp, f.rank))
    if first.pid is None:
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
    others = sorted(f.rank for f in failures if f is not first)
    if others:
        lines += ["", f"Also failed after it: rank(s) {', '.join(map(str, others))}."]
    lines += [
        "",
        "The other workers were stopped. "
        + (
            f"Worker logs are in {keep}."
            if keep
            else "Pass log_dir= (--log-dir) to keep each worker's logs."
        ),
    ]
    return WorkerFailedError(
        "\n".join(lines),
        rank=first.rank,
        exitcode=first.exitcode,
        traceback=first.trace,
        failures={f.rank: f.exitcode for f in failures},
    )


def _reported(rank: int, failure: Any) -> _Failure:
    message, trace = _failure_text(failure)
    return _Failure(
        rank=rank,
        local_rank=failure.local_rank,
        pid=failure.pid,
        exitcode=failure.exitcode,
        message=message,
        trace=trace,
        timestamp=int(failure.timestamp),
        signal=failure.signal_name() if failure.exitcode < 0 else "",
    )


def _from_error_files(err: Any, known: set[int]) -> list[_Failure]:
    """Failures the monitor did not report, from the error files of the same attempt
    (``<log dir>/<run>/attempt_<n>/<local rank>/error.json``)."""
    rank, failure = next(iter(err.failures.items()))
    path = Path(str(failure.error_file))
    attempt, base = path.parent.parent, rank - failure.local_rank
    if path.name != "error.json" or not attempt.is_dir():
        return []
    found = []
    for sub in sorted(attempt.iterdir()):
        error_file = sub / "error.json"
        if not sub.name.isdigit() or int(sub.name) in known or not error_file.is_file():
            continue
        try:
            data = json.loads(error_file.read_text()).get("message", {})
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        info = data.get("extraInfo", {})
        found.append(
            _Failure(
                rank=base + int(sub.name),
                local_rank=int(sub.name),
                pid=None,
                exitcode=1,
                message=str(data.get("message", "")).strip(),
                trace=str(info.get("py_callstack", "")),
                timestamp=int(info.get("timestamp", 0) or 0),
            )
        )
    return found


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
    if "elastic/errors.html" in text or text.strip() == "<NONE>":  # torch's placeholders
        text = ""
    return text.strip(), ""
