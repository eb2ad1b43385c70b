"""The rules that make jobs of processes: stalls, ranks grouped by launch, roles, what ended
processes leave. Hand-built samples and heartbeats (the rules are pure); the readers that
fill them are tested on the real machine in test_processes.py and tests/cli/test_top.py."""

from __future__ import annotations

import dataclasses

import pytest

from anydevice.hardware import jobs
from anydevice.hardware.facts import DeviceReading, DeviceUse
from anydevice.hardware.leftovers import leftovers
from anydevice.hardware.processes import Launch, ProcessSample
from anydevice.heartbeat import Beat, Collective

NOW = 1_000_000.0
GiB = 2**30


def sample(pid: int, ppid: int = 1, *, state: str = "S", torch: bool = True, **env: str):
    return ProcessSample(
        pid=pid,
        ppid=ppid,
        name="python",
        state=state,
        start_ticks=pid * 10,
        cpu_ticks=0,
        rss=100 * 2**20,
        threads=4,
        taken=0.0,
        uid=0,
        cmdline=("python", "train.py"),
        environ=env,
        torch=torch,
        deep=True,
    )


def beat(pid: int, rank: int = -1, world: int = -1, **kw) -> Beat:
    base = dict(
        pid=pid,
        created=NOW - 100,
        start_ticks=pid * 10,
        rank=rank,
        local_rank=rank,
        world_size=world,
        local_world_size=world,
        steps=500,
        last_step=NOW - 0.1,
        steps_per_second=10.0,
        allocated=0,
        reserved=0,
        peak=0,
        memory_read_at=0.0,
        collective=None,
        collectives_done=0,
        details={"run_id": "job-a", "master": "127.0.0.1", "host": "box"},
    )
    base.update(kw)
    return Beat(**base)


def job_env(rank: int, world: int = 2, **more: str) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "TORCHELASTIC_RUN_ID": "job-a",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        **more,
    }


@dataclasses.dataclass
class View:
    processes: tuple
    jobs: tuple
    devices: tuple
    notes: tuple
    leftovers: tuple


def view(samples, beats=(), devices=(), **kw) -> View:
    """What a reading makes of these parts: the jobs' view, and the leftovers."""
    by_pid = {s.pid: s for s in samples}
    v = jobs.assemble(by_pid, {}, list(beats), list(devices), now=NOW, host="box", **kw)
    left = leftovers(list(beats), by_pid, list(devices), v.processes, now=NOW, **kw)
    return View(v.processes, v.jobs, v.devices, v.notes, tuple(left))


# ----------------------------------------------------------------------------- stalls


def test_a_rank_is_stalled_after_five_of_its_steps_and_never_before_five_seconds():
    assert jobs.stall_after(100.0) == jobs.STALL_FLOOR_S == 5.0
    assert jobs.stall_after(0.1) == 50.0
    p = jobs.Progress(10, 10.0, 4.9, "batch", None, None, None, None, 0)
    assert jobs.judge(p, "sleeping") == ("stepping", None)
    assert jobs.judge(dataclasses.replace(p, since_last_step=5.1), "running") == ("stalled", 5.1)


def test_a_rank_stepping_once_a_second_that_stops_is_stalled_within_ten_seconds():
    """The done-when of ``anydevice top``: a SIGSTOPped rank within 10 s, by the rule."""
    for rate in (1.0, 2.0, 50.0):
        assert jobs.stall_after(rate) <= 10.0
    p = jobs.Progress(10, 1.0, 0.3, "batch", None, None, None, None, 0)
    # Stopped: at once, whatever its heartbeat's age.
    assert jobs.judge(p, "stopped") == ("stalled", 0.3)


def test_a_late_rank_inside_a_collective_waits_and_one_before_its_first_step_starts():
    inside = {"op": "all_reduce", "seq": 812, "group": "", "waited": 40.0}
    p = jobs.Progress(10, 10.0, 40.0, "batch", None, None, None, inside, 811)
    assert jobs.judge(p, "sleeping") == ("waiting", 40.0)
    fresh = jobs.Progress(0, 0.0, 2.0, None, None, None, None, None, 0)
    assert jobs.judge(fresh, "running") == ("starting", None)
    assert jobs.judge(None, "sleeping") == ("", None)
    assert jobs.judge(None, "stopped") == ("stalled", None)


# ----------------------------------------------------------------------------- jobs


def test_two_ranks_of_a_launch_make_one_job_with_its_launcher_and_data_workers():
    launcher = sample(10, torch=True)
    r0 = sample(11, ppid=10, **job_env(0))
    r1 = sample(12, ppid=10, **job_env(1))
    worker = sample(13, ppid=11, **job_env(0))  # a DataLoader worker inherits the env
    other = sample(20, torch=True)  # a notebook kernel
    v = view([launcher, r0, r1, worker, other], [beat(11, 0, 2), beat(12, 1, 2)])
    by_pid = {p.pid: p for p in v.processes}
    assert [by_pid[p].role for p in (10, 11, 12, 13, 20)] == [
        "launcher",
        "rank",
        "rank",
        "child",
        "process",
    ]
    assert by_pid[11].children == (13,)
    (job,) = v.jobs
    assert job.id == "job-a" and job.launcher == "torchrun" and job.launcher_pid == 10
    assert [(r, pid) for r, pid, _ in job.ranks] == [(0, 11), (1, 12)]
    assert job.missing == () and job.stalled == () and job.note is None
    assert job.steps_per_second == (10.0, 10.0)
    assert by_pid[11].status == "stepping" and by_pid[11].progress.steps == 500


def test_two_jobs_with_one_run_id_on_different_masters_stay_apart():
    a = sample(11, **job_env(0, 1))
    b = sample(21, **job_env(0, 1, MASTER_ADDR="10.0.0.2"))
    assert len(view([a, b]).jobs) == 2


def test_a_stopped_rank_is_listed_as_stalled_in_its_job():
    r0 = sample(11, **job_env(0))
    r1 = sample(12, state="T", **job_env(1))
    v = view([r0, r1], [beat(11, 0, 2), beat(12, 1, 2, last_step=NOW - 2.0)])
    (job,) = v.jobs
    assert job.stalled == (1,)
    row = next(p for p in v.processes if p.pid == 12)
    assert (row.status, row.state, row.stalled_for) == ("stalled", "stopped", pytest.approx(2.0))


def test_ranks_on_other_nodes_are_said_to_be_out_of_reach():
    env = job_env(0, world=4, LOCAL_WORLD_SIZE="2", GROUP_RANK="0")
    v = view([sample(11, **env), sample(12, **{**env, "RANK": "1", "LOCAL_RANK": "1"})])
    (job,) = v.jobs
    assert job.missing == (2, 3)
    assert "ranks 2-3 run on other nodes (2 of 4 here): not reachable" in job.note


def test_missing_ranks_of_a_one_node_job_are_not_running():
    v = view([sample(11, **job_env(0, world=3))])
    assert "ranks 1-2 of 3 are not running here" in v.jobs[0].note


def test_the_ranks_waiting_in_a_collective_name_the_stalled_one_outside_it():
    inside = Collective("all_reduce", 812, "", NOW - 30, 0)
    beats = [
        beat(11, 0, 3, last_step=NOW - 30, collective=inside),
        beat(12, 1, 3, last_step=NOW - 30),  # stuck elsewhere: the culprit
        beat(13, 2, 3, last_step=NOW - 30, collective=inside),
    ]
    samples = [sample(11 + r, **job_env(r, 3)) for r in range(3)]
    (job,) = view(samples, beats).jobs
    assert job.note == "2 rank(s) wait in all_reduce #812; rank(s) 1 stalled outside it"


def test_the_heartbeat_names_the_rank_of_a_process_whose_environment_cannot_be_read():
    hidden = dataclasses.replace(sample(11), environ=None, unreadable=("environ",))
    (row,) = view([hidden], [beat(11, 3, 8)]).processes
    assert (row.rank, row.world_size, row.job) == (3, 8, "job-a")


def test_a_process_using_a_device_is_listed_with_its_memory_and_use():
    plain = sample(30, torch=False)
    gpu = DeviceReading(
        "nvml:GPU-1",
        "NVIDIA",
        "nvml",
        "H100",
        0,
        "cuda:0",
        processes=(DeviceUse(30, 4 * GiB, 97.0),),
    )
    (row,) = view([plain], devices=[gpu]).processes
    assert row.devices == ("nvml:GPU-1",) and row.device_memory == 4 * GiB
    assert row.utilization == 97.0


def test_a_device_only_heartbeats_name_is_listed_from_their_allocators():
    samples = [sample(11, **job_env(0)), sample(12, **job_env(1))]
    details = {"run_id": "job-a", "device": "sim:0", "devices": ["sim:0"]}
    beats = [
        beat(pid, r, 2, details=details, reserved=8 * 2**20, allocated=2**20, memory_read_at=NOW)
        for pid, r in ((11, 0), (12, 1))
    ]
    v = view(samples, beats)
    (dev,) = v.devices
    assert (dev.key, dev.source, dev.torch_name) == ("heartbeat:sim:0", "heartbeat", "sim:0")
    assert dev.memory_used == 16 * 2**20 and {u.pid for u in dev.processes} == {11, 12}
    assert all(p.devices == ("heartbeat:sim:0",) for p in v.processes)
    cpu_only = [beat(11, 0, 2, details={"device": "cpu"})]  # the host publishes no memory
    assert view(samples[:1], cpu_only).devices == ()


# ----------------------------------------------------------------------------- leftovers


def test_a_killed_ranks_heartbeat_is_a_leftover_with_its_rank_job_and_memory():
    dead = beat(
        99,
        1,
        2,
        reserved=3 * GiB,
        memory_read_at=NOW - 5,
        last_step=NOW - 6,
        details={"run_id": "job-a", "device": "cuda:1"},
    )
    v = view([sample(11, **job_env(0))], [beat(11, 0, 2), dead])
    (left,) = v.leftovers
    assert (left.kind, left.pid, left.rank, left.job, left.memory) == (
        "record",
        99,
        1,
        "job-a",
        3 * GiB,
    )
    assert "ended without closing its heartbeat" in left.what and "3.0 GiB" in left.what


def test_a_reused_pid_does_not_keep_a_dead_ranks_heartbeat_alive():
    other = sample(99, torch=False)  # pid 99 now, started later than the record's writer
    old = beat(99, 1, 2, start_ticks=5)
    v = view([other], [old])
    assert [x.kind for x in v.leftovers] == ["record"] and v.processes == ()


def test_device_memory_of_a_pid_that_is_gone_is_orphaned_where_host_pids_are_seen():
    gpu = DeviceReading(
        "nvml:GPU-1", "NVIDIA", "nvml", "H100", 0, processes=(DeviceUse(4242, 12 * GiB),)
    )
    (left,) = view([], devices=[gpu], sees_host_pids=True).leftovers
    assert (left.kind, left.pid, left.memory) == ("memory", 4242, 12 * GiB)
    assert "12.0 GiB on H100 held by pid 4242, which is gone" in left.what
    contained = view([], devices=[gpu], sees_host_pids=False)
    assert contained.leftovers == ()  # in a container: the pid may be the host's
    assert "not in this PID namespace" in contained.notes[0]


def test_a_rank_whose_launcher_is_gone_is_an_orphan():
    r0 = sample(11, **job_env(0, 1, ANYDEVICE_LAUNCHER_PID="77", ANYDEVICE_LAUNCH_DIR="/tmp/x"))
    (left,) = view([r0]).leftovers
    assert (left.kind, left.rank) == ("orphan", 0) and "launcher (pid 77) is gone" in left.what


def test_launch_variables_of_every_launcher_are_read():
    assert (
        Launch.from_environ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "77"}).rank
        == 5
    )
    slurm = Launch.from_environ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "77"})
    assert (slurm.world_size, slurm.launcher, jobs.job_key(slurm)) == (8, "slurm", "slurm:77")
    mpi = Launch.from_environ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"})
    assert (mpi.rank, mpi.world_size, mpi.launcher) == (2, 4, "mpi")
    ours = Launch.from_environ(
        {"RANK": "0", "ANYDEVICE_LAUNCH_DIR": "/tmp/l", "TORCHELASTIC_RUN_ID": "r"}
    )
    assert ours.launcher == "anydevice" and jobs.job_key(ours) == "anydevice:/tmp/l"
    assert Launch.from_environ({"RANK": "x"}).rank is None


def test_the_json_form_of_each_part_is_plain():
    import json

    r0 = sample(11, **job_env(0, 1))
    v = view([r0], [beat(11, 0, 1, collective=Collective("barrier", 3, "", NOW - 1, 0))])
    text = json.dumps(
        {
            "p": [p.to_dict() for p in v.processes],
            "j": [j.to_dict() for j in v.jobs],
            "l": [x.to_dict() for x in v.leftovers],
        }
    )
    back = json.loads(text)
    assert back["p"][0]["progress"]["collective"]["op"] == "barrier"
    assert back["j"][0]["ranks"] == [{"rank": 0, "pid": 11, "status": "stepping"}]
