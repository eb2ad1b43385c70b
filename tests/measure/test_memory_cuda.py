"""Memory on a real NVIDIA GPU (``cuda`` marker: skipped without one, never faked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import anydevice as ad

pytestmark = pytest.mark.cuda

MiB = 2**20
GiB = 2**30
CHILD_NVML = "a fresh process that reads NVML (a child has no simulated GPU)"
HISTORY = "a snapshot is CUDA's allocator's history; the simulated one keeps none (refused)"


@pytest.mark.real_gpu(CHILD_NVML)
def test_looking_at_memory_creates_no_context_and_reads_nvml():
    code = textwrap.dedent(
        """
        import json, torch, anydevice as ad
        from anydevice.hardware.backends.cuda import driver_initialized
        s = ad.memory("cuda:0")
        with ad.track_memory("cuda:0"):
            pass
        ad.free_memory("cuda:0")
        with ad.Timer("cuda:0"):
            pass
        print(json.dumps({"torch_init": torch.cuda.is_initialized(),
                          "driver_init": driver_initialized(),
                          "allocated": s.allocated, "free": s.free, "total": s.total,
                          "notes": list(s.notes)}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
        env=dict(os.environ),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["torch_init"] is False and r["driver_init"] is False
    assert r["allocated"] == 0 and any("not used cuda yet" in n for n in r["notes"])
    assert 0 < r["free"] <= r["total"]


def test_memory_sees_a_cuda_allocation_to_the_byte():
    dev = torch.device("cuda", 0)
    torch.cuda.synchronize(dev)
    before = ad.memory(dev)
    x = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
    after = ad.memory(dev)
    assert after.allocated - before.allocated == 256 * MiB
    assert after.reserved >= after.allocated and after.peak >= after.allocated
    _, cuda_total = torch.cuda.mem_get_info(dev)
    assert after.total == pytest.approx(cuda_total, rel=0.05)
    assert 0 < after.free <= after.total
    del x


@pytest.mark.real_gpu("a CUDA context's memory, outside torch's allocator")
def test_memory_outside_torch_counts_this_processs_context():
    dev = torch.device("cuda", 0)
    x = torch.empty(MiB, dtype=torch.uint8, device=dev)  # CUDA is in use: a context
    s = ad.memory(dev)
    assert s.other is not None and s.other > 0  # at least this process's context
    del x


def test_track_memory_reads_the_exact_cuda_peak():
    dev = torch.device("cuda", 0)
    with ad.track_memory(dev) as m:
        t = torch.empty(512 * MiB, dtype=torch.uint8, device=dev)
        del t
    assert m.exact
    assert m.peak_increase >= 512 * MiB
    assert m.net == 0


def test_nested_track_memory_keeps_the_outer_peak_after_the_inner_reset():
    dev = torch.device("cuda", 0)
    with ad.track_memory(dev) as outer:
        big = torch.empty(GiB, dtype=torch.uint8, device=dev)
        del big
        with ad.track_memory(dev) as inner:
            small = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
            del small
    assert 64 * MiB <= inner.peak_increase < GiB  # the inner block reset the counter...
    assert outer.peak_increase >= GiB  # ...but the outer block still has its own peak
    # torch's own counter cannot be set back: it now counts from the inner block's start
    assert torch.cuda.max_memory_allocated(dev) < outer.peak


def test_free_memory_gives_cached_blocks_back():
    dev = torch.device("cuda", 0)
    x = torch.empty(512 * MiB, dtype=torch.uint8, device=dev)
    del x  # now cached by the allocator
    reserved = torch.cuda.memory_reserved(dev)
    released = ad.free_memory(dev)
    assert released >= 512 * MiB
    assert torch.cuda.memory_reserved(dev) <= reserved - 512 * MiB


def test_reserved_far_above_allocated_is_flagged():
    dev = torch.device("cuda", 0)
    ad.free_memory(dev)
    x = torch.empty(2 * GiB, dtype=torch.uint8, device=dev)
    del x
    s = ad.memory(dev)
    assert s.fragmented and "WARNING" in repr(s)
    ad.free_memory(dev)
    assert not ad.memory(dev).fragmented


# ----------------------------------------------------------------------------- history, pinned


@pytest.mark.real_gpu(HISTORY)
def test_track_memory_writes_a_snapshot_and_a_timeline(tmp_path):
    import pickle

    path = tmp_path / "runs" / "mem.pickle"
    size = 64 * MiB
    with ad.track_memory("cuda:0", snapshot=path) as m:
        x = torch.empty(size, dtype=torch.uint8, device="cuda:0")
        del x
    assert m.snapshot == path and path.exists()
    with open(path, "rb") as f:
        snap = pickle.load(f)
    events = [e for trace in snap["device_traces"] for e in trace]
    assert any(e["action"] == "alloc" and e["size"] >= size for e in events)
    assert any(e["action"] in ("free_requested", "free_completed") for e in events)
    html = path.with_suffix(".html").read_text()
    assert "Active Memory Timeline" in html and "snapshot.pickle" in html
    before = sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"])
    y = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    del y
    after = sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"])
    assert after == before  # recording stopped with the block


@pytest.mark.real_gpu(HISTORY)
def test_fit_batch_size_writes_a_snapshot_at_the_first_oom(tmp_path):
    import pickle

    path = tmp_path / "oom.pickle"
    free, _ = torch.cuda.mem_get_info(0)
    unit = max(GiB, free // 16)

    def step(n: int) -> None:
        torch.empty(n * unit, dtype=torch.uint8, device="cuda:0")

    found = ad.fit_batch_size(step, device="cuda:0", snapshot_on_oom=path)
    assert 1 <= found * unit <= free
    with open(path, "rb") as f:
        snap = pickle.load(f)
    actions = {e["action"] for trace in snap["device_traces"] for e in trace}
    assert "oom" in actions, actions
    assert path.with_suffix(".html").exists()


@pytest.mark.real_gpu("the simulated GPU's pinned memory keeps no counters")
def test_pinned_host_memory_is_reported_and_released():
    x = torch.empty(64 * MiB, dtype=torch.uint8).pin_memory()
    torch.empty(1, device="cuda:0")  # CUDA is in use
    held = ad.memory("cuda:0")
    assert held.pinned is not None and held.pinned >= 64 * MiB
    assert held.pinned_active is not None and held.pinned_active >= 64 * MiB
    assert "pinned host" in repr(held)
    del x
    released = ad.free_memory("cuda:0")
    after = ad.memory("cuda:0").pinned
    assert after is not None and after <= held.pinned - 64 * MiB
    assert released >= 64 * MiB
