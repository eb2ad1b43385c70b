"""The readers of accelerators that are not on the test machines (AMD, Intel, Apple), run
on outputs recorded in the form their kernels and tools print them (tests/hardware/recorded:
DRM fdinfo files, an ioreg dump, xpu-smi's JSON), on sysfs and procfs trees laid out as
the kernel lays them out, and on amdsmi records shaped as its Python interface returns
them. Untested on that hardware: docs/top.md says so."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from anydevice.hardware.backends import amdsmi, drm, ioreg, xpusmi
from anydevice.hardware.backends.watch import DeviceWatch

RECORDED = Path(__file__).parent / "recorded"
KiB, MiB, GiB = 2**10, 2**20, 2**30


def recorded(name: str) -> str:
    return (RECORDED / name).read_text()


# ----------------------------------------------------------------------------- fdinfo


def test_amdgpu_before_6_13_reports_vram_and_engine_time():
    c = drm.parse_fdinfo(recorded("fdinfo-amdgpu-5.19.txt"), pid=42)
    assert c is not None and (c.driver, c.pdev, c.client_id, c.pid) == (
        "amdgpu",
        "0000:03:00.0",
        7,
        42,
    )
    assert c.memory == {"vram": 263168 * KiB, "gtt": 2056 * KiB, "cpu": 0}
    assert c.device_memory == 263168 * KiB  # vram only: gtt is host memory
    assert c.engines == {"gfx": 1038458543, "compute": 5_000_000_000}


def test_amdgpu_from_6_13_reports_resident_vram():
    c = drm.parse_fdinfo(recorded("fdinfo-amdgpu-6.13.txt"))
    assert c is not None and c.memory["vram"] == 4 * GiB
    assert c.device_memory == 3 * GiB  # resident, where the driver says


def test_i915_reports_local_memory_and_engine_capacity():
    c = drm.parse_fdinfo(recorded("fdinfo-i915.txt"))
    assert c is not None and c.driver == "i915"
    assert c.device_memory == 2 * MiB  # local0; system0 and stolen are not the device's
    assert c.capacity == {"video": 2} and c.engines["render"] == 9288864723


def test_xe_reports_cycles_against_the_gpus_timestamp():
    c = drm.parse_fdinfo(recorded("fdinfo-xe.txt"))
    assert c is not None and c.pdev == "0000:4d:00.0"
    assert c.device_memory == 23992 * KiB
    assert c.cycles["rcs"] == 28257900 and c.total_cycles["rcs"] == 7655183225
    assert c.capacity == {"vcs": 2, "vecs": 2, "ccs": 4}


def test_a_non_compute_drm_client_and_a_plain_file_are_not_clients():
    assert drm.parse_fdinfo("pos:\t0\nflags:\t02\nmnt_id:\t3\n") is None
    assert drm.parse_fdinfo("drm-driver:\tvirtio_gpu\ndrm-client-id:\t1\n") is None


def test_the_busiest_engine_over_the_time_between_two_readings():
    def amd(gfx: int, compute: int) -> drm.DrmClient:
        text = f"drm-driver: amdgpu\ndrm-engine-gfx: {gfx} ns\ndrm-engine-compute: {compute} ns"
        client = drm.parse_fdinfo(text)
        assert client is not None
        return client

    assert drm.busy_percent(amd(0, 0), amd(250_000_000, 750_000_000), 1.0) == 75.0
    assert drm.busy_percent(amd(10, 900), amd(5, 900), 1.0) == 0.0  # went down: kept
    assert drm.busy_percent(amd(0, 0), amd(10**10, 0), 1.0) == 100.0  # capped

    def xe(cycles: int, total: int) -> drm.DrmClient:
        client = drm.parse_fdinfo(
            f"drm-driver: xe\ndrm-cycles-ccs: {cycles}\ndrm-total-cycles-ccs: {total}\n"
            "drm-engine-capacity-ccs: 4\n"
        )
        assert client is not None
        return client

    # 2000 busy cycles of 1000 elapsed, spread over 4 compute engines: half of them.
    assert drm.busy_percent(xe(0, 0), xe(2000, 1000), 1.0) == 50.0


def fake_proc(root: Path, pid: int, fds: dict[int, tuple[str, str]]) -> None:
    """``root/PID/fd/N`` -> target, ``root/PID/fdinfo/N`` with text, as /proc has them."""
    (root / str(pid) / "fd").mkdir(parents=True)
    (root / str(pid) / "fdinfo").mkdir()
    for fd, (target, text) in fds.items():
        os.symlink(target, root / str(pid) / "fd" / str(fd))
        (root / str(pid) / "fdinfo" / str(fd)).write_text(text)


def test_each_process_client_is_read_once_though_its_descriptor_is_duplicated(tmp_path):
    proc = tmp_path / "proc"
    amd = recorded("fdinfo-amdgpu-5.19.txt")
    fake_proc(
        proc,
        100,
        {
            3: ("/dev/dri/renderD128", amd),
            4: ("/dev/dri/renderD128", amd),
            5: ("/dev/null", "pos: 0\n"),
        },
    )
    fake_proc(proc, 200, {7: ("/dev/dri/card1", recorded("fdinfo-xe.txt"))})
    (proc / "300").mkdir()  # a process whose descriptors cannot be listed
    found = drm.clients(proc=str(proc))
    assert sorted((c.pid, c.driver) for c in found) == [(100, "amdgpu"), (200, "xe")]
    assert drm.clients([200], proc=str(proc))[0].client_id == 3


def fake_card(root: Path, n: int, driver: str, slot: str, pci: str, **files: str) -> None:
    dev = root / f"card{n}" / "device"
    (dev / "hwmon" / "hwmon3").mkdir(parents=True)
    vendor, device = pci.split(":")
    (dev / "uevent").write_text(f"DRIVER={driver}\nPCI_ID={pci.upper()}\nPCI_SLOT_NAME={slot}\n")
    (dev / "vendor").write_text(f"0x{vendor}\n")
    (dev / "device").write_text(f"0x{device}\n")
    for name, value in files.items():
        path = dev / name.replace("__", "/")
        path.write_text(value + "\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    root = tmp_path / "drm"
    fake_card(
        root,
        0,
        "amdgpu",
        "0000:03:00.0",
        "1002:744c",
        mem_info_vram_total=str(24 * GiB),
        mem_info_vram_used=str(5 * GiB),
        gpu_busy_percent="87",
        hwmon__hwmon3__temp1_input="61000",
        hwmon__hwmon3__power1_average="312000000",
        product_name="AMD Radeon RX 7900 XTX",
    )
    fake_card(root, 1, "xe", "0000:4d:00.0", "8086:0bd5")
    fake_card(root, 2, "virtio_gpu", "0000:00:02.0", "1af4:1050")
    (root / "renderD128").mkdir()
    return root


def test_the_cards_of_compute_drivers_with_amdgpus_memory_and_sensors(sysfs):
    amd, intel = drm.cards(str(sysfs))
    assert (amd.card, amd.vendor, amd.pdev, amd.pci_id) == (
        "card0",
        "AMD",
        "0000:03:00.0",
        "1002:744c",
    )
    assert (amd.name, amd.memory_total, amd.memory_used) == (
        "AMD Radeon RX 7900 XTX",
        24 * GiB,
        5 * GiB,
    )
    assert (amd.utilization, amd.temperature, amd.power) == (87.0, 61.0, 312.0)
    assert (intel.vendor, intel.driver, intel.memory_total) == ("Intel", "xe", None)


def test_a_pci_id_is_named_from_the_pci_database(tmp_path):
    ids = tmp_path / "pci.ids"
    ids.write_text(
        "1002  Advanced Micro Devices, Inc. [AMD/ATI]\n\t744c  Navi 31 [Radeon RX 7900]\n"
        "8086  Intel Corporation\n\t0bd5  Ponte Vecchio XT\n"
    )
    assert drm.pci_name("8086:0bd5", str(ids)) == "Ponte Vecchio XT"
    assert drm.pci_name("8086:ffff", str(ids)) is None


# ----------------------------------------------------------------------------- amdsmi


class Amdsmi:
    """The calls anydevice makes of amdsmi's Python interface, answering with records in
    its shapes (ROCm 6.x): VRAM in MiB, "N/A" for what a GPU does not report."""

    class AmdSmiInitFlags:
        INIT_AMD_GPUS = 2

    class AmdSmiTemperatureType:
        EDGE = 0

    class AmdSmiTemperatureMetric:
        CURRENT = 0

    def __init__(self, gpus: list[dict[str, Any]], fail_init: bool = False) -> None:
        self.gpus, self.fail_init, self.shut = gpus, fail_init, False

    def amdsmi_init(self, flags: int = 0) -> None:
        if self.fail_init:
            raise RuntimeError("AMDSMI_STATUS_DRIVER_NOT_LOADED")

    def amdsmi_shut_down(self) -> None:
        self.shut = True

    def amdsmi_get_processor_handles(self) -> list[int]:
        return list(range(len(self.gpus)))

    def _get(self, h: int, key: str) -> Any:
        value = self.gpus[h][key]
        if isinstance(value, Exception):
            raise value
        return value

    def amdsmi_get_gpu_device_bdf(self, h: int) -> str:
        return self._get(h, "bdf")

    def amdsmi_get_gpu_device_uuid(self, h: int) -> str:
        return self._get(h, "uuid")

    def amdsmi_get_gpu_asic_info(self, h: int) -> dict[str, Any]:
        return {"market_name": self._get(h, "name"), "vendor_id": "0x1002"}

    def amdsmi_get_gpu_vram_usage(self, h: int) -> dict[str, Any]:
        return {"vram_total": self._get(h, "total_mib"), "vram_used": self._get(h, "used_mib")}

    def amdsmi_get_gpu_activity(self, h: int) -> dict[str, Any]:
        return {"gfx_activity": self._get(h, "gfx"), "umc_activity": "N/A", "mm_activity": "N/A"}

    def amdsmi_get_temp_metric(self, h: int, kind: int, metric: int) -> Any:
        return self._get(h, "temp")

    def amdsmi_get_power_info(self, h: int) -> dict[str, Any]:
        return {
            "current_socket_power": self._get(h, "watts"),
            "average_socket_power": 300,
            "power_limit": 750,
        }

    def amdsmi_get_gpu_process_list(self, h: int) -> list[dict[str, Any]]:
        return [
            {
                "name": "python",
                "pid": pid,
                "mem": vram,
                "engine_usage": {"gfx": 0, "enc": 0},
                "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": vram},
                "cu_occupancy": 5,
            }
            for pid, vram in self._get(h, "procs").items()
        ]


MI300X = {
    "bdf": "0000:03:00.0",
    "uuid": "8fff74b5-0000-1000-80aa-deadbeef0001",
    "name": "AMD Instinct MI300X",
    "total_mib": 196592,
    "used_mib": 40960,
    "gfx": 97,
    "temp": 55,
    "watts": 640,
    "procs": {100: 30 * GiB},
}


def test_amdsmi_gives_each_gpus_memory_use_sensors_and_processes():
    lib = Amdsmi(
        [
            MI300X,
            {
                **MI300X,
                "bdf": "0000:43:00.0",
                "gfx": "N/A",
                "watts": "N/A",
                "temp": RuntimeError("not supported"),
                "procs": {},
            },
        ]
    )
    (a, b), notes = amdsmi.read(lib)
    assert notes == [] and lib.shut
    assert (a.name, a.pdev, a.memory_total, a.memory_used) == (
        "AMD Instinct MI300X",
        "0000:03:00.0",
        196592 * MiB,
        40 * GiB,
    )
    assert (a.utilization, a.temperature, a.power, a.processes) == (
        97.0,
        55.0,
        640.0,
        {100: 30 * GiB},
    )
    assert (b.utilization, b.temperature, b.power) == (None, None, 300.0)  # the average


def test_amdsmi_that_does_not_start_and_a_gpu_it_cannot_read():
    with pytest.raises(amdsmi.AmdsmiUnavailable, match="DRIVER_NOT_LOADED"):
        amdsmi.read(Amdsmi([], fail_init=True))
    lost = {**MI300X, "bdf": RuntimeError("AMDSMI_STATUS_NOT_FOUND")}
    lib = Amdsmi([MI300X, lost])
    (gpu,), notes = amdsmi.read(lib)
    assert gpu.pdev == "0000:03:00.0" and lib.shut
    assert notes == ["AMD GPU 1 could not be read through amdsmi (AMDSMI_STATUS_NOT_FOUND)."]


# ----------------------------------------------------------------------------- Apple, Intel


def test_ioreg_gives_the_apple_gpus_use_and_unified_memory():
    (gpu,) = ioreg.parse(recorded("ioreg-m2-max.txt"))
    assert (gpu.name, gpu.cores, gpu.utilization) == ("Apple M2 Max", 38, 23.0)
    assert (gpu.memory_used, gpu.memory_allocated) == (1451802624, 27078426624)
    assert ioreg.parse("") == [] and ioreg.parse("+-o IOAccelerator  <class x>\n") == []


def runner(outputs: dict[tuple[str, ...], str], calls: list[tuple[str, ...]]):
    def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append(tuple(argv))
        text = outputs.get(tuple(argv[1:]))
        return subprocess.CompletedProcess(argv, 0 if text is not None else 1, text or "", "")

    return run


def test_xpu_smi_gives_names_and_memory_of_intel_gpus():
    calls: list[tuple[str, ...]] = []
    run = runner(
        {
            ("discovery", "-j"): recorded("xpu-smi-discovery.json"),
            ("discovery", "-d", "0", "-j"): recorded("xpu-smi-discovery-d0.json"),
        },
        calls,
    )
    (gpu,) = xpusmi.read(run)
    assert (gpu.index, gpu.name, gpu.pdev) == (
        0,
        "Intel(R) Data Center GPU Max 1550",
        "0000:4d:00.0",
    )
    assert (gpu.memory_total, gpu.memory_used) == (64 * GiB, 68719476736 - 68113264640)
    failing = runner({("discovery", "-j"): recorded("xpu-smi-discovery.json")}, [])
    (partial,) = xpusmi.read(failing)
    assert partial.memory_total is None and partial.memory_used is None


# ----------------------------------------------------------------------------- together


def test_amd_gpus_through_amdsmi_with_each_process_use_from_fdinfo(tmp_path, sysfs):
    proc = tmp_path / "proc"
    fake_proc(proc, 100, {3: ("/dev/dri/renderD128", recorded("fdinfo-amdgpu-6.13.txt"))})
    watch = DeviceWatch(
        {},
        nvml=_no_nvml(),
        amdsmi=Amdsmi([MI300X]),
        proc=str(proc),
        drm_root=str(sysfs),
        run=runner({}, []),
    )
    watch.prime()
    text = recorded("fdinfo-amdgpu-6.13.txt").replace("98765432100 ns", "98765432100000 ns")
    (proc / "100" / "fdinfo" / "3").write_text(text)  # busy ever since the first reading
    devices, notes = watch.read()
    assert notes == []  # NVML missing is no news where other GPUs are
    amd = next(d for d in devices if d.source == "amdsmi")
    assert (amd.name, amd.memory_used, amd.utilization) == ("AMD Instinct MI300X", 40 * GiB, 97.0)
    (use,) = amd.processes
    assert (use.pid, use.memory, use.utilization) == (100, 30 * GiB, 100.0)
    intel = next(d for d in devices if d.vendor == "Intel")
    assert (intel.source, intel.pci_bus_id, intel.processes) == ("drm", "0000:4d:00.0", ())


def test_amd_gpus_without_amdsmi_come_from_the_kernel(tmp_path, sysfs):
    proc = tmp_path / "proc"
    fake_proc(proc, 100, {3: ("/dev/dri/renderD128", recorded("fdinfo-amdgpu-5.19.txt"))})
    watch = DeviceWatch(
        {},
        nvml=_no_nvml(),
        amdsmi=Amdsmi([], fail_init=True),
        proc=str(proc),
        drm_root=str(sysfs),
        run=runner({}, []),
    )
    devices, _ = watch.read()
    amd = next(d for d in devices if d.vendor == "AMD")
    assert (amd.source, amd.name, amd.index, amd.memory_total) == (
        "drm",
        "AMD Radeon RX 7900 XTX",
        0,
        24 * GiB,
    )
    (use,) = amd.processes
    assert (use.pid, use.memory, use.utilization) == (100, 263168 * KiB, None)  # one reading


def test_an_apple_gpu_on_a_mac(tmp_path):
    calls: list[tuple[str, ...]] = []
    run = runner({ioreg.COMMAND[1:]: recorded("ioreg-m2-max.txt")}, calls)
    watch = DeviceWatch(
        {}, nvml=_no_nvml(), drm_root=str(tmp_path / "none"), run=run, platform="darwin"
    )
    (gpu,), notes = watch.read()
    assert (gpu.vendor, gpu.source, gpu.utilization) == ("Apple", "ioreg", 23.0)
    assert gpu.name == "Apple M2 Max (38 GPU cores)" and gpu.memory_used == 1451802624
    assert notes == [] and calls == [ioreg.COMMAND]


def _no_nvml() -> Any:
    """An NVML binding whose init fails as it does without an NVIDIA driver."""
    import pynvml

    def init() -> None:
        raise pynvml.NVMLError_LibraryNotFound()

    return SimpleNamespace(
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        NVMLError_LibraryNotFound=pynvml.NVMLError_LibraryNotFound,
    )
