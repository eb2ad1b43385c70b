"""A resumed run draws what the uninterrupted one draws: ``save_state`` keeps the random
state (torch's CPU generator, the accelerator's, Python's ``random``, numpy's) per rank by
default, and the LR scheduler passed in; ``load_state`` restores them. ``rng_state=False``
leaves them out. In one process and on 2 real gloo ranks; on a GPU, its generator too."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import anydevice as ad
from ranks import process_tree_guard, run_ranks

STEPS, SAVED_AT = 6, 3


def _fresh(seed: int, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """What a training script does when it starts (again): seed everything, build."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return net, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _steps(net: nn.Module, opt: torch.optim.Optimizer, sched: object, steps: range,
           device: str = "cpu") -> list[tuple[float, ...]]:  # fmt: skip
    """Steps that draw as training does: an augmentation on the model's device, Python's
    and numpy's jitter, dropout's mask; what each step drew, and the learning rate."""
    drawn = []
    for _ in steps:
        x = torch.rand(4, 8, device=device)
        jitter, flip = random.random(), float(np.random.rand())
        y = net(x * (1 + jitter + flip))
        opt.zero_grad()
        y.pow(2).mean().backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]
        drawn.append((float(x.sum()), jitter, flip, float(y.detach().sum()),
                      opt.param_groups[0]["lr"]))  # fmt: skip
    return drawn


def _weights(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in ad.unwrap(net).parameters()]


def _resumed(path, device: str = "cpu", *, save: dict, load: dict) -> tuple[list, list]:
    """Run to SAVED_AT, save, start again (seeded as at the start), load, run to the end."""
    net, opt, sched = _fresh(0, device)
    _steps(net, opt, sched, range(SAVED_AT), device)
    ad.save_state(path, model=net, optimizer=opt, scheduler=sched, step=SAVED_AT, **save)
    ad.wait_for_saves()
    net, opt, sched = _fresh(0, device)
    extra = ad.load_state(path, model=net, optimizer=opt, scheduler=sched, **load)
    assert extra == {"step": SAVED_AT}
    return _steps(net, opt, sched, range(SAVED_AT, STEPS), device), _weights(net)


def _uninterrupted(device: str = "cpu") -> tuple[list, list]:
    net, opt, sched = _fresh(0, device)
    drawn = _steps(net, opt, sched, range(STEPS), device)
    return drawn[SAVED_AT:], _weights(net)


def test_a_resumed_run_draws_what_the_uninterrupted_run_draws(tmp_path):
    expected, weights = _uninterrupted()
    for how, save in (("blocking", {}), ("background", {"background": True})):
        drawn, got = _resumed(tmp_path / f"{how}.pt", save=save, load={})
        assert drawn == expected, how  # same augmentations, jitter, dropout masks and LR
        assert all(torch.equal(a, b) for a, b in zip(got, weights, strict=True)), how


def test_rng_state_false_leaves_the_random_state_out_and_as_it_is(tmp_path):
    expected, _ = _uninterrupted()
    not_saved, _ = _resumed(tmp_path / "a.pt", save={"rng_state": False}, load={})
    not_loaded, _ = _resumed(tmp_path / "b.pt", save={}, load={"rng_state": False})
    for drawn in (not_saved, not_loaded):
        assert [d[:4] for d in drawn] != [d[:4] for d in expected]  # other draws
        assert [d[4] for d in drawn] == [d[4] for d in expected]  # the scheduler resumed


def test_the_scheduler_and_a_state_dict_passed_the_old_way_both_resume(tmp_path, caplog):
    net, opt, sched = _fresh(0)
    _steps(net, opt, sched, range(2))
    old = ad.save_state(tmp_path / "old.pt", model=net, scheduler=sched.state_dict())
    assert ad.load_state(old, model=net)["scheduler"] == sched.state_dict()  # an extra, as before
    bare = ad.save_state(tmp_path / "bare.pt", model=net)
    fresh = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with caplog.at_level("WARNING", logger="anydevice"):
        ad.load_state(bare, model=net, scheduler=fresh)
    assert "holds no scheduler state" in caplog.text
    with pytest.raises(TypeError, match="LR scheduler"):
        ad.save_state(tmp_path / "x.pt", model=net, scheduler=object())


def _two_ranks(folder):
    def rank(init_method: str) -> dict:
        with ad.distributed(init_method=init_method, timeout=60) as d:
            net, opt, sched = _fresh(d.rank)  # every rank draws its own
            net = ad.prepare(net, strategy="ddp")
            drawn = _steps(net, opt, sched, range(STEPS))
            expected, weights = drawn[SAVED_AT:], _weights(net)
            net, opt, sched = _fresh(d.rank)
            net = ad.prepare(net, strategy="ddp")
            _steps(net, opt, sched, range(SAVED_AT))
            ad.save_state(folder, model=net, optimizer=opt, scheduler=sched, step=SAVED_AT)
            net, opt, sched = _fresh(d.rank)  # the job starts again
            net = ad.prepare(net, strategy="ddp")
            ad.load_state(folder, model=net, optimizer=opt, scheduler=sched)
            resumed = _steps(net, opt, sched, range(SAVED_AT, STEPS))
            return {"same draws": resumed == expected, "drawn": resumed,
                    "same weights": all(torch.equal(a, b) for a, b in
                                        zip(_weights(net), weights, strict=True))}  # fmt: skip

    return rank


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_each_of_two_ranks_resumes_its_own_random_state(tmp_path):
    with process_tree_guard():
        results = run_ranks(_two_ranks(tmp_path / "ckpt"), 2, tmp_path, timeout=150)
    for r, res in enumerate(results):
        assert res["same draws"] and res["same weights"], (r, res)
    assert results[0]["drawn"] != results[1]["drawn"]  # per rank: not one state for all


@pytest.mark.cuda
def test_a_resumed_run_on_a_gpu_draws_what_the_uninterrupted_run_draws(tmp_path, caplog):
    expected, weights = _uninterrupted("cuda")
    drawn, got = _resumed(tmp_path / "gpu.pt", "cuda", save={}, load={})
    assert drawn == expected  # the GPU's generator too: its augmentations and masks
    assert all(torch.equal(a, b) for a, b in zip(got, weights, strict=True))
    # on the CPU, the GPU's state is not restored, and that is said
    net, _, _ = _fresh(0)
    with caplog.at_level("WARNING", logger="anydevice"):
        ad.load_state(tmp_path / "gpu.pt", model=net)
    assert "the random state of cuda:0 was saved, and this model is on the CPU" in caplog.text
