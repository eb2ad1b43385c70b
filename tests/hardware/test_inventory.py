"""The inventory of this machine, and its stable JSON form."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import psutil
import pytest
import torch

import anydevice as ad
from anydevice.hardware.facts import DeviceInfo, ProcessInfo, format_bytes, parse_size
from anydevice.hardware.inventory import Inventory, inventory_without_torch
from machines import GiB, gpu, machine

#: The documented JSON keys (docs/inventory.md). Keys may be added, never removed.
HOST_KEYS = {
    "hostname", "os", "python", "torch", "torch_build", "cpu_model", "cores_logical",
    "cores_physical", "cores_usable", "memory_total", "memory_available", "torch_threads",
    "cpu_quota", "memory_limit", "cuda_runtime", "cudnn", "nccl", "driver", "driver_cuda",
    "nvidia_gpus",
}  # fmt: skip
DEVICE_KEYS = {
    "kind", "index", "spec", "name", "uuid", "pci_bus_id", "smi_index", "memory_total",
    "memory_free", "memory_used", "compute_capability", "multiprocessors", "bf16", "tf32",
    "utilization", "temperature", "power", "power_limit", "pcie_generation", "pcie_width",
    "processes", "mig_parent", "index_guessed", "notes",
}  # fmt: skip


def test_inventory_describes_this_host():
    inv = ad.inventory()
    h = inv.host
    assert h.torch == torch.__version__
    assert h.cores_logical == os.cpu_count()
    assert 1 <= h.cores_usable <= h.cores_logical
    assert 0 < h.memory_available <= h.memory_total <= psutil.virtual_memory().total
    assert h.torch_threads == torch.get_num_threads()
    assert h.python.endswith(".".join(map(str, __import__("sys").version_info[:3])))
    if torch.version.cuda is None:
        assert h.torch_build in ("CPU", "MPS") or h.torch_build.startswith(("ROCm", "XPU"))


def test_cpu_is_listed_last_and_described():
    inv = ad.inventory()
    cpu = inv.devices[-1]
    assert cpu.kind == "cpu" and cpu.index is None
    assert cpu.torch_device == torch.device("cpu")
    assert cpu.name == inv.host.cpu_model
    assert cpu.memory_total == inv.host.memory_total
    assert cpu.utilization is not None and 0.0 <= cpu.utilization <= 100.0


def test_json_form_has_the_documented_keys_and_round_trips():
    inv = ad.inventory()
    data = json.loads(inv.to_json())
    assert data["schema"] == "anydevice.inventory/1"
    assert set(data["host"]) == HOST_KEYS
    for d in data["devices"]:
        assert set(d) == DEVICE_KEYS
    assert Inventory.from_dict(data).to_dict() == inv.to_dict()


def test_device_json_round_trip_keeps_tuples_and_processes():
    d = gpu(1, free=3 * GiB, procs=(ProcessInfo(42, "python", 5 * GiB),), notes=("n",))
    back = DeviceInfo.from_dict(json.loads(json.dumps(d.to_dict())))
    assert back == d
    assert back.compute_capability == (9, 0)
    assert back.processes == (ProcessInfo(42, "python", 5 * GiB),)


def test_reprs_are_readable():
    d = gpu(0, free=3 * GiB, smi=2)
    assert repr(d) == (
        "DeviceInfo(cuda:0, 'NVIDIA H100 80GB HBM3', 3.0 GiB free of 80.0 GiB, cc 9.0, "
        "nvidia-smi 2)"
    )
    inv = machine(gpu(0))
    assert repr(inv) == "Inventory('testbox': cuda:0, cpu)"
    assert "torch 2.13.0+cu128 (CUDA 12.8)" in repr(inv.host)


def test_print_shows_the_tables_of_anydevice_info_and_notebooks_get_html():
    inv = machine(gpu(0, free=3 * GiB), notes=("a <note>",))
    text = str(inv)
    assert text != repr(inv) and "\n" in text
    for shown in ("host", "testbox", "torch", "cuda:0", "NVIDIA H100 80GB HBM3", "3.0 GiB free"):
        assert shown in text, shown
    assert "note: a <note>" in text
    page = inv._repr_html_()
    assert page.count("<table>") == 3  # the host, the GPU, the CPU
    assert "<b>cuda:0 NVIDIA H100 80GB HBM3</b>" in page and "3.0 GiB free" in page
    assert "a &lt;note&gt;" in page  # text is escaped


def test_rich_prints_an_inventory_as_the_tables_print_shows():
    import io

    from rich.console import Console

    inv = machine(gpu(0, free=3 * GiB), notes=("a note",))
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(inv)
    shown = out.getvalue()
    assert "cuda:0" in shown and "3.0 GiB free" in shown and "note: a note" in shown
    assert shown.index("host") < shown.index("cuda:0") < shown.index("note: a note")


def test_inventory_helpers():
    inv = machine(gpu(0), gpu(1))
    assert [d.spec for d in inv.accelerators] == ["cuda:0", "cuda:1"]
    assert inv.cpu.kind == "cpu"
    assert inv.find("cuda", 1) is inv.devices[1]
    assert inv.find("cuda", 7) is None


def test_format_bytes():
    assert format_bytes(None) == "?"
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**40) == "3.0 TiB"


def test_inventory_does_not_initialise_cuda_or_import_torch_xla():
    import sys

    from anydevice.hardware.backends.cuda import driver_initialized

    ad.inventory()
    assert not torch.cuda.is_initialized()
    assert not driver_initialized()
    assert "torch_xla" not in sys.modules


# ----------------------------------------------------------------------------- without torch


def test_inventory_without_torch_imports_no_torch_and_agrees_with_inventory():
    code = (
        "import json, sys\n"
        "from anydevice.hardware.inventory import inventory_without_torch\n"
        "inv = inventory_without_torch()\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'inv': inv.to_dict()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(out.stdout)
    assert report["torch"] is False
    light, full = report["inv"], ad.inventory().to_dict()
    assert set(light["host"]) == HOST_KEYS
    assert all(set(d) == DEVICE_KEYS for d in light["devices"])
    for key in HOST_KEYS - {"torch_threads", "memory_available"}:
        assert light["host"][key] == full["host"][key], key
    assert light["host"]["torch_threads"] is None
    assert [d["spec"] for d in light["devices"]] == [d["spec"] for d in full["devices"]]
    assert any("thread count is not probed" in n for n in light["notes"])


def test_inventory_without_torch_reads_torch_once_it_is_imported():
    inv = inventory_without_torch(telemetry=False)
    assert inv.host.torch_threads == torch.get_num_threads()
    assert not any("not probed" in n for n in inv.notes)


def test_backends_without_their_hardware_answer_without_torch():
    code = (
        "import json, sys\n"
        "from anydevice.hardware import backends\n"
        "out = {k: backends.get(k).probe_without_torch() for k in ('xla', 'xpu', 'mps')}\n"
        "print(json.dumps({'torch': 'torch' in sys.modules,\n"
        "    'answers': {k: None if p is None else len(p.devices) for k, p in out.items()}}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(out.stdout)
    expected = {
        "xla": None if importlib.util.find_spec("torch_xla") else 0,
        "xpu": None if getattr(torch.version, "xpu", None) else 0,
        "mps": None if sys.platform == "darwin" else 0,
    }
    assert report["answers"] == expected
    assert report["torch"] is False


def test_parse_size_reads_what_people_write():
    assert parse_size("8GiB") == parse_size("8 g") == 8 * GiB
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(512) == 512
    with pytest.raises(ValueError, match="cannot read '8 apples' as a memory size"):
        parse_size("8 apples")


def test_looking_with_telemetry_leaves_cuda_uninitialised(monkeypatch):
    # Observable on any build: torch's lazy initialisation is never entered (it is where
    # every torch.cuda query that needs the driver starts), and torch's flag stays False.
    import torch

    if torch.cuda.is_initialized():
        pytest.skip("CUDA is in use in this process already")
    entered = []
    real = torch.cuda._lazy_init
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: entered.append(1) or real())
    inv = ad.inventory()
    ad.describe("cpu")
    ad.describe("auto")
    inventory_without_torch()
    assert inv.cpu.kind == "cpu"
    assert entered == [] and not torch.cuda.is_initialized()
