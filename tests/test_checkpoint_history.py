"""Checkpoints that do not stall and a folder of them: ``keep=`` keeps the newest k,
``latest_in=`` resumes the newest complete one, ``background=True`` writes while training
goes on — its error surfacing at the next call, a SIGKILL mid-write (a real process)
leaving the previous checkpoint loadable."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

import anydevice as ad


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
    with pytest.raises(ad.CheckpointError, match="no complete checkpoint"):
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
