"""The processes of this machine as ``anydevice top`` needs them: which run torch, which
rank of which job each is, their CPU and memory; read from ``/proc`` without torch.

A process is looked at in two depths. Every process gets the shallow read, one file
(``/proc/PID/stat``: name, state, parent, start time, CPU ticks, resident set), always
readable. The deep read adds the command line, the launcher's variables in its environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``, ...:
:data:`LAUNCH_VARIABLES`), whether libtorch is mapped into it (``/proc/PID/maps``), and its
pids in nested PID namespaces (``NSpid``: a process in a container shows the container's
pid beside the host's); it is done for the processes that may run torch (a Python
interpreter, torch's own thread names) and for those the caller names (a GPU's
processes, the processes with a heartbeat).

What cannot be read is skipped, never raised: another user's environment and maps
(``EACCES`` unless root), a process that ended between two reads (its files vanish or read
empty), a kernel thread. A sample says what it could not read (``None``), and a scan counts
what it skipped. Elsewhere than Linux (no ``/proc``) psutil reads what it can: the command
line, the environment of this user's processes, CPU and memory; whether torch is mapped is
then known from the heartbeat alone.

>>> import os
>>> me = ProcessReader().sample(os.getpid(), deep=True)
>>> me.pid == os.getpid() and me.cmdline is not None
True
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "LAUNCH_VARIABLES",
    "Launch",
    "ProcessReader",
    "ProcessSample",
    "Scan",
    "cpu_percent",
    "host_cpu_times",
    "host_memory",
    "in_initial_pid_namespace",
]

#: The variables a launcher sets that say where a process sits in a job.
LAUNCH_VARIABLES: tuple[str, ...] = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "ANYDEVICE_LAUNCH_DIR",
    "ANYDEVICE_LAUNCHER_PID",
    "ANYDEVICE_DEVICE",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ZE_AFFINITY_MASK",
)
_WANTED = {v.encode() for v in LAUNCH_VARIABLES}

#: Process names (``comm``) worth a deep read: interpreters and torch's thread names.
_TORCHY_NAMES = ("python", "pt_", "torchrun", "anydevice", "ipykernel", "jupyter")

#: The inode of the initial PID namespace (``PROC_PID_INIT_INO`` in the kernel).
_INITIAL_PID_NS = 0xEFFFFFFC

#: How long a "torch is not mapped" answer is trusted before the maps are read again.
_RECHECK_S = 5.0

PROC = sys.platform.startswith("linux") and os.path.isdir("/proc/self")


@dataclass(frozen=True)
class Launch:
    """Where a process sits in a job, as its launcher's variables say (None: not said).

    >>> Launch.from_environ({"RANK": "3", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "r"}).rank
    3
    """

    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None  #: the ranks on this machine
    run_id: str | None = None  #: torchelastic's (torchrun, anydevice launch)
    slurm_job: str | None = None
    launch_dir: str | None = None  #: an anydevice launch's directory: unique per launch
    launcher_pid: int | None = None  #: an anydevice launch's launcher
    master: str | None = None  #: MASTER_ADDR:MASTER_PORT, where the ranks meet
    group_rank: int | None = None  #: the node's rank in a multi-node launch
    launcher: str | None = None  #: anydevice, torchrun, slurm, mpi, env

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> Launch:
        """Read the launcher's variables of one process's environment."""

        def num(*names: str) -> int | None:
            for name in names:
                text = env.get(name, "")
                if text.strip().lstrip("-").isdigit():
                    return int(text)
            return None

        run_id = env.get("TORCHELASTIC_RUN_ID") or None
        slurm = env.get("SLURM_JOB_ID") or None
        launch_dir = env.get("ANYDEVICE_LAUNCH_DIR") or None
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if launch_dir:
            launcher: str | None = "anydevice"
        elif run_id:
            launcher = "torchrun"
        elif slurm and "SLURM_PROCID" in env:
            launcher = "slurm"
        elif "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
            launcher = "mpi"
        elif "RANK" in env:
            launcher = "env"
        else:
            launcher = None
        return cls(
            rank=num("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"),
            local_rank=num("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"),
            world_size=num("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
            local_world_size=num("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
            run_id=run_id,
            slurm_job=slurm,
            launch_dir=launch_dir,
            launcher_pid=num("ANYDEVICE_LAUNCHER_PID"),
            master=f"{addr}:{port}" if addr and port else addr or None,
            group_rank=num("GROUP_RANK"),
            launcher=launcher,
        )


@dataclass(frozen=True)
class ProcessSample:
    """One process at one moment. Fields a read could not give are None."""

    pid: int
    ppid: int
    name: str  #: ``comm``: the executable's name, or the main thread's
    state: str  #: R running, S sleeping, D disk, T stopped, t traced, Z zombie, ...
    start_ticks: int  #: clock ticks after boot: with the pid, names the process for good
    cpu_ticks: int  #: user + system time so far, in clock ticks
    rss: int | None  #: resident set, bytes
    threads: int
    taken: float  #: ``time.monotonic()`` when read
    uid: int | None = None
    ns_pids: tuple[int, ...] = ()  #: its pid in each PID namespace, outermost first
    cmdline: tuple[str, ...] | None = None
    environ: Mapping[str, str] | None = None  #: the launcher's variables only
    torch: bool | None = None  #: libtorch mapped into it
    deep: bool = False  #: the deep read was done (cmdline, environ, maps, status)
    unreadable: tuple[str, ...] = ()  #: what the deep read could not read, e.g. "environ"

    @property
    def launch(self) -> Launch:
        """What the environment says of the job (all None where it was not readable)."""
        return Launch.from_environ(self.environ or {})

    @property
    def container_pid(self) -> int | None:
        """Its pid inside the innermost PID namespace, where that is not this one's."""
        return self.ns_pids[-1] if len(self.ns_pids) > 1 else None


@dataclass(frozen=True)
class Scan:
    """Every process found in one pass: samples by pid, and what was skipped."""

    samples: dict[int, ProcessSample] = field(default_factory=dict)
    vanished: int = 0  #: ended between the listing and the read
    unreadable: int = 0  #: deep reads refused (another user's process, a container's)


def cpu_percent(before: ProcessSample | None, now: ProcessSample) -> float | None:
    """The share of one core ``now`` used since ``before`` (the same process), in percent.

    >>> a = ProcessSample(1, 0, "p", "R", 5, 100, None, 1, taken=10.0)
    >>> b = ProcessSample(1, 0, "p", "R", 5, 150, None, 1, taken=11.0)
    >>> cpu_percent(a, b) == 50.0 * 100 / _ticks_per_second()
    True
    """
    if before is None or before.start_ticks != now.start_ticks or before.pid != now.pid:
        return None
    dt = now.taken - before.taken
    if dt <= 0:
        return None
    return max(0.0, (now.cpu_ticks - before.cpu_ticks) / _ticks_per_second() / dt * 100.0)


def host_cpu_times(proc: str = "/proc") -> tuple[int, int] | None:
    """The host's CPU time so far, busy and in all, in clock ticks (``/proc/stat``); None
    without ``/proc``. Two readings give the busy share between them."""
    text = _read(f"{proc}/stat")
    if not text:
        return None
    fields = [int(x) for x in text.split(b"\n", 1)[0].split()[1:]]
    idle = sum(fields[3:5])  # idle, iowait
    total = sum(fields[:8])  # user .. steal (guest time is inside user already)
    return total - idle, total


def host_memory(proc: str = "/proc") -> tuple[int, int] | None:
    """The host's RAM, in all and available, in bytes (``/proc/meminfo``); None without."""
    text = _read(f"{proc}/meminfo")
    if not text:
        return None
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(b":")
        if key in (b"MemTotal", b"MemAvailable"):
            found[key] = int(value.split()[0]) * 1024
    if len(found) < 2:
        return None
    return found[b"MemTotal"], found[b"MemAvailable"]


def in_initial_pid_namespace() -> bool | None:
    """Whether this process sees the host's pids (not in a container's PID namespace);
    None where it cannot tell."""
    try:
        link = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return link == f"pid:[{_INITIAL_PID_NS}]"


class ProcessReader:
    """Reads processes; remembers which run torch, so a live view reads each one's maps
    once (a "no" is read again after a few seconds: torch may be imported later).

    Args:
        proc: the procfs mount to read (``/proc``).
    """

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self._torch: dict[tuple[int, int], tuple[bool, float]] = {}
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.linux = PROC if proc == "/proc" else os.path.isdir(proc)

    def scan(self, wanted: Iterable[int] = ()) -> Scan:
        """Every process, shallow; deep for those that may run torch and for ``wanted``."""
        if not self.linux:
            return _psutil_scan(set(wanted))
        wanted = set(wanted)
        samples: dict[int, ProcessSample] = {}
        vanished = unreadable = 0
        try:
            names = os.listdir(self.proc)
        except OSError:
            return Scan()
        for name in names:
            if not name.isdigit():
                continue
            pid = int(name)
            sample = self.sample(pid, deep=None if pid not in wanted else True)
            if sample is None:
                vanished += 1
                continue
            samples[pid] = sample
            if sample.deep and sample.unreadable:
                unreadable += 1
        live = {(s.pid, s.start_ticks) for s in samples.values()}
        self._torch = {k: v for k, v in self._torch.items() if k in live}
        return Scan(samples, vanished, unreadable)

    def sample(self, pid: int, *, deep: bool | None = True) -> ProcessSample | None:
        """One process now, or None where it is gone (also when it ended mid-read).

        Args:
            pid: the process.
            deep: read its command line, environment, maps and status too; None: only
                where its name says it may run torch.
        """
        if not self.linux:
            return _psutil_scan({pid}).samples.get(pid)
        base = f"{self.proc}/{pid}"
        stat = _read(f"{base}/stat")
        if stat is None:
            return None
        try:
            shallow = self._parse_stat(pid, stat)
        except (ValueError, IndexError):
            return None
        if deep is None:
            deep = shallow.name.startswith(_TORCHY_NAMES) or shallow.name == "python3"
        if not deep or shallow.state == "Z":
            return shallow
        return self._deepen(shallow, base)

    def _parse_stat(self, pid: int, stat: bytes) -> ProcessSample:
        # The name is between the first "(" and the last ")": it may hold both.
        name = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
        f = stat[stat.rindex(b")") + 2 :].split()
        # fields after the name, from 0: state, ppid, ..., utime 11, stime 12, threads 17,
        # starttime 19, rss pages 21
        return ProcessSample(
            pid=pid,
            ppid=int(f[1]),
            name=name,
            state=f[0].decode(),
            start_ticks=int(f[19]),
            cpu_ticks=int(f[11]) + int(f[12]),
            rss=int(f[21]) * self._page,
            threads=int(f[17]),
            taken=time.monotonic(),
        )

    def _deepen(self, s: ProcessSample, base: str) -> ProcessSample | None:
        refused: list[str] = []
        raw = _read(f"{base}/cmdline", refused, "cmdline")
        cmdline = tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a) if raw else None
        if raw is not None and not raw and s.state != "Z" and not _exists(base):
            return None  # ended after its stat was read
        env_raw = _read(f"{base}/environ", refused, "environ")
        environ = None
        if env_raw is not None:
            environ = {}
            for item in env_raw.split(b"\0"):
                key, sep, value = item.partition(b"=")
                if sep and key in _WANTED:
                    environ[key.decode()] = value.decode(errors="replace")
        uid: int | None = None
        ns_pids: tuple[int, ...] = ()
        status = _read(f"{base}/status", refused, "status")
        if status is not None:
            uid, ns_pids = _parse_status(status)
        torch = self._maps_torch(s, base, refused)
        if not _exists(base):
            return None  # gone: what was read may be another process's
        return replace(
            s,
            deep=True,
            uid=uid,
            ns_pids=ns_pids,
            cmdline=cmdline,
            environ=environ,
            torch=torch,
            unreadable=tuple(refused),
        )

    def _maps_torch(self, s: ProcessSample, base: str, refused: list[str]) -> bool | None:
        key = (s.pid, s.start_ticks)
        known = self._torch.get(key)
        now = time.monotonic()
        if known is not None and (known[0] or now - known[1] < _RECHECK_S):
            return known[0]
        maps = _read(f"{base}/maps", refused, "maps")
        if maps is None:
            return None
        found = b"libtorch" in maps
        self._torch[key] = (found, now)
        return found


def _read(path: str, refused: list[str] | None = None, what: str = "") -> bytes | None:
    """A file's bytes; None where it is gone or refused (noting ``what`` in ``refused``)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:  # EACCES / EPERM: another user's, a container's; ESRCH: ended
        if refused is not None:
            refused.append(what)
        return None


def _exists(base: str) -> bool:
    return os.path.exists(base)


def _parse_status(text: bytes) -> tuple[int | None, tuple[int, ...]]:
    uid: int | None = None
    ns: tuple[int, ...] = ()
    for line in text.splitlines():
        if line.startswith(b"Uid:"):
            parts = line.split()
            uid = int(parts[1]) if len(parts) > 1 else None
        elif line.startswith(b"NSpid:"):
            ns = tuple(int(x) for x in line.split()[1:])
    return uid, ns


def _ticks_per_second() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100


def _psutil_scan(wanted: set[int]) -> Scan:
    """The same samples from psutil, where there is no ``/proc`` (macOS, Windows)."""
    import psutil

    samples: dict[int, ProcessSample] = {}
    vanished = unreadable = 0
    tick = _ticks_per_second()
    for p in psutil.process_iter():
        try:
            with p.oneshot():
                name = p.name()
                times = p.cpu_times()
                sample = ProcessSample(
                    pid=p.pid,
                    ppid=p.ppid(),
                    name=name,
                    state=_PSUTIL_STATES.get(p.status(), "S"),
                    start_ticks=int(p.create_time() * tick),
                    cpu_ticks=int((times.user + times.system) * tick),
                    rss=int(p.memory_info().rss),
                    threads=p.num_threads(),
                    taken=time.monotonic(),
                )
                if p.pid in wanted or name.startswith(_TORCHY_NAMES):
                    sample = _psutil_deepen(p, sample)
                    unreadable += bool(sample.unreadable)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            vanished += 1
            continue
        except psutil.AccessDenied:
            unreadable += 1
            continue
        samples[p.pid] = sample
    return Scan(samples, vanished, unreadable)


_PSUTIL_STATES = {"running": "R", "sleeping": "S", "disk-sleep": "D", "stopped": "T",
                  "zombie": "Z", "idle": "I"}  # fmt: skip


def _psutil_deepen(p: Any, s: ProcessSample) -> ProcessSample:
    import psutil

    refused = []
    values: dict[str, Any] = {}
    for what, call in (("cmdline", p.cmdline), ("environ", p.environ), ("status", p.uids)):
        try:
            values[what] = call()
        except psutil.AccessDenied:
            refused.append(what)
    env = values.get("environ")
    return replace(
        s,
        deep=True,
        uid=values["status"].real if "status" in values else None,
        cmdline=tuple(values["cmdline"]) if "cmdline" in values else None,
        environ=None if env is None else {k: v for k, v in env.items() if k in LAUNCH_VARIABLES},
        unreadable=tuple(refused),
    )
