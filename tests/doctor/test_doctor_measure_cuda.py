"""The doctor on a real NVIDIA GPU: its numbers inside the device's known limits."""

from __future__ import annotations

import pytest

from anydevice.doctor.measure import measure
from anydevice.hardware.inventory import inventory
from anydevice.hardware.peaks import gpu_peak, pcie_peak

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.real_gpu("the doctor's speeds, against a GPU's datasheet and the CPU"),
]


@pytest.fixture(scope="module")
def gpu_run():
    inv = inventory()
    return inv, measure(inv, "quick", devices=["cuda:0", "cpu"])


def test_matmul_and_memory_stay_under_the_datasheet_peaks(gpu_run):
    inv, m = gpu_run
    info = next(d for d in inv.devices if d.spec == "cuda:0")
    peaks = gpu_peak(info)
    for r in m.results:
        if r.device != "cuda:0" or r.peak is None:
            continue
        assert r.value <= 1.05 * r.peak, r  # faster than the datasheet: the arithmetic is off
    if peaks is not None and "bf16" in peaks.tflops:
        bf16 = m.result("cuda:0", "matmul-bf16")
        assert bf16.value > 0.3 * bf16.peak, bf16  # a 4096^3 bf16 matmul is compute-bound
        assert bf16.value > 4 * m.result("cuda:0", "matmul-fp32").value  # Tensor Cores


def test_host_device_copies_stay_under_the_link_and_pinned_is_faster(gpu_run):
    inv, m = gpu_run
    info = next(d for d in inv.devices if d.spec == "cuda:0")
    link = pcie_peak(info.pcie_generation, info.pcie_width)
    for name in ("h2d-pageable", "h2d-pinned", "d2h-pageable", "d2h-pinned"):
        r = m.result("cuda:0", name)
        assert r is not None and r.unit == "GB/s" and r.value > 0.5, name
        if link is not None:
            assert r.value < link, r
    assert m.result("cuda:0", "h2d-pinned").value > m.result("cuda:0", "h2d-pageable").value


def test_gpu_levers_pay_where_they_should(gpu_run):
    inv, m = gpu_run
    levers = {lv.name: lv for lv in m.levers if lv.device == "cuda:0"}
    assert set(levers) == {"pinned-memory", "overlap", "fast-matmul", "autocast", "channels-last"}
    assert levers["overlap"].speedup > 1.2  # a copy hidden behind as long a compute
    info = next(d for d in inv.devices if d.spec == "cuda:0")
    if info.compute_capability and info.compute_capability >= (8, 0):
        assert levers["autocast"].verdict == "use"
        assert levers["fast-matmul"].verdict == "use"


def test_the_quick_plan_stays_within_its_budget_on_a_gpu(gpu_run):
    _, m = gpu_run
    assert m.budget == 10.0 and m.seconds < 10.0 + 3.0
    assert m.notes == ()  # every step found time and ran
    bf16 = m.result("cuda:0", "matmul-bf16")
    assert bf16 is None or bf16.size >= 1024  # a GPU grows its problems to real sizes


def test_the_gpu_beats_the_cpu_side_by_side(gpu_run):
    _, m = gpu_run
    rows = {d.device: d for d in m.devices}
    assert rows["cpu"].vs_cpu == pytest.approx(1.0)
    assert rows["cuda:0"].vs_cpu > 1.0
    assert rows["cuda:0"].h2d is not None
    assert any(line.startswith(("Train on cuda:0", "cuda:0")) for line in m.advice)
