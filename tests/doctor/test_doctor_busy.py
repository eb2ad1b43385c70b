"""The doctor on a busy machine: every number says the threads it was measured with and
whether other processes were busy, no MFU above 100 %, advice that follows the verdicts,
and a table and a picture that read whole. The contention is real: a child process that
keeps one core busy while the doctor measures."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from rich.console import Console

from anydevice.doctor.measure import _mfu, measure
from anydevice.doctor.render import devices_table, results_table
from anydevice.doctor.results import DeviceSummary, Lever, Measured, Measurements
from anydevice.doctor.workloads import Run
from anydevice.hardware.inventory import inventory
from anydevice.measure.samples import format_time
from machines import cpu_device

SPIN = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"


@pytest.fixture(scope="module")
def busy_run():
    """A quick doctor run while a child process spins on a core (ended afterwards)."""
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        return measure(inventory(kinds=("cpu",)), "quick", budget=4.0)
    finally:
        spinner.kill()
        spinner.wait(timeout=30)


def test_every_number_says_its_threads_and_the_busy_ones_say_so(busy_run):
    assert busy_run.load is not None and busy_run.load.busy, busy_run.load
    threads = busy_run.load.measured_with
    for r in busy_run.results:
        assert r.threads == threads, r
        assert f"{threads} thread(s)" in r.conditions
        if r.busy:
            assert r.noisy and "busy" in r.conditions
    data = json.loads(json.dumps(busy_run.to_dict()))
    assert all(r["threads"] == threads and "busy" in r for r in data["results"])
    assert data["load"]["free_at_start"] >= 1


def test_no_mfu_is_above_one_and_an_invalid_one_says_why(busy_run):
    for d in busy_run.devices:
        for mfu in (d.mfu_fp32, d.mfu_best):
            assert mfu is None or 0 < mfu <= 1, d
        if d.mfu_invalid:
            assert "no " in d.mfu_invalid and "quiet" in d.mfu_invalid
            assert d.mfu_invalid in busy_run.advice


def test_advice_on_threads_follows_the_threads_lever(busy_run):
    lever = next((lv for lv in busy_run.levers if lv.name == "threads" and lv.speedup), None)
    said = " ".join(busy_run.advice)
    data = busy_run.to_dict()
    if lever is not None and lever.verdict != "use":
        assert "Set torch.set_num_threads" not in said
        assert data["load"]["advice"] is None
    if lever is not None and lever.verdict == "use":
        assert lever.how in said
    if lever is not None and lever.verdict == "noisy":
        assert "measure again when the machine is quiet" in said
    assert "use all" not in said  # not beside a load that kept cores busy


def test_no_advice_from_a_lever_whose_spread_is_too_wide(busy_run):
    from anydevice.doctor.results import MAX_SPREAD

    said = " ".join(busy_run.advice)
    for lv in busy_run.levers:
        if lv.spread is not None and lv.pairs >= 3 and lv.spread > MAX_SPREAD:
            assert lv.verdict == "noisy" and lv.how not in said, lv
        if lv.verdict == "use":
            assert lv.spread is None or lv.spread <= MAX_SPREAD, lv


def test_a_step_faster_than_the_measured_peak_gets_no_mfu_but_the_reason():
    """The peak measured while others took cores, the step at a quieter moment: the share
    would exceed 100 % (the doctor printed mfu_fp32 = 1.41)."""
    run = Run(measure_plan())
    run.add(Measured("cpu", "matmul-fp32", "matmul fp32", 50.0, "GFLOP/s", busy=True))
    mfu, source, invalid = _mfu(cpu_device(), run, 1e9, 1e-2, "fp32")  # 100 GFLOP/s
    assert mfu is None and source == "fp32 matmul measured here"
    assert "100 GFLOP/s, above the fp32 matmul measured here, 50 GFLOP/s" in invalid
    assert "busy" in invalid  # the conditions the peak was measured in
    mfu, _, invalid = _mfu(cpu_device(), run, 1e9, 4e-2, "fp32")  # 25 GFLOP/s
    assert mfu == pytest.approx(0.5) and invalid == ""


def measure_plan():
    from anydevice.doctor.workloads import PLANS

    return PLANS["quick"]


def test_the_80_column_tables_keep_their_headers_whole():
    row = DeviceSummary("cpu", "x", 6e-3, 4e-3, "bf16", 213.0, 1460.0, "bf16", 14.9, None, 1.0,
                        1e9, 0.6, 0.13, "fp32 matmul measured here")  # fmt: skip
    m = Measurements(
        "quick",
        3.0,
        results=(
            Measured("cpu", "matmul-fp32", "matmul fp32", 213.0, "GFLOP/s", threads=1, busy=True),
        ),
        devices=(row, dataclasses.replace(row, device="cpu2", mfu_best=None, mfu_invalid="x")),
        step="MLP training step: 4 layers of 512, batch 128, SGD",
    )
    console = Console(width=80, record=True, color_system=None)
    console.print(devices_table(m))
    console.print(results_table(m))
    text = console.export_text()
    assert "…" not in text, text
    assert "matmul" in text and "invalid" in text and "1 thread(s), busy" in text


def test_the_picture_leaves_out_empty_panels_and_starts_its_axes_at_0(tmp_path):
    pytest.importorskip("matplotlib")
    from anydevice.doctor.plot import _zero_or, plot

    assert _zero_or(format_time)(0.0, None) == "0"
    assert _zero_or(format_time)(2e-3, None) == format_time(2e-3)
    m = Measurements(
        "quick",
        3.0,
        results=(Measured("cpu", "matmul-fp32", "matmul fp32", 213.0, "GFLOP/s", threads=1),),
        levers=(Lever("cpu", "threads", "torch threads = free cores", "", "", note="n/a"),),
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = []
    original = plt.subplots

    def counting(*args, **kwargs):
        fig, axes = original(*args, **kwargs)
        drawn.append(axes.size)
        return fig, axes

    plt.subplots = counting
    try:
        assert plot(m, tmp_path / "d.png").stat().st_size > 0
    finally:
        plt.subplots = original
    assert drawn == [2]  # the matmul and the levers; no bandwidth, no step panel
