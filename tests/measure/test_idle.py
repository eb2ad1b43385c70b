"""Idle time read from trace events: the gap logic on traces laid out by hand (data, as an
Inventory is for selection), and a trace file that torch really wrote."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from anydevice.measure.idle import idle_time, read_trace


def step(ts: float, dur: float, n: int = 1) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": ts, "dur": dur}


def launch(ts: float, corr: int, dur: float = 5.0) -> dict:
    return {
        "ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur,
        "args": {"correlation": corr},
    }  # fmt: skip


def kernel(ts: float, dur: float, corr: int, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur, "args": {"correlation": corr}}


def data(ts: float, dur: float) -> dict:
    name = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def test_a_busy_device_is_not_idle():
    t = idle_time([step(0, 100), launch(0, 1, 1), kernel(0, 100, 1)])
    assert t is not None and t.idle == 0 and t.idle_share == 0
    assert t.host_wait == t.data_wait == t.other == 0


def test_launch_bound_gaps_are_host_time():
    # Three 10 us kernels, each launched only when the host gets to it, 30 us apart.
    events = [step(0, 90)]
    for i in range(3):
        events += [launch(30 * i, i), kernel(30 * i + 5, 10, i)]
    t = idle_time(events)
    assert t is not None
    assert t.window == pytest.approx(90e-6) and t.active == pytest.approx(30e-6)
    # gaps: [0,5) waits for launch at 0 -> other 5; [15,35) host until 30 then other 5;
    # [45,65) likewise; [75,90) after the last kernel: host
    assert t.host_wait == pytest.approx((15 + 15 + 15) * 1e-6)
    assert t.other == pytest.approx((5 + 5 + 5) * 1e-6)
    assert t.data_wait == 0
    assert t.host_wait + t.other + t.data_wait == pytest.approx(t.idle)
    assert "launch-bound" in t.summary() and "Device idle 66.7%" in t.summary()


def test_host_time_in_the_data_loader_is_waiting_on_data():
    events = [step(0, 100), data(0, 60), launch(70, 1), kernel(80, 20, 1)]
    t = idle_time(events)
    assert t is not None
    assert t.data_wait == pytest.approx(60e-6)
    assert t.host_wait == pytest.approx(10e-6)  # 60..70: the host, after the batch came
    assert t.other == pytest.approx(10e-6)  # 70..80: launched, not yet running


def test_work_queued_early_but_started_late_is_other():
    # Launched at 0, but waits (behind an event, another stream) until 50.
    t = idle_time([step(0, 100), launch(0, 1), kernel(50, 50, 1)])
    assert t is not None and t.other == pytest.approx(50e-6) and t.host_wait == 0


def test_overlapping_streams_and_copies_count_once():
    events = [
        step(0, 100),
        launch(0, 1),
        launch(1, 2),
        kernel(10, 50, 1),
        kernel(20, 60, 2, cat="gpu_memcpy"),
    ]
    t = idle_time(events)
    assert t is not None and t.active == pytest.approx(70e-6)


def test_without_steps_the_window_is_the_host_events():
    op = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 40}
    t = idle_time([op])
    assert t is not None and t.window == pytest.approx(40e-6) and t.active is None
    assert "No accelerator activity" in t.summary()
    assert idle_time([]) is None


def test_reads_a_trace_torch_wrote_gzipped_or_not(tmp_path):
    a = torch.randn(32, 32)
    with torch.profiler.profile() as prof:
        torch.mm(a, a)
    plain = tmp_path / "t.json"
    prof.export_chrome_trace(str(plain))
    packed = tmp_path / "t.json.gz"
    with gzip.open(packed, "wt") as f:
        f.write(plain.read_text())
    assert read_trace(plain) == read_trace(packed) == json.loads(plain.read_text())["traceEvents"]
    t = idle_time(read_trace(plain))
    assert t is not None and t.window > 0 and t.active is None and t.data_wait == 0
