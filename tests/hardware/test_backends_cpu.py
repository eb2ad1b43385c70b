"""Host facts: cgroup CPU quota and memory limit (v1 and v2), the CPU probe."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from anydevice.hardware.backends import cpu
from anydevice.hardware.backends.cpu import (
    CpuBackend,
    cgroup_cpu_quota,
    cgroup_memory_limit,
    torch_build,
)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_and_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "_cgroup_dirs", lambda root, controller: [root])
    _write(tmp_path, "cpu.max", "250000 100000\n")
    _write(tmp_path, "memory.max", "8589934592\n")
    assert cgroup_cpu_quota(tmp_path) == 2.5
    assert cgroup_memory_limit(tmp_path) == 8 * 2**30


def test_cgroup_v2_unlimited(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "_cgroup_dirs", lambda root, controller: [root])
    _write(tmp_path, "cpu.max", "max 100000\n")
    _write(tmp_path, "memory.max", "max\n")
    assert cgroup_cpu_quota(tmp_path) is None
    assert cgroup_memory_limit(tmp_path) is None


def test_cgroup_v1_quota_and_unlimited_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "_cgroup_dirs", lambda root, controller: [root / controller])
    _write(tmp_path, "cpu/cpu.cfs_quota_us", "150000\n")
    _write(tmp_path, "cpu/cpu.cfs_period_us", "100000\n")
    _write(tmp_path, "memory/memory.limit_in_bytes", "9223372036854771712\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    assert cgroup_memory_limit(tmp_path) is None
    _write(tmp_path, "cpu/cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_no_cgroup_files_means_unlimited(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "_cgroup_dirs", lambda root, controller: [root])
    assert cgroup_cpu_quota(tmp_path) is None
    assert cgroup_memory_limit(tmp_path) is None


def test_usable_cores_respects_the_quota():
    assert cpu._usable_cores(64, 2.5) <= 3
    assert cpu._usable_cores(64, 0.2) == 1


def test_native_bf16_reads_cpu_flags():
    assert cpu._native_bf16(frozenset({"avx512f", "avx512_bf16"})) is True
    assert cpu._native_bf16(frozenset({"amx_bf16"})) is True
    assert cpu._native_bf16(frozenset({"avx2", "fma"})) is False
    assert cpu._native_bf16(frozenset({"fp", "asimd", "bf16"})) is True


def test_probe_gives_one_cpu_and_the_host_fields():
    probe = CpuBackend().probe(telemetry=False)
    (device,) = probe.devices
    assert device.kind == "cpu"
    assert device.utilization is None  # telemetry off
    assert probe.host["torch_build"] == torch_build()
    assert probe.host["cores_usable"] >= 1


# A child process counts the files each probe opens, through Python's audit hook (every
# open() raises an "open" event): nothing is replaced, the probe reads as it always does.
COUNT_OPENS = """
import collections, sys
from anydevice.hardware.backends.cpu import CpuBackend

opened, on = collections.Counter(), [False]

def hook(event, args):
    if on[0] and event == "open" and isinstance(args[0], str):
        opened[args[0]] += 1

sys.addaudithook(hook)
backend = CpuBackend()
first = backend.probe(telemetry=False)
on[0] = True
second = backend.probe(telemetry=False)
on[0] = False
print(repr(dict(opened)))
print(first.host["cpu_model"] == second.host["cpu_model"], second.host["cores_physical"])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_a_second_probe_reads_only_what_can_change():
    out = subprocess.run(
        [sys.executable, "-c", COUNT_OPENS], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    opened: dict[str, int] = ast.literal_eval(lines[0])
    # The CPU's model, flags and topology: read by the first probe, not again.
    assert "/proc/cpuinfo" not in opened, opened
    assert not [p for p in opened if p.startswith("/sys/devices/system/cpu")], opened
    # Memory and the cgroup (its limits can change while the process runs): read again.
    assert opened.get("/proc/meminfo", 0) >= 1, opened
    assert opened.get("/proc/self/cgroup", 0) >= 1, opened
    assert lines[1].startswith("True ")


def test_the_cgroup_memory_limit_is_read_on_every_probe(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "_cgroup_dirs", lambda root, controller: [tmp_path])
    _write(tmp_path, "memory.max", f"{2**30}\n")
    assert CpuBackend().probe(telemetry=False).host["memory_limit"] == 2**30
    _write(tmp_path, "memory.max", f"{2**29}\n")  # as `docker update --memory` does
    probe = CpuBackend().probe(telemetry=False)
    assert probe.host["memory_limit"] == 2**29
    assert probe.host["memory_total"] <= 2**29
