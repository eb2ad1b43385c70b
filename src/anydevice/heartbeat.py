"""Heartbeats: what a torch process is doing, published for other processes to read.

A process that trains with anydevice (``ad.distributed``, ``DeviceLoader``, a worker of
``ad.launch``) keeps a small record in shared memory: who it is (rank, local rank, world
size, the launch or job it belongs to), how far it got (steps, the time of the last one,
steps per second), what its device's allocator holds, and the collective it is in, if
any, since when. ``anydevice top`` reads these records to show a job's ranks, and the
launcher reads them to tell a hung job from a slow one.

Why shared memory and a fixed layout: a collective is entered and left thousands of times
a second, so publishing must cost a few hundred nanoseconds (two ``struct.pack_into``
calls into an ``mmap``, no system call, no allocation); a reader in another process sees
each change at once, and a process that dies leaves its last state behind, which is what
a reader wants to see. Each record is a file of :data:`SIZE` bytes in :func:`folder`
(``/dev/shm/anydevice-<uid>`` where it exists, else the runtime or temporary folder;
``ANYDEVICE_HEARTBEAT_DIR`` chooses another), named ``<pid>.beat``, removed when its
process exits normally. A killed process's record stays for readers to see how it ended;
a process making its record removes those of ended processes last written to more than
:data:`KEPT_AFTER_EXIT` seconds ago (without that, every killed worker left 4 KiB of
shared memory behind until a reboot).

Consistency: the writer bumps a sequence number to odd before it writes and to even
after (a seqlock); a reader copies the record and retries while the number was odd or
changed under it. Writers are one process each and write from any thread under a lock;
readers never block a writer.

Layout (little-endian), fixed fields first, then a UTF-8 JSON text for what is slow to
change (the job, the devices, where a collective was called)::

    0    4s   magic b"ADHB"         4  H  version   6  H  (unused)
    8    Q    sequence (seqlock)    16 I  pid       20 I  (unused)
    24   d    created (wall s)      32 Q  process start (clock ticks since boot)
    40   4i   rank, local rank, world size, local world size (-1: unknown)
    56   Q    steps                 64 d  last step (wall s, 0: none)
    72   d    steps per second (moving average over about 10 s)
    80   3Q   allocated, reserved, peak bytes     104 d memory read at (wall s, 0: never)
    112  I    in a collective (0/1) 116 I  (unused)
    120  Q    collective sequence number          128 d entered (wall s)
    136  Q    collective fingerprint (op, shapes, dtypes)  144 Q collectives done
    152  16s  collective op          168 16s  collective group
    184  d    watched (wall s, 0: no watcher): the last tick of the process's watcher
              thread (:mod:`anydevice.launching.progress`)
    192 .. 255 (unused)
    256  I    text length           260 ..  JSON text (at most SIZE - 260 bytes)

Keys of the JSON text that the collective watch (:mod:`anydevice.launching.progress`)
writes, each present only while it means something:

* ``groups``: ``{group name: {"ranks": [global ranks], "desc": str}}``, the process
  groups this process belongs to;
* ``seqs``: ``{group name: sequence number}``, the last collective entered in each
  (torch's own numbering, the same on every rank of the group);
* ``gap``: the longest time, in seconds, between two successive collectives so far;
* ``call``: the collective it is in, once it has lasted (``op``, ``seq``, ``group``,
  ``shapes``, ``dtypes``, ``at`` file:line of the user's code, ``code`` that line's
  text, ``stack``);
* ``where``: where its main thread is while it is outside any collective (``at``,
  ``code``, ``function``, ``stack``).

Example::

    >>> import tempfile, os
    >>> os.environ["ANYDEVICE_HEARTBEAT_DIR"] = tempfile.mkdtemp()
    >>> beat = Heartbeat.create(rank=0, world_size=2, details={"job": "demo"})
    >>> beat.step(); beat.enter("all_reduce", 7)
    >>> [b.rank for b in read_all()], read_all()[0].collective.op
    ([0], 'all_reduce')
    >>> beat.close(); read_all()
    []
    >>> del os.environ["ANYDEVICE_HEARTBEAT_DIR"]
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "SIZE",
    "Beat",
    "Collective",
    "Heartbeat",
    "folder",
    "mine",
    "read_all",
    "read_file",
]

SIZE = 4096
MAGIC = b"ADHB"
VERSION = 1
_SUFFIX = ".beat"
_ENV_DIR = "ANYDEVICE_HEARTBEAT_DIR"
_ENV_OFF = "ANYDEVICE_HEARTBEAT"  # "0" turns publishing off

_HEAD = struct.Struct("<4sHH")  # at 0
_SEQ = struct.Struct("<Q")  # at 8
_WHO = struct.Struct("<IIdQ4i")  # at 16: pid, -, created, start ticks, ranks
_STEP = struct.Struct("<Qdd")  # at 56: steps, last step, rate
_MEMORY = struct.Struct("<QQQd")  # at 80
_ENTER = struct.Struct("<IIQdQ")  # at 112: in, -, seq, entered, fingerprint
_LEAVE = struct.Struct("<I")  # at 112
_DONE = struct.Struct("<Q")  # at 144
_NAMES = struct.Struct("<16s16s")  # at 152
_WATCHED = struct.Struct("<d")  # at 184
_TEXT_LEN = struct.Struct("<I")  # at 256
_TEXT_AT = 260
_RATE_WINDOW = 10.0  # seconds the steps-per-second average spans

#: Seconds a record of a process that has ended stays after its last write, for readers
#: to see how it ended (``anydevice top``, ``save_state`` naming a rank that died).
KEPT_AFTER_EXIT = 3600.0


@dataclass(frozen=True)
class Collective:
    """The collective a process is in: its op, sequence number, group, since when."""

    op: str
    seq: int
    group: str
    entered: float  # wall-clock seconds
    fingerprint: int

    def waited(self, now: float | None = None) -> float:
        """Seconds spent in it so far."""
        return max(0.0, (time.time() if now is None else now) - self.entered)


@dataclass(frozen=True)
class Beat:
    """One process's heartbeat as read: a snapshot, consistent as of one moment."""

    pid: int
    created: float
    start_ticks: int
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    steps: int
    last_step: float  # wall-clock seconds; 0 when no step yet
    steps_per_second: float
    allocated: int
    reserved: int
    peak: int
    memory_read_at: float  # 0 when never read
    collective: Collective | None
    collectives_done: int
    details: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    watched: float = 0.0  # wall-clock seconds of the watcher's last tick; 0 when none

    def since_last_step(self, now: float | None = None) -> float:
        """Seconds since the last step (since the record was made, before the first)."""
        ref = self.last_step or self.created
        return max(0.0, (time.time() if now is None else now) - ref)

    @property
    def alive(self) -> bool:
        """The process that wrote this is still running (and is the same process: a pid
        reused since is not it)."""
        ticks = _start_ticks(self.pid)
        return ticks is not None and (self.start_ticks == 0 or ticks == self.start_ticks)


def folder() -> Path:
    """Where heartbeats are kept: ``ANYDEVICE_HEARTBEAT_DIR``, else
    ``/dev/shm/anydevice-<uid>``, else ``$XDG_RUNTIME_DIR/anydevice``, else the temporary
    folder's ``anydevice-<uid>``."""
    chosen = os.environ.get(_ENV_DIR)
    if chosen:
        return Path(chosen)
    uid = os.getuid() if hasattr(os, "getuid") else 0
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"anydevice-{uid}"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.access(runtime, os.W_OK):
        return Path(runtime) / "anydevice"
    import tempfile  # only here: readers such as `anydevice top --once` start faster

    return Path(tempfile.gettempdir()) / f"anydevice-{uid}"


class Heartbeat:
    """This process's heartbeat: the writer. Create it with :meth:`create`, or take the
    process's own with :func:`mine`; every method is safe from any thread."""

    def __init__(self, path: Path, memory: mmap.mmap, handle: int) -> None:
        self.path = path
        self._mm = memory
        self._fd = handle
        self._lock = threading.Lock()
        self._seq = 0
        self._steps = 0
        self._rate = 0.0
        self._last = 0.0
        self._done = 0
        self._names: dict[tuple[str, str], bytes] = {}
        self._details: dict[str, Any] = {}
        self._closed = False
        self._pid = os.getpid()  # a forked child that inherits this object leaves it be

    @classmethod
    def create(
        cls,
        *,
        rank: int = -1,
        local_rank: int = -1,
        world_size: int = -1,
        local_world_size: int = -1,
        details: dict[str, Any] | None = None,
        where: Path | None = None,
    ) -> Heartbeat:
        """Make this process's record in ``where`` (default :func:`folder`), replacing an
        older one of the same pid."""
        place = where if where is not None else folder()
        place.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = place / f"{os.getpid()}{_SUFFIX}"
        # Made whole under another name, then renamed: a reader never sees a record half
        # made (no pid yet, so taken for one of a process long gone, and removed).
        making = place / f".{os.getpid()}.making"
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            mm = mmap.mmap(fd, SIZE)
        except BaseException:
            os.close(fd)
            making.unlink(missing_ok=True)
            raise
        beat = cls(path, mm, fd)
        _HEAD.pack_into(mm, 0, MAGIC, VERSION, 0)
        ticks = _start_ticks(os.getpid()) or 0
        who = (os.getpid(), 0, time.time(), ticks, rank, local_rank, world_size, local_world_size)
        _WHO.pack_into(mm, 16, *who)
        beat.describe(**(details or {}))
        os.replace(making, path)
        _remove_long_ended(place, os.getpid())
        return beat

    def identify(
        self, *, rank: int, local_rank: int, world_size: int, local_world_size: int = -1
    ) -> None:
        """Set who this process is (a process learns its rank after its record exists)."""
        with self._lock:
            self._begin()
            pid, _, created, ticks = _WHO.unpack_from(self._mm, 16)[:4]
            _WHO.pack_into(
                self._mm, 16, pid, 0, created, ticks, rank, local_rank, world_size, local_world_size
            )
            self._end()

    def step(self, now: float | None = None, count: int = 1) -> None:
        """Count one step (a batch delivered, an optimizer step), or ``count`` steps the
        last of which ended ``now`` (a caller that publishes a few at a time)."""
        t = time.time() if now is None else now
        with self._lock:
            self._steps += count
            if self._last:
                gap = t - self._last
                if gap > 0:
                    # A moving average whose weight follows time, not steps: one fast or
                    # slow step moves it by its share of the last ~10 s.
                    w = 1.0 - math.exp(-gap / _RATE_WINDOW)
                    now_rate = count / gap
                    self._rate = (
                        self._rate + w * (now_rate - self._rate) if self._rate else now_rate
                    )
            self._last = t
            self._begin()
            _STEP.pack_into(self._mm, 56, self._steps, t, self._rate)
            self._end()

    def memory(self, allocated: int, reserved: int, peak: int, now: float | None = None) -> None:
        """Publish the device allocator's counters (bytes)."""
        with self._lock:
            self._begin()
            at = time.time() if now is None else now
            _MEMORY.pack_into(self._mm, 80, allocated, reserved, peak, at)
            self._end()

    def enter(
        self,
        op: str,
        seq: int,
        group: str = "",
        fingerprint: int = 0,
        entered: float | None = None,
    ) -> None:
        """Say this process entered collective ``op`` number ``seq`` of ``group`` (at
        ``entered``, wall-clock seconds; default now)."""
        key = (op, group)
        names = self._names.get(key)
        if names is None:
            names = self._names[key] = _NAMES.pack(op.encode()[:16], group.encode()[:16])
        at = time.time() if entered is None else entered
        with self._lock:
            self._begin()
            _ENTER.pack_into(self._mm, 112, 1, 0, seq, at, fingerprint)
            self._mm[152:184] = names
            self._end()

    def leave(self, done: int | None = None) -> None:
        """Say the collective entered last has finished; ``done`` sets the count of
        collectives done (default: one more)."""
        with self._lock:
            self._done = self._done + 1 if done is None else done
            self._begin()
            _LEAVE.pack_into(self._mm, 112, 0)
            _DONE.pack_into(self._mm, 144, self._done)
            self._end()

    def tick(self, now: float | None = None) -> None:
        """Say the process's watcher thread is alive (``watched``, wall-clock seconds)."""
        with self._lock:
            self._begin()
            _WATCHED.pack_into(self._mm, 184, time.time() if now is None else now)
            self._end()

    def describe(self, **details: Any) -> None:
        """Merge ``details`` (JSON-serialisable: the job, the devices, where a collective
        was called) into the record's text; a value of None removes its key. Slow (JSON):
        call it when something changes, not per step."""
        with self._lock:
            for k, v in details.items():
                if v is None:
                    self._details.pop(k, None)
                else:
                    self._details[k] = v
            text = json.dumps(self._details, default=str, separators=(",", ":")).encode()
            if len(text) > SIZE - _TEXT_AT:
                text = json.dumps({"truncated": True}).encode()
            self._begin()
            _TEXT_LEN.pack_into(self._mm, 256, len(text))
            self._mm[_TEXT_AT : _TEXT_AT + len(text)] = text
            self._end()

    def close(self) -> None:
        """Remove the record (a process that ends normally leaves none)."""
        with self._lock:
            if self._closed or self._pid != os.getpid():
                return
            self._closed = True
            try:
                self._mm.close()
            finally:
                os.close(self._fd)
                self.path.unlink(missing_ok=True)

    def _begin(self) -> None:
        self._seq += 1
        _SEQ.pack_into(self._mm, 8, self._seq)

    def _end(self) -> None:
        self._seq += 1
        _SEQ.pack_into(self._mm, 8, self._seq)


_mine: Heartbeat | None = None
_mine_pid = -1
_mine_lock = threading.Lock()


def mine() -> Heartbeat | None:
    """This process's heartbeat, made on first use (with what the launcher's environment
    says of its rank and job); None where publishing is off (``ANYDEVICE_HEARTBEAT=0``)
    or cannot be done here (no writable folder). A forked child gets its own."""
    global _mine, _mine_pid
    if _mine is not None and _mine_pid == os.getpid():
        return _mine
    if os.environ.get(_ENV_OFF, "1") == "0":
        return None
    with _mine_lock:
        if _mine is not None and _mine_pid == os.getpid():
            return _mine
        env = os.environ
        try:
            beat = Heartbeat.create(
                rank=_int(env.get("RANK")),
                local_rank=_int(env.get("LOCAL_RANK")),
                world_size=_int(env.get("WORLD_SIZE")),
                local_world_size=_int(env.get("LOCAL_WORLD_SIZE")),
                details=_job_details(env),
            )
        except OSError:
            return None
        _mine, _mine_pid = beat, os.getpid()
        import atexit

        atexit.register(beat.close)
        return beat


def read_file(path: Path) -> Beat | None:
    """One record, or None where it is not one (another format, gone, or written to
    without pause while it was read)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        for _ in range(100):
            raw = os.pread(fd, SIZE, 0)
            if len(raw) < SIZE or raw[:4] != MAGIC:
                return None
            # The copy's sequence number was read before the fields after it; reading it
            # again now tells whether a write began or ended while they were copied.
            if raw[8:16] == os.pread(fd, 8, 8) and not _SEQ.unpack_from(raw, 8)[0] % 2:
                return _decode(raw, path)
            time.sleep(0.0002)
        return None
    except OSError:
        return None
    finally:
        os.close(fd)


def read_all(where: Path | None = None, *, prune: bool = True) -> list[Beat]:
    """Every record in ``where`` (default :func:`folder`), by pid. With ``prune``, the
    records of processes that no longer exist are returned once more, then removed; a
    reader that wants to flag leftovers passes ``prune=False``."""
    place = where if where is not None else folder()
    out = []
    for path in _files(place):
        beat = read_file(path)
        if beat is None:
            continue
        out.append(beat)
        if prune and not beat.alive:
            path.unlink(missing_ok=True)
    return sorted(out, key=lambda b: b.pid)


def _remove_long_ended(place: Path, me: int) -> None:
    """Remove the records of processes that ended more than :data:`KEPT_AFTER_EXIT`
    seconds after their last write (a record's times are its process's last words)."""
    now = time.time()
    for path in _files(place):
        if path.name == f"{me}{_SUFFIX}":
            continue
        beat = read_file(path)
        if beat is None or f"{beat.pid}{_SUFFIX}" != path.name or beat.alive:
            continue
        entered = beat.collective.entered if beat.collective else 0.0
        last = max(beat.created, beat.last_step, beat.memory_read_at, beat.watched, entered)
        if now - last > KEPT_AFTER_EXIT:
            path.unlink(missing_ok=True)


def _files(place: Path) -> Iterator[Path]:
    try:
        names = os.listdir(place)
    except OSError:
        return
    for name in names:
        if name.endswith(_SUFFIX):
            yield place / name


def _decode(raw: bytes, path: Path) -> Beat | None:
    if len(raw) < SIZE:
        return None
    magic, version, _ = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC or version != VERSION:
        return None
    pid, _, created, ticks, rank, local, world, local_world = _WHO.unpack_from(raw, 16)
    steps, last, rate = _STEP.unpack_from(raw, 56)
    allocated, reserved, peak, mem_at = _MEMORY.unpack_from(raw, 80)
    inside, _, cseq, entered, fingerprint = _ENTER.unpack_from(raw, 112)
    (done,) = _DONE.unpack_from(raw, 144)
    (watched,) = _WATCHED.unpack_from(raw, 184)
    op, group = (s.rstrip(b"\0").decode(errors="replace") for s in _NAMES.unpack_from(raw, 152))
    (n,) = _TEXT_LEN.unpack_from(raw, 256)
    try:
        details = json.loads(raw[_TEXT_AT : _TEXT_AT + n]) if n else {}
    except ValueError:
        return None
    return Beat(
        pid=pid,
        created=created,
        start_ticks=ticks,
        rank=rank,
        local_rank=local,
        world_size=world,
        local_world_size=local_world,
        steps=steps,
        last_step=last,
        steps_per_second=rate,
        allocated=allocated,
        reserved=reserved,
        peak=peak,
        memory_read_at=mem_at,
        collective=Collective(op, cseq, group, entered, fingerprint) if inside else None,
        collectives_done=done,
        details=details if isinstance(details, dict) else {},
        path=path,
        watched=watched,
    )


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (None: no such process, or one
    that has ended and waits to be reaped, a zombie). Two processes with one pid at
    different times differ here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return 0  # cannot read: assume alive, start unknown
    try:
        fields = stat[stat.rindex(b")") + 2 :].split()
        return None if fields[0] in (b"Z", b"X") else int(fields[19])
    except (ValueError, IndexError):
        return 0


def _int(text: str | None) -> int:
    try:
        return int(text) if text is not None else -1
    except ValueError:
        return -1


def _job_details(env: Any) -> dict[str, Any]:
    """The launch or job this process belongs to, from its launcher's environment."""
    keys = {
        "run_id": "TORCHELASTIC_RUN_ID",
        "slurm_job": "SLURM_JOB_ID",
        "launch_dir": "ANYDEVICE_LAUNCH_DIR",
        "launcher_pid": "ANYDEVICE_LAUNCHER_PID",
        "master": "MASTER_ADDR",
        "group_rank": "GROUP_RANK",
    }
    out: dict[str, Any] = {k: env[v] for k, v in keys.items() if env.get(v)}
    import socket
    import sys

    out["host"] = socket.gethostname()
    out["argv"] = sys.argv[:8]
    return out
