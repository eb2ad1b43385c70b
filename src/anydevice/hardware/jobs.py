"""The torch processes of a machine as jobs: who is which rank of which launch, who steps,
who stalled, and what was left behind. Pure: made from process samples
(:mod:`~anydevice.hardware.processes`), heartbeats (:mod:`anydevice.heartbeat`) and device
readings, so each rule is tested on hand-built data.

Rules, each in one function:

* **Stalled** (:func:`judge`): a rank is stalled when it is stopped (``SIGSTOP``, state
  ``T``), or when its heartbeat has not stepped for longer than :func:`stall_after` of its
  step rate: ``max(5 s, 5 steps)``. A rank stepping at least once a second that stops is
  flagged within 5 s; one that steps every 20 s, after 100 s. A stalled rank inside a
  collective is *waiting* (in that collective, since when): the rank the others wait for is
  the stalled one that is not in it.
* **Jobs** (:func:`job_key`): ranks belong together when their launcher's variables say so:
  an anydevice launch's directory, else torchelastic's run id with rank 0's address, else
  the SLURM job. The ranks a job's world has that are not on this machine are said to be on
  other nodes, out of reach from here (heartbeats live in each machine's shared memory).

What ended processes left behind is :mod:`anydevice.hardware.leftovers`'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from anydevice.hardware import processes
from anydevice.hardware.facts import DeviceReading, DeviceUse
from anydevice.hardware.processes import Launch, ProcessSample
from anydevice.heartbeat import Beat

__all__ = [
    "STALL_FLOOR_S",
    "STALL_STEPS",
    "JobReading",
    "ProcessReading",
    "Progress",
    "TorchView",
    "assemble",
    "beat_launch",
    "job_id",
    "job_key",
    "judge",
    "short_id",
    "stall_after",
    "wrote",
]

#: A rank is stalled after at least this many seconds without a step...
STALL_FLOOR_S = 5.0
#: ... and after this many of its usual step times.
STALL_STEPS = 5.0

_STATES = {"R": "running", "S": "sleeping", "D": "disk", "T": "stopped", "t": "traced",
           "Z": "zombie", "I": "idle", "X": "dead"}  # fmt: skip


@dataclass(frozen=True)
class Progress:
    """What a process's heartbeat says of its progress."""

    steps: int
    steps_per_second: float
    since_last_step: float  #: seconds (since the record was made, before a first step)
    step_unit: str | None  #: "batch", "optimizer", "meter": what a step is
    allocated: int | None  #: the device allocator's bytes (None: never read)
    reserved: int | None
    peak: int | None
    collective: dict[str, Any] | None  #: op, seq, group, waited (s)
    collectives_done: int
    #: the rate its steps came at while they came (the heartbeat's); ``steps_per_second``
    #: falls below it once no step comes. The stall rule measures lateness against it.
    usual_rate: float | None = None


@dataclass(frozen=True)
class ProcessReading:
    """One process ``anydevice top`` lists."""

    pid: int
    name: str
    command: str
    state: str  #: running, sleeping, stopped, zombie, ...
    role: str  #: rank, launcher, child (of a rank: a DataLoader worker), process
    ppid: int
    container_pid: int | None = None
    user: str | None = None
    cpu_percent: float | None = None
    rss: int | None = None
    torch: bool | None = None
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    job: str | None = None  #: the job's id as shown
    job_key: str | None = None
    launcher: str | None = None  #: anydevice, torchrun, slurm, mpi, env
    host: str | None = None
    devices: tuple[str, ...] = ()  #: device keys (``DeviceReading.key``)
    device_names: tuple[str, ...] = ()  #: the torch devices its heartbeat names
    device_memory: int | None = None  #: bytes on its devices, as their readers say
    utilization: float | None = None  #: percent of its busiest device
    progress: Progress | None = None
    status: str = ""  #: stepping, stalled, waiting, starting; "" without a heartbeat
    stalled_for: float | None = None  #: seconds since its last step, when stalled
    children: tuple[int, ...] = ()
    unreadable: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain types."""
        out = dataclasses.asdict(self)
        out["devices"], out["device_names"] = list(self.devices), list(self.device_names)
        out["children"], out["unreadable"] = list(self.children), list(self.unreadable)
        return out


@dataclass(frozen=True)
class JobReading:
    """The ranks of one launch seen here."""

    key: str
    id: str  #: as shown: the run id, the SLURM job, the launch's folder
    launcher: str | None
    launcher_pid: int | None
    world_size: int | None
    ranks: tuple[tuple[int, int, str], ...]  #: (rank, pid, status), by rank
    missing: tuple[int, ...]  #: ranks of the world not found here
    stalled: tuple[int, ...]
    hosts: tuple[str, ...]
    steps_per_second: tuple[float, float] | None  #: slowest and fastest rank's
    note: str | None = None  #: where the missing ranks are, who the others wait for

    def to_dict(self) -> dict[str, Any]:
        """Plain types."""
        out = dataclasses.asdict(self)
        out["ranks"] = [{"rank": r, "pid": p, "status": s} for r, p, s in self.ranks]
        for key in ("missing", "stalled", "hosts"):
            out[key] = list(out[key])
        out["steps_per_second"] = (
            None if self.steps_per_second is None else list(self.steps_per_second)
        )
        return out


@dataclass(frozen=True)
class TorchView:
    """The processes and jobs of one reading, and the devices known only from heartbeats."""

    processes: tuple[ProcessReading, ...]
    jobs: tuple[JobReading, ...]
    devices: tuple[DeviceReading, ...]  #: devices only heartbeats name (simulator, ...)
    notes: tuple[str, ...] = ()


def stall_after(steps_per_second: float) -> float:
    """Seconds without a step after which a rank stepping at this rate is stalled.

    >>> stall_after(10.0), stall_after(0.05)
    (5.0, 100.0)
    """
    usual = 1.0 / steps_per_second if steps_per_second > 0 else 0.0
    return max(STALL_FLOOR_S, STALL_STEPS * usual)


def judge(progress: Progress | None, state: str) -> tuple[str, float | None]:
    """A rank's status and, when stalled or waiting, its seconds since its last step.

    >>> p = Progress(100, 10.0, 7.5, "batch", None, None, None, None, 0)
    >>> judge(p, "sleeping")
    ('stalled', 7.5)
    >>> judge(dataclasses.replace(p, since_last_step=0.2), "stopped")
    ('stalled', 0.2)
    """
    stopped = state in ("stopped", "traced")
    if progress is None:
        return ("stalled", None) if stopped else ("", None)
    age = progress.since_last_step
    usual = progress.usual_rate if progress.usual_rate is not None else progress.steps_per_second
    late = age > stall_after(usual)
    if progress.steps == 0 and not stopped:
        return ("starting", None) if not late or progress.collective is None else ("waiting", age)
    if stopped:
        return "stalled", age
    if late:
        return ("waiting" if progress.collective is not None else "stalled"), age
    return "stepping", None


def job_key(launch: Launch) -> str | None:
    """Which job a process belongs to, from its launcher's variables (None: none).

    >>> job_key(Launch(run_id="r1", master="10.0.0.1:29500"))
    'torchelastic:r1@10.0.0.1'
    """
    if launch.launch_dir:
        return f"anydevice:{launch.launch_dir}"
    if launch.run_id:
        addr = (
            (launch.master or "").rsplit(":", 1)[0]
            if ":" in (launch.master or "")
            else launch.master
        )
        return f"torchelastic:{launch.run_id}@{addr or ''}"
    if launch.slurm_job:
        return f"slurm:{launch.slurm_job}"
    if launch.master and launch.world_size:
        return f"env:{launch.master}"
    return None


def short_id(job: str | None) -> str:
    """A job's id as people read it: a 32-digit hex run id (anydevice launch's) cut to 8.

    >>> short_id("0123456789abcdef0123456789abcdef")
    '01234567'
    """
    if not job:
        return ""
    if len(job) == 32 and all(c in "0123456789abcdef" for c in job):
        return job[:8]
    return job


def job_id(launch: Launch) -> str:
    if launch.run_id and launch.run_id != "none":
        return launch.run_id
    if launch.slurm_job:
        return f"slurm {launch.slurm_job}"
    if launch.launch_dir:
        return launch.launch_dir.rstrip("/").rsplit("/", 1)[-1]
    return launch.master or "?"


def beat_launch(beat: Beat) -> Launch:
    d = beat.details

    def num(value: Any) -> int | None:
        return int(value) if isinstance(value, (int, str)) and str(value).isdigit() else None

    return Launch(
        rank=beat.rank if beat.rank >= 0 else None,
        local_rank=beat.local_rank if beat.local_rank >= 0 else None,
        world_size=beat.world_size if beat.world_size >= 0 else None,
        local_world_size=beat.local_world_size if beat.local_world_size >= 0 else None,
        run_id=d.get("run_id"),
        slurm_job=d.get("slurm_job"),
        launch_dir=d.get("launch_dir"),
        launcher_pid=num(d.get("launcher_pid")),
        master=d.get("master"),
        group_rank=num(d.get("group_rank")),
        launcher=d.get("launcher"),
    )


def _merge(env: Launch, beat: Launch | None) -> Launch:
    """The environment's answer, completed by the heartbeat's (which knows the rank of an
    mpirun or SLURM process that ``ad.distributed`` identified)."""
    if beat is None:
        return env
    fields = {f.name: getattr(env, f.name) for f in dataclasses.fields(Launch)}
    for name, value in fields.items():
        if value is None:
            fields[name] = getattr(beat, name)
    if env.master is None and beat.master is not None:
        fields["master"] = beat.master
    return Launch(**fields)


def progress_of(beat: Beat, now: float) -> Progress:
    """The heartbeat's progress as of ``now``. Its rate is the published one, or less when
    no step came for longer than a step takes: no more than one step in the time since the
    last (a stopped rank's rate falls instead of staying what it was).

    >>> b = Beat(1, 0.0, 0, 0, 0, 1, 1, 50, 90.0, 10.0, 0, 0, 0, 0.0, None, 0)
    >>> progress_of(b, now=100.0).steps_per_second
    0.1
    """
    c = beat.collective
    age = beat.since_last_step(now)
    rate = beat.steps_per_second
    if beat.steps and age > 0:
        rate = min(rate, 1.0 / age)
    return Progress(
        steps=beat.steps,
        steps_per_second=rate,
        since_last_step=age,
        step_unit=beat.details.get("step_unit"),
        allocated=beat.allocated if beat.memory_read_at else None,
        reserved=beat.reserved if beat.memory_read_at else None,
        peak=beat.peak if beat.memory_read_at else None,
        collective=None
        if c is None
        else {"op": c.op, "seq": c.seq, "group": c.group, "waited": c.waited(now)},
        collectives_done=beat.collectives_done,
        usual_rate=beat.steps_per_second,
    )


def assemble(
    samples: Mapping[int, ProcessSample],
    cpu: Mapping[int, float],
    beats: Sequence[Beat],
    devices: Sequence[DeviceReading],
    *,
    now: float,
    host: str,
    sees_host_pids: bool | None = True,
) -> TorchView:
    """The processes worth listing and their jobs, from one reading's parts.

    Args:
        samples: the processes, by pid (deep-read where they may run torch).
        cpu: each process's CPU share since the reading before, in percent.
        beats: every heartbeat record, those of ended processes too.
        devices: the accelerators read, with their processes.
        now: wall-clock seconds, for the heartbeats' ages.
        host: this machine's name.
        sees_host_pids: this process sees the host's pids (not in a container's PID
            namespace); None: unknown. Device memory of a pid not found is an orphan only then.
    """
    alive = {b.pid: b for b in beats if wrote(b, samples)}
    usage: dict[int, list[tuple[DeviceReading, DeviceUse]]] = {}
    for d in devices:
        for u in d.processes or ():
            usage.setdefault(u.pid, []).append((d, u))
    shown = {
        pid
        for pid, s in samples.items()
        if s.torch or pid in alive or pid in usage or s.launch.rank is not None
    }
    launches = {
        pid: _merge(samples[pid].launch, beat_launch(alive[pid]) if pid in alive else None)
        for pid in shown
    }
    keys = {pid: job_key(launch) for pid, launch in launches.items()}
    rows: dict[int, ProcessReading] = {}
    for pid in shown:
        s, launch = samples[pid], launches[pid]
        used = usage.get(pid, [])
        beat = alive.get(pid)
        progress = progress_of(beat, now) if beat is not None else None
        state = _STATES.get(s.state, s.state)
        status, stalled_for = (
            judge(progress, state) if (beat or launch.rank is not None) else ("", None)
        )
        memories = [u.memory for _, u in used if u.memory is not None]
        utils = [u.utilization for _, u in used if u.utilization is not None]
        names = tuple(beat.details.get("devices") or ()) if beat is not None else ()
        rows[pid] = ProcessReading(
            pid=pid,
            name=s.name,
            command=_command(s),
            state=state,
            role="rank" if launch.rank is not None else "process",
            ppid=s.ppid,
            container_pid=s.container_pid,
            user=_user(s.uid),
            cpu_percent=cpu.get(pid),
            rss=s.rss,
            torch=s.torch if s.torch is not None else (True if beat is not None else None),
            rank=launch.rank,
            local_rank=launch.local_rank,
            world_size=launch.world_size,
            local_world_size=launch.local_world_size,
            job=job_id(launch) if keys[pid] else None,
            job_key=keys[pid],
            launcher=launch.launcher,
            host=(beat.details.get("host") if beat is not None else None) or host,
            devices=tuple(d.key for d, _ in used),
            device_names=tuple(str(n) for n in names),
            device_memory=sum(memories) if memories else None,
            utilization=max(utils) if utils else None,
            progress=progress,
            status=status,
            stalled_for=stalled_for,
            unreadable=s.unreadable,
        )
    rows = _roles(rows, samples)
    extra = _heartbeat_devices(rows, alive)
    jobs = _jobs(rows, samples)
    notes = []
    if sees_host_pids is False and any(pid not in samples for pid in usage):
        hidden = sorted(pid for pid in usage if pid not in samples)
        notes.append(
            f"{len(hidden)} device process(es) ({', '.join(map(str, hidden[:5]))}) are not in "
            "this PID namespace: the driver reports the host's pids. Run anydevice top on "
            "the host, or in a container started with --pid=host, to see them."
        )
    order = sorted(
        rows.values(),
        key=lambda r: (r.job_key or "~", r.rank if r.rank is not None else 1 << 30, r.pid),
    )
    return TorchView(tuple(order), jobs, tuple(extra), tuple(notes))


def _roles(
    rows: dict[int, ProcessReading], samples: Mapping[int, ProcessSample]
) -> dict[int, ProcessReading]:
    """A rank's descendants of its job and rank are its children (DataLoader workers);
    the parent of a job's ranks, or its launcher pid, is its launcher."""
    out = dict(rows)
    children: dict[int, list[int]] = {}
    for pid, r in rows.items():
        parent = rows.get(r.ppid)
        if (
            parent is not None
            and parent.job_key == r.job_key
            and parent.rank == r.rank
            and r.rank is not None
        ):
            out[pid] = dataclasses.replace(out[pid], role="child")
            children.setdefault(r.ppid, []).append(pid)
    for pid, kids in children.items():
        out[pid] = dataclasses.replace(out[pid], children=tuple(sorted(kids)))
    ranks = [r for r in out.values() if r.role == "rank"]
    for r in ranks:
        s = samples.get(r.pid)
        for candidate in (r.ppid, s.launch.launcher_pid if s is not None else None):
            row = out.get(candidate) if candidate is not None else None
            if row is not None and row.rank is None and row.role == "process":
                out[row.pid] = dataclasses.replace(
                    row, role="launcher", job=r.job, job_key=r.job_key, launcher=r.launcher
                )
    return out


def _heartbeat_devices(
    rows: dict[int, ProcessReading], alive: Mapping[int, Beat]
) -> list[DeviceReading]:
    """Devices that only heartbeats name (a process whose device no reader lists): one
    per device name, its memory the allocators' reserved bytes summed."""
    found: dict[str, list[tuple[int, Beat]]] = {}
    for pid, beat in alive.items():
        row = rows.get(pid)
        name = beat.details.get("device")
        if row is None or row.devices or not name or not beat.memory_read_at:
            continue  # listed by a reader already, or nothing published (the host)
        found.setdefault(str(name), []).append((pid, beat))
    out = []
    for name, users in sorted(found.items()):
        out.append(
            DeviceReading(
                key=f"heartbeat:{name}",
                vendor=None,
                source="heartbeat",
                name=name,
                torch_name=name,
                memory_used=sum(b.reserved for _, b in users),
                processes=tuple(DeviceUse(pid, b.reserved) for pid, b in users),
            )
        )
        for pid, b in users:
            rows[pid] = dataclasses.replace(
                rows[pid], devices=(f"heartbeat:{name}",), device_memory=b.reserved
            )
    return out


def _jobs(
    rows: dict[int, ProcessReading], samples: Mapping[int, ProcessSample]
) -> tuple[JobReading, ...]:
    by_key: dict[str, list[ProcessReading]] = {}
    for r in rows.values():
        if r.job_key is not None and r.role == "rank":
            by_key.setdefault(r.job_key, []).append(r)
    out = []
    for key, ranks in sorted(by_key.items()):
        ranks.sort(key=lambda r: (r.rank if r.rank is not None else 0, r.pid))
        world = max((r.world_size or 0) for r in ranks) or None
        seen = {r.rank for r in ranks}
        missing = tuple(i for i in range(world or 0) if i not in seen)
        stalled = tuple(r.rank for r in ranks if r.status in ("stalled",) and r.rank is not None)
        rates = [
            r.progress.steps_per_second
            for r in ranks
            if r.progress is not None and r.progress.steps
        ]
        launcher = next(
            (r for r in rows.values() if r.role == "launcher" and r.job_key == key), None
        )
        local = {r.local_world_size for r in ranks if r.local_world_size is not None}
        out.append(
            JobReading(
                key=key,
                id=ranks[0].job or key,
                launcher=ranks[0].launcher,
                launcher_pid=launcher.pid if launcher is not None else None,
                world_size=world,
                ranks=tuple((r.rank, r.pid, r.status) for r in ranks if r.rank is not None),
                missing=missing,
                stalled=stalled,
                hosts=tuple(sorted({r.host for r in ranks if r.host})),
                steps_per_second=(min(rates), max(rates)) if rates else None,
                note=_job_note(ranks, missing, world, local),
            )
        )
    return tuple(out)


def _job_note(
    ranks: list[ProcessReading], missing: tuple[int, ...], world: int | None, local: set[int]
) -> str | None:
    notes = []
    if missing:
        here = len(ranks)
        elsewhere = bool(local) and max(local) < (world or 0)
        listed = _ranges(missing)
        if elsewhere:
            notes.append(
                f"ranks {listed} run on other nodes ({here} of {world} here): not reachable "
                "from here, as heartbeats live in each machine's shared memory; run "
                "`anydevice top --job ...` on those nodes"
            )
        else:
            notes.append(f"ranks {listed} of {world} are not running here (ended, or not started)")
    inside = [(r, _collective(r)) for r in ranks if r.status == "waiting"]
    waiting = [(r, c) for r, c in inside if c is not None]
    if waiting:
        c = waiting[0][1]
        behind = tuple(
            r.rank
            for r in ranks
            if r.status == "stalled" and r.rank is not None and _collective(r) is None
        )
        who = f"; rank(s) {_ranges(behind)} stalled outside it" if behind else ""
        notes.append(f"{len(waiting)} rank(s) wait in {c['op']} #{c['seq']}{who}")
    return "; ".join(notes) or None


def _collective(r: ProcessReading) -> dict[str, Any] | None:
    return r.progress.collective if r.progress is not None else None


def wrote(b: Beat, samples: Mapping[int, ProcessSample]) -> bool:
    """The process that wrote ``b`` is among ``samples`` (the same one: its start time
    matches, where ``/proc`` tells start times)."""
    s = samples.get(b.pid)
    if s is None:
        return False
    return not processes.PROC or b.start_ticks == 0 or s.start_ticks == b.start_ticks


def _command(s: ProcessSample) -> str:
    if not s.cmdline:
        return s.name
    args = [a.rsplit("/", 1)[-1] if i == 0 else a for i, a in enumerate(s.cmdline)]
    return " ".join(args)


_users: dict[int, str] = {}


def _user(uid: int | None) -> str | None:
    if uid is None:
        return None
    if uid not in _users:
        try:
            import pwd

            _users[uid] = pwd.getpwuid(uid).pw_name
        except (ImportError, KeyError):  # no pwd (Windows), or a uid without a name
            _users[uid] = str(uid)
    return _users[uid]


def _ranges(ranks: tuple[int, ...]) -> str:
    """``0-3,7``.

    >>> _ranges((0, 1, 2, 3, 7))
    '0-3,7'
    """
    parts: list[str] = []
    run: list[int] = []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)
