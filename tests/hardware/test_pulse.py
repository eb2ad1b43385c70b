"""The library's step points publish this process's heartbeat: DeviceLoader batches,
optimizer steps (``p.step``, ``Throughput.step``), who it is (``ad.distributed``), and its
device's allocator counters at most once a second. Each case runs in a fresh process, as
a training script would, and reads the record it left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from anydevice import heartbeat


def run(code: str, where: Path, **env: str) -> dict:
    """Run ``code``; it prints its own heartbeat record (read back as another process
    would) as the last line of its output."""
    tail = textwrap.dedent(
        """
        import json as _json, dataclasses as _dc
        from anydevice import heartbeat as _hb
        from anydevice.hardware import pulse as _pulse
        _pulse.flush()  # the steps counted since the last write (written every 0.1 s)
        _b = _hb.read_file(_hb.mine().path)
        print(_json.dumps({k: v for k, v in _dc.asdict(_b).items() if k != "path"},
                          default=str))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code) + tail],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ANYDEVICE_HEARTBEAT_DIR": str(where), **env},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_device_loader_counts_its_batches_on_the_cpu_without_memory(tmp_path):
    beat = run(
        """
        import torch, anydevice as ad
        with ad.distributed() as d:
            for batch in ad.DeviceLoader([torch.ones(2)] * 7, d.device):
                pass
        """,
        tmp_path,
    )
    assert beat["steps"] == 7 and beat["last_step"] > 0 and beat["steps_per_second"] > 0
    assert beat["details"]["step_unit"] == "batch"
    assert beat["details"]["device"] == "cpu" and beat["details"]["launcher"] == "single"
    assert (beat["rank"], beat["world_size"]) == (0, 1)
    assert beat["memory_read_at"] == 0  # the host's memory is read by top from /proc


def test_once_an_optimizer_steps_the_batches_of_its_micro_steps_are_not_counted(tmp_path):
    beat = run(
        """
        import torch, anydevice as ad
        net = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        p = ad.precision("cpu", "fp32")
        meter = ad.Throughput(samples_per_step=3)
        loader = ad.DeviceLoader([torch.ones(1, 2)] * 9, "cpu")
        for i, x in enumerate(loader):
            p.backward(net(x).sum())
            if i % 3 == 2:               # three micro-batches per step
                p.step(opt)
                meter.step()             # one step, counted once
        """,
        tmp_path,
    )
    # Batches 1-3 before the first optimizer step, then the 3 optimizer steps.
    assert beat["steps"] == 3 + 3
    assert beat["details"]["step_unit"] == "optimizer"


def test_the_allocator_is_read_at_most_once_a_second_through_the_backend(tmp_path):
    """On the simulated accelerator (real allocator counters through torch's API): the
    counters are published, and read once for hundreds of quick steps."""
    beat = run(
        """
        import time, torch
        from anydevice import testing
        from anydevice.hardware import pulse
        from anydevice.hardware.backends import runtime
        dev = testing.enable()
        x = torch.ones(1024, device=dev)
        backend = runtime(dev.type)
        reads, read = [], backend.memory
        backend.memory = lambda d: reads.append(d) or read(d)
        start = time.monotonic()
        for _ in range(500):
            pulse.tick("batch", dev)
        elapsed = time.monotonic() - start
        assert 1 <= len(reads) <= elapsed / pulse.MEMORY_EVERY_S + 1, (len(reads), elapsed)
        """,
        tmp_path,
    )
    assert beat["steps"] == 500 and beat["details"]["device"].startswith("sim")
    assert beat["allocated"] >= 4096 and beat["reserved"] >= beat["allocated"]
    assert beat["peak"] >= beat["allocated"] and beat["memory_read_at"] > 0


def test_a_launched_worker_is_identified_by_ad_distributed(tmp_path):
    beat = run(
        """
        import anydevice as ad
        from anydevice.training import context
        world = context.environment.detect()
        context._announce(world, ad.device("cpu"), "gloo")
        """,
        tmp_path,
        RANK="3",
        LOCAL_RANK="1",
        WORLD_SIZE="8",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
        TORCHELASTIC_RUN_ID="job-9",
    )
    assert (beat["rank"], beat["local_rank"], beat["world_size"]) == (3, 1, 8)
    assert beat["local_world_size"] == 2
    assert beat["details"]["run_id"] == "job-9"
    assert beat["details"]["collective_backend"] == "gloo"


def test_publishing_off_makes_no_record_and_costs_a_check(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, anydevice as ad\n"
            "for b in ad.DeviceLoader([torch.ones(1)] * 3, 'cpu'): pass\n"
            "from anydevice.hardware import pulse; print(pulse._state.off)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ANYDEVICE_HEARTBEAT_DIR": str(tmp_path), "ANYDEVICE_HEARTBEAT": "0"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"] and heartbeat.read_all(tmp_path) == []


def test_steps_written_a_few_at_a_time_count_each_and_their_rate(tmp_path):
    """``Heartbeat.step(count=k)``: what pulse writes every 0.1 s."""
    beat = heartbeat.Heartbeat.create(where=tmp_path)
    try:
        beat.step(now=1000.0)
        beat.step(now=1001.0, count=10)  # ten steps in the second since the first
        got = heartbeat.read_file(beat.path)
        assert got is not None and got.steps == 11 and got.last_step == 1001.0
        assert got.steps_per_second == 10.0
    finally:
        beat.close()
