"""Live readings for ``anydevice top``: the host and this machine's processes for real, GPUs
from hand-built NVML records, the screen from hand-built readings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
from rich.console import Console

from anydevice import heartbeat
from anydevice.hardware.backends.watch import nvidia_records
from anydevice.hardware.facts import DeviceReading, DeviceUse
from anydevice.hardware.gpuwatch import SCHEMA, HostReading, Reading, Watcher
from anydevice.hardware.jobs import ProcessReading, Progress
from anydevice.hardware.topview import History, sorted_processes, sparkline, top_view
from conftest import cuda_gpu_present
from machines import GiB, mig, record


def test_first_reading_measures_the_cpu_over_a_real_interval():
    t = time.monotonic()
    w = Watcher()  # the interval starts here; its own reads fill it first
    r = w.read()
    assert time.monotonic() - t >= Watcher.FIRST_SAMPLE_S
    h = r.host
    assert 0.0 <= h.cpu_percent <= 100.0
    assert h.cores == os.cpu_count()
    assert h.memory_total == psutil.virtual_memory().total
    assert 0 < h.memory_used < h.memory_total
    assert json.loads(json.dumps(r.to_dict()))["schema"] == SCHEMA == "anydevice.top/2"


def test_readings_are_stamped_by_the_clock_given():
    ticks = iter([100.0, 101.5])
    w = Watcher(clock=lambda: next(ticks))
    assert [w.read().time, w.read().time] == [100.0, 101.5]


def test_without_a_gpu_the_reading_says_so():
    if cuda_gpu_present():
        return  # the GPU case is tested in test_cli with a real GPU
    r = Watcher().read()
    assert r.devices == ()
    assert r.notes and r.notes[0].startswith("no GPU")


def test_a_process_with_a_heartbeat_is_read_with_its_rank_and_steps(tmp_path):
    """A real process publishing a heartbeat; the watcher reads it (read-only) with its
    /proc facts; once it is killed, its record is what it left behind."""
    code = (
        "import sys; from anydevice import heartbeat\n"
        "b = heartbeat.mine()\n"
        "for _ in range(5): b.step()\n"
        "print('ok', flush=True); sys.stdin.readline()\n"
    )
    env = {
        **os.environ,
        "ANYDEVICE_HEARTBEAT_DIR": str(tmp_path),
        "RANK": "1",
        "WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "job-w",
    }
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ok\n"
        w = Watcher(folders=[tmp_path])
        (row,) = [p for p in w.read().processes if p.pid == child.pid]
        assert (row.rank, row.world_size, row.job, row.role) == (1, 2, "job-w", "rank")
        assert row.progress is not None and row.progress.steps == 5
        assert row.cpu_percent is not None and row.rss and row.rss > 0
        child.kill()
        child.wait(30)
        r = w.read()
        assert child.pid not in {p.pid for p in r.processes}
        (left,) = [x for x in r.leftovers if x.pid == child.pid]
        assert left.kind == "record" and left.rank == 1
        assert heartbeat.read_all(tmp_path, prune=False)  # the view removed nothing
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(30)


def test_every_gpu_is_listed_with_cuda_and_nvidia_smi_indices():
    gpus = [record(0, free=10 * GiB), record(1), record(2)]
    readings, notes = nvidia_records(gpus, {"CUDA_VISIBLE_DEVICES": "2,0"})
    assert [(g.index, g.torch_name) for g in readings] == [(0, "cuda:1"), (1, None), (2, "cuda:0")]
    assert readings[0].memory_used == 70 * GiB and readings[0].memory_total == 80 * GiB
    assert notes == []


def test_mig_devices_follow_their_gpu():
    gpus = [mig(record(0), 1, 2), record(1)]
    readings, _ = nvidia_records(gpus, {})
    assert [g.mig_parent is not None for g in readings] == [False, True, True, False]
    assert [g.index for g in readings] == [0, 0, 0, 1]
    # CUDA shows one MIG device per process, and the GPU in MIG mode is not one itself.
    assert [g.torch_name for g in readings] == [None, "cuda:0", None, "cuda:1"]


def test_nvml_processes_carry_their_memory_and_sm_use():
    from anydevice.hardware.facts import ProcessInfo

    g = record(0, processes=(ProcessInfo(7, "python", 3 * GiB),), process_utilization={7: 88.0})
    ((reading,), _) = nvidia_records([g], {})
    assert reading.processes == (DeviceUse(7, 3 * GiB, 88.0),)


HOST = HostReading("box", 37.0, 16, (1.0, 0.5, 0.25), 64 * GiB, 48 * GiB)
H100 = DeviceReading(
    key="nvml:GPU-x",
    vendor="NVIDIA",
    source="nvml",
    name="NVIDIA H100 80GB HBM3",
    index=3,
    torch_name="cuda:0",
    memory_used=20 * GiB,
    memory_total=80 * GiB,
    utilization=97.0,
    temperature=61.0,
    power=512.0,
    power_limit=700.0,
    processes=(DeviceUse(4242, 19 * GiB, 90.0),),
)


def rank_row(pid: int, rank: int, **kw) -> ProcessReading:
    base = dict(
        pid=pid,
        name="python",
        command="python train.py --lr 0.1",
        state="sleeping",
        role="rank",
        ppid=1,
        cpu_percent=99.0,
        rss=2 * GiB,
        torch=True,
        rank=rank,
        world_size=2,
        job="job-a",
        job_key="k",
        launcher="torchrun",
        host="box",
        devices=("nvml:GPU-x",),
        device_memory=19 * GiB,
        utilization=90.0,
        progress=Progress(100, 12.5, 0.1, "batch", 4 * GiB, 30 * GiB, 6 * GiB, None, 0),
        status="stepping",
    )
    base.update(kw)
    return ProcessReading(**base)


def test_top_view_shows_devices_ranks_memory_and_a_stalled_rank():
    stalled = rank_row(4243, 1, status="stalled", stalled_for=41.0, state="stopped")
    r = Reading(0.0, HOST, (H100,), (rank_row(4242, 0), stalled))
    console = Console(record=True, width=200)
    history = History()
    for _ in range(3):
        history.record(r)
    console.print(top_view(r, history=history))
    text = console.export_text()
    assert "box" in text and "CPU 37% of 16 cores" in text and "16.0 GiB / 64.0 GiB (25%)" in text
    row = next(line for line in text.splitlines() if "H100" in line)
    for cell in ("cuda:0", "3", "20.0 GiB / 80.0 GiB (25%)", "97%", "61 °C", "512 / 700 W"):
        assert cell in row, cell
    first = next(line for line in text.splitlines() if "4242" in line)
    for cell in ("job-a", "0/2", "stepping", "12.5", "4.0 GiB / 30.0 GiB / 6.0 GiB", "19.0 GiB"):
        assert cell in first, cell
    second = next(line for line in text.splitlines() if "4243" in line)
    assert "stalled 41 s (stopped)" in second
    assert sparkline([97.0] * 3, top=100) in row  # the use's history


def test_on_a_narrow_screen_the_least_needed_columns_go_first():
    r = Reading(0.0, HOST, (H100,), (rank_row(4242, 0),))
    console = Console(record=True, width=80)
    console.print(top_view(r))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines)
    header = next(line for line in lines if "pid" in line and "status" in line)
    assert "user" not in header and "rank" in header and "command" in header
    assert "4242" in next(line for line in lines if "job-a" in line)


def test_processes_sort_by_each_key():
    a = rank_row(1, 0, cpu_percent=10.0, job_key="b")
    b = rank_row(2, 1, cpu_percent=90.0, job_key="a")
    assert [p.pid for p in sorted_processes([a, b], "job")] == [2, 1]
    assert [p.pid for p in sorted_processes([a, b], "cpu")] == [2, 1]
    assert [p.pid for p in sorted_processes([a, b], "cpu", reverse=True)] == [1, 2]
    assert [p.pid for p in sorted_processes([a, b], "pid")] == [1, 2]


def test_a_reading_filters_by_rank_job_and_device():
    sim = DeviceReading(
        "heartbeat:sim:0",
        None,
        "heartbeat",
        "sim:0",
        torch_name="sim:0",
        processes=(DeviceUse(5, 1),),
    )
    rows = (
        rank_row(4242, 0),
        rank_row(
            5, 1, job="other", job_key="o", devices=("heartbeat:sim:0",), device_names=("sim:0",)
        ),
    )
    r = Reading(0.0, HOST, (H100, sim), rows)
    assert [p.pid for p in r.only(ranks=frozenset({1})).processes] == [5]
    assert [p.pid for p in r.only(job="job").processes] == [4242]
    on_sim = r.only(device="sim")
    assert [p.pid for p in on_sim.processes] == [5] and on_sim.devices == (sim,)
    assert [d.key for d in r.only(device="3").devices] == ["nvml:GPU-x"]  # nvidia-smi's
    assert [p.pid for p in r.only(device="cuda:0").processes] == [4242]
    assert r.only(device="GPU-nothing").processes == ()


def test_the_view_says_there_is_no_gpu_and_what_was_left_behind():
    from anydevice.hardware.leftovers import Leftover

    gone = Leftover("record", 99, "pid 99 (rank 1 of job j) ended without closing its heartbeat")
    console = Console(record=True, width=160)
    console.print(top_view(Reading(0.0, HOST, (), (), (), (gone,), ("no GPU: no driver.",))))
    text = console.export_text()
    assert "no GPU: no driver." in text and "no torch process here" in text
    assert "left behind: pid 99 (rank 1 of job j)" in text
