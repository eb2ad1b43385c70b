"""DeviceLoader on a real GPU: ordering, memory, overlap (``cuda`` marker).

Each test widens the race window with torch.cuda._sleep so an ordering bug shows up as a
wrong value, and checks results bit-exactly against the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import anydevice as ad

pytestmark = pytest.mark.cuda

N = 1 << 18  # floats per sample


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
    totals = []
    for b in loader:
        torch.cuda._sleep(3_000_000)  # the consumer's read of b stays queued...
        totals.append(b.sum())
        del b  # ...while b's block is freed and the next copy may want it
    assert [t.item() for t in totals] == expected


def test_pinned_and_pageable_sources_and_dataloader_workers_agree():
    ds = TensorDataset(torch.arange(4096.0).view(256, 16))
    expected = [b[0].sum().item() for b in DataLoader(ds, batch_size=32)]
    for kw in ({"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "pin_memory": True}):
        loader = ad.DeviceLoader(DataLoader(ds, batch_size=32, **kw), "cuda")
        got = [b[0].sum().item() for b in loader]
        assert got == expected, kw
        assert loader.stats.bytes_moved == 4096 * 4
        assert loader.stats.bandwidth is not None


def test_reserved_memory_is_flat_over_fifty_epochs():
    loader = ad.DeviceLoader(batches(8), "cuda")
    reserved = []
    for _ in range(50):
        for b in loader:
            b.mul_(2)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[2], reserved


def test_the_copy_overlaps_compute():
    # Copy and compute of comparable length: 128 MiB per batch (~3-5 ms over PCIe) against
    # two fp32 4096^2 matmuls (~4-5 ms on an H100 without TF32).
    host = [torch.randn(128 << 20 >> 2).pin_memory() for _ in range(6)]
    w = torch.randn(4096, 4096, device="cuda")

    def compute(x):
        y = (w @ w) @ w
        return x.sum() + y.sum()

    def naive():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for h in host:
            compute(h.to("cuda"))
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def ours():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for b in ad.DeviceLoader(host, "cuda"):
            compute(b)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    naive(), ours()  # warm up
    assert min(ours() for _ in range(3)) < 0.85 * min(naive() for _ in range(3))


def test_loader_and_side_stream_pass_the_cuda_sanitizer():
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
