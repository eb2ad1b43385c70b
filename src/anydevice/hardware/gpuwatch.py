"""Live readings of the host, every accelerator and every torch process, for ``anydevice top``.

No torch, no CUDA context: the accelerators through their vendors' readers
(:mod:`anydevice.hardware.backends.watch`), the processes from ``/proc``
(:mod:`anydevice.hardware.processes`), and what torch processes publish in their heartbeats
(:mod:`anydevice.heartbeat`), read, never written, so watching disturbs nothing it watches.
:mod:`anydevice.hardware.jobs` turns them into ranks, jobs and stalls,
:mod:`anydevice.hardware.leftovers` finds what ended processes left.

The JSON form of a :class:`Reading` (schema ``anydevice.top/2``, docs/top.md) is one
record per interval: memory in bytes, power in watts, temperature in degrees Celsius,
utilisation and CPU in percent, times in seconds, ``null`` when unknown.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anydevice.hardware import processes

if TYPE_CHECKING:
    from pathlib import Path

    from anydevice.hardware.facts import DeviceReading
    from anydevice.hardware.jobs import JobReading, ProcessReading
    from anydevice.hardware.leftovers import Leftover
    from anydevice.heartbeat import Beat

# What ``--once`` waits for (a CPU share needs an interval) is spent importing and reading:
# the modules for the readings are imported after the interval has begun (Watcher.read).

__all__ = ["SCHEMA", "HostReading", "Reading", "Watcher", "heartbeat_folders"]

SCHEMA = "anydevice.top/2"


@dataclass(frozen=True)
class HostReading:
    """The host now: CPU busy share since the last reading, load, and RAM."""

    hostname: str
    cpu_percent: float  #: all cores together, since the previous reading
    cores: int
    load: tuple[float, float, float] | None  #: 1, 5 and 15 minute load averages
    memory_total: int
    memory_available: int

    @property
    def memory_used(self) -> int:
        """RAM in use (total less available)."""
        return self.memory_total - self.memory_available

    def to_dict(self) -> dict[str, Any]:
        """Plain types, memory in bytes."""
        out = dataclasses.asdict(self)
        out["load"] = None if self.load is None else list(self.load)
        out["memory_used"] = self.memory_used
        return out


@dataclass(frozen=True)
class Reading:
    """Everything ``anydevice top`` shows at one moment."""

    time: float  #: seconds since the epoch
    host: HostReading
    devices: tuple[DeviceReading, ...]
    processes: tuple[ProcessReading, ...] = ()
    jobs: tuple[JobReading, ...] = ()
    leftovers: tuple[Leftover, ...] = ()
    notes: tuple[str, ...] = ()  #: why no GPU is listed, what could not be read
    skipped: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def only(
        self,
        *,
        ranks: frozenset[int] | None = None,
        job: str | None = None,
        device: str | None = None,
    ) -> Reading:
        """This reading with only the ranks, job and device asked for (the processes and
        jobs; the devices too with ``device``). A job matches by a part of its id; a device
        by its torch name (``cuda:1``, ``sim``), index, name, UUID or PCI slot, or their
        start; ``sim`` matches every ``sim:N``."""
        procs, devices, found = list(self.processes), list(self.devices), list(self.jobs)
        if job:
            needle = job.lower()

            def holds(*names: str | None) -> bool:
                return any(needle in n.lower() for n in names if n)

            procs = [p for p in procs if holds(p.job, p.job_key)]
            found = [j for j in found if holds(j.id, j.key)]
        if ranks is not None:
            procs = [p for p in procs if p.rank in ranks]
        if device:
            devices = [d for d in devices if _device_matches(d, device)]
            keys = {d.key for d in devices}
            names = {d.torch_name for d in devices if d.torch_name}
            procs = [p for p in procs if keys & set(p.devices) or names & set(p.device_names)]
        if ranks is not None or device:
            pids = {p.pid for p in procs}
            found = [j for j in found if any(pid in pids for _, pid, _ in j.ranks)]
        return dataclasses.replace(
            self, processes=tuple(procs), devices=tuple(devices), jobs=tuple(found)
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (docs/top.md): ``schema``, ``time``, ``host``, ``devices``,
        ``processes``, ``jobs``, ``leftovers``, ``notes``, ``skipped``."""
        return {
            "schema": SCHEMA,
            "time": self.time,
            "host": self.host.to_dict(),
            "devices": [d.to_dict() for d in self.devices],
            "processes": [p.to_dict() for p in self.processes],
            "jobs": [j.to_dict() for j in self.jobs],
            "leftovers": [x.to_dict() for x in self.leftovers],
            "notes": list(self.notes),
            "skipped": dict(self.skipped),
        }


def _device_matches(d: DeviceReading, spec: str) -> bool:
    s = spec.strip().lower()
    if s.isdigit():
        return d.index == int(s)
    names = [d.key, d.torch_name, d.name, d.uuid, d.pci_bus_id, d.vendor]
    if any(n and (n.lower() == s or n.lower().startswith(s)) for n in names):
        return True
    return ":" not in s and bool(d.torch_name) and str(d.torch_name).lower().split(":")[0] == s


def heartbeat_folders() -> list[Path]:
    """Where heartbeats are: ``ANYDEVICE_HEARTBEAT_DIR`` alone where set, else this user's
    folder and every other user's this process may read (root reads them all)."""
    from anydevice import heartbeat

    mine = heartbeat.folder()
    if os.environ.get("ANYDEVICE_HEARTBEAT_DIR"):
        return [mine]
    found = [mine]
    parent = mine.parent
    prefix = mine.name.rsplit("-", 1)[0] + "-"
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return found
    for name in names:
        path = parent / name
        if name.startswith(prefix) and path != mine and os.access(path, os.R_OK | os.X_OK):
            found.append(path)
    return found


class Watcher:
    """Takes :class:`Reading` s; CPU shares are measured between consecutive calls.

    >>> w = Watcher(environ={"CUDA_VISIBLE_DEVICES": ""})
    >>> w.read().host.cores >= 1
    True

    Args:
        environ: where ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` are read (default:
            this process's environment).
        clock: wall clock in seconds, for the reading's time stamp and heartbeat ages.
        devices: the accelerators' reader (default: every vendor's, as present).
        folders: where heartbeats are read (default: :func:`heartbeat_folders`).
    """

    #: The first CPU share is measured over at least this long, so it means something.
    FIRST_SAMPLE_S = 0.1

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
        *,
        devices: Any | None = None,
        folders: list[Path] | None = None,
    ) -> None:
        self._primed_at = time.monotonic()
        self._cpu = self._host_cpu()  # starts the first interval
        self._reader = processes.ProcessReader()
        self._last = self._reader.scan().samples  # the first CPU shares start here
        self._clock = clock
        self._folders = folders
        if devices is None:
            from anydevice.hardware.backends.watch import DeviceWatch

            devices = DeviceWatch(environ)
        self._devices = devices
        self._devices.prime()
        self._sees_host_pids = processes.in_initial_pid_namespace()

    def read(self) -> Reading:
        """Read the host, the accelerators and the processes now."""
        from anydevice.hardware.jobs import assemble
        from anydevice.hardware.leftovers import leftovers

        devices, notes = self._devices.read()
        wait = self.FIRST_SAMPLE_S - (time.monotonic() - self._primed_at)
        if wait > 0:
            time.sleep(wait)
        beats = self._beats()
        wanted = {b.pid for b in beats}
        wanted.update(u.pid for d in devices for u in d.processes or ())
        scan = self._reader.scan(wanted)
        scan.samples.pop(os.getpid(), None)  # the view itself is no torch process
        cpu = {}
        for pid, s in scan.samples.items():
            share = processes.cpu_percent(self._last.get(pid), s)
            if share is not None:
                cpu[pid] = share
        self._last = scan.samples
        now = self._clock()
        host = self._host()
        view = assemble(
            scan.samples,
            cpu,
            beats,
            devices,
            now=now,
            host=host.hostname,
            sees_host_pids=self._sees_host_pids,
        )
        left = leftovers(
            beats,
            scan.samples,
            devices,
            view.processes,
            now=now,
            sees_host_pids=self._sees_host_pids,
        )
        return Reading(
            time=now,
            host=host,
            devices=(*devices, *view.devices),
            processes=view.processes,
            jobs=view.jobs,
            leftovers=tuple(left),
            notes=(*notes, *view.notes),
            skipped={"vanished": scan.vanished, "unreadable": scan.unreadable},
        )

    def _beats(self) -> list[Beat]:
        from anydevice import heartbeat

        found = []
        for place in self._folders if self._folders is not None else heartbeat_folders():
            found.extend(heartbeat.read_all(place, prune=False))  # read-only: others' records
        return found

    def _host_cpu(self) -> tuple[int, int] | float:
        """The host's CPU times now (``/proc/stat``); elsewhere psutil's share since the
        last call."""
        times = processes.host_cpu_times() if processes.PROC else None
        if times is not None:
            return times
        import psutil

        return float(psutil.cpu_percent(interval=None))

    def _host(self) -> HostReading:
        now = self._host_cpu()
        before, self._cpu = self._cpu, now
        if isinstance(now, tuple) and isinstance(before, tuple):
            busy, total = now[0] - before[0], now[1] - before[1]
            share = 100.0 * busy / total if total > 0 else 0.0
        else:
            share = float(now) if not isinstance(now, tuple) else 0.0
        memory = processes.host_memory() if processes.PROC else None
        if memory is None:
            import psutil

            vm = psutil.virtual_memory()
            memory = int(vm.total), int(vm.available)
        try:
            load: tuple[float, float, float] | None = os.getloadavg()
        except (AttributeError, OSError):  # Windows has no load average
            load = None
        return HostReading(
            hostname=platform.node(),
            cpu_percent=max(0.0, min(100.0, share)),
            cores=os.cpu_count() or 1,
            load=load,
            memory_total=memory[0],
            memory_available=memory[1],
        )
