"""The NVML layer read through a hand-built binding (tests/nvml_binding.py) that answers as
a driver would, with pynvml's real error classes: GPUs that cannot be read become notes,
and the facts that do not change are read once per process.

anydevice's own code runs unchanged; only the driver's answers are chosen. A CPU build of
torch lists no CUDA device, but the NVML reading, its notes and its cost are the same.
"""

from __future__ import annotations

import json

import pynvml
import pytest

import anydevice as ad
from anydevice.cli import commands as cli
from anydevice.hardware.backends import nvml
from anydevice.hardware.backends.cuda import CudaBackend
from anydevice.hardware.backends.nvml import NvmlReader, NvmlUnavailable
from nvml_binding import Binding, gpus


def lost_second_gpu(error: Exception, call: str = "nvmlDeviceGetHandleByIndex") -> Binding:
    three = gpus(3)
    three[1].raises[call] = error
    return Binding(three)


@pytest.mark.parametrize(
    ("error", "call", "advice"),
    [
        (pynvml.NVMLError_GpuIsLost(), "nvmlDeviceGetHandleByIndex", "fell off the bus"),
        (pynvml.NVMLError_NoPermission(), "nvmlDeviceGetHandleByIndex", "/dev/nvidia*"),
        (pynvml.NVMLError_Unknown(), "nvmlDeviceGetUUID", "nvidia-smi -i 1 -q"),
        (pynvml.NVMLError_GpuIsLost(), "nvmlDeviceGetUUID", "fell off the bus"),
    ],
)
def test_a_gpu_nvml_cannot_read_is_a_note_not_a_crash(error, call, advice):
    binding = lost_second_gpu(error, call)
    info = NvmlReader(binding).read()
    assert [g.smi_index for g in info.gpus] == [0, 2]
    assert info.unreadable == (1,)
    (note,) = info.notes
    assert "nvidia-smi GPU 1" in note and type(error).__name__.removeprefix("NVMLError_") in note
    assert advice in note
    assert binding.calls["nvmlShutdown"] == 1  # the session is closed all the same


def test_nvml_that_cannot_count_the_gpus_is_unavailable_with_the_reason():
    binding = Binding(gpus(1))
    binding.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(pynvml.NVMLError_Unknown())  # type: ignore[method-assign]
    with pytest.raises(NvmlUnavailable, match="cannot count the GPUs.*Unknown"):
        NvmlReader(binding).read()
    assert binding.calls["nvmlShutdown"] == 1


def test_the_cuda_backend_carries_the_note_and_counts_every_physical_gpu():
    binding = lost_second_gpu(pynvml.NVMLError_GpuIsLost())
    probe = CudaBackend(environ={}, nvml_reader=NvmlReader(binding)).probe()
    assert probe.host["nvidia_gpus"] == 3
    assert any("nvidia-smi GPU 1 could not be read" in n for n in probe.notes)


@pytest.fixture
def lost_gpu_machine(monkeypatch):
    """This process's NVML reader, reading a machine whose second GPU fell off the bus."""
    binding = lost_second_gpu(pynvml.NVMLError_GpuIsLost())
    monkeypatch.setattr(nvml, "_reader", NvmlReader(binding))
    return binding


def test_device_inventory_and_describe_survive_a_lost_gpu(lost_gpu_machine):
    inv = ad.inventory()
    assert any("GpuIsLost" in n for n in inv.notes)
    assert ad.device("auto").type in ("cpu", "cuda")
    assert ad.describe("cpu").kind == "cpu"
    assert ad.inventory(telemetry=False, memory=False).cpu.kind == "cpu"
    assert lost_gpu_machine.calls["nvmlDeviceGetHandleByIndex"] >= 3


def test_info_top_and_select_survive_a_lost_gpu(lost_gpu_machine, capsys):
    assert cli.main(["info", "--json"]) == 0
    assert any("GpuIsLost" in n for n in json.loads(capsys.readouterr().out)["notes"])
    assert cli.main(["top", "--once", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert [g["index"] for g in record["devices"] if g["source"] == "nvml"] == [0, 2]
    assert any("GpuIsLost" in n for n in record["notes"])
    assert cli.main(["select"]) in (0, 1)  # a pick, or no CUDA torch here: never a traceback
    assert "Traceback" not in capsys.readouterr().err


def test_a_gpus_processes_come_with_their_memory_and_newest_sm_use():
    from dataclasses import replace

    from anydevice.hardware.backends.watch import nvidia_readings

    (gpu,) = gpus(1)
    gpu = replace(
        gpu,
        processes={4242: 19 * 2**30, 4243: 2**30},
        samples=[(4242, 50, 1), (4242, 97, 2), (4243, 10, 1)],  # (pid, SM %, time stamp)
    )
    readings, _ = nvidia_readings({}, Binding([gpu]))
    (reading,) = readings
    uses = {u.pid: (u.memory, u.utilization) for u in reading.processes or ()}
    assert uses == {4242: (19 * 2**30, 97.0), 4243: (2**30, 10.0)}
    quiet = replace(gpu, samples=None)  # no samples kept: NVML says NotFound
    ((reading,), _) = nvidia_readings({}, Binding([quiet]))
    assert [u.utilization for u in reading.processes or ()] == [None, None]


# ----------------------------------------------------------------------------- the cache


def test_static_facts_are_read_once_per_process():
    binding = Binding(gpus(2))
    reader = NvmlReader(binding)
    for _ in range(5):
        info = reader.static()
    assert binding.calls["nvmlInit"] == 1
    assert [g.uuid for g in info.gpus] == [g.uuid for g in binding.gpus]
    assert info.gpus[0].memory_total == binding.gpus[0].total
    assert info.gpus[0].memory_free is None  # changes: never served from the cache


def test_a_reading_asks_the_driver_each_time_and_refreshes_the_static_facts():
    binding = Binding(gpus(1))
    reader = NvmlReader(binding)
    reader.static()
    binding.gpus[0].free = 3 * 2**30
    assert reader.read(telemetry=False).gpus[0].memory_free == 3 * 2**30
    binding.gpus[0].name = "NVIDIA H200"
    assert reader.read(telemetry=False).gpus[0].name == "NVIDIA H200"
    assert reader.static().gpus[0].name == "NVIDIA H200"
    assert binding.calls["nvmlInit"] == 3 and binding.calls["nvmlShutdown"] == 3
    reader.forget()
    reader.static()
    assert binding.calls["nvmlInit"] == 4


def test_nvml_unavailable_is_remembered_for_static_facts_only():
    binding = Binding(gpus(1), init_error=pynvml.NVMLError_LibraryNotFound())
    reader = NvmlReader(binding)
    for _ in range(3):
        with pytest.raises(NvmlUnavailable, match="NVML library not found"):
            reader.static()
    assert binding.calls["nvmlInit"] == 1
    with pytest.raises(NvmlUnavailable):
        reader.read()
    assert binding.calls["nvmlInit"] == 2


def test_the_backend_reads_nvml_once_for_static_probes():
    binding = Binding(gpus(2))
    backend = CudaBackend(environ={}, nvml_reader=NvmlReader(binding))
    for _ in range(4):
        backend.probe_static()
    assert binding.calls["nvmlInit"] == 1
    backend.probe(telemetry=False)  # free memory wanted: a reading
    assert binding.calls["nvmlInit"] == 2


def test_resolving_specs_opens_no_nvml_session_after_the_first(monkeypatch):
    binding = Binding(gpus(2))
    monkeypatch.setattr(nvml, "_reader", NvmlReader(binding))
    for spec in ("auto", "gpu", "auto", 0, "auto"):
        try:
            ad.device(spec)
        except ad.DeviceNotFoundError:
            pass  # a CPU build of torch: no CUDA device, but NVML was looked at all the same
    ad.try_gpu()
    ad.devices("auto")
    assert binding.calls["nvmlInit"] == 1
    with pytest.raises(ad.DeviceNotFoundError):
        ad.device("free" if not ad.inventory(kinds=("cuda",)).of_kind("cuda") else "cuda:99")
    assert binding.calls["nvmlInit"] >= 2  # free memory is read when a policy compares it


def test_resolving_specs_tries_a_missing_nvml_once(monkeypatch):
    # The real pynvml on this machine: where the NVML library is missing, every spec used
    # to try to load it again.
    calls = []
    real = pynvml.nvmlInit

    def counted() -> None:
        calls.append(1)
        real()

    monkeypatch.setattr(nvml, "_reader", NvmlReader())
    monkeypatch.setattr(pynvml, "nvmlInit", counted)
    for _ in range(4):
        ad.device("auto")
    assert len(calls) == 1
