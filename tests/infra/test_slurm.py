"""SLURM for real: a two-node cluster on this machine (tests/infra/slurm.py) runs

* ``srun python train.py`` with one task per rank: ``ad.distributed()`` reads SLURM's
  variables (2 ranks on 2 nodes);
* one task per node running ``anydevice launch -n 2`` (4 ranks, the rendezvous at the
  first node that SLURM names);
* the preemption cycle, by ``scancel --signal=USR1`` and by a real ``--time`` limit with
  ``--signal=USR1@50``: every rank saves at the same step, rank 0 runs ``scontrol requeue``,
  the job comes back (``scontrol update StartTime=now`` ends SLURM's hold of a requeued
  job, ~120 s otherwise) and resumes at the saved step, on the loss trajectory of an
  uninterrupted run.

Each result is compared with the same training on one host (``anydevice launch``)."""

from __future__ import annotations

import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.runs import PYTHON, REPO, TRAIN, environ, read_run
from infra.slurm import NODES, Cluster, cluster

FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL")


@pytest.fixture(scope="module")
def slurm() -> Iterator[Cluster]:
    with cluster() as up:
        up.env.update({k: v for k, v in environ().items() if k == "PYTHONPATH"})
        yield up


def _script(*command: str) -> str:
    return f"cd {shlex.quote(str(REPO))}\nsrun {shlex.join(command)}\n"


def _train(out: Path, steps: int, *extra: str) -> tuple[str, ...]:
    return (PYTHON, str(TRAIN), "--out", str(out), "--steps", str(steps), *extra)


def _done(slurm: Cluster, job: int, timeout: float = 120) -> None:
    info = slurm.wait(job, FINISHED, timeout)
    assert info["JobState"] == "COMPLETED", f"job {job}: {info}\n{slurm.output(job)}"


@pytest.mark.timeout(240)
def test_srun_one_task_per_rank(slurm, scratch, one_host):
    job = slurm.sbatch(_script(*_train(scratch, 10)), "-N2", "--ntasks-per-node=1")
    _done(slurm, job)
    losses, final = read_run(scratch)
    assert (final["world_size"], final["launcher"]) == (2, "slurm")
    assert sorted(final["nodes"]) == sorted(NODES)
    expected, reference = one_host(10, 2)
    assert losses == expected
    assert final["checksum"] == reference["checksum"]


@pytest.mark.timeout(240)
def test_anydevice_launch_in_one_task_per_node(slurm, scratch, one_host):
    launch = (PYTHON, "-m", "anydevice", "launch", "-n", "2", "--timeout", "60")
    job = slurm.sbatch(_script(*launch, *_train(scratch, 10)[1:]), "-N2", "--ntasks-per-node=1")
    _done(slurm, job)
    losses, final = read_run(scratch)
    assert (final["world_size"], final["launcher"]) == (4, "torchelastic")
    assert sorted(final["nodes"]) == sorted(NODES * 2)
    expected, reference = one_host(10, 4)
    assert losses == expected
    assert final["checksum"] == reference["checksum"]


def _requeued_and_resumed(slurm: Cluster, job: int, limit: float, longer: bool = False) -> str:
    """Wait for the requeue, release SLURM's hold, wait for the rerun to complete; return
    the first run's output."""
    deadline = time.monotonic() + limit
    while True:
        info = slurm.job(job)
        if int(info.get("Restarts", "0")) >= 1 and info["JobState"] == "PENDING":
            break
        assert info["JobState"] not in FINISHED, f"job {job}: {info}\n{slurm.output(job)}"
        assert time.monotonic() < deadline, f"job {job} not requeued: {info}"
        time.sleep(0.5)
    first = slurm.output(job)
    # The nodes finish tearing the first run down (COMPLETING) before the rerun may start:
    # released at once, the rerun could be launched into that and end at 0 s with exit 1.
    while {line.strip() for line in slurm.run("sinfo", "-h", "-N", "-o", "%T").split()} != {"idle"}:
        assert time.monotonic() < deadline + 60, slurm.run("sinfo", "-N")
        time.sleep(0.5)
    update = ["scontrol", "update", f"JobId={job}", "StartTime=now"]
    if longer:  # the rerun finishes long before its own warning signal
        update.append("TimeLimit=10")
    slurm.run(*update)
    for _ in range(2):
        info = slurm.wait(job, FINISHED, 180)
        if info["JobState"] != "FAILED" or info.get("RunTime") != "00:00:00":
            break
        # SLURM here now and then fails to launch a released rerun (exit 1 at 0 s, before
        # any output of it): the library's part (saved, requeued) is done; launch it again.
        slurm.run("scontrol", "requeue", str(job))
        slurm.wait(job, ("PENDING",), 60)
        slurm.run(*update)
    _done(slurm, job, timeout=180)
    return first


@pytest.mark.timeout(300)
def test_preemption_by_scancel_signal_saves_requeues_and_resumes(slurm, scratch, one_host):
    steps = 30
    ckpt = scratch / "ckpt"
    job = slurm.sbatch(
        _script(*_train(scratch, steps, "--ckpt", str(ckpt), "--sleep", "0.3")),
        "-N2", "--ntasks-per-node=1", "--requeue",
    )  # fmt: skip
    losses_file = scratch / "losses.txt"
    deadline = time.monotonic() + 120
    while not losses_file.exists() or len(losses_file.read_text().splitlines()) < 4:
        assert time.monotonic() < deadline, slurm.output(job)
        time.sleep(0.2)
    slurm.run("scancel", "--signal=USR1", str(job))
    first = _requeued_and_resumed(slurm, job, 120)
    assert "preemption: requeued with scontrol requeue" in first, first
    losses, final = read_run(scratch)
    expected, reference = one_host(steps, 2)
    assert first.count("preemption: SIGUSR1 reached the job; saving") == 2, first  # each rank
    assert ckpt.exists()
    assert losses == expected  # every step once, the resumed ones on the same trajectory
    assert final["checksum"] == reference["checksum"]


@pytest.mark.timeout(400)
def test_preemption_by_time_limit_saves_requeues_and_resumes(slurm, scratch, one_host):
    # slurmctld checks time limits every 30 s and sends the warning once no more than
    # USR1's 50 s + those 30 s are left: 40 to 70 s into a 2-minute limit. (With a 1-minute
    # limit it can come at once, before Python runs.) The run needs longer: 50 steps of 1.5 s.
    steps = 50
    ckpt = scratch / "ckpt"
    job = slurm.sbatch(
        _script(*_train(scratch, steps, "--ckpt", str(ckpt), "--sleep", "1.5")),
        "-N2", "--ntasks-per-node=1", "--requeue", "--time=2", "--signal=USR1@50",
    )  # fmt: skip
    first = _requeued_and_resumed(slurm, job, 150, longer=True)
    assert "preemption: requeued with scontrol requeue" in first, first
    losses, final = read_run(scratch)
    expected, reference = one_host(steps, 2)
    assert first.count("preemption: SIGUSR1 reached the job; saving") == 2, first
    assert ckpt.exists()
    assert losses == expected
    assert final["checksum"] == reference["checksum"]
