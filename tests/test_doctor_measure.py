"""The doctor's measurements: real timings on this CPU, the pure parts on hand-built data."""

from __future__ import annotations

import math

import pytest
import torch

from anydevice.doctor import examine
from anydevice.doctor.measure import (
    PLANS,
    Lever,
    Measured,
    Plan,
    _choose,
    measure,
    strict_fp32,
)
from anydevice.doctor.peaks import gpu_peak, pcie_peak
from anydevice.inventory import inventory
from anydevice.matmul import MathSettings
from machines import cpu_device, gpu, machine

GHZ = 5.0  #: no CPU core here runs faster
#: FLOP per cycle per core at most: AVX-512 fp32 (2 FMA units x 16 lanes x 2), AMX bf16.
FLOP_PER_CYCLE = {"fp32": 64, "bf16": 2048}


@pytest.fixture(scope="module")
def cpu_run():
    return measure(inventory(kinds=("cpu",)), "quick")


# ----------------------------------------------------------------------------- on this CPU


def test_every_number_is_positive_finite_and_has_a_unit(cpu_run):
    assert {r.name for r in cpu_run.results} == {"matmul-fp32", "matmul-bf16", "memory-copy"}
    for r in cpu_run.results:
        assert r.device == "cpu"
        assert math.isfinite(r.value) and r.value > 0, r
        assert r.unit == ("GB/s" if r.name == "memory-copy" else "GFLOP/s")
        assert r.detail  # sizes and time per operation
    assert cpu_run.notes == ()
    assert 0 < cpu_run.seconds < 60


def test_cpu_throughput_is_below_what_its_cores_could_do(cpu_run):
    cores = inventory(kinds=("cpu",)).host.cores_logical
    for dtype, per_cycle in FLOP_PER_CYCLE.items():
        value = cpu_run.result("cpu", f"matmul-{dtype}").value
        assert 0.5 < value < cores * GHZ * per_cycle, (dtype, value)  # GFLOP/s


def test_memory_copy_is_a_plausible_dram_bandwidth(cpu_run):
    assert 0.5 < cpu_run.result("cpu", "memory-copy").value < 2000  # GB/s


def test_levers_on_the_cpu_carry_times_and_verdicts(cpu_run):
    by_name = {lv.name: lv for lv in cpu_run.levers}
    assert set(by_name) == {"fast-matmul", "autocast", "channels-last"}
    for lv in by_name.values():
        assert lv.device == "cpu"
        if lv.verdict != "n/a":
            assert lv.baseline > 0 and lv.lever > 0
            assert lv.speedup == pytest.approx(lv.baseline / lv.lever)
        assert lv.advice
    autocast = by_name["autocast"]
    bf16_cpu = inventory(kinds=("cpu",)).devices[0].bf16
    assert (autocast.verdict == "n/a") == (not bf16_cpu)  # fp32-only CPUs: nothing to try
    assert not any(lv.name in ("pinned-memory", "overlap") for lv in cpu_run.levers)


def test_the_cpu_row_compares_with_itself(cpu_run):
    (row,) = cpu_run.devices
    assert row.device == "cpu" and row.vs_cpu == pytest.approx(1.0)
    assert row.step_fp32 > 0 and row.step_best <= row.step_fp32
    assert row.h2d is None  # nothing to copy to
    assert row.best_dtype in ("fp32", "bf16")
    assert cpu_run.advice[0].startswith("Only the CPU here")


def test_to_dict_is_json_ready_with_units(cpu_run):
    import json

    data = json.loads(json.dumps(cpu_run.to_dict()))
    assert data["plan"] == "quick"
    assert all(r["unit"] in ("GFLOP/s", "GB/s") for r in data["results"])
    assert all(lv["unit"] == "s" and lv["verdict"] for lv in data["levers"])


def test_a_failing_measurement_becomes_a_note_and_the_rest_still_run():
    broken = Plan("broken", 0.01, 1, -1, 8, (8, 16), (8, 16), (2, 8), (2, 8))  # n = -1
    m = measure(inventory(kinds=("cpu",)), broken)
    assert any("matmul fp32: not measured (RuntimeError" in n for n in m.notes)
    assert m.result("cpu", "memory-copy") is not None  # measured after the failures
    assert any(lv.name == "channels-last" and lv.speedup for lv in m.levers)


def test_examine_measures_only_when_asked():
    inv = inventory(kinds=("cpu",))
    assert examine(inv, environ={}).measurements is None
    report = examine(inv, environ={}, measure="quick")
    assert report.measurements is not None
    assert report.to_dict()["measurements"]["plan"] == "quick"


def test_progress_counts_every_step_and_ends_done():
    calls = []
    measure(inventory(kinds=("cpu",)), "quick", progress=lambda *a: calls.append(a))
    total = calls[0][1]
    assert [c[0] for c in calls] == list(range(total + 1))
    assert calls[-1] == (total, total, "done")
    assert calls[0][2] == "cpu: matmul fp32"


def test_strict_fp32_turns_reduced_precision_off_and_restores_it():
    before = MathSettings.capture()
    torch.set_float32_matmul_precision("high")
    try:
        outer = MathSettings.capture()
        with strict_fp32():
            assert torch.get_float32_matmul_precision() == "highest"
        assert MathSettings.capture() == outer
    finally:
        before.restore()


# ----------------------------------------------------------------------------- pure parts


def test_unknown_plan_and_device_are_named():
    inv = machine(gpu(0))
    with pytest.raises(ValueError, match="plan='huge'"):
        measure(inv, "huge")
    with pytest.raises(ValueError, match=r"No device 'cuda:7' here; the devices are cuda:0, cpu"):
        _choose(inv, ["cuda:7"], PLANS["quick"])


def test_one_gpu_of_each_model_by_default_every_gpu_with_full():
    inv = machine(gpu(0), gpu(1), gpu(2, "A100"))
    assert [d.spec for d in _choose(inv, None, PLANS["default"])] == ["cuda:0", "cuda:2", "cpu"]
    assert len(_choose(inv, None, PLANS["full"])) == 4
    assert [d.spec for d in _choose(inv, ["cpu", "cuda:1"], PLANS["quick"])] == ["cpu", "cuda:1"]


@pytest.mark.parametrize(
    ("baseline", "lever", "verdict"),
    [(2.0, 1.0, "use"), (1.0, 0.95, "no-gain"), (1.0, 1.02, "no-gain"), (1.0, 1.2, "slower")],
)
def test_lever_verdicts_follow_the_speedup(baseline, lever, verdict):
    lv = Lever("cuda:0", "autocast", "mixed precision", "a step", "p.autocast()", baseline, lever)
    assert lv.verdict == verdict
    assert lv.advice.startswith(f"{baseline / lever:.2f}x")
    assert ("p.autocast()" in lv.advice) == (verdict == "use")


def test_a_lever_that_does_not_apply_says_why():
    lv = Lever("cuda:0", "fast-matmul", "TF32", "", "", note="no TF32 on compute capability 7.0")
    assert (lv.verdict, lv.speedup, lv.advice) == ("n/a", None, lv.note)


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
