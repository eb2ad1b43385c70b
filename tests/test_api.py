"""The public API is exactly the documented one, and importing it stays light."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import anydevice

DOCUMENTED = {
    "AnydeviceError", "ArgumentError", "DeviceInfo", "DeviceLike", "DeviceNotFoundError",
    "DeviceSpecError", "HostInfo", "Inventory", "ProcessInfo", "VisibilityError", "__version__",
    "describe",
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
    # how well the hardware is used
    "FlopCount", "ModuleFlops", "Peak", "Throughput", "ThroughputStats", "flops",
    # many devices, many machines
    "Distributed", "DistributedError", "DistributedTimeoutError", "WorkerFailedError",
    "WorkerImportError",
    "all_gather", "all_reduce", "broadcast", "distributed", "gather_for_metrics", "launch",
    "load_state", "prepare", "save_state", "share", "unwrap", "wait_for_saves",
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


#: Touch every public name, so the lazy package loads all of it.
LOAD_ALL = "import anydevice; [getattr(anydevice, n) for n in anydevice.__all__]; "
INIT = Path(anydevice.__file__)


def test_lazy_sources_and_type_checking_imports_name_exactly_all():
    # A public name is in two places, _SOURCES (__all__ is made from it) and the
    # TYPE_CHECKING imports, each written `name as name` (an explicit re-export).
    tree = ast.parse(INIT.read_text())
    (guard,) = [n for n in tree.body if isinstance(n, ast.If)]
    typed = {
        alias.name: node.module
        for node in guard.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    aliases = [a for n in guard.body if isinstance(n, ast.ImportFrom) for a in n.names]
    assert all(a.asname == a.name for a in aliases)
    public = set(anydevice.__all__) - {"__version__"}
    assert set(anydevice._SOURCES) == public, set(anydevice._SOURCES) ^ public
    assert typed == anydevice._SOURCES


def test_import_alone_imports_neither_torch_nor_our_modules():
    code = (
        "import sys, json; import anydevice; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'anydevice'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == ["anydevice", "anydevice._version"]


def test_public_names_are_never_hidden_by_modules_of_the_same_name():
    # A launched worker imports anydevice.launching.* before the user's ``ad.distributed()``;
    # no module directly under anydevice is named like a public name
    # (tests/test_package_shape.py), so none can replace one.
    code = (
        "import anydevice.hardware.inventory, anydevice.measure.memory\n"
        "import anydevice.numerics.precision, anydevice.checkpoints.state\n"
        "import anydevice.launching.runner, anydevice.training.context\n"
        "from anydevice.launching.elastic import plan\n"
        "import anydevice as ad, types\n"
        "names = ('inventory', 'memory', 'precision', 'distributed', 'launch', 'prepare')\n"
        "print(all(callable(getattr(ad, n)) and not isinstance(getattr(ad, n), "
        "types.ModuleType) for n in names))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "True"


def test_unknown_name_is_an_attribute_error_and_dir_lists_the_api():
    with pytest.raises(AttributeError, match="no attribute 'devcie'"):
        anydevice.devcie  # noqa: B018
    assert set(anydevice.__all__) <= set(dir(anydevice))


def test_loading_the_api_adds_only_anydevice_modules_and_psutil_to_torch():
    # psutil (a dependency) is how the CPU backend reads the host; it brings the standard
    # library's ``resource``.
    code = (
        "import sys, json, torch; before = set(sys.modules); "
        + LOAD_ALL
        + "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    added = json.loads(out.stdout)
    assert added, "anydevice itself should appear"
    others = [m for m in added if m.split(".")[0] not in ("anydevice", "psutil")]
    assert all(m.split(".")[0] in sys.stdlib_module_names for m in others), others


def test_loading_the_api_loads_no_rich_xla_or_cli():
    # The device backends do load (a name's lookup imports what its first call needs), but
    # none of them imports torch_xla before it looks (nor NVML: the test below).
    code = (
        "import sys, json; "
        + LOAD_ALL
        + "print(json.dumps([m for m in sys.modules if m.split('.')[0] in "
        "('rich', 'torch_xla') "
        "or m in ('anydevice.cli', 'anydevice.hardware.render', 'anydevice.doctor')]))"
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


def test_loading_the_api_loads_no_elastic_agent():
    # torch.distributed comes with torch; the elastic agent loads only when a launch starts.
    code = (
        "import sys, json; "
        + LOAD_ALL
        + "print(json.dumps([m for m in sys.modules if m.startswith('torch.distributed.elastic') "
        "or m.startswith('torch.distributed.launcher') or m == 'torch._dynamo']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == []


#: The first calls a newcomer times: each in a fresh process, after only its name's lookup.
FIRST_CALLS = {
    "device": "ad.device()",
    "DeviceLoader": "list(ad.DeviceLoader([torch.ones(2)] * 2))",
    "prepare": "ad.prepare(torch.nn.Linear(2, 2), strategy='dp')",
    "to": "ad.to(torch.nn.Linear(2, 2), 'auto')",
}


@pytest.mark.parametrize("name", sorted(FIRST_CALLS))
def test_a_names_lookup_imports_what_its_first_call_needs(name):
    # Step 1 of a timed loop must not pay imports: the lookup (``ad.device`` without the
    # call) loads them, and the first call then adds nothing to sys.modules.
    code = (
        "import sys, json, warnings, torch, anydevice as ad\n"
        "warnings.simplefilter('ignore')\n"
        f"ad.{name}\n"
        "before = set(sys.modules)\n"
        f"{FIRST_CALLS[name]}\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == [], f"ad.{name}'s first call imported these"


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        (lambda: anydevice.DeviceLoader(None), TypeError, ("loader must be", "DataLoader")),
        (lambda: anydevice.timeit(5), TypeError, ("fn must be the function to time", "(5)")),
        (
            lambda: anydevice.device("cpu", need_memory=float("nan")),
            anydevice.DeviceSpecError,
            ("need_memory=nan", "'8GiB'"),
        ),
        (
            lambda: anydevice.device("cpu", need_memory=[8]),
            TypeError,
            ("need_memory=[8]", "'8GiB'"),
        ),
    ],
)
def test_a_bad_argument_is_named_with_what_to_pass(call, error, says):
    with pytest.raises(error) as info:
        call()
    for words in says:
        assert words in str(info.value), str(info.value)
