"""What ``launch`` and ``anydevice launch`` take, checked before anything starts.

Each refusal is a :class:`~anydevice.errors.DistributedError` that names the argument in
both spellings (``timeout=``, ``--timeout``), the value given, and what to give instead::

    timeout=inf (--timeout): give the seconds any wait of the launcher may last, a number
    above 0 and at most 31536000 (365 days); the default is 300.

Each such error carries the argument's name as ``.argument``, so that the command line
can answer it as a bad flag (exit 2, with the usage line).

A number is a real number, not its text (``timeout="5"`` is refused: the command line
parses its own), and never a bool; a count is a whole number (``2.0`` is refused). What has
no meaning is refused rather than quietly replaced: NaN, infinities, waits longer than a
year (torch's stores and the system's timers overflow long before ``1e300``), a port
beyond 65535, port 0 where other nodes must find the port, a node rank past the last node,
an empty run id, a log folder that is a file.

This module imports the standard library only.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

from anydevice.errors import DistributedError

__all__ = [
    "MOST_NODES",
    "MOST_PROCESSES",
    "MOST_SECONDS",
    "check",
    "node_range",
    "process_count",
    "seconds",
]

#: The longest wait or grace taken, in seconds: a year.
MOST_SECONDS = 365 * 24 * 3600

#: The most processes per node taken.
MOST_PROCESSES = 4096

#: The most nodes taken.
MOST_NODES = 65536

#: Each argument's command-line spelling, for the messages.
_FLAGS = {
    "nprocs": "-n",
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "rdzv_endpoint": "--rdzv-endpoint",
    "run_id": "--rdzv-id",
    "max_restarts": "--max-restarts",
    "timeout": "--timeout",
    "grace": "--grace",
    "hang_after": "--hang-after",
    "log_dir": "--log-dir",
    "verbose": "--verbose",
    "local_addr": "--local-addr",
}

_START_METHODS = ("spawn", "forkserver", "fork")


def check(**given: Any) -> None:
    """Refuse the first of ``given`` (``launch``'s arguments, by name) that ``launch``
    does not take; an argument not given is not checked. A ``log_dir`` that is missing is
    made, as the launch would make it (pass it last).

    >>> check(timeout=60, grace=0, nnodes="1:4", node_rank=3)
    >>> check(timeout=float("nan"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    anydevice.errors.DistributedError: timeout=nan (--timeout): give the seconds any wait ...

    Raises:
        DistributedError: naming the argument, its value and what to give instead.
    """
    for name, value in given.items():
        _CHECKS[name](value, given)


def seconds(name: str, value: object, *, zero: bool = False, what: str, default: float) -> float:
    """``value`` as seconds: a finite real number above 0 (or 0 itself where ``zero``) and
    at most :data:`MOST_SECONDS`; ``what`` says what they are for in the message.

    >>> seconds("timeout", 7, what="for the test", default=300)
    7.0
    """
    low = "0 or more" if zero else "a number above 0"
    need = (
        f"give the seconds {what}, {low} and at most {MOST_SECONDS} (365 days); the default "
        f"is {default:g}"
    )
    number = _real(name, value, need)
    if not (0 < number <= MOST_SECONDS or (zero and number == 0)):  # NaN fails both
        raise _refused(name, value, need)
    return number


def process_count(value: object) -> int | str:
    """``nprocs`` as a count from 1 to :data:`MOST_PROCESSES` (an int, or its digits), or
    ``"auto"`` or ``"gpu"``.

    >>> process_count(" 4 "), process_count("GPU")
    (4, 'gpu')
    """
    need = (
        f"give the processes per node, a whole number from 1 to {MOST_PROCESSES}, 'gpu' (one "
        "per GPU) or 'auto' (one per GPU, else 1)"
    )
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("auto", "gpu"):
            return word
        if not word.isdigit():
            raise _refused("nprocs", value, need)
        count = int(word)
    else:
        count = _whole("nprocs", value, need)
    if not 1 <= count <= MOST_PROCESSES:
        raise _refused("nprocs", value, need)
    return count


def node_range(value: object) -> tuple[int, int]:
    """``nnodes`` as ``(MIN, MAX)``: a whole number, or ``"MIN:MAX"``, with
    ``1 <= MIN <= MAX <=`` :data:`MOST_NODES`.

    >>> node_range(2), node_range("1:4")
    ((2, 2), (1, 4))
    """
    need = (
        f"give the number of nodes (1 to {MOST_NODES}), or a range 'MIN:MAX' with 1 <= MIN <= MAX"
    )
    if isinstance(value, str):
        low, sep, high = value.strip().partition(":")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise _refused("nnodes", value, need)
        bounds = int(low), int(high if sep else low)
    else:
        count = _whole("nnodes", value, need)
        bounds = count, count
    if not 1 <= bounds[0] <= bounds[1] <= MOST_NODES:
        raise _refused("nnodes", value, need)
    return bounds


# ----------------------------------------------------------------------------- the checks


def _fn(value: object, given: Mapping[str, Any]) -> None:
    if not callable(value):
        raise _naming(
            "fn",
            DistributedError(
                f"ad.launch({value!r}, ...): the first argument is the function each worker "
                f"runs, and a {type(value).__name__} cannot be called. Pass the function itself, "
                "e.g. ad.launch(train, nprocs=2)."
            ),
        )


def _target(value: object, given: Mapping[str, Any]) -> None:
    if not isinstance(value, str) or not value.strip():
        raise _naming(
            "target",
            DistributedError(
                f"target={value!r}: give the script to run (a path), or with module=True the "
                "module's name."
            ),
        )


def _args(value: object, given: Mapping[str, Any]) -> None:
    if not isinstance(value, (list, tuple)) or not all(isinstance(a, str) for a in value):
        raise _naming(
            "args",
            DistributedError(
                f"args={value!r}: give the script's arguments as a list of strings, e.g. "
                "['--lr', '0.1']."
            ),
        )


def _module(value: object, given: Mapping[str, Any]) -> None:
    if not isinstance(value, bool):
        raise _naming(
            "module", DistributedError(f"module={value!r}: give True (run a module) or False.")
        )


def _nprocs(value: object, given: Mapping[str, Any]) -> None:
    process_count(value)


def _nnodes(value: object, given: Mapping[str, Any]) -> None:
    node_range(value)


def _node_rank(value: object, given: Mapping[str, Any]) -> None:
    if value is None:
        return
    _, most = node_range(given.get("nnodes", 1))
    need = f"give this node's rank, a whole number from 0 to {most - 1} (nnodes={most})"
    if most == 1:
        need = "leave it out with one node, or give nnodes the number of nodes"
    rank = _whole("node_rank", value, need)
    if not 0 <= rank < most:
        raise _refused("node_rank", value, need)


def _rdzv_endpoint(value: object, given: Mapping[str, Any]) -> None:
    if value is None:
        return
    need = "give HOST:PORT with a port from 1 to 65535, e.g. '10.0.0.1:29400'"
    if not isinstance(value, str):
        raise _refused("rdzv_endpoint", value, need)
    host, sep, port = value.rpartition(":")
    if not sep or not _word(host) or not port.isdigit() or int(port) > 65535:
        raise _refused("rdzv_endpoint", value, need)
    if int(port) == 0 and node_range(given.get("nnodes", 1))[1] > 1:
        raise _refused(
            "rdzv_endpoint",
            value,
            "port 0 lets the system pick one, which the other nodes cannot know: give the "
            "port they all use, from 1 to 65535, e.g. '10.0.0.1:29400'",
        )


def _run_id(value: object, given: Mapping[str, Any]) -> None:
    if value is None:
        return
    text = value if isinstance(value, str) else ""
    if not (text.strip() and text.isprintable() and text == text.strip()):
        raise _refused(
            "run_id",
            value,
            "give the job's name, the same on every node: a non-empty string of printable "
            "characters without spaces at its ends (the default is 'anydevice', or the "
            "SLURM job id)",
        )


def _max_restarts(value: object, given: Mapping[str, Any]) -> None:
    need = "give how often to restart the workers after a failure, a whole number of 0 or more"
    if _whole("max_restarts", value, need) < 0:
        raise _refused("max_restarts", value, need)


def _start_method(value: object, given: Mapping[str, Any]) -> None:
    if value not in _START_METHODS:
        raise _naming(
            "start_method",
            DistributedError(
                f"start_method={value!r}: use 'spawn' (the default), 'forkserver' or 'fork'."
            ),
        )


def _timeout(value: object, given: Mapping[str, Any]) -> None:
    seconds("timeout", value, what="any wait of the launcher may last", default=300)


def _grace(value: object, given: Mapping[str, Any]) -> None:
    seconds(
        "grace",
        value,
        zero=True,
        what="the workers may take to exit after a signal to the launcher",
        default=30,
    )


def _hang_after(value: object, given: Mapping[str, Any]) -> None:
    seconds(
        "hang_after",
        value,
        zero=True,
        what="a rank may wait in one collective before the launch says why the job makes no "
        "progress (0 turns the hang watch off)",
        default=30,
    )


def _log_dir(value: object, given: Mapping[str, Any]) -> None:
    if value is None:
        return
    need = "give a folder to keep each worker's logs in (it is made if missing)"
    try:
        path = os.fspath(value)  # type: ignore[call-overload]  # anything else is refused
    except TypeError:
        raise _refused("log_dir", value, need) from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path.strip() or "\0" in path:
        raise _refused("log_dir", value, need)
    if os.path.exists(path) and not os.path.isdir(path):
        raise _refused("log_dir", value, "it is a file, not a folder: " + need)
    try:
        os.makedirs(path, exist_ok=True)  # as the launch would: a folder it cannot make fails now
    except OSError as e:
        raise _refused("log_dir", value, f"it cannot be made ({e.strerror}): " + need) from None


def _verbose(value: object, given: Mapping[str, Any]) -> None:
    if not isinstance(value, bool):
        raise _refused("verbose", value, "give True or False")


def _local_addr(value: object, given: Mapping[str, Any]) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not _word(value.strip()):
        raise _refused(
            "local_addr",
            value,
            "give this node's address that the other nodes reach, e.g. the one `ip -brief "
            "addr` lists for the network they share, or leave it out",
        )


_CHECKS: dict[str, Callable[[object, Mapping[str, Any]], None]] = {
    "fn": _fn,
    "target": _target,
    "args": _args,
    "module": _module,
    "nprocs": _nprocs,
    "nnodes": _nnodes,
    "node_rank": _node_rank,
    "rdzv_endpoint": _rdzv_endpoint,
    "run_id": _run_id,
    "max_restarts": _max_restarts,
    "start_method": _start_method,
    "timeout": _timeout,
    "grace": _grace,
    "hang_after": _hang_after,
    "log_dir": _log_dir,
    "verbose": _verbose,
    "local_addr": _local_addr,
}


# ----------------------------------------------------------------------------- internals


def _real(name: str, value: object, need: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _refused(name, value, need)
    return float(value)


def _whole(name: str, value: object, need: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _refused(name, value, need)
    return int(value)


def _word(text: str) -> bool:
    """Whether ``text`` is non-empty and printable, without whitespace."""
    return bool(text) and text.isprintable() and not any(c.isspace() for c in text)


def _refused(name: str, value: object, need: str) -> DistributedError:
    flag = _FLAGS.get(name)
    return _naming(
        name, DistributedError(f"{name}={value!r}{f' ({flag})' if flag else ''}: {need}.")
    )


def _naming(name: str, error: DistributedError) -> DistributedError:
    error.argument = name  # type: ignore[attr-defined]  # read by the command line
    return error
