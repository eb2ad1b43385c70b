"""fit_batch_size: the search, what it catches and what it does not, and agreement across ranks.

``step`` functions raise ``torch.OutOfMemoryError`` above a threshold (or let the real CPU
allocator fail); the distributed test runs two real forked ranks in a gloo group.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import weakref

import pytest
import torch
from hypothesis import given, settings, strategies as st

import anydevice as ad
from anydevice.measure.batch_size import search
from anydevice.measure.memory_readings import is_out_of_memory


def limited(threshold: int, calls: list[int] | None = None):
    """A step that fits up to ``threshold`` and runs out of memory above it."""

    def step(batch_size: int) -> None:
        if calls is not None:
            calls.append(batch_size)
        if batch_size > threshold:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch_size} GiB")

    return step


@settings(max_examples=500, deadline=None)
@given(
    threshold=st.integers(1, 5000),
    start=st.integers(1, 600),
    low=st.integers(1, 40),
    high=st.integers(1, 8000),
)
def test_search_finds_the_largest_size_that_fits(threshold, start, low, high):
    start = max(start, low)
    high = max(high, start)
    calls: list[int] = []

    def fits(n: int) -> bool:
        calls.append(n)
        return n <= threshold

    found = search(fits, start=start, low=low, high=high)
    assert found == (None if threshold < low else min(threshold, high))
    assert all(low <= c <= high for c in calls)
    assert len(calls) == len(set(calls))  # never the same size twice
    grow = math.ceil(math.log2(max(threshold, start) / min(threshold, start))) + 2
    bisect = math.ceil(math.log2(max(threshold, start) + 1)) + 1
    assert len(calls) <= grow + bisect


def recording(threshold: int):
    calls: list[int] = []

    def fits(n: int) -> bool:
        calls.append(n)
        return n <= threshold

    return fits, calls


def test_search_doubles_then_bisects():
    fits, calls = recording(37)
    assert search(fits, start=4, low=1, high=10**6) == 37
    assert calls == [4, 8, 16, 32, 64, 48, 40, 36, 38, 37]


def test_search_bisects_below_start_when_start_does_not_fit():
    fits, calls = recording(5)
    assert search(fits, start=64, low=2, high=10**6) == 5
    assert calls[:2] == [64, 2]


def test_search_stops_at_high():
    fits, calls = recording(10**6)
    assert search(fits, start=3, low=1, high=20) == 20
    assert calls == [3, 6, 12, 20]


def test_fit_batch_size_tries_each_size_once_and_frees_memory_between():
    calls: list[int] = []
    assert ad.fit_batch_size(limited(21, calls), start=16, high=10**4, device="cpu") == 21
    assert calls == [16, 32, 24, 20, 22, 21]


def test_even_low_failing_is_a_clear_error():
    with pytest.raises(ad.BatchSizeError) as info:
        ad.fit_batch_size(limited(3), start=16, low=4, device="cpu")
    text = str(info.value)
    assert "low=4" in text and "CUDA out of memory. Tried to allocate 4 GiB" in text
    assert "MemoryStats(cpu" in text


def test_a_step_that_never_runs_out_of_memory_is_reported():
    with pytest.raises(ad.BatchSizeError, match="does step use its batch size"):
        ad.fit_batch_size(lambda batch_size: None, start=2**29, device="cpu")


def test_other_errors_propagate_untouched():
    error = ValueError("shape mismatch in step")

    def step(batch_size: int) -> None:
        if batch_size >= 8:
            raise error

    with pytest.raises(ValueError) as info:
        ad.fit_batch_size(step, start=8, device="cpu")
    assert info.value is error
    assert info.traceback[-1].name == "step"  # the traceback still points into step


def test_host_memory_error_and_a_real_allocator_failure_count_as_out_of_memory():
    def python_step(batch_size: int) -> None:
        if batch_size > 6:
            raise MemoryError

    def torch_step(batch_size: int) -> None:
        if batch_size > 11:
            torch.empty(2**50, dtype=torch.uint8)  # the real CPU allocator fails

    assert ad.fit_batch_size(python_step, start=4, device="cpu") == 6
    assert ad.fit_batch_size(torch_step, start=8, device="cpu") == 11


def test_a_failed_try_is_freed_before_the_next():
    alive: list[weakref.ref[torch.Tensor]] = []

    def step(batch_size: int) -> None:
        assert all(r() is None for r in alive), "an earlier try's tensor is still alive"
        activations = torch.empty(batch_size * 1024)
        alive.append(weakref.ref(activations))
        if batch_size > 20:
            raise torch.OutOfMemoryError("pretend")  # its traceback holds `activations`

    assert ad.fit_batch_size(step, start=16, device="cpu") == 20


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"low": 0}, "low"), ({"start": 2, "low": 4}, "start"), ({"start": 8, "high": 4}, "high")],
)
def test_rejects_inconsistent_bounds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ad.fit_batch_size(limited(10), device="cpu", **kwargs)


# ----------------------------------------------------------------------------- two ranks


def _rank(rank: int, rdzv: str, limits: list[int], fail_rank: int, out: mp.Queue) -> None:
    import datetime

    import torch.distributed as dist

    result: tuple[str, object]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rdzv}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=30),
        )
        calls: list[int] = []

        def step(batch_size: int) -> None:
            calls.append(batch_size)
            if rank == fail_rank and batch_size >= 8:
                raise ValueError("broken step")
            if batch_size > limits[rank]:
                raise torch.OutOfMemoryError("pretend")

        try:
            result = ("ok", (ad.fit_batch_size(step, start=16, device="cpu"), calls))
        except Exception as e:
            result = (type(e).__name__, str(e))
        dist.destroy_process_group()
    except Exception as e:  # pragma: no cover - reported to the parent
        result = ("setup", repr(e))
    out.put((rank, result))
    out.close()
    out.join_thread()  # put() hands over to a feeder thread; let it finish before exiting
    os._exit(0)


def _run_ranks(tmp_path, limits: list[int], fail_rank: int = -1) -> dict[int, tuple]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    rdzv = str(tmp_path / "rdzv")
    procs = [ctx.Process(target=_rank, args=(r, rdzv, limits, fail_rank, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    assert all(not p.is_alive() for p in procs)
    return results


@pytest.mark.slow
def test_ranks_agree_on_the_smallest_limit(tmp_path):
    results = _run_ranks(tmp_path, limits=[48, 20])
    assert results[0][0] == "ok" and results[1][0] == "ok", results
    (a, calls_a), (b, calls_b) = results[0][1], results[1][1]
    assert a == b == 20
    assert calls_a == calls_b  # the same sizes in the same order on both ranks


@pytest.mark.slow
def test_an_error_on_one_rank_stops_the_other(tmp_path):
    results = _run_ranks(tmp_path, limits=[100, 100], fail_rank=1)
    assert results[1] == ("ValueError", "broken step")
    assert results[0][0] == "BatchSizeError" and "another rank" in results[0][1]


# ----------------------------------------------------------------------------- out of memory


def test_a_real_cpu_allocation_failure_is_out_of_memory():
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the CPU allocator refuses
    assert is_out_of_memory(info.value)


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
        RuntimeError("MPS backend out of memory (other allocations: 1 GiB)"),
        RuntimeError("XPU out of memory. Tried to allocate 20.00 MiB"),
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported later"),
    ],
)
def test_out_of_memory_errors_of_every_device(exc):
    assert is_out_of_memory(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("Expected all tensors to be on the same device"),
        ValueError("out of memory"),  # right words, wrong kind of error
        KeyError("x"),
    ],
)
def test_other_errors_are_not_out_of_memory(exc):
    assert not is_out_of_memory(exc)


# ----------------------------------------------------------------------------- wrapped errors


def _real_cpu_oom() -> None:
    torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the real CPU allocator refuses


class BackendCompilerFailed(RuntimeError):
    """Shaped like torch._dynamo's: it re-raises the backend's error as its cause."""


def wrapped_by_cause(batch_size: int) -> None:
    if batch_size > 12:
        try:
            _real_cpu_oom()
        except RuntimeError as e:
            raise BackendCompilerFailed("backend='inductor' raised an error") from e


def wrapped_by_context(batch_size: int) -> None:
    if batch_size > 9:
        try:
            _real_cpu_oom()
        except RuntimeError:
            raise KeyError("cleanup after the failed step")  # noqa: B904 (the point: implicit)


def test_out_of_memory_wrapped_in_another_error_is_found_through_the_chain():
    assert ad.fit_batch_size(wrapped_by_cause, start=4, device="cpu") == 12
    assert ad.fit_batch_size(wrapped_by_context, start=4, device="cpu") == 9


def test_a_chain_cut_with_from_none_is_not_out_of_memory():
    def step(batch_size: int) -> None:
        try:
            _real_cpu_oom()
        except RuntimeError:
            raise ValueError("the step's own error") from None

    with pytest.raises(ValueError, match="own error"):
        ad.fit_batch_size(step, start=4, device="cpu")


def test_a_cyclic_chain_ends():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert not is_out_of_memory(a)


@pytest.mark.parametrize(
    "text",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "Unable to find a valid cuDNN algorithm to run convolution",
        "cuFFT error: CUFFT_ALLOC_FAILED",
    ],
)
def test_cuda_library_allocation_failures_raised_by_a_step_are_out_of_memory(text):
    def step(batch_size: int) -> None:
        if batch_size > 5:
            raise RuntimeError(text)

    assert ad.fit_batch_size(step, start=2, device="cpu") == 5


# ----------------------------------------------------------------------------- bounds, margin


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start": 2.5}, r"start is a batch size, a whole number, not float \(2.5\).*start=2"),
        ({"low": 1.0}, "low is a batch size"),
        ({"high": float("inf")}, "high is a batch size"),
        ({"start": True}, "start is a batch size"),
        ({"margin": "0.9"}, "margin is a fraction"),
    ],
)
def test_sizes_that_are_not_whole_numbers_are_refused_before_any_try(kwargs, match):
    calls: list[object] = []
    with pytest.raises(TypeError, match=match):
        ad.fit_batch_size(calls.append, device="cpu", **kwargs)
    assert calls == []


@pytest.mark.parametrize("margin", [0, -0.5, 1.5, float("nan")])
def test_margin_outside_zero_to_one_is_refused(margin):
    with pytest.raises(ValueError, match=r"margin=.* must be in \(0, 1\]"):
        ad.fit_batch_size(limited(10), device="cpu", margin=margin)


@pytest.mark.parametrize(
    ("limit", "margin", "expected"), [(100, 0.9, 90), (37, 0.5, 18), (1, 0.9, 1)]
)
def test_margin_returns_that_fraction_of_the_largest_size_that_fits(limit, margin, expected):
    assert ad.fit_batch_size(limited(limit), start=4, device="cpu", margin=margin) == expected
