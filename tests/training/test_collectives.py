"""Collectives in a world of one (no group) and across real forked gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import anydevice as ad
from ranks import process_tree_guard, run_ranks


@pytest.fixture(autouse=True)
def no_process_left_behind():
    with process_tree_guard():
        yield


# ----------------------------------------------------------------------------- world of one


def test_world_of_one_all_reduce_is_the_value_as_a_new_tensor():
    x = torch.tensor([1, 2, 3])
    mean = ad.all_reduce(x)
    assert mean.dtype == torch.get_default_dtype()  # a mean of integers is fractional
    assert mean.tolist() == [1.0, 2.0, 3.0]
    total = ad.all_reduce(x, op="sum")
    assert total.dtype == torch.int64 and total.tolist() == [1, 2, 3]
    total += 1
    assert x.tolist() == [1, 2, 3]  # the input is never written


def test_world_of_one_all_reduce_takes_numbers():
    assert ad.all_reduce(2.5, op="max").item() == 2.5


def test_unknown_op_is_named():
    with pytest.raises(ValueError, match="op='avg'"):
        ad.all_reduce(1.0, op="avg")


def test_world_of_one_gather_and_broadcast_return_the_value():
    obj = {"acc": 0.9}
    assert ad.all_gather(obj) == [obj]
    assert ad.broadcast(obj) is obj
    x = torch.arange(4)
    assert ad.gather_for_metrics(x) is x


def test_world_of_one_broadcast_from_a_missing_rank_is_an_error():
    with pytest.raises(ad.DistributedError, match=r"ranks are 0\.\.0"):
        ad.broadcast(1, src=1)


@pytest.mark.parametrize(
    "call",
    [
        lambda: ad.all_reduce(1.0),
        lambda: ad.all_gather(1),
        lambda: ad.broadcast(1),
        lambda: ad.gather_for_metrics(torch.zeros(2), 2),
    ],
)
def test_several_ranks_without_a_group_refuse_to_answer_alone(monkeypatch, call):
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ad.DistributedError, match="no process group exists"):
        call()


# ----------------------------------------------------------------------------- two ranks


def test_all_reduce_ops_across_ranks(tmp_path):
    def rank(init_method):
        with ad.distributed(init_method=init_method, timeout=30) as d:
            x = torch.tensor([float(d.rank + 1), 10.0 * (d.rank + 1)])
            ops = ("sum", "mean", "max", "min", "product")
            out = {op: ad.all_reduce(x, op=op).tolist() for op in ops}
            out["untouched"] = x.tolist()
            return out

    r0, r1 = run_ranks(rank, 2, tmp_path)
    assert r0 == r1 | {"untouched": r0["untouched"]}
    assert r0["sum"] == [3.0, 30.0]
    assert r0["mean"] == [1.5, 15.0]
    assert (r0["max"], r0["min"], r0["product"]) == ([2.0, 20.0], [1.0, 10.0], [2.0, 200.0])
    assert (r0["untouched"], r1["untouched"]) == ([1.0, 10.0], [2.0, 20.0])


def test_all_gather_tensors_of_different_lengths_and_objects(tmp_path):
    def rank(init_method):
        with ad.distributed(init_method=init_method, timeout=30) as d:
            rows = torch.full((d.rank + 1, 2), d.rank)
            return ad.all_gather(rows), ad.all_gather({"rank": d.rank, "name": f"r{d.rank}"})

    for tensors, objects in run_ranks(rank, 2, tmp_path):
        assert [t.tolist() for t in tensors] == [[[0, 0]], [[1, 1], [1, 1]]]
        assert objects == [{"rank": 0, "name": "r0"}, {"rank": 1, "name": "r1"}]


def test_all_gather_refuses_tensors_that_cannot_stack(tmp_path):
    def rank(init_method):
        with ad.distributed(init_method=init_method, timeout=30) as d:
            try:
                ad.all_gather(torch.zeros(2, 3 + d.rank))
            except ad.DistributedError as e:
                return str(e)
            return "gathered"

    for message in run_ranks(rank, 2, tmp_path):
        assert "all but the first dimension" in message and "(2, 4)" in message


def test_broadcast_tensors_to_ranks_that_pass_none_and_objects(tmp_path):
    def rank(init_method):
        with ad.distributed(init_method=init_method, timeout=30) as d:
            mine = torch.arange(4.0) * 10 if d.rank == 1 else None
            t = ad.broadcast(mine, src=1)
            same_shape = ad.broadcast(torch.full((2,), float(d.rank)), src=0)
            cfg = ad.broadcast({"seed": 1234} if d.is_main else None)
            return t.tolist(), same_shape.tolist(), cfg

    assert (
        run_ranks(rank, 2, tmp_path) == [([0.0, 10.0, 20.0, 30.0], [0.0, 0.0], {"seed": 1234})] * 2
    )


# ----------------------------------------------------------------------------- metrics


@pytest.mark.parametrize(("samples", "world", "shuffle"), [(10, 3, False), (11, 2, True)])
def test_gather_for_metrics_counts_every_sample_once(tmp_path, samples, world, shuffle):
    dataset = list(range(samples))

    def rank(init_method):
        with ad.distributed(init_method=init_method, timeout=30):
            model = torch.nn.Linear(1, 1)
            loader = DataLoader(dataset, batch_size=2, shuffle=shuffle)
            model, loader = ad.prepare(model, loader, strategy="none")  # no DDP needed here
            seen = torch.cat(list(loader))  # what this rank evaluated, in loader order
            naive = torch.cat(ad.all_gather(seen))
            names = [f"s{i}" for i in seen.tolist()]
            ids, copies = ad.gather_for_metrics((seen, names), loader)
            return naive.tolist(), ids.tolist(), copies

    padded = -(-samples // world) * world
    for naive, ids, names in run_ranks(rank, world, tmp_path):
        assert len(naive) == padded > samples  # the sampler repeated some samples...
        assert sorted(ids) == dataset  # ...and gather_for_metrics counts each once
        assert names == [f"s{i}" for i in ids]  # lists come back in the same order
        if not shuffle:
            assert ids == dataset  # in dataset order when the sampler does not shuffle


def test_gather_for_metrics_needs_the_loader_across_ranks(tmp_path):
    def rank(init_method):
        with ad.distributed(init_method=init_method, timeout=30):
            try:
                ad.gather_for_metrics(torch.zeros(3))
            except ad.DistributedError as e:
                return str(e)
            return "gathered"

    assert all("gather_for_metrics(x, loader)" in m for m in run_ranks(rank, 2, tmp_path))
