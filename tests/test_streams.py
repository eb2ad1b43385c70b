"""side_stream(): a no-op without CUDA; ordered both ways, and reused, on a real GPU."""

from __future__ import annotations

import pytest
import torch

import anydevice as ad


def test_without_cuda_it_is_a_no_op_that_yields_none():
    with ad.side_stream("cpu") as s:
        y = torch.arange(4.0) * 2
    assert s is None
    assert y.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_default_device_without_cuda_is_a_no_op():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the cuda tests cover it")
    with ad.side_stream() as s:
        pass
    assert s is None


def test_errors_inside_pass_through():
    with pytest.raises(KeyError, match="boom"), ad.side_stream("cpu"):
        raise KeyError("boom")


@pytest.mark.cuda
def test_side_stream_reads_what_the_current_stream_wrote():
    # The tutorial race: normal_() is still queued behind a long kernel on the current
    # stream when the side stream sums A. Without the wait the sum reads stale memory.
    for _ in range(20):
        a = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(5_000_000)  # keep the current stream busy
        a.fill_(1.0)
        with ad.side_stream("cuda") as s:
            assert s is not None
            assert torch.cuda.current_stream() == s
            total = a.sum()
        assert total.item() == float(1 << 20)


@pytest.mark.cuda
def test_tensors_made_inside_are_complete_outside():
    for _ in range(20):
        with ad.side_stream("cuda"):
            torch.cuda._sleep(5_000_000)  # the side stream is slow
            b = torch.full((1 << 20,), 3.0, device="cuda")
        assert (b * 2).sum().item() == 6.0 * (1 << 20)


@pytest.mark.cuda
def test_the_same_stream_is_reused():
    with ad.side_stream("cuda:0") as s1:
        pass
    with ad.side_stream(torch.device("cuda", 0)) as s2:
        pass
    assert s1 == s2
    assert s1 != torch.cuda.current_stream()


@pytest.mark.cuda
def test_freed_side_tensors_are_not_reused_while_the_current_stream_reads_them():
    # Forced reuse: the current stream still has a slow read of x queued when x is freed;
    # the next side-stream allocation of the same size must not overwrite it early.
    results = []
    for _ in range(20):
        with ad.side_stream("cuda"):
            x = torch.full((1 << 20,), 2.0, device="cuda")
        torch.cuda._sleep(5_000_000)
        total = x.sum()
        del x
        with ad.side_stream("cuda"):
            y = torch.full((1 << 20,), -7.0, device="cuda")
        results.append(total.item())
        del y
    assert results == [2.0 * (1 << 20)] * 20
