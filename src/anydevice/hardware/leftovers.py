"""What ended processes left behind, for ``anydevice top``: pure, from one reading's parts.

* a heartbeat whose process is gone: it was killed or crashed (a process that exits
  normally removes its own), with the rank, job and memory it last published;
* device memory a driver reports for a pid that no longer exists (or is a zombie), where
  this process sees the host's pids (in a container's PID namespace the drivers' pids are
  the host's, and a pid not found here proves nothing);
* a rank whose launcher (``ANYDEVICE_LAUNCHER_PID``) is gone, still running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from anydevice.hardware.facts import DeviceReading, format_bytes
from anydevice.hardware.jobs import (
    ProcessReading,
    beat_launch,
    job_id,
    job_key,
    short_id,
    wrote,
)
from anydevice.hardware.processes import ProcessSample
from anydevice.heartbeat import Beat

__all__ = ["Leftover", "leftovers"]


@dataclass(frozen=True)
class Leftover:
    """Something a process left behind: what, whose, how much."""

    kind: str  #: record (a dead process's heartbeat), memory (device memory), orphan (rank)
    pid: int
    what: str  #: a sentence for people
    memory: int | None = None
    device: str | None = None
    rank: int | None = None
    job: str | None = None
    path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain types."""
        return dataclasses.asdict(self)


def leftovers(
    beats: Sequence[Beat],
    samples: Mapping[int, ProcessSample],
    devices: Sequence[DeviceReading],
    processes: Sequence[ProcessReading],
    *,
    now: float,
    sees_host_pids: bool | None = True,
) -> list[Leftover]:
    """What ended processes left: their heartbeats, device memory held by no live pid,
    ranks whose launcher is gone.

    Args:
        beats: every heartbeat record, those of ended processes too.
        samples: the processes now, by pid.
        devices: the accelerators read, with their processes.
        processes: the processes listed (:func:`anydevice.hardware.jobs.assemble`'s).
        now: wall-clock seconds.
        sees_host_pids: this process sees the host's pids (None: unknown).
    """
    out = []
    for b in beats:
        if wrote(b, samples):
            continue
        launch = beat_launch(b)
        who = (
            f"rank {launch.rank} of job {short_id(job_id(launch))}"
            if launch.rank is not None
            else "a process"
        )
        where = b.details.get("device", "?")
        held = (
            f", holding {format_bytes(b.reserved)} reserved on {where} when last read"
            if b.memory_read_at and b.reserved
            else ""
        )
        last = f"last step {b.since_last_step(now):.0f} s ago" if b.steps else "no step"
        out.append(
            Leftover(
                kind="record",
                pid=b.pid,
                what=f"pid {b.pid} ({who}) ended without closing its heartbeat: killed, or "
                f"crashed ({b.steps} steps, {last}{held}). `anydevice top --prune` removes it.",
                memory=b.reserved if b.memory_read_at else None,
                device=b.details.get("device"),
                rank=launch.rank,
                job=job_id(launch) if job_key(launch) else None,
                path=str(b.path) if b.path else None,
            )
        )
    if sees_host_pids:
        for d in devices:
            for u in d.processes or ():
                s = samples.get(u.pid)
                if s is None or s.state == "Z":
                    gone = "a zombie" if s is not None else "gone"
                    out.append(
                        Leftover(
                            kind="memory",
                            pid=u.pid,
                            what=f"{format_bytes(u.memory)} on {d.name} held by pid "
                            f"{u.pid}, which is {gone}: the driver has not freed it (a GPU "
                            "reset does).",
                            memory=u.memory,
                            device=d.key,
                        )
                    )
    for r in processes:
        s = samples.get(r.pid)
        boss = s.launch.launcher_pid if s is not None else None
        if r.role == "rank" and boss and boss not in samples:
            out.append(
                Leftover(
                    kind="orphan",
                    pid=r.pid,
                    what=f"rank {r.rank} (pid {r.pid}) of job {short_id(r.job)} runs on, but "
                    "its launcher "
                    f"(pid {boss}) is gone.",
                    memory=r.device_memory,
                    rank=r.rank,
                    job=r.job,
                )
            )
    return out
