"""Memory on the CPU for real: RSS readings, peak tracking, giving memory back, OOM errors.

Allocations are real tensors, filled so their pages are resident; sizes are large enough
(>= 128 MiB) that other work in the process cannot hide them.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

import anydevice as ad
from anydevice.measure.memory import MemoryStats

MiB = 2**20
GiB = 2**30


def resident(nbytes: int) -> torch.Tensor:
    """A tensor of ``nbytes`` whose pages are all touched (so they count in RSS)."""
    return torch.ones(nbytes // 4, dtype=torch.float32)


def test_cpu_memory_reads_this_process_and_the_system():
    s = ad.memory("cpu")
    rss = psutil.Process().memory_info().rss
    assert s.device == "cpu"
    assert abs(s.allocated - rss) < 64 * MiB
    assert s.peak >= s.allocated
    assert 0 < s.free <= s.total <= psutil.virtual_memory().total
    assert s.reserved is None and s.other is None and not s.fragmented
    assert "resident" in repr(s) and "available of" in repr(s)


def test_cpu_memory_sees_a_real_allocation():
    before = ad.memory("cpu").allocated
    x = resident(256 * MiB)
    after = ad.memory("cpu").allocated
    assert after - before >= 200 * MiB
    del x


def test_memory_without_a_device_is_the_device_in_use():
    expected = "cpu" if not torch.cuda.is_initialized() else f"cuda:{torch.cuda.current_device()}"
    assert ad.memory(None).device == expected


def test_memory_of_meta_is_refused():
    with pytest.raises(ValueError, match="meta"):
        ad.memory("meta")


def test_memory_stats_flags_fragmentation_only_when_much_is_cached():
    def stats(allocated, reserved):
        return MemoryStats("cuda:0", allocated=allocated, reserved=reserved, free=None, total=None)

    assert stats(1 * GiB, 4 * GiB).fragmented
    assert not stats(3 * GiB, 4 * GiB).fragmented  # ratio under 2
    assert not stats(100 * MiB, 900 * MiB).fragmented  # under 1 GiB unused
    text = repr(stats(1 * GiB, 4 * GiB))
    assert "4.0x allocated" in text and "3.0 GiB is cached" in text and "free_memory" in text


def test_memory_stats_names_memory_used_outside_the_allocator():
    s = MemoryStats(
        "cuda:0", allocated=GiB, reserved=2 * GiB, free=70 * GiB, total=80 * GiB, alloc_retries=3
    )
    assert s.other == 8 * GiB
    assert s.cached == GiB
    text = repr(s)
    assert "8.0 GiB used outside this process's allocator" in text
    assert "3 allocation(s) needed the cache flushed" in text
    d = s.to_dict()
    assert json.loads(json.dumps(d))["other"] == 8 * GiB


# ----------------------------------------------------------------------------- track_memory


def test_track_memory_exact_when_the_block_sets_a_new_high_water_mark():
    # A fresh interpreter has a low high-water mark, so a 512 MiB block raises it, even
    # when it was started by a larger process (getrusage's ru_maxrss survives execve and
    # would carry the parent's 1 GiB over; the mark of the process's own memory does not).
    code = textwrap.dedent(
        """
        import json, torch, anydevice as ad
        with ad.track_memory("cpu") as m:
            x = torch.ones(2**27)  # 512 MiB, touched
            del x
        print(json.dumps({"exact": m.exact, "increase": m.peak_increase, "net": m.net,
                          "method": m.method}))
        """
    )
    parent = textwrap.dedent(
        f"""
        import subprocess, sys
        big = bytearray(2**30)  # 1 GiB, touched: this parent is larger than the block
        sys.stdout.write(subprocess.run([sys.executable, "-c", {code!r}], capture_output=True,
                                        text=True, timeout=120, check=True).stdout)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", parent], capture_output=True, text=True, timeout=150, check=True
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["exact"] is True and "high-water" in r["method"]
    assert r["increase"] >= 500 * MiB
    assert r["net"] < 64 * MiB  # the big block was unmapped again


@pytest.fixture
def samples(monkeypatch):
    """Wait until each open block's sampling thread has read the memory in use twice more:
    a block's sleep assumed the thread had run, which a busy machine may not grant it
    within the sleep."""
    from anydevice.measure import memory

    reads: dict[int, int] = {}  # reader -> its reads
    read = memory._Reader.__call__

    def counted(self):
        reads[id(self)] = reads.get(id(self), 0) + 1
        return read(self)

    monkeypatch.setattr(memory._Reader, "__call__", counted)

    def wait_for_more(n: int = 2) -> None:
        target = {k: v + n for k, v in reads.items()}
        deadline = time.monotonic() + 60
        while any(reads[k] < v for k, v in target.items()) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert all(reads[k] >= v for k, v in target.items()), "a sampling thread never read"

    return wait_for_more


def test_track_memory_samples_a_peak_below_the_high_water_mark(samples):
    big = resident(512 * MiB)  # set a high-water mark well above what the block will reach
    del big
    gc.collect()
    with ad.track_memory("cpu", interval=0.001) as m:
        x = resident(192 * MiB)
        samples()  # read while x is there
        del x
    assert m.exact is False and "sampled" in m.method
    assert m.peak_increase >= 150 * MiB
    assert m.peak >= max(m.start, m.end)
    assert "peak" in repr(m)


def test_nested_track_memory_keeps_the_outer_peak(samples):
    with ad.track_memory("cpu") as outer:
        with ad.track_memory("cpu") as inner:
            x = resident(160 * MiB)
            samples()
            del x
        assert inner.peak_increase >= 120 * MiB
    assert outer.peak >= inner.peak


def test_track_memory_reads_nothing_before_the_block_ends_and_cleans_up_on_error():
    def block() -> ad.MemoryUsage:
        with ad.track_memory("cpu") as m:
            with pytest.raises(ad.MeasurementError, match="not ended"):
                _ = m.peak
            seen.append(m)
            raise KeyError("boom")

    seen: list[ad.MemoryUsage] = []
    with pytest.raises(KeyError):
        block()
    assert seen[0].peak >= seen[0].start  # filled in although the block raised
    assert not [t for t in threading.enumerate() if t.name == "anydevice-memory"]


def test_track_memory_rejects_a_bad_interval():
    with pytest.raises(ValueError, match="interval"), ad.track_memory("cpu", interval=0):
        pass


# ----------------------------------------------------------------------------- free_memory


def test_free_memory_collects_garbage_cycles_and_returns_what_it_released():
    class Node:
        pass

    gc.disable()  # so no automatic collection frees the cycle before free_memory looks
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle only the garbage collector frees
        a.payload = resident(256 * MiB)
        del a, b
        released = ad.free_memory("cpu")
    finally:
        gc.enable()
    assert released >= 200 * MiB


def test_free_memory_with_nothing_to_release_returns_zero_or_more():
    assert ad.free_memory("cpu") >= 0


# ----------------------------------------------------------------------------- history, pinned


def test_a_snapshot_is_refused_where_no_history_is_kept(tmp_path):
    path = tmp_path / "mem.pickle"
    ran = []
    with (
        pytest.raises(ad.MeasurementError, match="CUDA's caching allocator") as info,
        ad.track_memory("cpu", snapshot=path),
    ):
        ran.append(1)
    assert "cpu keeps none" in str(info.value) and "record_memory=True" in str(info.value)
    assert not ran and not path.exists()


def test_fit_batch_size_refuses_an_oom_snapshot_on_the_cpu_before_trying(tmp_path):
    tried = []
    with pytest.raises(ad.MeasurementError, match="cpu keeps none"):
        ad.fit_batch_size(tried.append, device="cpu", snapshot_on_oom=tmp_path / "oom.pickle")
    assert tried == []


def test_pinned_memory_is_unknown_before_cuda_is_used():
    # This process never initialised CUDA (a CPU build here): no pinned memory can exist,
    # and reading it must not create a CUDA context to find out.
    s = ad.memory("cpu")
    assert torch.cuda.is_initialized() or (s.pinned is None and s.pinned_active is None)
    assert "pinned" in s.to_dict()
    assert ad.free_memory("cpu") >= 0
