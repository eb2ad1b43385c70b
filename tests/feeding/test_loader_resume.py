"""Resuming a loader mid-epoch: the same epoch goes on at the next batch, in the same
order, skipping at the sampler where it can (nothing loaded for what was seen); with
DataLoader workers, a DistributedSampler on two real gloo ranks, and a real SIGTERM."""

from __future__ import annotations

import functools
import os
import signal
import warnings
from typing import Any

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


# ------------------------------------------------------------------ every kind of order

EPOCHS, SAMPLES = 3, 24
#: kinds of loop: the sampler, and whether the loop sets the epoch itself
KINDS = ["distributed-auto", "distributed-explicit", "generator", "no-generator"]
#: (workers, persistent_workers, prefetch)
FEEDS = [(0, False, False), (0, False, True), (2, False, True), (2, True, False)]


def _order_loader(kind: str, workers: int, persistent: bool, prefetch: bool, seed: int):
    from anydevice.training.parallel import distributed_loader

    data = TensorDataset(torch.arange(SAMPLES))
    kw = {"batch_size": 4, "num_workers": workers, "persistent_workers": persistent}
    if kind.startswith("distributed"):  # what ad.prepare builds for rank 0 of 2
        dl = distributed_loader(DataLoader(data, shuffle=True, **kw), 2, 0)
    elif kind == "generator":
        dl = DataLoader(data, shuffle=True, generator=torch.Generator().manual_seed(seed), **kw)
    else:
        dl = DataLoader(data, shuffle=True, **kw)
    return ad.DeviceLoader(dl, "cpu", prefetch=prefetch)


def _loop(loader, kind: str, start: int, stop: tuple[int, int] | None = None):
    """The training loop: sample ids seen per epoch, and where ``stop`` says (epoch,
    batches done in it; ``(e, 0)`` is after epoch e - 1's pass ended), a checkpoint as
    ``ad.save_state`` writes it (through torch.save, read back weights-only) with the
    global RNG and the loop's epoch, as the README's loop saves it."""
    seen: dict[int, list[int]] = {}
    for epoch in range(start, EPOCHS):
        if stop == (epoch, 0):
            return seen, _checkpoint(loader, epoch)
        if kind == "distributed-explicit":
            loader.set_epoch(epoch)
        for k, (x,) in enumerate(loader, 1):
            seen.setdefault(epoch, []).extend(x.tolist())
            torch.rand(1)  # the step draws from the global RNG too (dropout, augmentation)
            if stop == (epoch, k):
                return seen, _checkpoint(loader, epoch)
    return seen, None


def _checkpoint(loader, epoch: int) -> dict:
    import io

    buffer = io.BytesIO()
    torch.save({"loader": loader.state_dict(), "rng": torch.get_rng_state(), "epoch": epoch},
               buffer)  # fmt: skip
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _repeated_and_skipped(seen: list[int], expected: list[int]) -> tuple[int, int]:
    import collections

    counts = collections.Counter(seen)
    repeated = sum(c - 1 for c in counts.values() if c > 1)
    return repeated, len(set(expected) - set(counts))


def _resumed(kind, feed, stop, restore_rng: bool = True) -> dict[int, list[int]]:
    torch.manual_seed(0)
    seen, saved = _loop(_order_loader(kind, *feed, seed=0), kind, 0, stop)
    assert saved is not None
    torch.manual_seed(12345)  # a new process: another global RNG, another generator seed
    resumed = _order_loader(kind, *feed, seed=99)
    resumed.load_state_dict(saved["loader"])
    if restore_rng:
        torch.set_rng_state(saved["rng"])
    rest, _ = _loop(resumed, kind, saved["epoch"])
    return {e: seen.get(e, []) + rest.get(e, []) for e in range(EPOCHS)}


@pytest.mark.parametrize("feed", FEEDS, ids=lambda f: f"workers{f[0]}-persist{f[1]}-pf{f[2]}")
@pytest.mark.parametrize("kind", KINDS)
def test_a_resume_at_any_point_repeats_and_skips_nothing_and_keeps_the_order(kind, feed):
    torch.manual_seed(0)
    whole, _ = _loop(_order_loader(kind, *feed, seed=0), kind, 0)
    per_epoch = len(whole[0]) // 4
    # mid-epoch in every epoch, at an epoch's last batch, between epochs
    stops = [(0, 1), (1, 2), (2, per_epoch - 1), (0, per_epoch), (1, 0)]
    if feed[0]:
        stops = stops[1:4]  # worker processes make each pass slow: fewer points
    for stop in stops:
        got = _resumed(kind, feed, stop)
        for epoch in range(EPOCHS):
            counts = _repeated_and_skipped(got[epoch], whole[epoch])
            assert counts == (0, 0), f"stopped at {stop}: epoch {epoch} (repeated, skipped)"
        assert got == whole, f"stopped at {stop}: another order"


def test_without_a_generator_or_the_rng_restored_each_epoch_is_still_whole():
    feed = FEEDS[0]
    torch.manual_seed(0)
    whole, _ = _loop(_order_loader("no-generator", *feed, seed=0), "no-generator", 0)
    got = _resumed("no-generator", feed, (1, 2), restore_rng=False)
    assert got[1] == whole[1]  # the resumed epoch: the saved seed's order
    for epoch in range(EPOCHS):
        assert _repeated_and_skipped(got[epoch], whole[epoch]) == (0, 0)


def test_a_sampler_that_draws_from_the_global_rng_warns_on_resume_and_names_the_fix():
    from torch.utils.data import SubsetRandomSampler

    data = TensorDataset(torch.arange(float(N)))

    def make(generator=None):
        sampler = SubsetRandomSampler(range(N), generator=generator)
        return ad.DeviceLoader(DataLoader(data, batch_size=2, sampler=sampler), "cpu")

    first = make()
    it = iter(first)
    next(it), next(it)
    with pytest.warns(UserWarning, match=r"global RNG.*generator=torch\.Generator\(\)"):
        make().load_state_dict(first.state_dict())
    own = make(torch.Generator().manual_seed(1))
    it = iter(own)
    seen = [v for _ in range(3) for v in _values(next(it))]
    state = own.state_dict()
    again = make(torch.Generator().manual_seed(7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.load_state_dict(state)
        rest = [v for b in again for v in _values(b)]
    assert sorted(seen + rest) == [float(i) for i in range(N)]


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


# ------------------------------------------------- the README's loop on two ranks, stopped

RANK_SAMPLES = 24  #: 12 per rank: 6 batches of 2, 3 steps of 2 micro-batches per epoch
#: (loop, step after which it stops): at epoch 0's last step, mid epoch 1, mid epoch 2 —
#: for the README's loop (accumulate, automatic epochs) and the DDP tutorial's (set_epoch
#: by hand, one batch a step)
STOPS = [("readme", 3), ("readme", 4), ("readme", 8), ("tutorial", 6), ("tutorial", 8)]


def _rank_loop(d, folder, loop: str, stop: int | None) -> dict:
    """Train ``EPOCHS`` epochs from ``folder``'s checkpoint if there is one; with ``stop``,
    save after that many optimizer steps and stop, as a killed job's last checkpoint."""
    torch.manual_seed(0)
    data = TensorDataset(torch.arange(float(RANK_SAMPLES)).unsqueeze(1))
    model, loader, opt = ad.prepare(
        torch.nn.Linear(1, 1),
        DataLoader(data, batch_size=2, shuffle=True),
        functools.partial(torch.optim.SGD, lr=0.01),
    )
    state = {"model": model, "optimizer": opt, "loader": loader}
    start, n = 0, 0
    if stop is None and (folder / "ckpt").exists():
        extra = ad.load_state(folder / "ckpt", **state)
        start, n = extra["epoch"], extra["step"]
    seen: dict[int, list[int]] = {}
    for epoch in range(start, EPOCHS):
        if loop == "tutorial":
            loader.set_epoch(epoch)
            steps: Any = ([batch] for batch in loader)  # one batch a step
        else:
            steps = d.accumulate(model, loader, micro_batches=2)
        for step in steps:
            for (x,) in step:
                seen.setdefault(epoch, []).extend(int(v) for v in x.flatten())
                loss = (model(x) - 2 * x).pow(2).mean()
                (step.scale(loss) if loop == "readme" else loss).backward()
            opt.step()
            opt.zero_grad()
            n += 1
            if n == stop:
                ad.save_state(folder / "ckpt", **state, epoch=epoch, step=n)
                return {"seen": seen}
    weights = {k: v.detach().clone() for k, v in ad.unwrap(model).state_dict().items()}
    del model, opt  # before the group ends
    return {"seen": seen, "weights": weights}


def _stopped_runs(tmp, stopped: bool):
    def rank(init_method: str) -> dict:
        out = {}
        with ad.distributed(init_method=init_method, timeout=60) as d:
            for loop in ("readme", "tutorial"):
                out[loop] = _rank_loop(d, tmp / loop, loop, None)  # the uninterrupted runs
            for loop, stop in STOPS:
                out[(loop, stop)] = _rank_loop(d, tmp / f"{loop}{stop}", loop,
                                               stop if stopped else None)  # fmt: skip
        return out

    return rank


@pytest.mark.slow
@pytest.mark.timeout(420)  # two two-rank runs of 7 loops each, on a loaded machine
def test_two_ranks_stopped_anywhere_resume_in_new_processes_repeating_and_skipping_nothing(
    tmp_path,
):
    for loop, stop in [("readme", None), ("tutorial", None), *STOPS]:
        (tmp_path / f"{loop}{stop or ''}").mkdir()
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    with process_tree_guard():
        first = run_ranks(_stopped_runs(tmp_path, True), 2, tmp_path / "first", timeout=300)
        again = run_ranks(_stopped_runs(tmp_path, False), 2, tmp_path / "second", timeout=300)
    everyone = range(RANK_SAMPLES)
    for loop, stop in STOPS:
        whole = [first[r][loop] for r in range(2)]
        parts = [(first[r][(loop, stop)], again[r][(loop, stop)]) for r in range(2)]
        for epoch in range(EPOCHS):
            got = [i for before, after in parts for part in (before, after)
                   for i in part["seen"].get(epoch, [])]  # fmt: skip
            counts = _repeated_and_skipped(got, list(everyone))
            assert counts == (0, 0), f"{loop} stopped after step {stop}: epoch {epoch}"
        for r in range(2):
            before, after = parts[r]
            joined = {e: before["seen"].get(e, []) + after["seen"].get(e, [])
                      for e in range(EPOCHS)}  # fmt: skip
            assert joined == whole[r]["seen"], f"{loop} stopped after step {stop}: rank {r}"
            for key, value in after["weights"].items():
                torch.testing.assert_close(value, whole[r]["weights"][key], rtol=0, atol=0)


def test_bad_states_are_argument_errors_at_the_call_naming_the_key_and_what_to_do():
    first = _loader(3)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    del it
    cases = [
        (None, "must be a dict, not NoneType"),
        ({"epoch": 1}, r"lacks \['position'\]"),
        ({**state, "epoch": "3"}, r"state\['epoch'\]='3' is not a whole number"),
        ({**state, "position": -1}, r"state\['position'\]=-1 is below 0"),
        ({**state, "position": 10**9}, "epoch has 7 batches: resuming would skip every"),
        ({**state, "started": 1}, r"state\['started'\]=1 must be True or False"),
        ({**state, "generator": torch.zeros(5)}, "torch.float32 tensor, not a generator's state"),
        ({**state, "generator": torch.zeros(9, dtype=torch.uint8)}, "not a valid state"),
        ({**state, "samples": N + 1}, f"dataset of {N + 1} samples, but this one has .* {N}"),
        ({**state, "sampler": "DistributedSampler"}, "a DistributedSampler sampler"),
        ({**state, "batch_size": 2}, "samples seen are not a whole number"),
        ({**state, "colour": "red"}, r"unknown keys \['colour'\]"),
    ]
    for bad, message in cases:
        loader = _loader(3)
        with pytest.raises(ad.ArgumentError, match=message) as info:
            loader.load_state_dict(bad)
        assert "state_dict()" in str(info.value) or "load it with" in str(info.value)
        assert [_values(b) for b in loader] == [_values(b) for b in _loader(3)]  # untouched
    plain = DataLoader(TensorDataset(torch.arange(float(N))), batch_size=BATCH, shuffle=True)
    without_generator = ad.DeviceLoader(plain, "cpu")
    with pytest.raises(ad.ArgumentError, match="sampler has none"):
        without_generator.load_state_dict(state)

    def endless_but_short():
        yield from (torch.zeros(1) for _ in range(3))

    short = ad.DeviceLoader(endless_but_short(), "cpu")
    short.load_state_dict({**state, "sampler": None, "samples": None, "batch_size": None,
                           "generator": None, "position": 5})  # fmt: skip
    with pytest.raises(ad.ArgumentError, match="ended after 3 batches"):
        next(iter(short))


def test_a_state_resumes_on_another_batch_size_where_the_samples_seen_make_whole_batches():
    first = _loader(3)
    it = iter(first)
    seen = [v for _ in range(2) for v in _values(next(it))]  # 6 samples: 2 batches of 3
    state = first.state_dict()
    del it
    data = TensorDataset(torch.arange(float(N)))
    g = torch.Generator()  # any seed: the state's generator decides
    halves = ad.DeviceLoader(DataLoader(data, batch_size=2, shuffle=True, generator=g), "cpu")
    halves.load_state_dict(state)
    assert len(halves) == (N - 6) // 2
    rest = [v for b in halves for v in _values(b)]
    assert seen + rest == [v for b in _loader(3) for v in _values(b)]


def test_a_resumed_pass_in_another_epoch_than_the_states_warns():
    loader = sharded_loader()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    again = sharded_loader()
    again.load_state_dict({**state, "epoch_is_users": True})
    again.set_epoch(4)
    with pytest.warns(UserWarning, match=r"runs epoch 4, but .* epoch 0.*set_epoch\(0\)"):
        next(iter(again))


def sharded_loader() -> ad.DeviceLoader:
    from anydevice.training.parallel import distributed_loader

    dl = DataLoader(TensorDataset(torch.arange(float(N))), batch_size=2, shuffle=True)
    return ad.DeviceLoader(distributed_loader(dl, 2, 1), "cpu")
