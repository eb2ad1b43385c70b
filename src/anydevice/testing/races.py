"""The stream race detector: every unordered pair of accesses, reported where it happens.

On a GPU, work queued on one stream is ordered after work on another only when a wait
says so (``wait_stream``, ``wait_event``, a host synchronisation). A read that nothing
orders after the write it needs reads whatever is in memory when it runs: the right
values on a quiet machine, the old ones (or NaN) under load. The detector finds such a
pair the first time it happens, whatever the timing, and names both lines::

    StreamRaceError: read after write on a tensor (1048576,) float32 on sim:0
      read    at train.py:14 (aten::mul) on the default stream of sim:0
      written at train.py:11 (aten::copy_) on stream 1 of sim:0, made at train.py:9
      Nothing orders the read after the write: it may read the old bytes.
      fix: before line 14, `torch.accelerator.current_stream().wait_stream(copier)`

How it works (torch's CUDA sanitizer's algorithm, on torch's device-generic API): each
stream has a vector clock, each block of memory its last write and the reads since; an
access on stream S is ordered after one on stream T when S has waited, through any chain
of waits, events and host synchronisations, for T's work up to it. The host is one more
stream, for pinned host memory that a copy which does not block still reads or writes.
Memory freed while another stream still used it, and handed to a new tensor, keeps the
old accesses (the simulator's allocator says when it does; ``record_stream`` clears
them). ``elapsed_time`` on an event the host has not seen complete is reported too.

What it sees: every operator of the threads it watches (the thread that started it, the
Python threads started after, autograd's threads), through a dispatcher hook, and every
stream, event and synchronisation made through ``torch.Stream``, ``torch.Event`` and
``torch.accelerator`` (their device guard is wrapped). Not seen: collectives, CUDA
graphs, ``torch.compile``'s kernels, raw reads of memory outside torch's operators
(``.numpy()``, ``torch.save`` of pinned memory), and waits made through a device's own
module (``torch.cuda.Stream.wait_stream`` on a real GPU), which it then takes for missing.

On the simulated accelerator it is on by default (:func:`anydevice.testing.enable`,
``races=``); on a real accelerator of any kind, :func:`detect_races` turns it on.
"""

from __future__ import annotations

import atexit
import linecache
import os
import re
import sys
import sysconfig
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from anydevice.errors import AnydeviceError, DeviceSpecError

__all__ = [
    "RaceMode",
    "RaceReport",
    "StreamRaceError",
    "StreamRaceWarning",
    "expect_races",
    "race_mode",
    "race_reports",
]

#: What a race found does: raise :class:`StreamRaceError` at the racing call, warn
#: (:class:`StreamRaceWarning`) and go on, or nothing (the detector is off).
RaceMode = Literal["raise", "warn", "off"]
MODES: tuple[RaceMode, ...] = ("raise", "warn", "off")

_lib: Any = None  # the extension, once the detector started
_mode: str = "off"
_reports: list[RaceReport] = []
_uncaught: list[RaceReport] = []  # reported outside expect_races() blocks
_collecting: list[list[RaceReport]] = []  # expect_races() blocks, innermost last
_previous_profile: Any = None
_ignored: list[str] = []  # torch's and anydevice's folders: not the user's frames
_stdlib: list[str] = []


class StreamRaceError(AnydeviceError, RuntimeError):
    """Two accesses to one tensor's memory that nothing orders (see :class:`RaceReport`);
    raised at the second one. ``.report`` holds the report."""

    def __init__(self, report: RaceReport | str) -> None:
        super().__init__(str(report))
        self.report = report if isinstance(report, RaceReport) else None


class StreamRaceWarning(RuntimeWarning):
    """A stream race, reported as a warning (``races="warn"``)."""


@dataclass(frozen=True)
class Access:
    """One side of a race: where in the user's code, which operator, on which stream."""

    site: str  #: ``"train.py:14"`` (``"?"`` where no Python frame made it)
    op: str  #: ``"aten::mul"``, ``"record"``, ``"elapsed_time"``
    stream: str  #: ``"the default stream of sim:0"``, ``"stream 1 of sim:0"``, ``"the host"``
    line: int | None = None  #: the line number of ``site``


@dataclass(frozen=True)
class RaceReport:
    """A race the detector found: the access now, the one before it that nothing orders,
    the memory, and the fix. ``str()`` is the message raised or warned."""

    #: ``"read after write"``, ``"write after read"``, ``"write after write"``, ``"timing"``
    kind: str
    tensor: str  #: ``"(1048576,) float32 on sim:0"`` (the tensor of the access now)
    now: Access
    before: Access
    fix: str  #: one line: what to write, and where
    why: str  #: what can go wrong
    freed: str | None = None  #: where the memory was freed, when it was reused while in use

    def __str__(self) -> str:
        verbs = {
            "read after write": ("read", "written"),
            "write after read": ("written", "read"),
            "write after write": ("written", "written before"),
        }
        if self.kind == "timing":
            head = (
                f"stream race: elapsed_time read at {self.now.site} before the event was "
                "known complete"
            )
            lines = [
                f"  the event was recorded at {self.before.site} on {self.before.stream} "
                f"({self.before.op}); the host had not waited for it"
            ]
        else:
            now_verb, before_verb = verbs[self.kind]
            head = f"stream race: {self.kind} on a tensor {self.tensor}"
            width = max(len(now_verb), len(before_verb))
            lines = [
                f"  {verb:<{width}} at {a.site} ({a.op}) on {a.stream}"
                for verb, a in ((now_verb, self.now), (before_verb, self.before))
            ]
            if self.freed is not None:
                lines.append(
                    f"  its memory was freed at {self.freed} while that access was pending, and "
                    "the allocator handed it to the tensor above"
                )
        return "\n".join([head, *lines, f"  {self.why}", f"  fix: {self.fix}"])


def race_mode() -> str:
    """The detector's mode in this process: ``"raise"``, ``"warn"`` or ``"off"``."""
    return _mode


def race_reports() -> list[RaceReport]:
    """Every race reported in this process so far, oldest first (inside
    :func:`expect_races` blocks too)."""
    _flush()
    return list(_reports)


def uncaught() -> list[RaceReport]:
    """The races reported outside :func:`expect_races` blocks, oldest first: what fails a
    run (``python -m anydevice.testing``) or a test (the pytest plugin)."""
    _flush()
    return list(_uncaught)


def _flush() -> None:
    """Report the host's raw accesses to pinned memory seen since the last look (the
    simulator's protected mappings; the main thread also looks at its next bytecode)."""
    if _lib is not None:
        try:
            _lib.deliver_host_faults()
        except StreamRaceError:
            pass  # recorded; raised where it was found when that is the main thread


@contextmanager
def expect_races() -> Iterator[list[RaceReport]]:
    """Collect the races of a block instead of raising or warning, for tests that show a
    bug: the list yielded fills as they are found; the block fails with AssertionError
    when none is.

    Raises:
        AssertionError: the block made no race report.
        AnydeviceError: the detector is off (nothing could be reported).
    """
    if _mode == "off":
        raise AnydeviceError(
            "expect_races(): the stream race detector is off in this process; turn it on "
            "with anydevice.testing.enable() (the simulator) or detect_races()"
        )
    caught: list[RaceReport] = []
    _collecting.append(caught)
    try:
        yield caught
    finally:
        _collecting.remove(caught)
    if not caught:
        raise AssertionError("expect_races(): the block made no stream race report")


def forget() -> None:
    """Forget every stream's clock, every access and every race reported so far, as in a
    fresh process (the reports already made stay in :func:`race_reports`): for repeated
    runs of one program in a benchmark. Not while work is queued that matters."""
    if _lib is not None:
        _lib.reset_races()


def forget_reported() -> None:
    """Report each race again from now on, though it was reported before (each race is
    reported once per pair of lines): a new test's start."""
    if _lib is not None:
        _lib.forget_reported()


def check_mode(mode: object) -> None:
    if mode not in MODES:
        raise DeviceSpecError(
            f"races={mode!r} is not a mode; use 'raise' (a StreamRaceError at the racing "
            "call), 'warn' (a StreamRaceWarning, and the program goes on) or 'off'"
        )


def start(lib: Any, device_type: str, *, simulated: bool, mode: str) -> None:
    """Start the detector for ``device_type`` (once per process; later: the mode)."""
    global _lib
    check_mode(mode)
    if _lib is not None:
        _set_mode(mode)
        return
    if mode == "off":
        return
    import torch

    anydevice_folder = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _ignored[:] = [_folder(torch.__file__), _folder_of(anydevice_folder)]
    _stdlib[:] = sorted({_folder_of(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")})
    lib.start_races(device_type, simulated, 2, _ignored, _stdlib, _deliver)
    _lib = lib
    _set_mode(mode)
    lib.watch_thread(True)
    _watch_new_threads()
    atexit.register(lib.stop_sites)


def _set_mode(mode: str) -> None:
    global _mode
    _mode = mode
    if _lib is not None:
        _lib.set_race_mode(0 if mode == "off" else 2)


def _folder(file: str) -> str:
    return _folder_of(os.path.dirname(os.path.realpath(file)))


def _folder_of(path: str) -> str:
    return os.path.join(os.path.realpath(path), "")


def _watch_new_threads() -> None:
    """Python threads started from now on turn the operator hook on for themselves."""
    global _previous_profile
    _previous_profile = threading.getprofile()
    threading.setprofile(_first_call_in_thread)


def _first_call_in_thread(frame: Any, event: str, arg: Any) -> None:
    if _lib is not None:
        _lib.watch_thread(True)
    sys.setprofile(_previous_profile)


# ------------------------------------------------------------------------- reports


def _deliver(info: dict[str, Any]) -> None:
    """Called by the extension for each race found: record it, then raise or warn."""
    report = _report(info)
    _reports.append(report)
    if _collecting:
        _collecting[-1].append(report)
        return
    _uncaught.append(report)
    if _mode == "raise":
        raise StreamRaceError(report)
    if _mode == "warn":
        warnings.warn(StreamRaceWarning(str(report)), stacklevel=2)


def _site(site_id: int, *, function: bool = True) -> tuple[str, int | None]:
    """``"train.py:14 in step()"`` (and the library frame it went through, if any) and
    the line number."""
    found = _lib.site(site_id) if _lib is not None and site_id >= 0 else None
    if found is None:
        return "?", None
    file, line, name, inside = found
    text = f"{_short(file)}:{line}"
    if function and name not in ("<module>", "?"):
        text += f" in {name}()"
    if inside >= 0:
        inner = _lib.site(inside)
        if inner is not None:
            text += f", inside {_short(inner[0])}:{inner[1]}"
    return text, line


def _short(file: str) -> str:
    try:
        relative = os.path.relpath(file)
    except ValueError:
        return file
    return file if relative.startswith("..") else relative


def _stream(s: dict[str, Any]) -> str:
    if s["host"]:
        return "the host"
    name = (
        f"the default stream of {s['device']}"
        if s["id"] == 0
        else f"stream {s['id']} of {s['device']}"
    )
    if s["made"] >= 0:
        name += f" (made at {_site(s['made'], function=False)[0]})"
    return name


def _name_at(site_id: int, pattern: str) -> str | None:
    """The name ``pattern`` (a regex with one group) finds in the source line of a site:
    the variable a stream was assigned to where it was made, the tensor a ``del`` freed."""
    found = _lib.site(site_id) if _lib is not None and site_id >= 0 else None
    if found is None:
        return None
    match = re.match(pattern, linecache.getline(found[0], found[1]))
    return match.group(1) if match else None


def _stream_expr(s: dict[str, Any]) -> str:
    """A name for the stream in a line of code: the variable it was assigned to where it
    was made (``copier = torch.Stream(dev)``), else a placeholder."""
    name = _name_at(s["made"], r"\s*([A-Za-z_][\w.]*)\s*=.*Stream\(")
    if name is not None:
        return name
    if s["id"] == 0:
        return "<the default stream>"
    return f"<stream {s['id']} of {s['device']}>"


def _frame_of(traceback: str) -> tuple[str, int | None]:
    """The user's frame in a traceback the signal handler wrote (most recent first)."""
    library: tuple[str, int | None] | None = None
    inner: str | None = None  # the innermost frame, for a thread that runs no user code
    for file, line, function in re.findall(r'File "(.*)", line (\d+) in (.*)', traceback):
        path = os.path.realpath(file)
        text = f"{_short(file)}:{line}" + (f" in {function}()" if function != "<module>" else "")
        inner = inner or text
        if file.startswith("<frozen ") or any(path.startswith(p) for p in _ignored):
            continue
        if "/site-packages/" in path or "/dist-packages/" in path:
            library = library or (text, int(line))
        elif not any(path.startswith(p) for p in _stdlib):
            return text, int(line)
    if library is not None:
        return library
    if inner is not None:
        return f"{inner} (a thread that runs none of your code)", None
    return "? (a thread without Python frames)", None


def _report(info: dict[str, Any]) -> RaceReport:
    now, before = info["now"], info["before"]
    now_site, now_line = _frame_of(info["trace"]) if info["trace"] else _site(now["site"])
    before_site, before_line = _site(before["site"])
    kind = info["kind"]
    freed = _site(info["freed"])[0] if info["freed"] >= 0 else None
    if now["op"] in ("aten::resolve_conj", "aten::resolve_neg"):
        now = {**now, "op": "tolist() or numpy()"}  # they read the bytes right after
    at_now = f"before line {now_line}" if now_line is not None else "before the second access"
    before_expr = _stream_expr(before["stream"])
    if kind == "timing":
        why = "elapsed_time needs both events complete: it may fail, or time only part of the work."
        fix = f"{at_now}, synchronize the event (`end.synchronize()`) or its stream"
    elif now["stream"]["host"]:
        if kind == "read after write":
            why = "The host may read the buffer before the copy into it lands: old bytes, or NaN."
        else:
            why = (
                "The host may change the buffer while the copy still reads it: the device "
                "gets the new bytes."
            )
        waits = "`torch.accelerator.synchronize()`"
        if before["stream"]["id"] != 0:
            waits = f"`{before_expr}.synchronize()` (the copy's stream), or {waits}"
        fix = (
            f"{at_now}, wait for the copy: {waits}, or an event recorded after line "
            f"{before_line} and `.synchronize()`d"
        )
        if info["hint"] == "synchronized another stream":
            other = _stream(info["hint_stream"])
            fix += f" (line {_line(info['hint_site'])} synchronized {other} instead)"
    else:
        why = (
            "Nothing orders "
            + {
                "read after write": "the read after the write: it may read the old bytes.",
                "write after read": "the write after the read: the read may see the new bytes.",
                "write after write": "the two writes: either may land last.",
            }[kind]
        )
        if info["reused"]:
            tensor = _name_at(info["freed"], r"\s*del\s+([A-Za-z_][\w.]*)\s*(?:#.*)?$") or "tensor"
            fix = (
                f"keep the freed tensor's memory for {before_expr} until it is done: "
                f"`{tensor}.record_stream({before_expr})` before it is freed"
                + (f" (line {_line(info['freed'])})" if freed else "")
                + ", or `torch.accelerator.current_stream().wait_stream("
                + f"{before_expr})` before the free"
            )
        elif info["hint"] == "event on another stream":
            fix = (
                f"record the event on {before_expr}, the stream that made the tensor: "
                f"`e.record({before_expr})` after line {before_line} (line "
                f"{_line(info['hint_site'])} recorded it on {_stream(info['hint_stream'])})"
            )
        elif before["stream"]["id"] == 0 and now["stream"]["id"] != 0:
            side = _stream_expr(now["stream"])
            fix = (
                f"make {side} wait for the default stream before it runs line {now_line}: "
                f"`{side}.wait_stream(torch.accelerator.current_stream())` before its `with` "
                "block (ad.side_stream() does it on entry)"
            )
        else:
            fix = f"{at_now}, `torch.accelerator.current_stream().wait_stream({before_expr})`"
    return RaceReport(
        kind=kind,
        tensor=info["tensor"],
        now=Access(now_site, now["op"], _stream(now["stream"]), now_line),
        before=Access(before_site, before["op"], _stream(before["stream"]), before_line),
        fix=fix,
        why=why,
        freed=freed,
    )


def _line(site_id: int) -> str:
    line = _site(site_id)[1]
    return "?" if line is None else str(line)
