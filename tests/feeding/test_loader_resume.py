"""Resuming a loader mid-epoch: the same epoch goes on at the next batch, in the same
order, skipping at the sampler where it can (nothing loaded for what was seen); with
DataLoader workers, a DistributedSampler on two real gloo ranks, and a real SIGTERM."""

from __future__ import annotations

import functools
import os
import signal

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import anydevice as ad
from ranks import process_tree_guard, run_ranks

N, BATCH = 20, 3


class Counted(Dataset):
    """A map-style dataset that remembers which items were loaded (in this process)."""

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loaded.append(i)
        return torch.tensor([float(i)])


def _loader(seed: int, dataset: Dataset | None = None, **kw) -> ad.DeviceLoader:
    data = dataset if dataset is not None else TensorDataset(torch.arange(float(N)))
    g = torch.Generator().manual_seed(seed)
    return ad.DeviceLoader(DataLoader(data, batch_size=BATCH, shuffle=True, generator=g, **kw),
                           "cpu")  # fmt: skip


def _values(batch) -> list[float]:
    return (batch[0] if isinstance(batch, list) else batch).flatten().tolist()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_pass_goes_on_at_the_next_batch_in_the_same_order(workers):
    whole = [_values(b) for b in _loader(3, num_workers=workers)]
    first = _loader(3, num_workers=workers)
    it = iter(first)
    seen = [_values(next(it)) for _ in range(3)]
    state = first.state_dict()
    assert (state["position"], state["epoch"]) == (3, 0)
    del it
    resumed = _loader(99, num_workers=workers)  # another seed: the saved generator decides
    resumed.load_state_dict(state)
    assert len(resumed) == len(whole) - 3
    rest = [_values(b) for b in resumed]
    assert seen + rest == whole
    assert len(resumed) == len(whole)  # the next pass is whole again


def test_skipping_happens_at_the_sampler_so_seen_items_are_not_loaded():
    data = Counted()
    first = _loader(5, data)
    it = iter(first)
    seen = [_values(next(it)) for _ in range(4)]
    state = first.state_dict()
    again = Counted()
    resumed = _loader(5, again)
    resumed.load_state_dict(state)
    rest = [_values(b) for b in resumed]
    assert sorted(v for b in seen + rest for v in b) == [float(i) for i in range(N)]
    assert sorted(again.loaded) == sorted(int(v) for b in rest for v in b)  # no seen item
    assert resumed.loader.batch_sampler.sampler is resumed.loader.sampler  # put back


def test_a_source_without_a_sampler_is_skipped_by_hand():
    batches = [torch.full((2,), float(i)) for i in range(6)]
    first = ad.DeviceLoader(batches, "cpu")
    it = iter(first)
    next(it), next(it)
    resumed = ad.DeviceLoader(batches, "cpu")
    resumed.load_state_dict(first.state_dict())
    assert [float(b[0]) for b in resumed] == [2.0, 3.0, 4.0, 5.0]


def test_save_state_and_load_state_carry_the_loader(tmp_path, caplog):
    net = torch.nn.Linear(1, 1)
    first = _loader(7)
    it = iter(first)
    seen = [_values(next(it)) for _ in range(2)]
    path = ad.save_state(tmp_path / "ckpt.pt", model=net, loader=first, step=2)
    resumed = _loader(0)
    assert ad.load_state(path, model=net, loader=resumed) == {"step": 2}  # no loader entry
    assert seen + [_values(b) for b in resumed] == [_values(b) for b in _loader(7)]
    bare = ad.save_state(tmp_path / "bare.pt", model=net)
    ad.load_state(bare, model=net, loader=_loader(0))
    assert "no loader state" in caplog.text
    with pytest.raises(TypeError, match="ad.DeviceLoader"):
        ad.save_state(tmp_path / "x.pt", model=net, loader=[1, 2])
    with pytest.raises(ValueError, match="lacks"):
        _loader(0).load_state_dict({"epoch": 1})


# ----------------------------------------------------------------------------- two ranks

STEPS = 8  # batches per rank per epoch


def _job(folder, stop_at: int | None):
    """Two ranks train one epoch over a DistributedSampler; with ``stop_at``, rank 0 sends
    rank 1 a real SIGTERM after that many steps, every rank saves (loader included) and
    exits; without, the run resumes from the checkpoint if there is one."""

    def rank(init_method: str) -> dict:
        out: dict = {"losses": [], "batches": []}
        torch.manual_seed(0)

        def save() -> None:
            ad.save_state(folder / "ckpt", model=net, optimizer=opt, loader=loader)

        try:
            with ad.distributed(init_method=init_method, timeout=30, on_preempt=save) as d:
                data = TensorDataset(torch.arange(float(2 * STEPS * 2)).unsqueeze(1))
                net, loader, opt = ad.prepare(
                    torch.nn.Linear(1, 1),
                    DataLoader(data, batch_size=2, shuffle=True),
                    functools.partial(torch.optim.SGD, lr=0.01),
                    strategy="ddp",
                )
                if stop_at is None and (folder / "ckpt").exists():
                    ad.load_state(folder / "ckpt", model=net, optimizer=opt, loader=loader)
                out["left"] = len(loader)
                pids = ad.all_gather(os.getpid())
                for s, (x,) in enumerate(loader):
                    opt.zero_grad()
                    loss = (net(x) - 2 * x).pow(2).mean()
                    loss.backward()
                    opt.step()
                    out["losses"].append(float(ad.all_reduce(loss.detach(), op="sum")))
                    out["batches"].append(x.flatten().tolist())
                    if stop_at is not None and d.rank == 0 and s + 1 == stop_at:
                        os.kill(pids[1], signal.SIGTERM)  # only rank 1 is told
                    d.check_preemption()
        except SystemExit as e:
            out["exit"] = e.code
        return out

    return rank


@pytest.mark.slow
@pytest.mark.timeout(420)  # three two-rank runs, one after another, on a loaded machine
def test_a_job_preempted_mid_epoch_resumes_at_the_next_batch_with_the_same_losses(tmp_path):
    with process_tree_guard():
        for name in ("a", "b", "c", "whole", "stopped", "resumed"):
            (tmp_path / name).mkdir()
        whole = run_ranks(_job(tmp_path / "a", None), 2, tmp_path / "whole", timeout=120)
        stopped = run_ranks(_job(tmp_path / "b", 3), 2, tmp_path / "stopped", timeout=120)
        assert all(r["exit"] == 128 + signal.SIGTERM for r in stopped), stopped
        done = len(stopped[0]["losses"])
        assert done in (3, 4) and all(len(r["losses"]) == done for r in stopped)
        os.replace(tmp_path / "b" / "ckpt", tmp_path / "c" / "ckpt")
        resumed = run_ranks(_job(tmp_path / "c", None), 2, tmp_path / "resumed", timeout=120)
    for r_whole, r_stop, r_res in zip(whole, stopped, resumed, strict=True):
        assert r_res["left"] == STEPS - done
        assert r_stop["batches"] + r_res["batches"] == r_whole["batches"]
        assert r_stop["losses"] + r_res["losses"] == pytest.approx(r_whole["losses"], rel=1e-6)
