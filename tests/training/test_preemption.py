"""Preemption: real signals to real ranks; every rank stops after the same step, saves, and
the checkpoint resumes to the loss of the run that was never stopped."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import anydevice as ad
from anydevice.training.preemption import requeue_command, requeue_signal
from ranks import process_tree_guard, run_ranks
from workers import batches, model


@pytest.fixture(autouse=True)
def no_process_left_behind():
    with process_tree_guard():
        yield


STEPS = 6
GLOBAL = 16


def train_step(net, opt, s: int, rank: int = 0, world: int = 1) -> float:
    """Step ``s`` of the same global batches on any world size (see test_distributed_state)."""
    x, y = batches(STEPS, 2, seed=11)
    share = torch.arange(GLOBAL).tensor_split(world)[rank]
    opt.zero_grad()
    err = (net(x[s, share]) - y[s, share]).pow(2).sum()
    (err * world / GLOBAL).backward()
    opt.step()
    return float(ad.all_reduce(err.detach(), op="sum")) / GLOBAL


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.02)


# ----------------------------------------------------------------------------- world of one


def test_a_signal_is_acted_on_at_the_next_check_and_handlers_are_restored(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    calls = []
    with ad.distributed(on_preempt=lambda: calls.append("saved")) as d:
        assert signal.getsignal(signal.SIGTERM) is not before
        d.check_preemption()  # nothing yet
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal: only recorded, no exit here
        os.kill(os.getpid(), signal.SIGTERM)  # again (srun and torchrun): still only recorded
        assert d.preemption.received == signal.SIGTERM and calls == []
        with pytest.raises(SystemExit) as stopped:
            d.check_preemption()
    assert stopped.value.code == 128 + signal.SIGTERM
    assert calls == ["saved"]
    assert signal.getsignal(signal.SIGTERM) is before
    with ad.distributed() as plain:
        plain.check_preemption()  # without on_preempt: nothing to check
    with (
        pytest.raises(TypeError, match="function of no arguments"),
        ad.distributed(on_preempt="save"),  # type: ignore[arg-type]
    ):
        pass


def test_sigusr1_under_slurm_requeues_the_job(tmp_path, monkeypatch):
    # scontrol as this machine does not have it: a script that records its arguments
    log = tmp_path / "scontrol.log"
    script = tmp_path / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with ad.distributed(on_preempt=lambda: None) as d:
        assert signal.SIGUSR1 in d.preemption.signals
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(SystemExit) as stopped:
            d.check_preemption()
    assert stopped.value.code == 128 + signal.SIGUSR1
    assert log.read_text() == "requeue 4242\n"
    assert requeue_command({"SLURM_JOB_ID": "1"}) == ["scontrol", "requeue", "1"]


def test_the_requeue_signal_is_settable_and_a_missing_scontrol_says_what_to_do(
    tmp_path, monkeypatch, caplog
):
    # Where the program uses SIGUSR1 itself, SLURM sends SIGUSR2 (--signal=USR2@120); here
    # scontrol is absent, as in many containers: a warning with what to do, not a crash.
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    monkeypatch.setenv("ANYDEVICE_REQUEUE_SIGNAL", "USR2")
    with ad.distributed(on_preempt=lambda: None) as d:
        assert signal.SIGUSR2 in d.preemption.signals
        assert signal.SIGUSR1 not in d.preemption.signals
        os.kill(os.getpid(), signal.SIGUSR2)
        with pytest.raises(SystemExit) as stopped, caplog.at_level("WARNING", "anydevice"):
            d.check_preemption()
    assert stopped.value.code == 128 + signal.SIGUSR2
    assert "preemption: SIGUSR2 reached the job" in caplog.text
    assert "scontrol is not on PATH" in caplog.text
    assert "requeue it from outside: scontrol requeue 4243" in caplog.text
    with pytest.raises(ValueError, match=r"ANYDEVICE_REQUEUE_SIGNAL='HUP'.*USR1.*USR2"):
        requeue_signal({"ANYDEVICE_REQUEUE_SIGNAL": "HUP"})


# ----------------------------------------------------------------------------- two ranks


def _preempted_rank(folder):
    def rank(init_method: str) -> dict:
        out: dict = {"steps": []}
        state = {"step": 0}

        def save() -> None:
            ad.save_state(folder / "ckpt", model=net, optimizer=opt, step=state["step"])
            out["saved_at"] = state["step"]

        try:
            with ad.distributed(init_method=init_method, timeout=30, on_preempt=save) as d:
                net, opt = ad.prepare(
                    model(seed=0), optimizer=optimizer, strategy="fsdp", precision="fp32"
                )
                pids = ad.all_gather(os.getpid())
                for s in range(STEPS):
                    out["steps"].append(train_step(net, opt, s, d.rank, 2))
                    state["step"] = s + 1
                    if d.rank == 0 and s == 2:
                        os.kill(pids[1], signal.SIGTERM)  # only rank 1 is told
                    d.check_preemption()
        except SystemExit as e:
            out["exit"] = e.code
        return out

    return rank


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_and_resumes(tmp_path):
    # the run that is never stopped
    net = model(seed=0)
    opt = optimizer(net.parameters())
    reference = [train_step(net, opt, s) for s in range(STEPS)]

    folder = tmp_path / "ckpts"
    folder.mkdir()
    (tmp_path / "ranks").mkdir()
    results = run_ranks(_preempted_rank(folder), 2, tmp_path / "ranks", timeout=90)
    stops = {r["saved_at"] for r in results}
    assert len(stops) == 1, results  # every rank stopped after the same step
    stop = stops.pop()
    assert stop in (3, 4)  # rank 1 saw the signal before its check of step 3 or of step 4
    for r in results:
        assert r["exit"] == 128 + signal.SIGTERM
        assert r["steps"] == pytest.approx(reference[:stop], rel=1e-5)

    # resume (here in a world of one) and finish: the same losses as the unstopped run
    net = model(seed=1)
    opt = optimizer(net.parameters())
    extra = ad.load_state(folder / "ckpt", model=net, optimizer=opt)
    assert extra == {"step": stop}
    rest = [train_step(net, opt, s) for s in range(extra["step"], STEPS)]
    assert rest == pytest.approx(reference[stop:], rel=1e-5)


# ----------------------------------------------------------------------------- a real launcher

JOB = """
import sys, time, torch
import anydevice as ad
from torch import nn

state = {"step": 0}
def save():
    ad.save_state(sys.argv[1], model=model, optimizer=opt, step=state["step"])

with ad.distributed(timeout=60, on_preempt=save) as d:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model, opt = ad.prepare(net, optimizer=torch.optim.AdamW, strategy="fsdp")
    for s in range(100_000):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        state["step"] = s + 1
        if d.is_main and s == 5:
            print("training", flush=True)
        time.sleep(0.005)
        d.check_preemption()
"""


@pytest.mark.slow
def test_sigterm_to_torchrun_reaches_the_workers_which_save_a_whole_checkpoint(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    ckpt = tmp_path / "ckpt"
    torchrun = Path(sys.executable).parent / "torchrun"
    argv = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), str(ckpt)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ANYDEVICE_DEVICE": "cpu"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until the workers train
            if "training" in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler does
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert "got signal: 15" in out  # torchrun stopped on the signal and passed it on
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(net.parameters())
    extra = ad.load_state(ckpt, model=net, optimizer=opt)
    assert extra["step"] >= 6, out[-3000:]
    assert opt.state_dict()["state"][0]["step"] == extra["step"]  # saved after that step
