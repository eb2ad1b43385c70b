"""``ad.share``: processes really update one set of parameters (Hogwild)."""

from __future__ import annotations

import multiprocessing as mp
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import anydevice as ad
from ranks import process_tree_guard

ROOT = Path(__file__).resolve().parents[2]
STEPS, LR = 25, 0.5


@pytest.fixture(autouse=True)
def no_process_left_behind():
    with process_tree_guard():
        yield


def test_share_puts_parameters_and_buffers_in_shared_memory():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    assert ad.share(net) is net
    assert all(t.is_shared() for t in (*net.parameters(), *net.buffers()))


def test_share_drops_gradients_each_process_must_own():
    net = nn.Linear(3, 1)
    net(torch.ones(2, 3)).sum().backward()
    ad.share(net)
    assert all(p.grad is None for p in net.parameters())


def test_share_refuses_a_model_off_the_cpu():
    with pytest.raises(ad.DistributedError, match="on meta"):
        ad.share(nn.Linear(2, 2, device="meta"))


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(2))
        for h in self.heads:
            nn.init.zeros_(h.weight)


def climb(rank: int, model: TwoHeads, first_done, seen) -> None:
    """Worker ``rank`` trains only head ``rank``: each SGD step adds exactly LR to it."""
    head = model.heads[rank]
    optimizer = torch.optim.SGD(head.parameters(), lr=LR)
    if rank == 1:
        first_done.wait(60)
        seen.put(model.heads[0].weight.item())  # head 0, as worker 0 left it
    for _ in range(STEPS):
        optimizer.zero_grad()
        (-head(torch.ones(1, 1))).sum().backward()  # gradient -1
        optimizer.step()
    if rank == 0:
        first_done.set()


def test_several_processes_update_one_shared_set_of_parameters():
    model = ad.share(TwoHeads())
    ctx = mp.get_context("fork")
    first_done, seen = ctx.Event(), ctx.SimpleQueue()
    workers = [ctx.Process(target=climb, args=(r, model, first_done, seen)) for r in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    alive = [w for w in workers if w.is_alive()]
    for w in alive:
        w.kill()
    assert not alive and [w.exitcode for w in workers] == [0, 0]
    # Both processes wrote into the parent's tensors...
    assert model.heads[0].weight.item() == pytest.approx(STEPS * LR)
    assert model.heads[1].weight.item() == pytest.approx(STEPS * LR)
    # ...and worker 1 read worker 0's updates from the same memory.
    assert seen.get() == pytest.approx(STEPS * LR)


@pytest.mark.slow
def test_hogwild_example_trains_the_shared_model():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hogwild.py"), "--steps", "60",
         "--start-method", "fork"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    before = float(re.search(r"before: accuracy ([0-9.]+)", out.stdout).group(1))
    after = float(re.search(r"after 2 x 60 steps: accuracy ([0-9.]+)", out.stdout).group(1))
    assert after > max(0.8, before + 0.2), out.stdout
