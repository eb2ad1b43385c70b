"""The public API is exactly the documented one, and importing it stays light."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import anydevice

DOCUMENTED = {
    "AnydeviceError", "DeviceInfo", "DeviceLike", "DeviceNotFoundError", "DeviceSpecError",
    "HostInfo", "Inventory", "ProcessInfo", "VisibilityError", "__version__", "describe",
    "device", "devices", "inventory", "restrict_visible", "try_all_gpus", "try_gpu",
    "to", "device_of", "devices_of", "check_devices", "diagnose", "save", "load",
    "DeviceMismatchError", "MoveError", "NoTensorError", "CheckpointError",
    "Precision", "PrecisionError", "StepOrderError", "channels_last", "fast_matmul",
    "precision",
    "DeviceLoader", "LoaderStats", "side_stream",
    # measuring
    "BatchSizeError", "Measurement", "MeasurementError", "MemoryStats", "MemoryUsage",
    "SyncReport", "Timer", "find_syncs", "fit_batch_size", "free_memory", "memory",
    "nvtx_range", "profile", "timeit", "track_memory",
    # many devices, many machines
    "Distributed", "DistributedError", "DistributedTimeoutError", "WorkerFailedError",
    "all_gather", "all_reduce", "broadcast", "distributed", "gather_for_metrics", "launch",
    "prepare", "share", "unwrap",
    # kernels
    "ExtensionError", "load_extension",
}  # fmt: skip

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_all_is_exactly_the_documented_api():
    assert set(anydevice.__all__) == DOCUMENTED
    assert len(anydevice.__all__) == len(set(anydevice.__all__))
    for name in anydevice.__all__:
        assert hasattr(anydevice, name), name


def test_every_public_name_is_in_the_api_reference():
    text = API_DOC.read_text()
    documented = set(re.findall(r"^#+ `(?:ad\.)?([A-Za-z_]+)", text, flags=re.M))
    assert DOCUMENTED - {"__version__"} <= documented


def test_import_adds_only_anydevice_modules_to_torch():
    code = (
        "import sys, json, torch; before = set(sys.modules); import anydevice; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    added = json.loads(out.stdout)
    assert added, "anydevice itself should appear"
    assert all(m == "anydevice" or m.startswith("anydevice.") for m in added), added


def test_import_loads_no_rich_nvml_xla_or_backends():
    code = (
        "import sys, json; import anydevice; "
        "print(json.dumps([m for m in sys.modules if m.split('.')[0] in "
        "('rich', 'torch_xla', 'psutil') or m.startswith('anydevice.backends') "
        "or m in ('anydevice.cli', 'anydevice.console', 'anydevice.doctor')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == []


def test_pynvml_is_not_imported_by_anydevice_itself():
    # torch imports pynvml on its own when it is installed; anydevice must not add it.
    code = (
        "import sys; sys.modules['pynvml'] = None; import torch, anydevice; "
        "print(anydevice.device('cpu'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "cpu"


def test_import_loads_no_elastic_agent():
    # torch.distributed comes with torch; the elastic agent loads only when a launch starts.
    code = (
        "import sys, json; import anydevice; "
        "print(json.dumps([m for m in sys.modules if m.startswith('torch.distributed.elastic') "
        "or m.startswith('torch.distributed.launcher') or m == 'torch._dynamo']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == []
