"""side_stream(): a no-op without CUDA; ordered both ways, and reused, on a real GPU.

The stream cache's logic (one object per key, forgotten in a forked child) is tested on
the CPU with plain objects in place of streams, in real forked processes.
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import threading
import warnings

import pytest
import torch

import anydevice as ad
from anydevice.feeding.streams import StreamCache, _Side


def counting_cache() -> tuple[StreamCache, list[tuple[int, int]]]:
    made: list[tuple[int, int]] = []
    serial = itertools.count(1)

    def make(index: int, priority: int) -> tuple[int, int]:
        made.append((index, priority))
        return (os.getpid(), next(serial))

    return StreamCache(make), made


def test_the_cache_makes_one_object_per_device_priority_and_role():
    cache, made = counting_cache()
    a = cache.get(0)
    assert cache.get(0) is a
    assert cache.get(0, 0, "side") is a
    b = cache.get(0, 0, "copy")
    c = cache.get(1)
    d = cache.get(0, -1)
    assert len({id(x) for x in (a, b, c, d)}) == 4
    assert made == [(0, 0), (0, 0), (1, 0), (0, -1)]
    assert len(cache) == 4


def test_threads_asking_at_once_get_the_same_object():
    cache, made = counting_cache()
    got: list[object] = []
    start = threading.Barrier(8)

    def ask() -> None:
        start.wait()
        got.append(cache.get(3, 0, "copy"))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 8 and all(g is got[0] for g in got)
    assert made == [(3, 0)]


def test_a_forked_child_makes_its_own_even_while_another_thread_holds_the_lock():
    cache, _ = counting_cache()
    parents = cache.get(0)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with cache._lock:  # another thread is inside get() at the moment of the fork
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    read, write = os.pipe()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: on purpose
            pid = os.fork()
        if pid == 0:  # the child: one thread, the parent's lock copied in its held state
            code = 1
            try:
                pid_made, serial = cache.get(0)
                os.write(write, f"{pid_made} {serial}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        answered, _, _ = select.select([read], [], [], 20)
        reply = os.read(read, 64) if answered else b""
        if not reply:  # deadlocked on the copied lock: stop it, leave nothing behind
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join(10)
        os.close(read)
    assert reply, "the child hung on the lock it inherited"
    assert os.waitstatus_to_exitcode(status) == 0
    child_pid, serial = (int(x) for x in reply.split())
    assert child_pid == pid  # made in the child, not the parent's object
    assert serial == 2
    assert cache.get(0) is parents  # the parent keeps its own


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


class Waits:
    """A stream stand-in that records which streams it was told to wait for."""

    def __init__(self) -> None:
        self.waited: list[str] = []

    def wait_stream(self, other: str) -> None:
        self.waited.append(other)


def test_every_entry_waits_for_each_stream_the_side_stream_was_entered_from():
    # A block freed after reads on stream A may be reused by a later block entered from
    # stream B: that entry must wait for A too, not only for B.
    side = _Side(Waits())
    for current in ("default", "A", "default", "B"):
        side.enter_from(current)
    assert side.stream.waited == [
        "default",
        "default", "A",
        "default", "A",
        "default", "A", "B",
    ]  # fmt: skip


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
            assert torch.accelerator.current_stream() == s  # a torch.Stream, as on XPU
            assert torch.cuda.current_stream().stream_id == s.stream_id
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
    assert s1 != torch.accelerator.current_stream()


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


@pytest.mark.cuda
def test_a_block_entered_from_another_stream_does_not_reuse_memory_still_read_elsewhere():
    # x is made in a block entered from the default stream and read there, slowly; the
    # next block is entered from another stream, which has nothing queued.
    other = torch.cuda.Stream()
    results, blocks = [], []
    for _ in range(20):
        with ad.side_stream("cuda"):
            x = torch.full((1 << 20,), 2.0, device="cuda")
        blocks.append(x.data_ptr())
        torch.cuda._sleep(5_000_000)
        total = x.sum()
        del x
        with torch.cuda.stream(other), ad.side_stream("cuda"):
            y = torch.full((1 << 20,), -7.0, device="cuda")
            blocks.append(y.data_ptr())
        results.append(total.item())
        other.synchronize()
        del y
    assert len(set(blocks)) < len(blocks), "no block was reused: the test proves nothing"
    assert results == [2.0 * (1 << 20)] * 20
