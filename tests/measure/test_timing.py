"""Timing: the autorange logic on a fake clock, Measurement statistics, timeit and Timer.

The fake clock makes the calibration deterministic: a function "costs" exactly what it
adds to the clock, so what timeit reports can be checked against the truth. Real CPU runs
check the plumbing; no test asserts how fast anything is.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import anydevice as ad
from anydevice.measure.samples import MAX_NUMBER, Calibration, Measurement, autorange, format_time
from anydevice.measure.timing import timeit


class FakeClock:
    """Seconds that move only when work is 'done' (``spend``) or the clock is read (``tick``)."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now = 0.0
        self.tick = tick
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.tick
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def linear(cost: float, overhead: float):
    """A measure(n) of a function taking ``cost`` s, on a clock costing ``overhead`` s."""
    calls = []

    def measure(n: int) -> float:
        calls.append(n)
        return n * cost + overhead

    return measure, calls


# ----------------------------------------------------------------------------- autorange


@settings(max_examples=200, deadline=None)
@given(
    cost=st.floats(1e-9, 0.5),
    overhead=st.floats(0.0, 1e-3),
    min_time=st.floats(0.001, 2.0),
)
def test_autorange_bounds_the_clock_share_and_the_sample_count(cost, overhead, min_time):
    measure, _ = linear(cost, overhead)
    plan = autorange(measure, min_time=min_time)
    target = max(overhead / 1e-3, min_time / 1000)
    sample = plan.number * cost + overhead
    assert plan.overhead == pytest.approx(overhead)
    assert sample >= target or plan.number == MAX_NUMBER
    # it aims at 1.2x the target and may overshoot by one call
    assert plan.number * cost <= 1.2 * target + cost + 1e-12
    assert 5 <= plan.repeat <= 1000
    assert plan.repeat == min(max(math.ceil(min_time / sample), 5), 1000)


def test_autorange_grows_at_most_tenfold_per_step():
    measure, calls = linear(1e-7, 0.0)
    plan = autorange(measure, min_time=1.0)  # target 1 ms -> about 12000 calls
    growth = [b / a for a, b in itertools.pairwise(calls[5:]) if b != a]
    assert plan.number >= 10_000
    assert growth and max(growth) <= 10


def test_autorange_keeps_explicit_number_and_repeat():
    measure, calls = linear(1e-6, 1e-6)
    plan = autorange(measure, min_time=0.5, number=7, repeat=9)
    assert (plan.number, plan.repeat) == (7, 9)
    assert set(calls) <= {0, 7}


def test_autorange_median_of_three_ignores_one_slow_calibration_sample():
    # The first sample of 1 call is disturbed (50 ms); the function really takes 1 µs.
    slow_once = iter([5e-2])

    def measure(n: int) -> float:
        return n * 1e-6 + (next(slow_once, 0.0) if n == 1 else 0.0)

    plan = autorange(measure, min_time=0.2)
    assert plan.number > 1  # not fooled into one call per sample
    assert plan.estimate == pytest.approx(1e-6, rel=1e-6)
    assert plan.repeat == math.ceil(0.2 / (plan.number * 1e-6))  # nor into five samples


def test_autorange_counts_flush_time_against_min_time():
    measure, _ = linear(1e-3, 0.0)
    plain = autorange(measure, min_time=0.5, number=1)
    flushed = autorange(measure, min_time=0.5, number=1, per_sample_cost=4e-3)
    assert plain.repeat == 500
    assert flushed.repeat == 100


def test_autorange_terminates_on_a_clock_that_never_moves():
    plan = autorange(lambda n: 0.0, min_time=0.1)
    assert isinstance(plan, Calibration)
    assert plan.repeat == 1000


# ----------------------------------------------------------------------------- Measurement


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(1e-9, 10.0), min_size=1, max_size=60))
def test_measurement_statistics_match_numpy(times):
    m = Measurement(times=tuple(times))
    a = np.array(times)
    assert m.median == pytest.approx(np.median(a))
    assert m.mean == pytest.approx(a.mean())
    assert m.iqr == pytest.approx(np.percentile(a, 75) - np.percentile(a, 25), abs=1e-12)
    assert (m.min, m.max) == (a.min(), a.max())
    assert m.quantile(0.9) == pytest.approx(np.quantile(a, 0.9))
    assert m.count == len(times)


def test_noisy_measurement_warns_in_its_repr():
    rng = np.random.default_rng(0)
    quiet = Measurement(times=tuple(1e-3 * (1 + 0.01 * rng.standard_normal(50))), label="q")
    noisy = Measurement(times=tuple(1e-3 * rng.lognormal(0, 0.5, 50)), label="n")
    assert not quiet.noisy and "WARNING" not in repr(quiet)
    assert noisy.relative_iqr > 0.1 and noisy.noisy
    assert "WARNING: " in repr(noisy) and "IQR" in repr(noisy)


def test_measurement_warns_about_few_samples_and_clock_overhead():
    few = Measurement(times=(1e-3, 1e-3))
    costly = Measurement(times=(1e-6,) * 10, number=1, overhead=1e-6)
    assert any("sample" in w for w in few.warnings)
    assert any("clock costs" in w for w in costly.warnings)
    flushed = Measurement(times=(1e-6,) * 10, number=1, overhead=1e-6, flush_l2=True)
    assert not any("clock costs" in w for w in flushed.warnings)


def test_measurement_repr_says_how_it_was_measured():
    m = Measurement(
        times=(2e-3,) * 8, number=4, label="mm", device="cuda:0", clock="cuda-event",
        flush_l2=True, warmup=3,
    )  # fmt: skip
    text = repr(m)
    assert "'mm', cuda:0" in text and "2 ms" in text
    assert "8 samples x 4 calls" in text and "cuda-event clock" in text
    assert "3 warm-up calls" in text and "flushed" in text
    assert m.to_dict()["median"] == pytest.approx(2e-3) and m.unit == "s"


def test_measurement_rejects_no_samples_and_zero_calls():
    with pytest.raises(ValueError, match="at least one sample"):
        Measurement(times=())
    with pytest.raises(ValueError, match="number"):
        Measurement(times=(1.0,), number=0)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(2.5, "2.5 s"), (0.0125, "12.5 ms"), (3.2e-5, "32 us"), (4.5e-9, "4.5 ns")],
)
def test_format_time_picks_a_readable_unit(seconds, text):
    assert format_time(seconds) == text


# ----------------------------------------------------------------------------- timeit


def test_timeit_on_a_fake_clock_reports_the_true_cost_per_call():
    clock = FakeClock(tick=1e-7)
    cost = 3e-6
    m = ad.timeit(clock.spend, cost, clock=clock, device="cpu", min_time=0.1)
    assert m.clock == "FakeClock"
    assert m.number > 1
    assert m.median == pytest.approx(cost, rel=2e-3)  # the clock's share is under 0.1%
    assert m.iqr == pytest.approx(0.0, abs=1e-12)
    assert m.overhead == pytest.approx(1e-7)


def test_timeit_warms_up_before_reading_the_clock():
    clock = FakeClock()
    reads_at_call: list[int] = []

    def fn() -> None:
        reads_at_call.append(clock.reads)
        clock.spend(1e-3)

    m = ad.timeit(fn, warmup=4, clock=clock, device="cpu", min_time=0.01)
    assert reads_at_call[:4] == [0, 0, 0, 0]
    assert reads_at_call[4] > 0
    assert m.warmup == 4


def test_timeit_honours_number_and_repeat():
    clock = FakeClock()
    calls = []

    def fn() -> None:
        calls.append(1)
        clock.spend(1e-4)

    m = ad.timeit(fn, warmup=2, number=7, repeat=9, clock=clock, device="cpu")
    assert (m.count, m.number) == (9, 7)
    assert m.times == pytest.approx([1e-4] * 9)
    # warm-up, calibration (one to three samples of 7), and 9 samples of 7
    assert len(calls) in (2 + 7 + 63, 2 + 21 + 63)


def test_timeit_flush_times_one_call_per_sample():
    clock = FakeClock()
    m = ad.timeit(clock.spend, 1e-6, clock=clock, device="cpu", flush_l2=True, repeat=5)
    assert m.flush_l2 and m.number == 1
    assert m.median == pytest.approx(1e-6)


def test_timeit_passes_arguments_and_names_the_function():
    seen = []

    def step(x, *, scale):
        seen.append((x, scale))

    m = ad.timeit(step, 2, scale=3, min_time=0.001, repeat=5)
    assert set(seen) == {(2, 3)}
    assert m.label == "test_timeit_passes_arguments_and_names_the_function.<locals>.step"
    assert ad.timeit(torch.add, torch.ones(2), 1, repeat=5, min_time=0.001).label == "add"


def test_timeit_real_cpu_op():
    a = torch.randn(32, 32)
    m = ad.timeit(torch.mm, a, a, min_time=0.02)
    assert m.device == "cpu" and m.clock == "perf_counter"
    assert m.count >= 5 and all(t > 0 for t in m.times)
    assert m.min <= m.median <= m.max


def test_timeit_takes_the_device_of_its_tensor_arguments():
    x = torch.ones(4, device="meta")
    assert ad.timeit(torch.add, x, 1, repeat=5, min_time=0.001).device == "meta"
    model = torch.nn.Linear(2, 2).to("meta")
    assert ad.timeit(lambda m: m.weight.sum(), model, repeat=5, min_time=0.001).device == "meta"
    nested = {"inputs": [x]}
    assert ad.timeit(lambda b: b["inputs"][0] + 1, nested, repeat=5, min_time=0.001).device == (
        "meta"
    )


def test_timeit_checks_its_arguments():
    with pytest.raises(ValueError, match="warmup"):
        ad.timeit(lambda: None, warmup=-1)
    with pytest.raises(ValueError, match="repeat"):
        ad.timeit(lambda: None, repeat=0)
    with pytest.raises(ValueError, match="number"):
        ad.timeit(lambda: None, number=0)
    with pytest.raises(ValueError, match="min_time"):
        ad.timeit(lambda: None, min_time=float("nan"))
    with pytest.raises(ad.DeviceNotFoundError):
        ad.timeit(lambda: None, device="cuda:99")


# ----------------------------------------------------------------------------- Timer


def test_timer_keeps_every_lap():
    clock = FakeClock()
    t = ad.Timer("cpu", clock=clock, label="step")
    for cost in (1.0, 2.0, 4.0):
        with t:
            clock.spend(cost)
    assert t.laps == (1.0, 2.0, 4.0)
    assert t.elapsed == 4.0 and t.total == 7.0
    m = t.measurement()
    assert m.median == 2.0 and m.label == "step" and m.clock == "FakeClock"
    t.reset()
    assert t.laps == ()


def test_timer_start_and_stop_without_with():
    clock = FakeClock()
    t = ad.Timer(clock=clock).start()
    clock.spend(0.5)
    assert t.running
    assert t.stop() == 0.5
    assert not t.running


def test_timer_block_that_raises_is_not_a_lap():
    t = ad.Timer("cpu")
    with pytest.raises(KeyError), t:
        raise KeyError("boom")
    assert t.laps == () and not t.running
    with t:
        pass
    assert len(t.laps) == 1


def test_timer_misuse_says_what_to_do():
    t = ad.Timer("cpu")
    with pytest.raises(ad.MeasurementError, match="no block has been timed"):
        _ = t.elapsed
    with pytest.raises(ad.MeasurementError, match="start"):
        t.stop()
    t.start()
    with pytest.raises(ad.MeasurementError, match="already running"):
        t.start()
    with pytest.raises(ad.MeasurementError, match="no block"):
        ad.Timer().measurement()


def test_device_reaches_a_function_that_takes_it_and_other_shared_keywords_are_refused():
    """``ad.timeit(torch.ones, n, device=...)`` timed a CPU allocation labelled with the
    device: ``device=`` went to timeit alone. It now reaches the function too; a keyword
    whose owner cannot be told (``label=`` of a function that takes one) is refused."""
    made = []

    def alloc(n, *, device=None):
        made.append(device)
        return torch.ones(n, device=device)

    m = timeit(alloc, 16, device="cpu", repeat=1, number=1)
    assert m.device == "cpu" and made and set(made) == {"cpu"}
    made.clear()
    timeit(alloc, 16, repeat=1, number=1)  # not given: the function's own default
    assert made and set(made) == {None}

    def scaled(x, *, label="y"):
        return x * 2

    with pytest.raises(TypeError, match=r"label= is timeit's own.*functools\.partial\(scaled"):
        timeit(scaled, torch.ones(2), label="doubling", repeat=1, number=1)
    # bound by a partial: no doubt whose it is, and timeit keeps its own
    m = timeit(functools.partial(scaled, label="z"), torch.ones(2), label="x2", repeat=1)
    assert m.label == "x2"
    # a function with **kwargs, or one that does not take the name, is not second-guessed
    assert timeit(lambda **kw: kw, device="cpu", repeat=1, number=1).device == "cpu"
    assert timeit(torch.mm, torch.ones(2, 2), torch.ones(2, 2), label="mm", repeat=1).label == "mm"
