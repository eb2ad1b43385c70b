"""The doctor's measurements: real timings on this CPU, the pure parts on hand-built data."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch

from anydevice.doctor import examine
from anydevice.doctor.measure import _emulated, measure, run_plan
from anydevice.doctor.results import Lever, Measured, Measurements
from anydevice.doctor.targets import choose_devices
from anydevice.doctor.workloads import PLANS, Plan, Run
from anydevice.errors import DeviceNotFoundError, DeviceSpecError
from anydevice.hardware.inventory import Inventory, inventory
from anydevice.hardware.peaks import gpu_peak, pcie_peak
from anydevice.numerics.matmul import MathSettings, _Saved, strict_fp32
from machines import cpu_device, gpu, host, machine

#: Seconds a run may take past its budget here: one call predicted from the size below it
#: can take longer on a machine that other jobs keep busy. A bound that only a budget
#: ignored would break (the emulated bf16 matmuls alone would take minutes), not a speed.
MARGIN = 30.0
#: A plan with tiny sizes: every step ends after its samples in a fraction of a second on
#: any device, long before the budget, which is there for a loaded machine.
TINY = Plan("tiny", 30.0, 0.002, 1, 64, 64, (16, 32), (16, 32), (2, 16), (2, 16))


@pytest.fixture(scope="module")
def cpu_run():
    """The quick plan at the sizes a user gets, in 4 s: on a loaded machine the last steps
    may find the budget spent (and say so in a note)."""
    return measure(inventory(kinds=("cpu",)), "quick", budget=4.0)


@pytest.fixture(scope="module")
def tiny_run():
    """Every step of the CPU, each done well within its share whatever the load."""
    return measure(inventory(kinds=("cpu",)), TINY)


# ----------------------------------------------------------------------------- on this CPU


def test_every_number_is_positive_finite_and_has_a_unit(cpu_run):
    assert {r.name for r in cpu_run.results} == {"matmul-fp32", "matmul-bf16", "memory-copy"}
    for r in cpu_run.results:
        assert r.device == "cpu"
        assert math.isfinite(r.value) and r.value > 0, r
        assert r.unit == ("GB/s" if r.name == "memory-copy" else "GFLOP/s")
        assert r.detail and r.size > 0  # sizes and time per operation
    assert 0 < cpu_run.seconds < 4.0 + MARGIN


def test_memory_copy_is_a_plausible_dram_bandwidth(cpu_run):
    assert 0.01 < cpu_run.result("cpu", "memory-copy").value < 2000  # GB/s


def test_levers_on_the_cpu_carry_times_spreads_and_verdicts(tiny_run):
    by_name = {lv.name: lv for lv in tiny_run.levers}
    assert {"fast-matmul", "autocast", "channels-last", "threads"} <= set(by_name)
    for lv in by_name.values():
        assert lv.device == "cpu"
        if lv.verdict != "n/a":
            assert lv.baseline > 0 and lv.lever > 0
            assert lv.speedup == pytest.approx(lv.baseline / lv.lever)
            assert lv.low <= lv.high and lv.pairs >= 1
        assert lv.advice
    autocast = by_name["autocast"]
    bf16_cpu = inventory(kinds=("cpu",)).devices[0].bf16
    assert (autocast.verdict == "n/a") == (not bf16_cpu)  # fp32-only CPUs: nothing to try
    assert not any(lv.name in ("pinned-memory", "overlap") for lv in tiny_run.levers)


def test_the_cpu_row_compares_with_itself(tiny_run):
    (row,) = tiny_run.devices
    assert row.device == "cpu" and row.vs_cpu == pytest.approx(1.0)
    assert row.step_fp32 > 0 and row.step_best <= row.step_fp32
    assert row.h2d is None  # nothing to copy to
    assert row.best_dtype in ("fp32", "bf16")
    assert any(a.startswith("Only the CPU here") for a in tiny_run.advice)


def test_the_training_step_reports_its_flops_and_mfu(tiny_run):
    (row,) = tiny_run.devices
    batch, width = step_size_of(tiny_run)
    # 4 Linear(width, width) layers: forward 2*b*w*w each, backward twice that (no bias
    # FLOPs in FlopCounterMode), LayerNorm/GELU/SGD count nothing.
    assert row.step_flops == 6 * 4 * batch * width * width
    fp32 = tiny_run.result("cpu", "matmul-fp32")
    expected = row.step_flops / row.step_fp32 / (fp32.value * 1e9)
    if expected > 1:  # the peak was measured while other processes took cores: no MFU
        assert row.mfu_fp32 is None and row.mfu_invalid, row
        return
    assert row.mfu_fp32 == pytest.approx(expected)
    # where the CPU has native bf16 the doctor measures a bf16 matmul too: its own source
    assert "fp32 matmul measured here" in row.mfu_source.split("; ")
    data = json.loads(json.dumps(tiny_run.to_dict()))["devices"][0]
    assert data["mfu_fp32"] == pytest.approx(expected) and data["step_flops"] == row.step_flops


def step_size_of(m):
    """(batch, width) of the step, read back from the step's description."""
    import re

    found = re.search(r"(\d+) layers of (\d+), batch (\d+)", m.step)
    assert found, m.step
    return int(found.group(3)), int(found.group(2))


def test_to_dict_is_json_ready_with_units_spreads_and_load(cpu_run):
    data = json.loads(json.dumps(cpu_run.to_dict()))
    assert data["plan"] == "quick" and data["budget"] == 4.0
    assert all(r["unit"] in ("GFLOP/s", "GB/s") for r in data["results"])
    for lv in data["levers"]:
        assert lv["unit"] == "s" and lv["verdict"] and "noisy" in lv and "spread" in lv
    assert data["load"]["usable"] >= 1 and isinstance(data["load"]["busy"], bool)


def test_the_budget_holds_with_work_that_is_slow_here():
    """bf16 matmuls without native bf16 (this CPU: ~500x slower than fp32) and emulated
    bf16 autocast steps: the run stays within its budget whatever the device's speed."""
    cpu = dataclasses.replace(inventory(kinds=("cpu",)).devices[0], bf16=True, tf32=True)
    plan = dataclasses.replace(PLANS["default"], budget=3.0)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # its first import is not measuring
    start = time.perf_counter()
    m = run_plan(inventory(kinds=("cpu",)), [cpu], plan)
    wall = time.perf_counter() - start
    assert wall < 3.0 + MARGIN, wall
    assert m.seconds <= wall
    bf16 = m.result("cpu", "matmul-bf16")
    assert bf16 is not None and bf16.size >= 64  # measured, at the size it reached
    assert f"{bf16.size}x{bf16.size}" in bf16.detail


def test_a_deliberately_slow_lever_is_cut_to_its_slot():
    from anydevice.doctor.budget import Budget, sized

    def make(size):  # each call takes size ms: 4 s at the largest size
        return (lambda: time.sleep(size / 1000),)

    start = time.perf_counter()
    timed = sized(make, [1, 10, 100, 1000, 4000], Budget(10).slot(0.4), sample=0.5)
    wall = time.perf_counter() - start
    assert wall < 4.0 + 1.5, wall  # a slot ignored would run a 4 s call on top
    assert timed.size == 100 and timed.capped  # 1 s calls would not have fit in 4 s
    assert 0.09 < timed.median() < 0.2
    assert len(timed.times[0]) >= 3


def test_advice_comes_only_where_the_spread_allows_it():
    """The readings of a loaded 2-core machine, by hand: the threads lever at 9.02x ±83 %
    and a bf16 matmul setting at 2.1x ±70 % (both once "use"), channels_last at 1.4x ±10 %.
    Only the last is advice; the threads line says to measure again, and sets nothing."""
    from anydevice.doctor.load import Load
    from anydevice.doctor.measure import _advice

    inv = Inventory(host=host(cores_logical=2, cores_usable=2), devices=(cpu_device(bf16=True),))
    run = Run(PLANS["quick"])
    threads = Lever("cpu", "threads", "torch threads = free cores", "the step",
                    "torch.set_num_threads(1)", 0.1804, 0.02, low=1.5, high=16.5, pairs=9,
                    noisy=True)  # fmt: skip
    fast = Lever("cpu", "fast-matmul", "reduced-precision fp32 matmuls", "a matmul",
                 'with ad.fast_matmul("medium"): ...', 2.1, 1.0, low=1.2, high=4.14, pairs=9,
                 noisy=True)  # fmt: skip
    conv = Lever("cpu", "channels-last", "channels_last", "a conv step",
                 "model = ad.channels_last(model)", 1.4, 1.0, low=1.26, high=1.54,
                 pairs=9)  # fmt: skip
    run.levers += [threads, fast, conv]
    assert [lv.verdict for lv in run.levers] == ["noisy", "noisy", "use"]
    load = Load(usable=2, others=1.6, torch_threads=2, measured_with=1, free_at_start=1)
    said = "\n".join(_advice(inv, (), run, load))
    assert "set_num_threads" not in said and "OMP_NUM_THREADS" not in said, said
    assert "9.02x (±83%): noisy: measure again when the machine is quiet." in said
    assert "Keep torch's default" not in said  # no verdict either way
    assert "fast_matmul" not in said
    assert "cpu: channels_last, 1.40x faster here (±10%): model = ad.channels_last(model)" in said
    m = Measurements("quick", 3.0, levers=tuple(run.levers), load=load)
    assert m.to_dict()["load"]["advice"] is None  # the load's own thread advice withdrawn


def test_an_emulated_dtype_measured_noisily_keeps_the_fact_not_the_factor():
    inv = Inventory(host=host(), devices=(cpu_device(bf16=False),))
    run = Run(PLANS["quick"])
    run.add(Measured("cpu", "matmul-fp32", "matmul fp32", 65.3, "GFLOP/s", noisy=True))
    run.add(Measured("cpu", "matmul-bf16", "matmul bf16", 7.65, "GFLOP/s", noisy=True))
    (line,) = _emulated(inv, run)
    assert line.startswith("bf16 is emulated on cpu (no native bf16 units): keep fp32 there")
    assert "9x" not in line and "measure again when the machine is quiet" in line
    unknown = Inventory(host=host(), devices=(cpu_device(bf16=None),))
    (line,) = _emulated(unknown, run)
    assert "readings are noisy" in line and "keep fp32" not in line


def test_an_emulated_dtype_becomes_advice():
    inv = Inventory(host=host(), devices=(cpu_device(bf16=False),))
    run = Run(PLANS["quick"])
    run.add(Measured("cpu", "matmul-fp32", "matmul fp32", 120.0, "GFLOP/s"))
    run.add(Measured("cpu", "matmul-bf16", "matmul bf16", 0.25, "GFLOP/s"))
    (line,) = _emulated(inv, run)
    assert line.startswith("bf16 is emulated on cpu: 480x slower than fp32")
    assert "keep fp32" in line
    run.results[1] = Measured("cpu", "matmul-bf16", "matmul bf16", 600.0, "GFLOP/s")
    assert _emulated(inv, run) == []


def test_every_gpu_branch_runs_on_the_cpu_with_tiny_sizes():
    """The CUDA steps (copies, pinned memory, overlap, TF32, autocast) and the other
    accelerators' steps, run on this CPU: a crash after the timing shows here."""
    cpu = dataclasses.replace(inventory(kinds=("cpu",)).devices[0], bf16=True, tf32=True)
    for kind, names in [
        ("cuda", {"matmul-fp32", "matmul-tf32", "matmul-bf16", "matmul-fp16", "memory-copy",
                  "h2d-pageable", "h2d-pinned", "d2h-pageable", "d2h-pinned"}),
        ("mps", {"matmul-fp32", "matmul-bf16", "matmul-fp16", "memory-copy", "h2d-pageable",
                 "d2h-pageable"}),
    ]:  # fmt: skip
        m = run_plan(inventory(kinds=("cpu",)), [cpu], TINY, branch=lambda d, k=kind: k)
        assert m.notes == (), (kind, m.notes)
        assert {r.name for r in m.results} == names, kind
        assert all(math.isfinite(r.value) and r.value > 0 for r in m.results)
        levers = {lv.name: lv for lv in m.levers}
        expected = {"fast-matmul", "autocast", "channels-last"}
        if kind == "cuda":
            expected |= {"pinned-memory", "overlap"}
        assert set(levers) == expected, kind
        if kind != "cuda":
            assert levers.pop("fast-matmul").verdict == "n/a"  # no TF32 off CUDA
        assert all(lv.speedup and lv.speedup > 0 for lv in levers.values()), levers
        assert m.devices[0].step_best is not None


def test_a_failing_measurement_becomes_a_note_and_the_rest_still_run():
    broken = dataclasses.replace(TINY, cpu_matmul=-1)  # no n x n matmul with n = -1
    m = measure(inventory(kinds=("cpu",)), broken)
    assert any("matmul fp32: not measured (RuntimeError" in n for n in m.notes)
    assert m.result("cpu", "memory-copy") is not None  # measured after the failures
    assert any(lv.name == "channels-last" and lv.speedup for lv in m.levers)


def test_examine_measures_only_when_asked():
    inv = inventory(kinds=("cpu",))
    assert examine(inv, environ={}).measurements is None
    report = examine(inv, environ={}, measure=TINY)
    assert report.measurements is not None
    assert report.to_dict()["measurements"]["plan"] == "tiny"


def test_progress_counts_every_step_ends_done_and_shows_the_time_left():
    calls = []
    measure(inventory(kinds=("cpu",)), TINY, progress=lambda *a: calls.append(a))
    total = calls[0][1]
    assert [c[0] for c in calls] == list(range(total + 1))
    assert calls[-1][:3] == (total, total, "done")
    assert calls[0][2] == "cpu: matmul fp32"
    lefts = [c[3] for c in calls]
    assert lefts == sorted(lefts, reverse=True) and 0 <= lefts[-1] <= lefts[0] <= TINY.budget


def test_strict_fp32_turns_reduced_precision_off_and_restores_it():
    before = _Saved.save()  # MathSettings only reads; this puts everything back
    torch.set_float32_matmul_precision("high")
    try:
        outer = MathSettings.capture()
        with strict_fp32():
            assert torch.get_float32_matmul_precision() == "highest"
        assert MathSettings.capture() == outer
    finally:
        before.restore()


def test_the_channels_last_advice_agrees_with_the_api_docs(tiny_run):
    (lever,) = [lv for lv in tiny_run.levers if lv.name == "channels-last"]
    assert "inputs may stay NCHW" in lever.how and "NCHW images" in lever.workload
    api = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    assert "Inputs may stay NCHW" in api
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3)).to(memory_format=torch.channels_last)
    out = net(torch.randn(2, 3, 8, 8))  # an NCHW input
    assert out.is_contiguous(memory_format=torch.channels_last)  # the claim itself


# ----------------------------------------------------------------------------- pure parts


def test_unknown_plan_and_device_are_named():
    inv = machine(gpu(0))
    with pytest.raises(ValueError, match="plan='huge'"):
        measure(inv, "huge")
    with pytest.raises(DeviceNotFoundError, match="cuda:7"):
        measure(inv, TINY, devices=["cuda:7"])
    with pytest.raises(DeviceSpecError, match="banana"):
        measure(inv, TINY, devices=["banana"])


def test_one_gpu_of_each_model_by_default_every_gpu_with_full():
    inv = machine(gpu(0), gpu(1), gpu(2, "A100"))
    assert [d.spec for d in choose_devices(inv, PLANS["default"])] == ["cuda:0", "cuda:2", "cpu"]
    assert len(choose_devices(inv, PLANS["full"])) == 4


def test_devices_are_read_with_ad_devices_grammar():
    from anydevice.doctor import resolve_devices

    inv = machine(gpu(0), gpu(1))
    specs = ["CPU", "1", "gpu:0", "cuda:1", "auto", "cpu:0"]
    assert [d.spec for d in resolve_devices(inv, specs, {})] == ["cpu", "cuda:1", "cuda:0"]
    assert [d.spec for d in resolve_devices(inv, ["auto"], {"ANYDEVICE_DEVICE": "cuda:1"})] == [
        "cuda:1"
    ]


def test_plans_budgets_are_the_documented_ones():
    assert {name: p.budget for name, p in PLANS.items()} == {
        "quick": 10.0,
        "default": 30.0,
        "full": 180.0,
    }


@pytest.mark.parametrize(
    ("low", "high", "verdict", "words"),
    [
        (1.8, 2.2, "use", "faster here"),
        (0.8, 0.9, "slower", "slower here"),
        (1.01, 1.04, "no-gain", "no gain here"),
        (0.8, 1.5, "no-gain", "no clear difference"),  # the spread straddles 1x
        (0.99, 1.3, "no-gain", "no clear difference"),
        # wider than ±50 %: whichever side of 1x, nothing to act on
        (1.5, 16.5, "noisy", "noisy: measure again when the machine is quiet"),
        (0.7, 3.0, "noisy", "noisy: measure again when the machine is quiet"),
        (0.05, 0.6, "noisy", "noisy: measure again when the machine is quiet"),
    ],
)
def test_a_verdict_needs_the_whole_spread_on_one_side(low, high, verdict, words):
    median = (low + high) / 2
    lv = Lever("cpu", "channels-last", "NHWC", "a step", "ad.channels_last(model)",
               median, 1.0, low=low, high=high, pairs=7)  # fmt: skip
    assert lv.verdict == verdict
    assert words in lv.advice
    assert f"±{(high - low) / 2 / median:.0%}" in lv.advice
    data = lv.to_dict()
    assert data["spread"] == pytest.approx((high - low) / 2 / median)
    assert data["verdict"] == verdict and data["pairs"] == 7


def test_too_few_pairs_give_no_verdict():
    lv = Lever("cpu", "threads", "t", "w", "h", 2.0, 1.0, low=1.9, high=2.1, pairs=2)
    assert lv.verdict == "no-gain" and "2 pair(s) only" in lv.advice


@pytest.mark.parametrize(
    ("baseline", "lever", "verdict"),
    [(2.0, 1.0, "use"), (1.0, 0.95, "no-gain"), (1.0, 1.02, "no-gain"), (1.0, 1.2, "slower")],
)
def test_a_lever_without_a_spread_follows_the_speedup(baseline, lever, verdict):
    lv = Lever("cuda:0", "autocast", "mixed precision", "a step", "p.autocast()", baseline, lever)
    assert lv.verdict == verdict
    assert lv.advice.startswith(f"{baseline / lever:.2f}x")
    assert ("p.autocast()" in lv.advice) == (verdict == "use")


def test_a_lever_that_does_not_apply_says_why():
    lv = Lever("cuda:0", "fast-matmul", "TF32", "", "", note="no TF32 on compute capability 7.0")
    assert (lv.verdict, lv.speedup, lv.advice) == ("n/a", None, lv.note)


def test_interleaved_pairs_give_a_median_and_a_spread():
    from anydevice.doctor.budget import compare

    c = compare([2.0, 2.2, 1.8, 2.0, 4.0], [1.0, 1.1, 0.9, 1.0, 2.0])  # a slow pair: both slow
    assert c.speedup == pytest.approx(2.0) and c.low == c.high == pytest.approx(2.0)
    assert c.clear and not c.noisy and c.pairs == 5
    mixed = compare([1.0, 1.3, 0.8, 1.1], [1.0, 1.0, 1.0, 1.0])
    assert mixed.low < 1.0 < mixed.high and not mixed.clear


def test_measured_share_of_peak_and_repr():
    m = Measured("cuda:0", "matmul-bf16", "matmul bf16", 791.5e3, "GFLOP/s", 989.4e3, "H100")
    assert m.fraction == pytest.approx(0.8, abs=1e-3)
    assert "80% of H100" in repr(m)
    assert Measured("cpu", "memory-copy", "copy", 40.0, "GB/s").fraction is None


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA GH200 480GB", "GH200 480GB"),
        ("NVIDIA GH200 144G HBM3e", "GH200 144GB"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10", "A10"),
        ("Tesla T4", "T4"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
    ],
)
def test_gpu_peaks_are_found_by_name(name, model):
    assert gpu_peak(gpu(0, name=name)).model == model


def test_a_gh200_is_not_taken_for_an_h200():
    peak = gpu_peak(gpu(0, name="NVIDIA GH200 480GB"))
    assert peak.memory_gbps == 4000.0  # HBM3 at 4.0 TB/s, not the H200's 4.8


def test_no_peak_for_unknown_gpus_mig_slices_and_cpus():
    assert gpu_peak(gpu(0, name="NVIDIA Future GPU")) is None
    assert gpu_peak(gpu(0, mig_parent="GPU-1111")) is None
    assert gpu_peak(cpu_device()) is None
    t4 = gpu_peak(gpu(0, "T4"))
    assert set(t4.tflops) == {"fp32", "fp16"}  # no bf16 or TF32 units on Turing


def test_pcie_peak_from_generation_and_width():
    assert pcie_peak(3, 16) == pytest.approx(15.75, abs=0.01)
    assert pcie_peak(4, 8) == pytest.approx(pcie_peak(3, 16))  # half the lanes, twice the rate
    assert pcie_peak(5, 16) == pytest.approx(63.02, abs=0.01)
    assert pcie_peak(1, 16) == pytest.approx(4.0)  # 8b/10b encoding
    assert pcie_peak(None, 16) is None
    assert pcie_peak(9, 16) is None
