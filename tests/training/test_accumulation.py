"""Gradient accumulation: ``d.accumulate`` in one process and on two real gloo ranks.

The ranks count the gradient reductions that really ran, as torch's profiler records each
collective the gloo process group executes (``gloo:all_reduce``; FSDP2's reduce-scatter
runs as one on gloo), and compare the weights with one process trained on the whole
batch.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import anydevice as ad
from anydevice.training.accumulation import accumulate, micro_batch_size
from ranks import process_tree_guard, run_ranks

FEATURES, B, N, STEPS, LR = 6, 4, 4, 3, 0.1  # micro-batch b, N per step


@pytest.fixture(autouse=True)
def no_process_left_behind():
    with process_tree_guard():
        yield


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def data(rows: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=g)
    return x, x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(rows, 1, generator=g)


def reference(x: torch.Tensor, y: torch.Tensor, per_step: int, clip: float | None = None):
    """One process, one batch of ``per_step`` rows per optimizer step."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for start in range(0, len(x), per_step):
        opt.zero_grad()
        nn.functional.mse_loss(
            model(x[start : start + per_step]), y[start : start + per_step]
        ).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model.state_dict()


def accumulated(
    source, micro_batches: int, mode: str = "fp32", clip: float | None = None, device="cpu"
):
    """The same model trained through ``accumulate`` and ``ad.precision``."""
    model = net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    p = ad.precision(device, mode)
    facts = {"sizes": [], "scales": []}
    for step in accumulate(model, source, micro_batches=micro_batches):
        for xb, yb in step:
            xb, yb = xb.to(device), yb.to(device)
            with p.autocast():
                loss = nn.functional.mse_loss(model(xb).float(), yb)
            p.backward(step.scale(loss))
        p.unscale_(opt)  # once, after the last micro-batch
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        facts["scales"].append(p.step(opt).scale)
        opt.zero_grad(set_to_none=True)
        facts["sizes"].append(step.size)
    return {k: v.cpu() for k, v in model.state_dict().items()}, facts


def close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for k, v in b.items():
        torch.testing.assert_close(a[k], v, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- one process


def test_n_micro_batches_of_b_give_the_weights_of_one_batch_of_n_times_b():
    x, y = data(STEPS * N * B)
    loader = DataLoader(TensorDataset(x, y), batch_size=B)
    got, facts = accumulated(loader, N)
    assert facts["sizes"] == [N] * STEPS
    close(got, reference(x, y, N * B))
    # and not the weights of N steps of b (the test can tell them apart)
    with pytest.raises(AssertionError):
        close(got, reference(x, y, B))


def test_a_short_last_step_is_the_mean_of_what_is_left_with_or_without_a_length():
    rows = (2 * N + 2) * B  # two full steps and one of 2 micro-batches
    x, y = data(rows)
    want = reference(x, y, N * B)  # the last batch has 2 * B rows
    loader = DataLoader(TensorDataset(x, y), batch_size=B)
    got, facts = accumulated(loader, N)
    assert facts["sizes"] == [N, N, 2]
    close(got, want)

    def no_length() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from loader

    got, facts = accumulated(no_length(), N)  # read ahead; the short step is corrected
    assert facts["sizes"] == [N, N, 2]
    close(got, want)


def test_fp16_scales_the_loss_unscales_once_before_clipping_and_steps_once():
    x, y = data(STEPS * N * B)
    loader = DataLoader(TensorDataset(x, y), batch_size=B)
    got, facts = accumulated(loader, N, mode="fp16", clip=0.5)
    assert all(s is not None and s > 1 for s in facts["scales"])  # a GradScaler ran
    close(got, reference(x, y, N * B, clip=0.5), rtol=2e-2, atol=2e-3)  # fp16 forward


def test_global_batch_and_fit_batch_size_choose_the_micro_batch_and_their_number():
    budget = 40 * FEATURES * 4  # bytes of input a step may hold

    def step(batch_size: int) -> None:
        if batch_size * FEATURES * 4 > budget:
            raise torch.OutOfMemoryError(f"{batch_size} rows do not fit")
        model = net()
        model(torch.randn(batch_size, FEATURES)).sum().backward()

    with ad.distributed() as d:
        fits = ad.fit_batch_size(step, start=8, device="cpu")
        assert fits == 40
        micro = d.micro_batch_size(96, fits=fits)
        assert micro == 32  # the largest divisor of 96 that fits
        x, y = data(2 * 96)
        loader = DataLoader(TensorDataset(x, y), batch_size=micro)
        steps = d.accumulate(net(), loader, global_batch=96)
        assert steps.micro_batches == 3 and len(steps) == 2
    got, facts = accumulated(loader, steps.micro_batches)
    assert facts["sizes"] == [3, 3]
    close(got, reference(x, y, 96))


def test_each_pass_ends_the_loaders_pass_so_a_distributed_sampler_reshuffles():
    def loader() -> ad.DeviceLoader:
        data_ = TensorDataset(torch.arange(24.0))
        sampler = DistributedSampler(data_, num_replicas=1, rank=0, shuffle=True, seed=3)
        return ad.DeviceLoader(DataLoader(data_, batch_size=4, sampler=sampler), device="cpu")

    plain, through = loader(), loader()
    steps = accumulate(net(), through, micro_batches=2)
    orders, want = [], []
    for _ in range(3):
        seen = []
        for step in steps:
            for (xb,) in step:
                seen += xb.tolist()
        orders.append(seen)
        want.append([v for (xb,) in plain for v in xb.tolist()])
    assert orders == want  # the orders of a plain loop over the same loader, epoch by epoch
    assert orders[0] != orders[1] != orders[2]  # a new shuffle every pass
    assert through.sampler.epoch == plain.sampler.epoch == 2


class Lying:
    """An iterable whose len() is not what it gives."""

    def __init__(self, length: int, gives: int) -> None:
        self.length, self.gives = length, gives

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.gives))


def test_a_loader_whose_length_is_wrong_is_named():
    def run(source: Lying) -> list[list[int]]:
        return [list(step) for step in accumulate(nn.Linear(2, 1), source, micro_batches=2)]

    with pytest.warns(UserWarning, match="more batches than its len"):
        run(Lying(4, 6))
    with pytest.raises(ad.StepOrderError, match="ended after 3 batches, but its len"):
        run(Lying(4, 3))


def test_no_loader_gives_endless_steps_of_micro_batch_numbers():
    steps = iter(accumulate(nn.Linear(2, 1), micro_batches=3))
    assert [list(next(steps)) for _ in range(3)] == [[0, 1, 2]] * 3
    with pytest.raises(TypeError, match="no length"):
        len(accumulate(nn.Linear(2, 1), micro_batches=3))


def test_a_step_left_unfinished_is_an_error_not_a_silent_skip():
    steps = iter(accumulate(nn.Linear(2, 1), range(8), micro_batches=4))
    first = next(steps)
    assert next(iter(first)) == 0
    with pytest.raises(ad.StepOrderError, match="left after 1 of its 4"):
        next(steps)
    again = next(iter(accumulate(nn.Linear(2, 1), range(8), micro_batches=4)))
    list(again)
    with pytest.raises(ad.StepOrderError, match="already iterated"):
        iter(again)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one"),
        ({"micro_batches": 2, "global_batch": 8}, "exactly one"),
        ({"micro_batches": 0}, "micro_batches=0"),
        ({"micro_batches": 2.0}, "whole number"),
        ({"global_batch": 100}, "global_batch=100 is not a whole number.*batch size 8"),
        ({"global_batch": 0}, "global_batch=0"),
    ],
)
def test_bad_arguments_name_the_value_and_what_to_do(kwargs, message):
    loader = DataLoader(range(64), batch_size=8)
    with pytest.raises(ad.ArgumentError, match=message):
        accumulate(nn.Linear(2, 1), loader, **kwargs)


def test_an_uneven_global_batch_points_to_the_public_micro_batch_size():
    """The fix it names is public: ``d.micro_batch_size`` on the context, which knows the
    world size (``micro_batch_size`` itself is not in ``anydevice``'s API)."""
    loader = DataLoader(range(64), batch_size=8)
    with pytest.raises(ValueError) as info:
        accumulate(nn.Linear(2, 1), loader, global_batch=100)
    said = str(info.value)
    assert "d.micro_batch_size(100, fits=" in said and "ad.distributed() as d" in said
    assert "a loader batch size of 5" in said  # 100 = 20 x 5
    assert not hasattr(ad, "micro_batch_size")
    with ad.distributed() as d:
        assert d.micro_batch_size(100, fits=8) == 5  # what the message says to call


def test_micro_batch_size_refuses_what_cannot_be_split():
    assert micro_batch_size(512, fits=37, world_size=2) == 32
    assert micro_batch_size(7, fits=3) == 1  # a prime: one sample at a time
    with pytest.raises(ValueError, match="world_size=2"):
        micro_batch_size(9, fits=4, world_size=2)
    with pytest.raises(ValueError, match="fits=0"):
        micro_batch_size(8, fits=0)
    with pytest.raises(ValueError, match="has none"):
        accumulate(nn.Linear(2, 1), range(8), global_batch=8)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["auto", "fp16"])
def test_on_a_gpu_micro_batches_in_mixed_precision_match_one_batch(mode):
    x, y = data(STEPS * N * B)
    loader = DataLoader(TensorDataset(x, y), batch_size=B)
    got, facts = accumulated(loader, N, mode=mode, clip=0.5, device="cuda")
    assert facts["sizes"] == [N] * STEPS
    if mode == "fp16":
        assert all(s is not None and s > 1 for s in facts["scales"])
    close(got, reference(x, y, N * B, clip=0.5), rtol=3e-2, atol=5e-3)  # bf16/fp16 forward


# ----------------------------------------------------------------------------- two ranks


def _reductions(prof: profile) -> int:
    names = collections.Counter(e.name for e in prof.events())
    return names["gloo:all_reduce"]


def _train_on_rank(init_method: str, strategy: str) -> dict:
    with ad.distributed(init_method=init_method, timeout=60) as d:
        x, y = data(STEPS * d.world_size * N * B)
        facts: dict = {}
        for how in ("accumulate", "every micro-batch"):
            # DDP makes rank 0's weights everyone's; FSDP2 shards what each rank holds
            model = net(seed=d.rank if strategy == "ddp" else 0)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            extra = {"precision": "fp32"} if strategy == "fsdp" else {}  # not bf16 gathers
            model, opt = ad.prepare(model, optimizer=opt, strategy=strategy, **extra)
            facts["wrapper"] = type(model).__name__
            p = ad.precision(d.device, "fp32")
            micro = []
            for s in range(STEPS):  # rank r takes its N * B rows of each global batch
                rows = s * d.world_size * N * B + d.rank * N * B
                micro += [
                    (x[rows + m * B : rows + (m + 1) * B], y[rows + m * B : rows + (m + 1) * B])
                    for m in range(N)
                ]
            counts = []
            for step in d.accumulate(model, micro, micro_batches=N):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for xb, yb in step:
                        if how == "every micro-batch":  # the sync a plain loop leaves on
                            _sync_on(model)
                        loss = nn.functional.mse_loss(model(xb), yb)
                        p.backward(step.scale(loss))
                p.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                p.step(opt)
                opt.zero_grad(set_to_none=True)
                counts.append(_reductions(prof))
            facts[how] = counts
            state = model.state_dict()
            if strategy == "fsdp":
                state = {k: v.full_tensor() for k, v in state.items()}
            else:
                state = {k.removeprefix("module."): v for k, v in state.items()}
            facts[f"params {how}"] = {k: v.detach().clone() for k, v in state.items()}
            if strategy == "ddp" and how == "accumulate":
                facts["ddp"] = _ddp_edges(d, model, micro)
            del model, opt
        return facts


def _ddp_edges(d: ad.Distributed, model: nn.Module, micro: list) -> dict:
    """The sync is on again after a pass and after an error mid-step; a model without
    DDP in a world of two is warned about."""
    edges = {"after a pass": model.require_backward_grad_sync}
    try:
        for step in d.accumulate(model, micro, micro_batches=N):
            for i, (xb, _) in enumerate(step):
                edges["inside"] = model.require_backward_grad_sync  # micro-batch 0: off
                if i == 1:
                    raise KeyError("a failing micro-batch")
                model(xb).sum().backward()
    except KeyError:
        edges["after an error"] = model.require_backward_grad_sync
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d.accumulate(ad.unwrap(model), micro, micro_batches=N)
    edges["warned"] = [str(w.message) for w in caught]
    compiled = torch.compile(model)  # not run: only its wrapper is looked through
    edges["compiled syncs"] = d.accumulate(compiled, micro, micro_batches=N).syncs
    return edges


def _sync_on(model: nn.Module) -> None:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model.require_backward_grad_sync = True
    else:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def _ddp_rank(init_method: str) -> dict:
    return _train_on_rank(init_method, "ddp")


def _fsdp_rank(init_method: str) -> dict:
    return _train_on_rank(init_method, "fsdp")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("rank_fn", "wrapper"), [(_ddp_rank, "DistributedDataParallel"), (_fsdp_rank, "FSDPSequential")]
)
def test_two_ranks_reduce_once_per_step_and_match_one_process_on_the_whole_batch(
    rank_fn, wrapper, tmp_path
):
    results = run_ranks(rank_fn, 2, tmp_path, timeout=300)
    x, y = data(STEPS * 2 * N * B)
    want = reference(x, y, 2 * N * B, clip=10.0)
    for facts in results:
        assert facts["wrapper"] == wrapper
        once, every = facts["accumulate"], facts["every micro-batch"]
        # DDP: one bucket, so one all-reduce per step; FSDP2: one reduce-scatter per
        # sharded block per step. Without accumulation, N times as many.
        per_step = once[0]
        assert per_step >= 1
        assert once == [per_step] * STEPS, once
        assert every == [N * per_step] * STEPS, every
        if wrapper == "DistributedDataParallel":
            assert per_step == 1
            edges = facts["ddp"]
            assert edges["inside"] is False
            assert edges["after a pass"] is True and edges["after an error"] is True
            assert any("neither DDP nor sharded" in w for w in edges["warned"]), edges
            assert edges["compiled syncs"] is True
        close(facts["params accumulate"], want)
        close(facts["params every micro-batch"], want)


def test_a_plain_model_in_a_world_of_one_trains_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ad.distributed() as d:
            steps = d.accumulate(net(), [0, 1, 2], micro_batches=2)
            assert not steps.syncs


def _uneven_rank(init_method: str) -> dict:
    out = {}
    with ad.distributed(init_method=init_method, timeout=30) as d:
        model = ad.prepare(net())
        sized = DataLoader(range(16), batch_size=2)
        try:
            accumulate(model, sized, global_batch=8, world_size=1)
        except ad.ArgumentError as e:
            out["world_size"] = str(e)
        batches = [torch.ones(B, FEATURES)] * (6 if d.rank == 0 else 4)  # each its own list
        try:
            for step in d.accumulate(model, batches, micro_batches=2):
                for x in step:
                    step.scale(model(x).sum()).backward()
        except ad.DistributedError as e:
            out["uneven"] = str(e)
        del model
        return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ranks_whose_loaders_differ_in_length_are_told_so_on_every_rank_before_a_step(tmp_path):
    results = run_ranks(_uneven_rank, 2, tmp_path, timeout=120)
    for out in results:
        assert "different numbers of batches this pass (rank 0: 6, rank 1: 4)" in out["uneven"]
        assert "ad.prepare" in out["uneven"]
        assert "world_size=1, but the process group has 2 ranks" in out["world_size"]


PAIRS = DataLoader(range(8), batch_size=2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: accumulate(None, range(4), micro_batches=2), "model=None.*nn.Module"),
        (lambda: accumulate(nn.Linear, range(4), micro_batches=2), "model=.*nn.Module"),
        (lambda: accumulate(net(), 5, micro_batches=2), "loader=5.*iterable of batches"),
        (lambda: accumulate(net(), "abcd", micro_batches=2), "loader='abcd'"),
        (lambda: accumulate(net(), {"x": 1}, micro_batches=2), "loader=.*dict"),
        (lambda: accumulate(net(), range(4), micro_batches=2.0), "micro_batches=2.0"),
        (lambda: accumulate(net(), range(4), micro_batches=True), "micro_batches=True"),
        (lambda: accumulate(net(), PAIRS, global_batch=8, world_size=0), "world_size=0"),
        (lambda: accumulate(net(), PAIRS, global_batch=8, world_size="2"), "world_size='2'"),
        (lambda: accumulate(net(), range(4), micro_batches=2, world_size=-1), "world_size=-1"),
        (lambda: accumulate(net(), PAIRS, global_batch=8.0), "global_batch=8.0"),
        (lambda: micro_batch_size(8, fits=float("nan")), "fits=nan"),
    ],
)
def test_every_bad_argument_is_an_argument_error_naming_it(call, message):
    with ad.distributed(), pytest.raises(ad.ArgumentError, match=message):
        call()
