"""The Throughput meter: rates over a sliding window, MFU against a peak, summed over real
gloo ranks, and no synchronisation per step on CUDA."""

from __future__ import annotations

import pytest
import torch

import anydevice as ad
from anydevice.measure.throughput import Peak, ThroughputStats, dtype_name, peak_tflops
from anydevice.numerics.matmul import strict_fp32
from ranks import process_tree_guard, run_ranks


class FakeClock:
    """Seconds that advance only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rates_are_totals_over_the_window():
    clock = FakeClock()
    meter = ad.Throughput(
        samples_per_step=32,
        tokens_per_step=32 * 128,
        flops_per_step=4e12,
        peak=Peak(8.0, "bf16", "given"),
        device="cpu",
        clock=clock,
    )
    for _ in range(4):
        meter.step()
        clock.now += 0.5
    s = meter.compute()
    assert (s.steps, s.seconds, s.step_time) == (3, 1.5, 0.5)
    assert s.samples_per_s == pytest.approx(64.0)
    assert s.tokens_per_s == pytest.approx(64.0 * 128)
    assert s.tflops == pytest.approx(8.0)
    assert s.mfu == pytest.approx(1.0)
    assert s.world_size == 1 and s.clock == "perf_counter"
    assert "MFU 100.0% of 8 (given)" in repr(s)
    assert s.to_dict()["peak_source"] == "given"


def test_the_window_slides_over_the_newest_steps():
    clock = FakeClock()
    meter = ad.Throughput(samples_per_step=10, window=2, device="cpu", clock=clock)
    for duration in (5.0, 5.0, 5.0, 1.0, 1.0):  # slow steps first, then fast ones
        meter.step()
        clock.now += duration
    meter.step()
    s = meter.compute()
    assert (s.steps, s.seconds) == (2, 2.0)
    assert s.samples_per_s == pytest.approx(10.0)
    meter.reset()
    with pytest.raises(ad.MeasurementError, match="0 step"):
        meter.compute()


def test_a_step_can_override_its_numbers():
    clock = FakeClock()
    meter = ad.Throughput(samples_per_step=8, device="cpu", clock=clock)
    meter.step()
    clock.now += 1.0
    meter.step(samples=3)  # a last, smaller batch
    assert meter.compute().samples_per_s == pytest.approx(3.0)


def test_rates_not_asked_for_are_none():
    clock = FakeClock()
    meter = ad.Throughput(samples_per_step=4, device="cpu", clock=clock)
    meter.step()
    clock.now += 1.0
    meter.step()
    s = meter.compute()
    assert s.tokens_per_s is None and s.tflops is None and s.mfu is None and s.peak is None


def test_one_step_has_no_duration():
    meter = ad.Throughput(device="cpu")
    meter.step()
    with pytest.raises(ad.MeasurementError, match="at least 2 calls"):
        meter.compute()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "window must be >= 1"),
        ({"samples_per_step": -1}, "samples_per_step must be >= 0"),
        ({"flops_per_step": float("nan")}, "flops_per_step must be >= 0"),
        ({"peak": "datasheet"}, "peak must be 'auto'"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ad.Throughput(device="cpu", **kwargs)


def two_steps(meter: ad.Throughput, clock: FakeClock, seconds: float = 0.1) -> ThroughputStats:
    meter.step()
    clock.now += seconds
    meter.step()
    return meter.compute()


def test_auto_peak_on_the_cpu_is_the_measured_matmul():
    clock = FakeClock()
    s = two_steps(ad.Throughput(flops_per_step=1e9, dtype="fp32", device="cpu", clock=clock), clock)
    peak = peak_tflops("cpu", "fp32")
    assert s.peak == peak and peak is not None and peak.measured
    assert s.mfu == pytest.approx(0.01 / peak.tflops) and s.mfu_invalid is None


# ----------------------------------------------------------------------------- the step's dtype


def test_the_meter_does_not_guess_the_dtype_of_the_math():
    clock = FakeClock()
    s = two_steps(ad.Throughput(flops_per_step=1e9, device="cpu", clock=clock), clock)
    assert s.tflops == pytest.approx(0.01)  # the rate is known; its share of a peak is not
    assert s.mfu is None and s.peak is None
    assert "dtype of the step's math is unknown" in str(s.mfu_invalid)
    assert "dtype=" in str(s.mfu_invalid) and "ad.flops(step)" in str(s.mfu_invalid)
    assert "MFU not given: the dtype" in repr(s)


@pytest.mark.parametrize("where", ["built inside autocast", "stepped inside autocast"])
def test_a_bf16_autocast_step_is_set_against_the_bf16_peak(where):
    clock = FakeClock()
    if where == "built inside autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            meter = ad.Throughput(flops_per_step=1e6, device="cpu", clock=clock)
        s = two_steps(meter, clock)
    else:
        meter = ad.Throughput(flops_per_step=1e6, device="cpu", clock=clock)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s = two_steps(meter, clock)
    assert s.peak is not None and s.peak.dtype == "bf16"
    assert s.peak == peak_tflops("cpu", "bf16")


def test_a_flop_count_brings_its_dtype():
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        count = ad.flops(layer, x)
    clock = FakeClock()
    meter = ad.Throughput(flops_per_step=count, device="cpu", clock=clock)
    s = two_steps(meter, clock)  # the steps run outside autocast: only the count tells
    assert meter.flops_per_step == count.total == 2 * 8 * 64 * 64
    assert s.tflops == pytest.approx(count.total / 0.1 / 1e12)
    assert s.peak is not None and s.peak.dtype == "bf16"


def test_a_dtype_given_wins():
    clock = FakeClock()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        meter = ad.Throughput(flops_per_step=1e6, dtype="fp64", device="cpu", clock=clock)
        s = two_steps(meter, clock)
    assert s.peak is not None and s.peak.dtype == "fp64"


def test_autocast_seen_in_two_dtypes_is_not_one_dtype():
    clock = FakeClock()
    meter = ad.Throughput(flops_per_step=1e6, device="cpu", clock=clock)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        meter.step()
    clock.now += 0.1
    with torch.autocast("cpu", dtype=torch.float16):
        meter.step()
    s = meter.compute()
    assert s.mfu is None and "bf16 and fp16" in str(s.mfu_invalid)


def test_an_unknown_dtype_name_is_refused():
    with pytest.raises(ValueError, match=r"dtype='bfloat16' .* 'bf16'"):
        ad.Throughput(flops_per_step=1.0, dtype="bfloat16", device="cpu")


# ----------------------------------------------------------------------------- MFU above 100 %


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("measured: fp32 matmul 2048^3 on cpu", "measured under other conditions"),
        ("H100 SXM datasheet, dense fp32", "faster dtype than fp32"),
        ("given", "give the device's real peak"),
    ],
)
def test_a_rate_above_the_peak_is_no_mfu(source, why):
    clock = FakeClock()
    peak = Peak(10.0, "fp32", source)
    meter = ad.Throughput(flops_per_step=1.41e12, peak=peak, device="cpu", clock=clock)
    s = two_steps(meter, clock, seconds=0.1)  # 14.1 TFLOP/s against a peak of 10
    assert s.tflops == pytest.approx(14.1)
    assert s.mfu is None and s.peak == peak
    assert "1.41x the peak: 14.1 against 10 TFLOP/s" in str(s.mfu_invalid)
    assert why in str(s.mfu_invalid)
    assert "141" not in repr(s) and "MFU not given: the rate is 1.41x" in repr(s)
    assert s.to_dict()["mfu"] is None and s.to_dict()["mfu_invalid"] == s.mfu_invalid


def test_a_rate_at_the_peak_is_an_mfu_of_one():
    clock = FakeClock()
    meter = ad.Throughput(flops_per_step=1e12, peak=10.0, device="cpu", clock=clock)
    s = two_steps(meter, clock, seconds=0.1)
    assert s.mfu == 1.0 and s.mfu_invalid is None
    assert "MFU 100.0% of 10 (given)" in repr(s)


def test_a_real_loop_on_the_cpu_is_timed_with_perf_counter():
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)
    meter = ad.Throughput(samples_per_step=32, peak=None, device="cpu")
    with ad.Timer("cpu") as t:
        meter.step()
        for _ in range(20):
            layer(x).sum().backward()
            meter.step()
    s = meter.compute()
    assert s.steps == 20 and 0 < s.seconds <= t.elapsed
    assert s.samples_per_s == pytest.approx(640 / s.seconds)


def test_the_cpus_measured_peak_is_kept_per_thread_count():
    threads = torch.get_num_threads()
    if threads == 1:
        pytest.skip("torch runs one thread here: no other count to compare")
    assert peak_tflops("cpu", "fp32").source.endswith(f"on cpu, {threads} threads")  # type: ignore[union-attr]
    torch.set_num_threads(1)
    try:
        one = peak_tflops("cpu", "fp32")
    finally:
        torch.set_num_threads(threads)
    assert one is not None and one.source.endswith("on cpu, 1 thread")


def test_measuring_a_peak_leaves_settings_that_already_fit_alone():
    import sys

    from anydevice.measure.throughput import _measured_peak

    written: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        name = getattr(arg, "__name__", "")
        if event == "c_call" and name.startswith("_set_") and "precision" in name:
            written.append(name)

    _measured_peak.cache_clear()
    with strict_fp32():  # full fp32 already: nothing to switch for an fp32 peak
        sys.setprofile(profile)
        try:
            peak = peak_tflops("cpu", "fp64")
            peak = peak_tflops("cpu", "fp32")
        finally:
            sys.setprofile(None)
        assert written == [] and peak is not None and peak.tflops > 0
        torch.set_float32_matmul_precision("medium")  # oneDNN may compute fp32 in bf16 now
        _measured_peak.cache_clear()
        sys.setprofile(profile)
        try:
            peak_tflops("cpu", "fp32")
        finally:
            sys.setprofile(None)
        assert written  # measured under full fp32 all the same, then put back
        assert torch.get_float32_matmul_precision() == "medium"


def test_dtype_names():
    assert dtype_name(torch.float16) == "fp16" and dtype_name(torch.float64) == "fp64"
    assert dtype_name(torch.float8_e4m3fn) == "fp8"
    assert dtype_name(torch.float32, torch.device("cuda"), tf32=True) == "tf32"


@pytest.mark.skipif(
    not hasattr(torch._C, "_get_fp32_precision_getter"),
    reason="torch's fp32_precision settings arrived in torch 2.9",
)
def test_a_flop_number_on_cuda_is_set_against_tf32_where_torchs_settings_say_so():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from anydevice.measure.throughput import _dtype_in_use

    with FakeTensorMode():  # torch places it on cuda:0; no data, no GPU
        a = torch.empty(64, 64, device="cuda")
    cuda = torch.device("cuda", 0)
    with strict_fp32():  # restores every setting exactly
        assert _dtype_in_use(cuda, (a,)) == "fp32"
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # torch's current API
        assert _dtype_in_use(cuda, (a,)) == "tf32"
        assert _dtype_in_use(torch.device("cpu"), (torch.ones(2),)) == "fp32"


# ----------------------------------------------------------------------------- two ranks


def _rank(init_method: str) -> dict[str, object]:
    with ad.distributed(init_method=init_method, timeout=30) as d:
        clock = FakeClock()
        seconds_per_step = 1.0 + d.rank  # rank 1 is twice as slow
        meter = ad.Throughput(
            samples_per_step=10,
            flops_per_step=2e12,
            peak=Peak(4.0, "fp32", "given"),
            device="cpu",
            clock=clock,
        )
        for _ in range(3):
            meter.step()
            clock.now += seconds_per_step
        return meter.compute().to_dict()


def test_ranks_sum_their_rates(tmp_path):
    with process_tree_guard():
        r0, r1 = run_ranks(_rank, 2, tmp_path, timeout=90)
    assert r0 == r1  # every rank gets the same, global numbers
    assert r0["world_size"] == 2
    assert r0["seconds"] == 4.0  # the slowest rank's window
    assert r0["samples_per_s"] == pytest.approx(10 / 1 + 10 / 2)
    assert r0["tflops"] == pytest.approx(2 / 1 + 2 / 2)
    assert r0["mfu"] == pytest.approx(3.0 / (4.0 + 4.0))


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.real_gpu(
    "torch.cuda.set_sync_debug_mode('error'): the simulated GPU flags no syncs (refused)"
)
def test_cuda_steps_record_events_without_synchronising():
    a = torch.randn(1024, 1024, device="cuda")
    meter = ad.Throughput(samples_per_step=1, peak=None, device="cuda")
    torch.cuda.synchronize()
    with ad.Timer("cuda") as t:
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call now raises
        try:
            meter.step()
            for _ in range(50):
                torch.mm(a, a)
                meter.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    s = meter.compute()
    assert s.clock == "cuda-event" and s.steps == 50
    assert 0.8 * t.elapsed <= s.seconds <= t.elapsed  # device time of the 50 matmuls


@pytest.mark.cuda
@pytest.mark.real_gpu("compares the meter's cost with a GPU's matmul time")
def test_cuda_meter_overhead_is_under_one_percent_of_a_small_step():
    a = torch.randn(2048, 2048, device="cuda")
    meter = ad.Throughput(samples_per_step=1, peak=None, device="cuda")

    def loop(with_meter: bool) -> float:
        with ad.Timer("cuda") as t:
            for _ in range(200):
                torch.mm(a, a)
                if with_meter:
                    meter.step()
        return t.elapsed

    loop(True)  # warm-up
    bare = min(loop(False) for _ in range(5))
    metered = min(loop(True) for _ in range(5))
    assert metered <= 1.01 * bare, (metered, bare)


@pytest.mark.cuda
@pytest.mark.real_gpu("autocast on the simulated GPU casts nothing: its math is fp32")
def test_a_bf16_autocast_loop_on_a_gpu_is_set_against_the_bf16_peak():
    model = torch.nn.Linear(4096, 4096, device="cuda")
    x = torch.randn(4096, 4096, device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().sum()
        loss.backward()

    count = ad.flops(step)
    meter = ad.Throughput(flops_per_step=count, device="cuda")  # built and stepped outside
    for _ in range(20):
        step()
        meter.step()
    s = meter.compute()
    assert count.dtype == "bf16"
    assert s.peak is not None and s.peak.dtype == "bf16"
    assert s.mfu is not None and 0 < s.mfu <= 1, s


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="this process already uses CUDA")
def test_without_a_device_the_meter_times_the_cpu_when_no_accelerator_is_in_use():
    meter = ad.Throughput(samples_per_step=1, peak=None)
    meter.step()
    meter.step()
    assert meter.device.type == "cpu" and meter.clock == "perf_counter"
    assert meter.compute().steps == 1


@pytest.mark.cuda
def test_without_a_device_the_meter_follows_the_work_to_cuda():
    meter = ad.Throughput(samples_per_step=1, peak=None)  # before the model is on the GPU
    x = torch.ones(1024, device="cuda")
    for _ in range(3):
        x.mul_(1.0)
        meter.step()
    assert meter.device.type == "cuda" and meter.clock == "cuda-event"
    assert meter.compute().steps == 2


@pytest.mark.cuda
def test_cuda_events_are_reused_once_the_window_is_full():
    meter = ad.Throughput(samples_per_step=1, window=2, peak=None, device="cuda")
    for _ in range(3):
        meter.step()
    oldest = meter._marks[0][0]
    meter.step()  # the oldest event leaves the window and is recorded again as the newest
    assert meter._marks[-1][0] is oldest
    assert meter.compute().steps == 2
