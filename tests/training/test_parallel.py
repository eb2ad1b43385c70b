"""``ad.prepare`` / ``ad.unwrap`` and the loader rebuilt around a DistributedSampler."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn.parallel import DataParallel
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
    WeightedRandomSampler,
    default_collate,
)

import anydevice as ad
from anydevice.training.parallel import device_loader, distributed_loader
from ranks import process_tree_guard, run_ranks


@pytest.fixture(autouse=True)
def no_process_left_behind():
    with process_tree_guard():
        yield


def pairs(batch):
    """A collate_fn the rebuilt loader must keep."""
    return ("custom", default_collate(batch))


def seed_worker(worker_id: int) -> None:
    torch.manual_seed(worker_id)


# ----------------------------------------------------------------------------- world of one


def test_world_of_one_returns_the_users_model_and_optimizer_and_a_device_loader():
    net = nn.Linear(3, 1)
    loader = DataLoader(range(8), batch_size=2, shuffle=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, dl, same_opt = ad.prepare(net, loader, opt, device="cpu")
    assert model is net and same_opt is opt
    assert isinstance(dl, ad.DeviceLoader)
    assert dl.loader is loader  # nothing to shard: the user's DataLoader, wrapped
    assert dl.device == torch.device("cpu")
    assert dl.dataset is loader.dataset and dl.batch_size == 2  # read through
    assert sorted(torch.cat(list(dl)).tolist()) == list(range(8))


@pytest.mark.parametrize(
    "misplaced",
    [
        lambda net: torch.optim.Adam(net.parameters()),
        lambda net: functools.partial(torch.optim.AdamW, lr=1e-3),
    ],
    ids=["optimizer", "optimizer-factory"],
)
def test_an_optimizer_in_the_loader_place_is_refused_naming_optimizer_keyword(misplaced):
    net = nn.Linear(3, 1)
    with pytest.raises(TypeError, match=r"second argument is the loader.*optimizer=opt"):
        ad.prepare(net, misplaced(net))


def test_return_shape_follows_the_arguments():
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert ad.prepare(net) is net
    assert ad.prepare(net, optimizer=opt) == (net, opt)
    loader = DataLoader(range(4))
    model, dl = ad.prepare(net, loader)
    assert model is net and dl.loader is loader


def test_a_device_loader_keeps_its_settings_and_is_not_wrapped_twice():
    def double(b):
        return b * 2

    dl = ad.DeviceLoader(DataLoader(range(4), batch_size=2), "cpu", double, False, depth=3)
    _, same = ad.prepare(nn.Linear(1, 1), dl, device="cpu")
    assert same is dl  # already delivering to this device, nothing to shard
    shard = device_loader(dl, 2, 1, torch.device("cpu"))
    assert shard is not dl and shard.loader is not dl.loader
    assert (shard.transform, shard.prefetch, shard.depth) == (double, False, 3)
    assert [b.tolist() for b in shard] == [[2, 6]]  # rank 1's samples 1 and 3, doubled
    with pytest.raises(ad.DistributedError, match="wraps a list, not a DataLoader"):
        device_loader(ad.DeviceLoader([torch.ones(1)], "cpu"), 2, 0, torch.device("cpu"))


def test_unknown_strategy_is_named():
    with pytest.raises(ValueError, match="strategy='zero3'"):
        ad.prepare(nn.Linear(1, 1), strategy="zero3")


def test_dataparallel_on_cpu_warns_and_does_not_wrap():
    net = nn.Linear(3, 1)
    with pytest.warns(RuntimeWarning, match="silently just call the module"):
        model = ad.prepare(net, strategy="dp", device="cpu")
    assert model is net


def test_optimizer_for_another_model_is_refused():
    other = torch.optim.SGD(nn.Linear(3, 5).parameters(), lr=0.1)
    with pytest.raises(ad.DistributedError, match="made for another model"):
        ad.prepare(nn.Linear(3, 1), optimizer=other)


def test_prepare_outside_the_group_of_a_launched_world_is_refused(monkeypatch):
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ad.DistributedError, match="each rank would train its own copy"):
        ad.prepare(nn.Linear(2, 2))


def test_unwrap_returns_the_user_module_through_wrappers():
    net = nn.Linear(2, 2)
    assert ad.unwrap(net) is net
    assert ad.unwrap(DataParallel(net)) is net  # pass-through on the CPU, still a wrapper
    assert ad.unwrap(torch.compile(DataParallel(net))) is net


# ----------------------------------------------------------------------------- loaders


def test_rebuilt_loader_keeps_every_setting():
    generator = torch.Generator().manual_seed(5)
    loader = DataLoader(
        TensorDataset(torch.arange(20.0)),
        batch_size=3,
        shuffle=True,
        num_workers=2,
        collate_fn=pairs,
        pin_memory=False,
        drop_last=True,
        timeout=30,
        worker_init_fn=seed_worker,
        generator=generator,
        prefetch_factor=3,
        persistent_workers=True,
    )
    shard = distributed_loader(loader, num_replicas=2, rank=1)
    assert isinstance(shard.sampler, DistributedSampler)
    assert (shard.sampler.num_replicas, shard.sampler.rank, shard.sampler.shuffle) == (2, 1, True)
    for name in (
        "dataset", "batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last",
        "timeout", "worker_init_fn", "generator", "prefetch_factor", "persistent_workers",
    ):  # fmt: skip
        assert getattr(shard, name) is getattr(loader, name), name
    batches = list(shard)  # real worker processes
    assert all(tag == "custom" for tag, _ in batches)
    assert len(batches) == 10 // 3  # 10 samples for this rank; the last partial batch dropped


def test_unshuffled_loader_stays_in_order_per_rank():
    shard = distributed_loader(DataLoader(range(10), batch_size=4), num_replicas=3, rank=2)
    assert not shard.sampler.shuffle
    assert torch.cat(list(shard)).tolist() == [2, 5, 8, 1]  # 8 padded by repeating sample 1


def test_one_replica_or_a_loader_already_sharded_for_this_rank_is_kept():
    loader = DataLoader(range(10))
    assert distributed_loader(loader, 1, 0) is loader
    sharded = DataLoader(range(10), sampler=DistributedSampler(range(10), 2, 1))
    assert distributed_loader(sharded, 2, 1) is sharded
    with pytest.raises(ad.DistributedError, match="for rank 1 of 2, but this is rank 0 of 4"):
        distributed_loader(sharded, 4, 0)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize(
    ("loader", "match"),
    [
        (DataLoader(Stream()), "IterableDataset"),
        (DataLoader(range(8), sampler=WeightedRandomSampler([1.0] * 8, 8)), "WeightedRandom"),
        (DataLoader(range(8), batch_sampler=[[0, 1], [2, 3]]), "batch_sampler"),
        (
            DataLoader(range(8), sampler=torch.utils.data.RandomSampler(range(8), True)),
            "replacement",
        ),
    ],
)
def test_loaders_that_cannot_be_sharded_say_why(loader, match):
    with pytest.raises(ad.DistributedError, match=match):
        distributed_loader(loader, 2, 0)


def test_the_shard_sampler_is_torchs_own_and_the_device_loader_advances_it():
    ranks = [
        device_loader(DataLoader(range(12), shuffle=True), 2, r, torch.device("cpu"))
        for r in (0, 1)
    ]
    assert all(type(dl.sampler) is DistributedSampler for dl in ranks)
    epochs = [tuple([b.item() for b in dl] for dl in ranks) for _ in range(3)]
    for a, b in epochs:
        assert sorted(a + b) == list(range(12))  # each epoch: the ranks split the data
    assert len({tuple(a) for a, _ in epochs}) == 3  # and the order changes every epoch
    for e, (a, _) in enumerate(epochs):
        plain = DistributedSampler(range(12), num_replicas=2, rank=0, shuffle=True)
        plain.set_epoch(e)
        assert a == list(plain)  # torch's own order for epoch e


# ----------------------------------------------------------------------------- two ranks


def test_two_ranks_get_ddp_without_device_ids_on_cpu_and_a_sharded_loader(tmp_path):
    def rank(init_method):
        with ad.distributed(init_method=init_method, timeout=30) as d:
            return inspect_ddp(d)

    for r, facts in enumerate(run_ranks(rank, 2, tmp_path)):
        assert facts["type"] == "DistributedDataParallel"
        assert facts["device_ids"] is None
        assert facts["unwrapped"]
        assert facts["optimizer_same"]
        assert facts["again_same"]  # preparing a prepared model leaves it alone
        assert (facts["loader"], facts["inner"]) == ("DeviceLoader", "DataLoader")
        assert (facts["sampler"], facts["rank"], facts["replicas"]) == ("DistributedSampler", r, 2)
        assert facts["batches"] == [[r, r + 2], [r + 4, r + 6]]
        assert "optimizer=opt" in facts["positional_optimizer"]  # not AttributeError: sampler


def inspect_ddp(d):
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = DataLoader(range(8), batch_size=2)
    model, shard, same_opt = ad.prepare(net, loader, opt)
    again = ad.prepare(model)
    try:
        ad.prepare(net, opt)  # the optimizer where the loader goes
        positional = "accepted"
    except Exception as e:
        positional = f"{type(e).__name__}: {e}"
    return {  # the DDP model dies on return, before the group is destroyed
        "type": type(model).__name__,
        "device_ids": model.device_ids,
        "unwrapped": ad.unwrap(model) is net,
        "optimizer_same": same_opt is opt,
        "again_same": again is model,
        "loader": type(shard).__name__,
        "inner": type(shard.loader).__name__,
        "sampler": type(shard.sampler).__name__,
        "rank": shard.sampler.rank,
        "replicas": shard.sampler.num_replicas,
        "batches": [b.tolist() for b in shard],
        "positional_optimizer": positional,
    }


def test_set_epoch_on_the_prepared_loader_reaches_the_sampler_on_every_rank(tmp_path):
    def rank(init_method):
        with ad.distributed(init_method=init_method, timeout=30):
            loader = DataLoader(range(16), batch_size=4, shuffle=True)
            _, dl = ad.prepare(nn.Linear(1, 1), loader)
            next(iter(dl))  # a peek does not use up an epoch
            passes = [torch.cat(list(dl)).tolist() for _ in range(3)]  # epochs 0, 1, 2
            dl.set_epoch(1)
            again = torch.cat(list(dl)).tolist()  # epoch 1 once more
            dl.sampler.set_epoch(3)  # the DDP tutorial's own call, on torch's sampler
            resumed = [torch.cat(list(dl)).tolist() for _ in range(2)]
            return passes, again, resumed, dl.sampler.epoch

    results = run_ranks(rank, 2, tmp_path)
    for r, (passes, again, resumed, epoch) in enumerate(results):
        assert len({tuple(p) for p in passes}) == 3  # a new order each epoch, unasked
        assert again == passes[1]  # set_epoch chose the epoch
        orders = []
        for e in range(4):
            plain = DistributedSampler(range(16), num_replicas=2, rank=r, shuffle=True)
            plain.set_epoch(e)
            orders.append(list(plain))  # torch's own sampler at epoch e
        assert passes == orders[:3]
        assert resumed == [orders[3], orders[3]]  # the user's epoch, kept as torch keeps it
        assert epoch == 3
    for e in range(3):  # the ranks split every epoch between them
        assert sorted(results[0][0][e] + results[1][0][e]) == list(range(16))


def test_ddp_strategy_wraps_even_a_group_of_one_and_auto_does_not(tmp_path):
    def rank(init_method):
        with ad.distributed(init_method=init_method, timeout=30):
            auto = type(ad.prepare(nn.Linear(2, 1))).__name__
            forced = type(ad.prepare(nn.Linear(2, 1), strategy="ddp")).__name__
            return auto, forced

    assert run_ranks(rank, 1, tmp_path) == [("Linear", "DistributedDataParallel")]


def test_dataparallel_in_a_multi_process_world_is_refused(tmp_path):
    def rank(init_method):
        with ad.distributed(init_method=init_method, timeout=30) as d:
            d.barrier()  # both joined before one leaves (else: gloo's connect sees it go)
            try:
                ad.prepare(nn.Linear(2, 1), strategy="dp")
            except ad.DistributedError as e:
                return str(e)
            return "wrapped"

    assert all("one of 2 processes" in m for m in run_ranks(rank, 2, tmp_path))


# ----------------------------------------------------------------------------- GPU


@pytest.mark.cuda
def test_dataparallel_on_one_gpu_gives_the_bare_modules_output():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
    x = torch.randn(64, 16, device="cuda")
    expected = net(x)
    model = ad.prepare(net, strategy="dp", device="cuda:0")
    assert isinstance(model, DataParallel) and model.device_ids[0] == 0
    torch.testing.assert_close(model(x), expected)


@pytest.mark.cuda
def test_optimizer_state_follows_the_model_to_the_gpu():
    net = nn.Linear(4, 2)
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(3, 4)).sum().backward()
    opt.step()  # state on the CPU
    ad.prepare(net, optimizer=opt, device="cuda:0")
    state = opt.state[next(iter(net.parameters()))]
    assert state["exp_avg"].device.type == "cuda"
    assert state["step"].device.type == "cpu"  # torch keeps a non-capturable step on the CPU
    opt.step()  # and the step runs on the GPU


@pytest.mark.cuda
@pytest.mark.real_gpu("an NCCL process group: collectives on the simulated GPUs are refused")
def test_ddp_on_a_gpu_gets_its_device_id(monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    with ad.distributed(timeout=60) as d:
        ids = ad.prepare(nn.Linear(2, 1), strategy="ddp").device_ids  # dropped at once
        assert ids == [d.device.index]
