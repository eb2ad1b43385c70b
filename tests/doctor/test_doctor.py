"""Doctor checks: each verdict on hand-built machines, and the report on this one."""

from __future__ import annotations

from pathlib import Path

import pytest

from anydevice.doctor import examine
from anydevice.doctor.checks import (
    CPU_WHEEL_COMMAND,
    check_cores,
    check_device_env,
    check_driver,
    check_free_memory,
    check_nvml,
    check_torch_build,
    check_visibility,
)
from anydevice.hardware.backends.nvml import pci_gpus
from anydevice.hardware.facts import ProcessInfo
from machines import GiB, gpu, machine

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_only_torch_on_a_gpu_machine_fails_with_the_right_wheel():
    inv = machine(torch="2.13.0+cpu", torch_build="CPU", cuda_runtime=None, nvidia_gpus=4,
                  driver_cuda="12.6")  # fmt: skip
    c = check_torch_build(inv, {})
    assert c.status == "fail"
    assert "4 NVIDIA GPU(s)" in c.summary
    assert c.fix and c.fix.endswith("whl/cu126")


def test_cuda_torch_without_gpu_is_only_information_with_the_cpu_wheel_line():
    c = check_torch_build(machine(nvidia_gpus=0), {})
    assert c.status == "info" and "no NVIDIA GPU here" in c.summary and "2 GB" in c.summary
    assert c.fix and c.fix.endswith(CPU_WHEEL_COMMAND)
    assert CPU_WHEEL_COMMAND in (ROOT / "README.md").read_text()  # the README's own line
    assert check_torch_build(machine(gpu(0)), {}).status == "ok"


@pytest.mark.skipif(pci_gpus() != 0, reason="needs a machine with no NVIDIA GPU on its bus")
def test_without_nvml_and_without_a_gpu_nvml_is_not_asked_for():
    """A CUDA torch on a CPU machine: NVML's library is missing because there is no
    driver and no GPU; the doctor said to install it."""
    inv = machine(nvidia_gpus=0, notes=("NVML library not found (libnvidia-ml.so.1).",))
    c = check_nvml(inv, {})
    assert c.status == "skip" and "no NVIDIA GPU here" in c.summary, c


def test_pci_gpus_counts_nvidia_display_and_3d_controllers_only(tmp_path):
    for name, vendor, cls in [
        ("0000:01:00.0", "0x10de", "0x030200"),  # an H100: 3D controller
        ("0000:02:00.0", "0x10de", "0x030000"),  # a VGA GPU
        ("0000:01:00.1", "0x10de", "0x040300"),  # its HDMI audio function
        ("0000:03:00.0", "0x8086", "0x030000"),  # another vendor's GPU
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "class").write_text(cls + "\n")
    assert pci_gpus(tmp_path) == 2
    assert pci_gpus(tmp_path / "absent") is None


def test_driver_too_old_for_the_runtime_major_fails():
    inv = machine(gpu(0), cuda_runtime="12.8", driver="470.82", driver_cuda="11.4")
    c = check_driver(inv, {})
    assert c.status == "fail"
    assert "CUDA 11.4" in c.summary and "12.8" in c.summary


def test_driver_older_minor_warns():
    inv = machine(gpu(0), cuda_runtime="12.8", driver="550.54", driver_cuda="12.4")
    assert check_driver(inv, {}).status == "warn"


def test_driver_new_enough_is_ok_and_no_gpu_is_skipped():
    assert check_driver(machine(gpu(0), driver_cuda="13.0"), {}).status == "ok"
    assert check_driver(machine(), {}).status == "skip"


def test_driver_unknown_warns():
    assert check_driver(machine(gpu(0), driver_cuda=None), {}).status == "warn"


def test_empty_visible_devices_warns():
    inv = machine(nvidia_gpus=2)
    c = check_visibility(inv, {"CUDA_VISIBLE_DEVICES": ""})
    assert c.status == "warn" and "empty" in c.summary


def test_visible_devices_with_ignored_entries_warns():
    inv = machine(gpu(0), gpu(1), notes=("CUDA_VISIBLE_DEVICES='0,1,5': entry '5' is past...",))
    c = check_visibility(inv, {"CUDA_VISIBLE_DEVICES": "0,1,5"})
    assert c.status == "warn"
    assert "lists 3 entries but only 2" in c.summary
    assert "entry '5'" in c.summary


def test_guessed_order_warns_with_the_fix():
    inv = machine(
        gpu(0, "A100", smi=1, index_guessed=True), gpu(1, "T4", smi=0, index_guessed=True)
    )
    c = check_visibility(inv, {})
    assert c.status == "warn"
    assert c.fix and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in c.fix


def test_visible_devices_shift_is_information():
    inv = machine(gpu(0, smi=2), gpu(1, smi=3), nvidia_gpus=4)
    c = check_visibility(inv, {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert c.status == "info"
    assert "cuda:0 is nvidia-smi GPU 2" in c.summary


def test_matching_numbering_is_ok():
    assert check_visibility(machine(gpu(0), gpu(1)), {}).status == "ok"
    assert check_visibility(machine(), {}).status == "skip"


def test_nvml_missing_warns():
    inv = machine(gpu(0), notes=("NVML: Driver/library version mismatch (...)",))
    c = check_nvml(inv, {})
    assert c.status == "warn" and "mismatch" in c.summary
    assert check_nvml(machine(gpu(0)), {}).status == "ok"


def test_low_free_memory_on_the_default_gpu_warns_and_names_holders():
    procs = (ProcessInfo(111, "python", 70 * GiB), ProcessInfo(222, "jupyter", 9 * GiB))
    inv = machine(gpu(0, free=int(0.5 * GiB), procs=procs), gpu(1))
    c = check_free_memory(inv, {})
    assert c.status == "warn"
    assert "pid 111 python (70.0 GiB)" in c.summary
    assert c.fix and "ad.device('free')" in c.fix


def test_enough_free_memory_is_ok():
    assert check_free_memory(machine(gpu(0, free=40 * GiB)), {}).status == "ok"


def test_oversubscribed_threads_warn():
    inv = machine(cores_logical=64, cores_usable=4, cpu_quota=4.0, torch_threads=32)
    c = check_cores(inv, {})
    assert c.status == "warn"
    assert "cgroup quota 4 cores" in c.summary
    assert c.fix == "torch.set_num_threads(4) or OMP_NUM_THREADS=4."


def test_fewer_usable_cores_is_information_and_all_cores_ok():
    assert (
        check_cores(machine(cores_logical=64, cores_usable=8, torch_threads=8), {}).status == "info"
    )
    assert check_cores(machine(), {}).status == "ok"


def test_report_exit_code_follows_failures():
    healthy = examine(machine(gpu(0)), environ={})
    assert healthy.ok and healthy.exit_code == 0
    broken = examine(machine(torch_build="CPU", cuda_runtime=None, nvidia_gpus=1), environ={})
    assert not broken.ok and broken.exit_code == 1
    data = broken.to_dict()
    assert data["schema"] == "anydevice.doctor/1" and data["ok"] is False
    assert {c["status"] for c in data["checks"]} >= {"fail"}


def test_doctor_on_this_machine_has_every_check():
    report = examine()
    names = [c.name for c in report.checks]
    assert names == [
        "device-env", "torch-build", "driver", "visibility", "nvml", "free-memory", "cores",
        "toolchain", "mps-fallback",
    ]  # fmt: skip
    assert all(c.summary for c in report.checks)


def test_a_bogus_anydevice_device_fails_with_the_fix():
    inv = machine(gpu(0))
    c = check_device_env(inv, {"ANYDEVICE_DEVICE": "bogus"})
    assert c.status == "fail"
    assert "Unknown device 'bogus' (from ANYDEVICE_DEVICE)" in c.summary
    assert c.fix and "unset ANYDEVICE_DEVICE" in c.fix and "cuda:0, cpu" in c.fix
    report = examine(inv, environ={"ANYDEVICE_DEVICE": "bogus"})
    assert not report.ok and report.exit_code == 1


def test_anydevice_device_naming_a_missing_gpu_fails_and_a_good_one_is_ok():
    inv = machine(gpu(0))
    missing = check_device_env(inv, {"ANYDEVICE_DEVICE": "cuda:3"})
    assert missing.status == "fail" and "cuda:3" in missing.summary
    good = check_device_env(inv, {"ANYDEVICE_DEVICE": "CPU"})
    assert good.status == "ok" and "picks cpu" in good.summary
    assert check_device_env(inv, {}).status == "skip"
