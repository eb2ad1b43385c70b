"""DeviceLoader on a real GPU: ordering, memory, overlap (``cuda`` marker).

Each test widens the race window with torch.cuda._sleep so an ordering bug shows up as a
wrong value, and checks results bit-exactly against the CPU. The memory tests first check
that the allocator really did hand a freed batch's block to a later copy: without that
reuse, nothing could have gone wrong and the test would prove nothing.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import anydevice as ad
from anydevice.feeding.streams import copy_stream
from anydevice.feeding.transfer import pin_leaves

pytestmark = pytest.mark.cuda

N = 1 << 18  # floats per sample
#: Why the overlap tests need a physical GPU (benchmarks/bench_sim_overlap.py measures the
#: loader's overlap on the simulated one).
SPEED = "compares a GPU's copy and matmul times (128 MiB batches, 4096² matmuls)"


def batches(n: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 1000, (N,), generator=g).float() for _ in range(n)]


def test_batches_are_complete_under_a_slow_side_stream():
    data = batches()
    expected = [b.sum().item() for b in data]

    def slow(b):
        torch.cuda._sleep(2_000_000)  # on the side stream, after the copy was queued
        return b * 1

    loader = ad.DeviceLoader(data, "cuda", transform=slow)
    got = [b.sum().item() for b in loader]
    assert got == expected


def test_consumer_reads_are_not_overwritten_by_reused_memory():
    data = batches()
    expected = [b.sum().item() for b in data]
    loader = ad.DeviceLoader(data, "cuda")
    totals, blocks = [], []
    for b in loader:
        blocks.append(b.data_ptr())
        torch.cuda._sleep(3_000_000)  # the consumer's read of b stays queued...
        totals.append(b.sum())
        del b  # ...while b's block is freed and the next copy may want it
    assert len(set(blocks)) < len(blocks), "no block was reused: the test proves nothing"
    assert [t.item() for t in totals] == expected


def test_a_consumer_on_another_stream_reads_complete_batches_and_keeps_their_memory():
    data = batches()
    expected = [b.sum().item() for b in data]

    def slow(b):
        torch.cuda._sleep(2_000_000)  # the copy stream is late: reads must wait for it
        return b * 1

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the loop runs on `side`: batches are ready there
        got = []
        for b in ad.DeviceLoader(data, "cuda", transform=slow):
            torch.cuda._sleep(3_000_000)  # `side` reads late...
            got.append(b.sum())
            del b  # ...a block freed now: the copy stream, waiting for nothing on `side`,
            # would reuse it at once unless the allocator holds it for `side`
        got = [t.item() for t in got]  # item() waits for `side`
    assert got == expected


def test_batches_read_on_alternating_streams_are_never_overwritten():
    # Batch k is read on the default stream, batch k+1 on another, and so on: the copy
    # issued while one stream is current must not reuse a block the other still reads.
    data = batches()
    expected = [b.sum().item() for b in data]
    side = torch.cuda.Stream()
    it = iter(ad.DeviceLoader(data, "cuda"))
    totals = []
    for k in range(len(data)):
        with torch.cuda.stream(side) if k % 2 else contextlib.nullcontext():
            b = next(it)
            torch.cuda._sleep(3_000_000)
            totals.append(b.sum())
            del b
    assert next(it, None) is None
    torch.cuda.current_stream().wait_stream(side)
    assert [t.item() for t in totals] == expected


def test_two_loaders_on_one_device_share_the_copy_stream_and_stay_correct():
    a = batches(12)
    b = [x.neg() for x in a]
    sums = []
    for x, y in zip(ad.DeviceLoader(a, "cuda"), ad.DeviceLoader(b, "cuda"), strict=True):
        torch.cuda._sleep(1_000_000)
        sums.append((x.sum(), y.sum()))
        del x, y
    assert [(p.item(), q.item()) for p, q in sums] == [
        (x.sum().item(), y.sum().item()) for x, y in zip(a, b, strict=True)
    ]
    dev = torch.device("cuda", torch.cuda.current_device())
    assert copy_stream(dev) is copy_stream(dev)
    with ad.side_stream(dev) as side:
        assert side != copy_stream(dev)  # user work on side_stream() never delays copies


@dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


def test_a_batch_mixing_gpu_and_cpu_tensors_and_a_dataclass_arrives_whole():
    # torch's own pin_memory() raises on the CUDA tensor ("only dense CPU tensors can be
    # pinned") and leaves the dataclass pageable; pinning leaf by leaf does neither.
    w = torch.ones(3, device="cuda")
    data = [
        {
            "w": w,
            "x": torch.full((N,), float(i)),
            "pair": Pair(torch.arange(4.0) + i, torch.tensor([i])),
        }
        for i in range(6)
    ]
    loader = ad.DeviceLoader(data, "cuda")
    for i, b in enumerate(loader):
        assert b["w"] is w
        assert b["x"].is_cuda and b["x"][0].item() == float(i)
        assert isinstance(b["pair"], Pair) and b["pair"].x.is_cuda
        assert b["pair"].x.tolist() == [i + 0.0, i + 1.0, i + 2.0, i + 3.0]
    assert loader.stats.pinned is False  # they came pageable; the loader pinned them
    assert loader.stats.bytes_moved == 6 * (N * 4 + 4 * 4 + 8)
    dev = torch.device("cuda", torch.cuda.current_device())
    out, _, already = pin_leaves(data[0], dev)
    assert not already and out["w"] is w
    assert out["x"].is_pinned() and out["pair"].x.is_pinned() and out["pair"].y.is_pinned()
    again, _, already = pin_leaves(out, dev)
    assert already and again["x"] is out["x"]


def test_pinned_and_pageable_sources_and_dataloader_workers_agree():
    ds = TensorDataset(torch.arange(4096.0).view(256, 16))
    expected = [b[0].sum().item() for b in DataLoader(ds, batch_size=32)]
    for kw in ({"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "pin_memory": True}):
        loader = ad.DeviceLoader(DataLoader(ds, batch_size=32, **kw), "cuda")
        got = [b[0].sum().item() for b in loader]
        assert got == expected, kw
        assert loader.stats.bytes_moved == 4096 * 4
        assert loader.stats.bandwidth is not None


def test_without_prefetch_next_pins_and_does_not_wait_for_the_queued_compute():
    # prefetch=False reads the source on this thread. A copy from pageable memory would
    # hold the host until the compute queued before it and the copy itself were done
    # (64 MiB is far more than the driver's staging buffer); pinned here, the copy is
    # queued and next() returns while that compute still runs.
    data = [torch.full((1 << 24,), float(i)) for i in range(3)]  # pageable, 64 MiB each
    loader = ad.DeviceLoader(data, "cuda", prefetch=False)
    it = iter(loader)
    got = [next(it)]  # also fills the pinned-memory cache, reused by the next batches
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of compute on the consumer's stream
    got.append(next(it))
    computing = not torch.cuda.current_stream().query()
    got.append(next(it))
    torch.cuda.synchronize()
    assert computing, "next() waited for the compute queued before it"
    assert [b.device.type for b in got] == ["cuda"] * 3
    assert [(b.min().item(), b.max().item()) for b in got] == [(0, 0), (1, 1), (2, 2)]
    assert loader.stats.pinned is False  # what the source delivered
    assert loader.stats.bytes_moved == 3 * (4 << 24)


def test_reserved_memory_is_flat_with_a_loader_built_every_epoch():
    # A common loop (and the gpu_loader benchmark's): a new DeviceLoader per epoch. A new
    # stream per loader would strand each epoch's cached blocks in its own pool.
    data = batches(8)
    reserved = []
    for _ in range(40):
        for b in ad.DeviceLoader(data, "cuda"):
            b.mul_(2)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[2], reserved


def test_reserved_memory_is_flat_over_fifty_epochs():
    loader = ad.DeviceLoader(batches(8), "cuda")
    reserved = []
    for _ in range(50):
        for b in loader:
            b.mul_(2)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[2], reserved


def overlap_case():
    # Copy and compute of comparable length: 128 MiB per batch (~3-5 ms over PCIe) against
    # two fp32 4096^2 matmuls (~4-5 ms on an H100 without TF32).
    host = [torch.randn(128 << 20 >> 2).pin_memory() for _ in range(6)]
    w = torch.randn(4096, 4096, device="cuda")

    def compute(x):
        y = (w @ w) @ w
        return x.sum() + y.sum()

    return host, compute


def best_of_three(run) -> float:
    run()  # warm up
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


@pytest.mark.real_gpu(SPEED)
def test_the_copy_overlaps_compute():
    host, compute = overlap_case()

    def naive():
        for h in host:
            compute(h.to("cuda"))

    def ours():
        for b in ad.DeviceLoader(host, "cuda"):
            compute(b)

    assert best_of_three(ours) < 0.85 * best_of_three(naive)


@pytest.mark.real_gpu(SPEED)
def test_the_copy_overlaps_compute_when_the_host_syncs_every_step():
    # loss.item() every step: the host waits for compute k before asking for batch k+1.
    # The copy of k+1 must still run under compute k, not after it.
    host, compute = overlap_case()

    def naive():  # no overlap: the copy, then the compute, then the sync
        for h in host:
            compute(h.to("cuda")).item()

    def ours():
        for b in ad.DeviceLoader(host, "cuda"):
            compute(b).item()

    assert best_of_three(ours) < 0.85 * best_of_three(naive)


@pytest.mark.real_gpu(
    "torch's CUDA sanitizer needs CUDA, in a child process; under the simulator its own "
    "race detector checks these loops"
)
def test_loader_and_side_stream_pass_the_cuda_sanitizer():
    # CSAN checks the ordering of kernels that touch the same tensor (a read of a batch
    # before its copy ends would be flagged); it forgets a tensor's accesses when it is
    # freed, so reuse of freed blocks is checked by the tests above, by value.
    code = textwrap.dedent(
        """
        import torch, anydevice as ad
        data = [torch.randn(1 << 16) for _ in range(8)]
        for b in ad.DeviceLoader(data, "cuda", transform=lambda x: x * 2):
            (b + 1).sum()
        a = torch.randn(1 << 16, device="cuda")
        with ad.side_stream():
            c = a * 3
        (c + a).sum().item()
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TORCH_CUDA_SANITIZER": "1"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")
