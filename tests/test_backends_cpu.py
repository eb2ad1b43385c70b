"""Host facts: cgroup CPU quota and memory limit (v1 and v2), the CPU probe."""

from __future__ import annotations

from pathlib import Path

from anydevice.backends import cpu
from anydevice.backends.cpu import CpuBackend, cgroup_cpu_quota, cgroup_memory_limit, torch_build


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
