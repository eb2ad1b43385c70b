"""Checkpoints that do not stall and a folder of them: ``keep=`` keeps the newest k,
``latest_in=`` resumes the newest complete one, ``background=True`` writes while training
goes on — its error surfacing at the next call, a SIGKILL mid-write (a real process)
leaving the previous checkpoint loadable."""

from __future__ import annotations

import logging
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import anydevice as ad
from ranks import process_tree_guard, run_ranks


def _net(value: float) -> torch.nn.Linear:
    net = torch.nn.Linear(2, 1)
    with torch.no_grad():
        net.weight.fill_(value)
    return net


def test_keep_keeps_the_newest_and_latest_in_resumes_the_newest_complete(tmp_path):
    folder = tmp_path / "ckpts"
    for step in range(1, 5):
        path = ad.save_state(folder, model=_net(step), keep=2, step=step)
        assert path == folder / f"step-{step:09d}"
    assert sorted(p.name for p in folder.iterdir()) == ["step-000000003", "step-000000004"]
    (folder / "step-000000005").mkdir()  # a sharded save cut short: no index, no manifest
    net = _net(0)
    assert ad.load_state(latest_in=folder, model=net) == {"step": 4}
    assert float(net.weight.detach()[0, 0]) == 4.0
    ad.save_state(folder, model=_net(6), keep=2, step=6)
    # the partial step 5 is newer than the oldest kept (4): a save under way elsewhere
    assert sorted(p.name for p in folder.iterdir()) == [
        "step-000000004", "step-000000005", "step-000000006",
    ]  # fmt: skip


def test_bad_keep_step_and_paths_are_named(tmp_path):
    with pytest.raises(TypeError, match="step="):
        ad.save_state(tmp_path / "c", model=_net(1), keep=2)
    with pytest.raises(ValueError, match="keep must be"):
        ad.save_state(tmp_path / "c", model=_net(1), keep=0, step=1)
    with pytest.raises(TypeError, match="a path or latest_in"):
        ad.load_state(tmp_path / "c", model=_net(1), latest_in=tmp_path)
    with pytest.raises(ad.CheckpointError, match="no intact checkpoint there"):
        ad.load_state(latest_in=tmp_path, model=_net(1))


def test_a_background_save_holds_the_state_it_was_given_and_its_error_surfaces_next(tmp_path):
    net = _net(1.0)
    path = ad.save_state(tmp_path / "bg.pt", model=net, background=True, step=1)
    with torch.no_grad():
        net.weight.fill_(2.0)  # the next step changes the weights while it may be writing
    ad.wait_for_saves()
    fresh = _net(0)
    assert ad.load_state(path, model=fresh) == {"step": 1}
    assert float(fresh.weight.detach()[0, 0]) == 1.0  # staged before the change
    # a write that fails in the background: raised at the next call, never lost
    ad.save_state(tmp_path / "missing" / "x.pt", model=net, background=True)
    with pytest.raises(ad.CheckpointError, match="missing"):
        ad.save_state(tmp_path / "after.pt", model=net)
    assert not (tmp_path / "after.pt").exists()  # the failed one was said first
    ad.wait_for_saves()  # nothing left in flight


KILLED = """
import sys, torch, anydevice as ad
folder = sys.argv[1]
net = torch.nn.Linear(2, 1)
ad.save_state(folder, model=net, keep=3, step=1)
big = torch.nn.Linear(6000, 6000)  # ~144 MB: a write that takes a while
ad.save_state(folder, model=big, keep=3, step=2, background=True)
print("writing", flush=True)
ad.wait_for_saves()
"""


@pytest.mark.slow
def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "ckpts"
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(folder)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 60
        while not list(folder.glob(".step-000000002*")) and time.monotonic() < deadline:
            time.sleep(0.005)  # the temporary file of step 2 is being written
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert not (folder / "step-000000002").exists(), "the write finished before the kill"
    net = torch.nn.Linear(2, 1)
    assert ad.load_state(latest_in=folder, model=net) == {"step": 1}


# ----------------------------------------------------------------------------- two ranks


def _ddp(value: float, width: int = 4) -> torch.nn.Module:
    net = torch.nn.Linear(width, width)
    with torch.no_grad():
        net.weight.fill_(value)
        net.bias.fill_(value)
    return net


def _saves_in_the_background(folder):
    """Three background saves of a DDP model (keep=2), each followed at once by a change
    of the weights; the last one left in flight for ``ad.distributed``'s exit to finish."""

    def rank(init_method: str) -> dict:
        with ad.distributed(init_method=init_method, timeout=60):
            net = ad.prepare(_ddp(0.0), strategy="ddp")
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for step in (1, 2, 3):
                with torch.no_grad():
                    for p in net.parameters():
                        p.fill_(float(step))
                ad.save_state(folder, model=net, optimizer=opt, keep=2, step=step,
                              background=True)  # fmt: skip
                with torch.no_grad():  # the loop goes on while it writes
                    for p in net.parameters():
                        p.fill_(-1.0)
            # no wait_for_saves: the end of ad.distributed waits for step 3
        done = sorted(p.name for p in folder.iterdir())
        fresh = _ddp(0.0)
        extra = ad.load_state(latest_in=folder, model=fresh)
        return {"done": done, "extra": extra, "weight": fresh.weight.detach().tolist()}

    return rank


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_background_save_on_two_ranks_loads_back_equal_and_keeps_the_newest(tmp_path):
    folder = tmp_path / "ckpts"
    # this process saved in the background first: the ranks forked from it inherit its
    # save thread's pool, but not the thread
    ad.save_state(tmp_path / "one.pt", model=_net(1.0), background=True)
    ad.wait_for_saves()
    with process_tree_guard():
        results = run_ranks(_saves_in_the_background(folder), 2, tmp_path, timeout=180)
    for r in results:
        assert r["done"] == ["step-000000002", "step-000000003"]
        assert r["extra"] == {"step": 3}
        assert r["weight"] == [[3.0] * 4] * 4  # staged before the loop changed it
    net = _ddp(0.0)  # and on a world of one, DCP resharding it
    assert ad.load_state(folder / "step-000000002", model=net) == {"step": 2}
    assert float(net.bias.detach()[0]) == 2.0


def _killed_while_writing(folder):
    """Rank 1 SIGKILLs itself while DCP writes its shard of step 2 in the background;
    rank 0 reports what its wait for that save raised."""

    def rank(init_method: str) -> dict:
        with ad.distributed(init_method=init_method, timeout=20) as d:
            ad.save_state(folder, model=_ddp(1.0), keep=3, step=1)
            big = _ddp(2.0, width=3000)  # ~36 MB per rank: a write that takes a while
            ad.save_state(folder, model=big, keep=3, step=2, background=True)
            if d.rank == 1:
                deadline = time.monotonic() + 60
                while not list(folder.glob(".step-000000002.*/__1_0.distcp")):
                    assert time.monotonic() < deadline, "the shard was never written"
                    time.sleep(0.001)
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                ad.wait_for_saves()
            except ad.CheckpointError as e:
                return {"error": str(e)}
            return {"error": None}

    return rank


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_of_a_rank_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "ckpts"
    with process_tree_guard(), pytest.raises(AssertionError, match="rank 1 died"):
        run_ranks(_killed_while_writing(folder), 2, tmp_path, timeout=180)
    status, survivor = pickle.loads((tmp_path / "rank0.pickle").read_bytes())
    assert status == "ok", survivor
    assert survivor["error"] is not None and "step-000000002" in survivor["error"], survivor
    assert not (folder / "step-000000002").exists()
    net = _ddp(0.0)
    assert ad.load_state(latest_in=folder, model=net) == {"step": 1}
    assert float(net.weight.detach()[0, 0]) == 1.0


def _fails_to_write(folder, logs):
    """After step 1, no rank may write a file over 64 KiB (a real EFBIG from the kernel):
    the shards fail in DCP's background thread, twice."""

    def rank(init_method: str) -> dict:
        out: dict = {}
        handler = logging.FileHandler(logs / f"log{os.environ['RANK']}")
        logging.getLogger("anydevice").addHandler(handler)
        with ad.distributed(init_method=init_method, timeout=60):
            net = _ddp(1.0, width=300)  # ~360 KB
            ad.save_state(folder, model=net, keep=2, step=1)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
            ad.save_state(folder, model=net, keep=2, step=2, background=True)
            try:
                ad.save_state(folder, model=net, keep=2, step=3)  # waits for step 2 first
            except ad.CheckpointError as e:
                out["next save"] = str(e)
            ad.save_state(folder, model=net, keep=2, step=4, background=True)
            # left in flight: the end of ad.distributed waits for it and logs its error
        handler.close()
        out["done"] = sorted(p.name for p in folder.iterdir())
        return out

    return rank


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_error_in_the_background_write_on_two_ranks_surfaces(tmp_path):
    folder, logs = tmp_path / "ckpts", tmp_path / "logs"
    logs.mkdir()
    with process_tree_guard():
        results = run_ranks(_fails_to_write(folder, logs), 2, tmp_path, timeout=180)
    for r, result in enumerate(results):
        # both ranks raise it at the next call, before that call writes anything
        assert "could not write their part" in result["next save"], result
        assert "step-000000002" in result["next save"]
        assert result["done"] == ["step-000000001"], result  # nothing partial, nothing lost
        log = (logs / f"log{r}").read_text()
        assert "background save_state failed" in log and "step-000000004" in log, log


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"


@pytest.mark.slow
@pytest.mark.long  # two runs of the example on 2 ranks (make test-long)
@pytest.mark.timeout(400)
def test_the_ddp_example_saves_in_the_background_and_a_second_run_resumes_mid_epoch(tmp_path):
    def run(*argv: str) -> str:
        out = subprocess.run(
            [sys.executable, str(EXAMPLE), "--spawn", "2", "--checkpoints", str(tmp_path / "c"),
             "--save-every", "7", *argv],
            capture_output=True, text=True, timeout=180, cwd=tmp_path,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    first = run("--epochs", "1")  # 32 steps: saved at 7, 14, 21 and 28
    assert "resumed" not in first
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "step-000000021", "step-000000028",
    ]  # fmt: skip
    second = run("--epochs", "2")
    # 28 steps of 2 micro-batches done; the epoch's 63 batches per rank leave 7
    assert "resumed at step 28, epoch 0 (7 batches left)" in second, second
    assert "epoch 0: loss" in second and "epoch 1: loss" in second
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "step-000000056", "step-000000063",
    ]  # fmt: skip
