"""Live readings for ``anydevice top``: the host here, GPUs from hand-built NVML records."""

from __future__ import annotations

import json
import os
import time

import psutil
from rich.console import Console

from anydevice.hardware.facts import ProcessInfo
from anydevice.hardware.gpuwatch import GpuReading, HostReading, Reading, Watcher, gpu_readings
from anydevice.hardware.render import top_view
from conftest import cuda_gpu_present
from machines import GiB, mig, record


def test_first_reading_measures_the_cpu_over_a_real_interval():
    w = Watcher()
    t = time.monotonic()
    r = w.read()
    assert time.monotonic() - t >= Watcher.FIRST_SAMPLE_S * 0.9
    h = r.host
    assert 0.0 <= h.cpu_percent <= 100.0
    assert h.cores == os.cpu_count()
    assert h.memory_total == psutil.virtual_memory().total
    assert 0 < h.memory_used < h.memory_total
    assert json.loads(json.dumps(r.to_dict()))["schema"] == "anydevice.top/1"


def test_readings_are_stamped_by_the_clock_given():
    ticks = iter([100.0, 101.5])
    w = Watcher(clock=lambda: next(ticks))
    assert [w.read().time, w.read().time] == [100.0, 101.5]


def test_without_a_gpu_the_reading_says_so():
    if cuda_gpu_present():
        return  # the GPU case is tested in test_cli with a real GPU
    r = Watcher().read()
    assert r.gpus == ()
    assert r.notes and r.notes[0].startswith("no GPU")


def test_every_gpu_is_listed_with_cuda_and_nvidia_smi_indices():
    gpus = [record(0, free=10 * GiB), record(1), record(2)]
    readings, notes = gpu_readings(gpus, {"CUDA_VISIBLE_DEVICES": "2,0"})
    assert [(g.smi_index, g.cuda_index) for g in readings] == [(0, 1), (1, None), (2, 0)]
    assert readings[0].memory_used == 70 * GiB and readings[0].memory_total == 80 * GiB
    assert notes == ()


def test_mig_devices_follow_their_gpu():
    gpus = [mig(record(0), 1, 2), record(1)]
    readings, _ = gpu_readings(gpus, {})
    assert [g.mig_parent is not None for g in readings] == [False, True, True, False]
    assert [g.smi_index for g in readings] == [0, 0, 0, 1]
    # CUDA shows one MIG device per process, and the GPU in MIG mode is not one itself.
    assert [g.cuda_index for g in readings] == [None, 0, None, 1]


def test_top_view_shows_gpus_processes_and_the_host():
    host = HostReading("box", 37.0, 16, (1.0, 0.5, 0.25), 64 * GiB, 48 * GiB)
    gpu = GpuReading(
        smi_index=3,
        cuda_index=0,
        uuid="GPU-x",
        name="NVIDIA H100 80GB HBM3",
        memory_used=20 * GiB,
        memory_total=80 * GiB,
        utilization=97.0,
        temperature=61.0,
        power=512.0,
        power_limit=700.0,
        processes=(ProcessInfo(4242, "python", 19 * GiB),),
    )
    hidden = GpuReading(smi_index=0, cuda_index=None, uuid="GPU-y", name="Tesla T4")
    console = Console(record=True, width=160)
    console.print(top_view(Reading(0.0, host, (gpu, hidden))))
    text = console.export_text()
    assert "box" in text and "CPU 37% of 16 cores" in text and "16.0 GiB / 64.0 GiB (25%)" in text
    row = next(line for line in text.splitlines() if "H100" in line)
    for cell in ("cuda:0", "3", "20.0 GiB / 80.0 GiB (25%)", "97%", "61 °C", "512 / 700 W"):
        assert cell in row, cell
    assert "4242" in text and "19.0 GiB" in text
    t4 = next(line for line in text.splitlines() if "Tesla T4" in line)
    assert " - " in t4 and "unknown" in t4
    console = Console(record=True, width=160)
    console.print(top_view(Reading(0.0, host, (), ("no GPU: no driver.",))))
    assert "no GPU: no driver." in console.export_text()
