"""Timing on a real NVIDIA GPU (``cuda`` marker: skipped without one, never faked).

The reference is a hand-written CUDA-event timing of the same kernel, and
``torch.cuda._sleep`` is the kernel: it spins the GPU for a number of cycles, so its
duration is known to be well above any launch or clock overhead.
"""

from __future__ import annotations

import statistics

import pytest
import torch

import anydevice as ad
from anydevice.hardware.selection import resolve
from anydevice.measure import clocks

pytestmark = pytest.mark.cuda
#: Why the 10 % agreements need a physical GPU: the simulated GPU's kernel times are a
#: host thread's sleeps, as late as the machine's load makes them.
AGREEMENT = "two timings of a GPU kernel agreeing to 10 %: a GPU's clock, not a busy host's"


def reference(fn, reps: int = 20) -> float:
    """Median seconds of ``fn`` by one CUDA event pair per call, after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def sleep_for(seconds: float):
    """A kernel that keeps the GPU busy for about ``seconds`` (spin by clock cycles)."""
    rate_hz = 1.5e9  # roughly; the reference timing, not this number, is what tests compare to
    cycles = int(seconds * rate_hz)
    return lambda: torch.cuda._sleep(cycles)


@pytest.mark.real_gpu(AGREEMENT)
def test_timeit_uses_cuda_events_and_agrees_with_a_manual_timing():
    fn = sleep_for(1e-3)
    ref = reference(fn)
    m = ad.timeit(fn, min_time=0.2, device="cuda")
    assert m.clock == "cuda-event"
    assert m.device == f"cuda:{torch.cuda.current_device()}"
    assert m.median == pytest.approx(ref, rel=0.10)


def test_timeit_infers_cuda_from_its_tensor_arguments():
    x = torch.ones(1024, device="cuda")
    m = ad.timeit(torch.add, x, 1, min_time=0.05)
    assert m.device.startswith("cuda") and m.clock == "cuda-event"
    assert m.number > 1  # a microsecond kernel is timed in blocks of calls


@pytest.mark.real_gpu(AGREEMENT)
def test_timeit_times_the_current_stream():
    side = torch.cuda.Stream()
    fn = sleep_for(2e-3)
    ref = reference(fn)
    with torch.cuda.stream(side):
        m = ad.timeit(fn, min_time=0.1, device="cuda")
    assert m.median == pytest.approx(ref, rel=0.10)


@pytest.mark.real_gpu("an L2 cache to flush: the simulated GPU has none")
def test_flush_l2_makes_a_read_of_cached_data_cold_and_stays_out_of_the_window():
    # A sum over half the L2, timed one call per sample, queued behind one of three
    # kernels: an idle one (x stays cached: warm), anydevice's flush, and a memset of
    # four times the L2 (x surely evicted: cold). The flushed times must be the cold ones.
    dev = torch.device("cuda", torch.cuda.current_device())
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    if not l2:
        pytest.skip("this GPU reports no L2 size")
    x = torch.ones(l2 // 2 // 4, device=dev)
    big = torch.empty(l2, dtype=torch.int32, device=dev)  # 4x the L2 in bytes
    clock = clocks._EventClock(dev)
    flush = clocks.flusher(dev)
    flush_time = statistics.median(clock.run(flush, 1, 20, None))
    idle = sleep_for(flush_time)  # keeps the GPU as busy as a flush, touches no memory

    def median(before) -> float:
        return statistics.median(clock.run(x.sum, 1, 100, before))

    warm, evicted, flushed = median(idle), median(big.zero_), median(flush)
    if evicted < 1.05 * warm:
        pytest.skip(f"L2 and memory reads take the same time here ({warm=}, {evicted=})")
    assert abs(flushed - evicted) < abs(flushed - warm), (warm, flushed, evicted)
    m = ad.timeit(x.sum, flush_l2=True, repeat=100)
    assert m.flush_l2 and m.number == 1
    assert abs(m.median - evicted) < abs(m.median - warm)  # timeit's samples are cold
    assert m.median < 0.5 * flush_time  # and the flush is outside the timed window


def test_timer_waits_for_the_gpu_work_of_its_block():
    fn = sleep_for(20e-3)
    ref = reference(fn, reps=3)
    with ad.Timer("cuda") as t:
        fn()  # returns at once; only the synchronisation at exit makes the time right
    assert t.elapsed >= 0.8 * ref


def test_a_bare_cuda_spec_is_the_current_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.cuda.init()
    with torch.cuda.device(1):
        assert resolve("cuda") == torch.device("cuda", 1)
        assert ad.timeit(torch.cuda._sleep, 1000, min_time=0.01, device="cuda").device == "cuda:1"


def test_timer_without_a_device_waits_for_every_gpu_in_use():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.cuda.init()
    other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
    with torch.cuda.device(other):
        fn = sleep_for(20e-3)
        ref = reference(fn, reps=3)
    assert torch.device("cuda", other) in clocks.in_use()
    with ad.Timer() as t, torch.cuda.device(other):
        fn()  # queued on a GPU that is not the current one; the Timer stops after
    assert t.elapsed >= 0.8 * ref
