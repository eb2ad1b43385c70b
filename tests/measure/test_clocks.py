"""Device clocks: synchronising, which device is in use, device specs, the cache flush size."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import anydevice as ad
from anydevice.hardware.backends.cpu import _cache_size
from anydevice.hardware.selection import resolve
from anydevice.measure import clocks


def test_synchronize_the_cpu_or_meta_waits_for_nothing():
    # Nothing is queued on the host or on meta: no wait is asked of torch (one its backend
    # cannot do would warn), and waiting for every device in use initialises none.
    initialized = torch.cuda.is_initialized()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert clocks.synchronize(torch.device("cpu")) is None
        assert clocks.synchronize(torch.device("meta")) is None
        assert clocks.synchronize(None) is None
    assert torch.cuda.is_initialized() == initialized


def test_active_device_is_the_cpu_until_an_accelerator_is_used():
    expected = "cuda" if torch.cuda.is_initialized() else "cpu"
    assert clocks.active_device().type == expected


def test_device_of_arguments_looks_into_containers_and_modules():
    meta = torch.ones(1, device="meta")
    model = torch.nn.Linear(2, 2).to("meta")
    assert clocks.device_of_arguments(iter([1, "x", meta])) == torch.device("meta")
    assert clocks.device_of_arguments(iter([{"batch": [meta]}])) == torch.device("meta")
    assert clocks.device_of_arguments(iter([model])) == torch.device("meta")
    assert clocks.device_of_arguments(iter([1, [2, (3,)], {}])) is None


def test_resolve_checks_the_spec_against_this_machine():
    assert resolve("cpu") == torch.device("cpu")
    with pytest.raises(ad.DeviceNotFoundError, match="cuda:99"):
        resolve("cuda:99")


def test_cache_size_reads_sysfs_units(tmp_path):
    (tmp_path / "size").write_text("32768K\n")
    assert _cache_size(tmp_path) == 32 * 2**20
    (tmp_path / "size").write_text("2M\n")
    assert _cache_size(tmp_path) == 2 * 2**20
    assert _cache_size(tmp_path / "missing") == 0


def test_cpu_flush_is_twice_the_largest_cache():
    root = "/sys/devices/system/cpu/cpu0/cache"
    sizes = [_cache_size(p) for p in Path(root).glob("index*")]
    expected = 2 * max(sizes) if sizes and max(sizes) else clocks.FALLBACK_FLUSH_BYTES
    assert clocks.flush_bytes(torch.device("cpu")) == expected


@pytest.mark.cuda
@pytest.mark.real_gpu("CUDA contexts, in a child process (a child has no simulated GPU)")
def test_synchronize_none_covers_every_gpu_with_a_context_and_makes_none():
    code = textwrap.dedent(
        """
        import torch
        from anydevice.measure import clocks
        n = torch.cuda.device_count()
        last = n - 1
        torch.ones(1, device=f"cuda:{last}")  # use only the last GPU
        before = [torch._C._cuda_hasPrimaryContext(i) for i in range(n)]
        found = [d.index for d in clocks.in_use()]
        with torch.cuda.device(last):
            torch.cuda._sleep(50_000_000)  # tens of ms on the last GPU
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(last))
        clocks.synchronize(None)
        print(done.query(), found == [i for i in range(n) if before[i]],
              last in found, before == [torch._C._cuda_hasPrimaryContext(i) for i in range(n)])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True", "True", "True"]


def test_synchronize_asks_per_gpu_whether_a_context_exists():
    # On this build no context can exist: the per-GPU question answers False without
    # raising, and synchronize waits for nothing.
    from anydevice.hardware.backends.cuda import has_primary_context

    if torch.cuda.is_initialized():
        pytest.skip("CUDA is in use in this process; the cuda test covers it")
    assert has_primary_context(0) is False
    clocks.synchronize(torch.device("cuda:0"))
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda
@pytest.mark.real_gpu("CUDA contexts, in a child process (a child has no simulated GPU)")
def test_synchronize_a_gpu_without_a_context_creates_none():
    # torch.cuda.synchronize(k) runs cudaSetDevice(k), which creates a context (~500 MB)
    # on GPU k; a GPU this process never used has nothing queued to wait for.
    code = textwrap.dedent(
        """
        import torch
        from anydevice.measure import clocks
        has = torch._C._cuda_hasPrimaryContext
        n = torch.cuda.device_count()
        torch.cuda.init()  # torch's CUDA state, no context yet
        if n > 1:
            torch.ones(1, device="cuda:0")  # use only cuda:0
        target = n - 1 if n > 1 else 0
        before = has(target)
        clocks.synchronize(torch.device("cuda", target))
        clocks.synchronize(None)
        print(before, has(target), n == 1 or has(0))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False", "True"]
