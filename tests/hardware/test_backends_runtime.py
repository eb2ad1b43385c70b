"""The run-time half of the backends: one implementation on torch's device-generic API.

CUDA, XPU and every privateuse1 backend (the simulated accelerator of
``tests/sim_cases.py``, torch's python test backend of ``tests/privateuse1_cases.py``,
torch's OpenReg) run streams, events, event timing, side streams, the loader's copies and
the allocator's counters through the same methods of :class:`anydevice.hardware.backends.Backend`.
These tests hold that true: a CUDA-only path added beside the tested one fails here.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from anydevice.hardware import backends
from anydevice.hardware.backends import Backend, runtime

#: The run-time methods the simulator's and torch's test backends exercise.
RUN_TIME = (
    "stream_device",
    "new_stream",
    "current_stream",
    "use_stream",
    "new_event",
    "set_device",
    "memory",
    "reset_peak",
    "empty_cache",
    "initialized",
)

#: What each kind with streams does its own way, and why (nothing generic answers it).
OWN_WAY = {
    # has this GPU a primary context (the driver), asked without creating one; the
    # compute-capability rules of its policies; torch's sync debug mode is CUDA's
    "cuda": {
        "in_use",
        "synchronize",
        "free_total",
        "cache_bytes",
        "channels_last_pays",
        "sync_debug",
        "sync_debug_unavailable",
    },
    "xpu": {"channels_last_pays"},  # oneDNN's
    "accelerator": {"in_use"},  # the privateuse1 name and torch's current accelerator
}


def overridden(kind: str) -> set[str]:
    cls = type(backends.get(kind))
    return {
        name
        for name, member in inspect.getmembers(cls)
        if name in Backend.__dict__
        and not name.startswith("_")
        and callable(member)
        and member is not getattr(Backend, name)
        and name not in {"probe", "probe_static", "probe_without_torch", "unavailable_reason"}
    }


@pytest.mark.parametrize("kind", sorted(OWN_WAY))
def test_kinds_with_streams_run_the_generic_code(kind: str) -> None:
    backend = backends.get(kind)
    assert backend.has_streams
    assert overridden(kind) == OWN_WAY[kind]
    for name in RUN_TIME:
        assert getattr(type(backend), name) is getattr(Backend, name), name


def test_cuda_differs_by_its_flags_only() -> None:
    cuda, generic = backends.get("cuda"), backends.get("accelerator")
    flags = ("records_streams", "reuses_events", "pins_surely", "times_events")
    assert [getattr(cuda, f) for f in flags] == [True, True, True, True]
    assert [getattr(generic, f) for f in flags] == [False, False, False, None]


@pytest.mark.parametrize("kind", ["cpu", "mps", "xla"])
def test_kinds_without_streams_have_no_side_streams(kind: str) -> None:
    backend = backends.get(kind)
    assert not backend.has_streams
    assert backend.stream_device(torch.device(kind)) is None


def test_a_device_type_no_backend_claims_has_no_streams_and_is_not_the_host() -> None:
    meta, lazy = runtime("meta"), runtime("lazy")
    assert lazy is runtime("lazy") and meta is runtime("meta") and meta is not lazy
    assert meta is not backends.get("cpu") and isinstance(meta, type(lazy))
    assert not (meta.has_streams or meta.is_host or meta.counts_peaks)
    assert lazy.holds_data and not meta.holds_data
    from anydevice.feeding.streams import stream_device

    assert stream_device(torch.device("meta")) is None
    meta.synchronize(torch.device("meta"))  # nothing queued: returns


def test_cuda_without_a_gpu_has_no_stream_device_and_stays_uninitialised() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the cuda-marked tests cover it")
    assert backends.get("cuda").stream_device(torch.device("cuda", 0)) is None
    assert not torch.cuda.is_initialized()


# ------------------------------------------------------------------ device-kind branches
KIND_NAMES = frozenset({"cpu", "cuda", "mps", "xpu", "xla", "meta", "npu", "hpu", "mtia"})
PACKAGE = Path(__file__).resolve().parents[2] / "src" / "anydevice"

#: Comparisons of a device type (or kind) to a literal kind name left outside backends/,
#: per module: each is a branch a new device kind has to be added to. Only ever lowered.
STILL_BRANCHING = {
    "hardware/facts.py": 1,  # DeviceInfo.is_accelerator: the data's own definition
    "hardware/selection.py": 1,  # the grammar's word: cpu, the host in the inventory
}


def test_what_differs_between_kinds_is_said_by_their_backends() -> None:
    """The facts the feature modules used to branch on, each a backend's flag or method."""
    cpu, cuda, xpu, xla = (backends.get(k) for k in ("cpu", "cuda", "xpu", "xla"))
    meta = runtime("meta")
    assert not meta.holds_data and cpu.holds_data and cuda.holds_data
    assert cpu.always_probed and cuda.always_probed and not xpu.always_probed
    assert cuda.keeps_history and not xpu.keeps_history and not cpu.keeps_history
    assert cuda.data_parallel and not xpu.data_parallel
    assert cuda.ddp_device_ids and xpu.ddp_device_ids and not cpu.ddp_device_ids
    assert cuda.visibility_variable == "CUDA_VISIBLE_DEVICES" and cpu.visibility_variable is None
    refusal = xla.collective_refusal("gloo")
    assert refusal is not None and "backend='xla'" in refusal
    assert xla.collective_refusal("xla") is None and cuda.collective_refusal("gloo") is None


def test_the_registry_answers_from_the_kinds_records() -> None:
    """What selection, the inventory and the collectives used to list by name."""
    assert backends.accelerators() == ("cuda", "xla", "xpu", "mps")  # "auto"'s order
    assert backends.gpu_kinds() == ("cuda", "xpu", "mps")
    assert backends.probe_order() == (*backends.accelerators(), backends.GENERIC, "cpu")
    assert backends.host() is backends.facts("cpu") and backends.facts("cpu").collective == "gloo"
    assert backends.facts("npu") == backends.Kind("npu")  # a kind only torch knows: defaults
    assert backends.facts("xla").words == ("tpu",) and not backends.facts("meta").indexed
    assert [k.name for k in backends.kinds() if k.precision is not None] == [
        "cuda",
        "xla",
        "xpu",
        "mps",
        "cpu",
    ]
    assert backends.group_backends("cpu:gloo,cuda:nccl") == {"gloo", "nccl"}
    assert backends.collective_device("gloo") == torch.device("cpu")
    with pytest.raises(ValueError, match="registered already"):
        backends.register(type(backends.get("cuda")))


def _names_a_kind(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in KIND_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_kind(e) for e in node.elts)
    return False


def kind_branches(source: str) -> list[int]:
    """Lines comparing something to a literal device kind name (``== "cuda"``,
    ``in ("cuda", "xpu")``), docstrings and doctests aside."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)
            and any(_names_a_kind(n) for n in (node.left, *node.comparators))
        ):
            lines.append(node.lineno)
    return lines


def test_the_kind_branch_finder_sees_the_forms_it_counts() -> None:
    code = 'a = d.type == "cuda"\nb = k in ("xpu", "x")\nc = s == "cudax"\nd = t != "cpu"\n'
    assert kind_branches(code) == [1, 2, 4]


def _sources(*skipped: str) -> dict[str, str]:
    """The package's modules by path, those under ``skipped`` folders left out."""
    return {
        rel: path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
        if not (rel := path.relative_to(PACKAGE).as_posix()).startswith(skipped)
    }


def _assert_held(found: dict[str, list[int]], allowed: dict[str, int], fix: str) -> None:
    """Each module's lines ``found`` are at most ``allowed`` there, and the allowance is
    lowered as soon as they fall (a ratchet: it only ever goes down)."""
    grown = {rel: lines for rel, lines in found.items() if len(lines) > allowed.get(rel, 0)}
    assert not grown, f"{fix}: {grown}"
    lowered = {
        rel: len(found.get(rel, [])) for rel, n in allowed.items() if len(found.get(rel, [])) < n
    }
    assert not lowered, f"fewer than allowed: lower the allowance to {lowered}"


def test_no_module_outside_backends_gains_a_device_kind_branch() -> None:
    # testing/cuda/ maps one kind onto the simulator: naming that kind is what it is for.
    sources = _sources("hardware/backends/", "testing/cuda/")
    found = {rel: lines for rel, source in sources.items() if (lines := kind_branches(source))}
    _assert_held(
        found,
        STILL_BRANCHING,
        "device-kind branches outside backends/ (put the difference in the kind's backend, "
        "as a flag or a method)",
    )


# ------------------------------------------------------------------ device kinds named
#: Words that name a device kind or a collective backend: every kind's name and spec words
#: the registry knows, the collective backends of the kinds and of torch's map, and device
#: types torch knows that anydevice serves through the generic backend. Not "cpu": torch's
#: host device, which every torch has, written for host tensors (``.to("cpu")``).
KIND_WORDS = frozenset(
    {
        *(w for k in backends.kinds() for w in (k.name, *k.words)),
        *("cuda", "hip", "mps", "xpu", "xla", "tpu", "meta", "npu", "hpu", "mtia"),
        "privateuseone",
    }
) - {"cpu"}
COLLECTIVE_WORDS = frozenset(
    {
        *(k.collective for k in backends.kinds() if k.collective),
        *map(str, torch.distributed.Backend.default_device_backend_map.values()),
        *("nccl", "gloo", "xccl", "hccl", "ucc"),
    }
)  # not "mpi": also the launcher MPI's name (a world's launcher), which names no kind

#: Kind names, collective-backend names and ``torch.<kind>.`` calls left outside
#: backends/ and testing/ (the simulator's own backend), per module: each a place a new
#: device kind would have to be added to. Only ever lowered; none is left.
STILL_NAMING: dict[str, int] = {}

#: Modules outside backends/ that import a vendor's backend module, each because the
#: feature is that vendor's by definition (nothing a new kind would change):
VENDOR_FEATURES = {
    "launching/preflight.py": "fork after cuInit is unsafe: CUDA's driver state",
    "doctor/checks.py": "the CUDA wheel, nvidia-smi numbering, NVIDIA PCI cards, MPS fallback",
    "doctor/toolchain.py": "nvcc builds for the NVIDIA GPUs here",
    "extension.py": "nvcc's -gencode flags for the NVIDIA GPUs here",
    "hardware/freest.py": "anydevice select writes CUDA_VISIBLE_DEVICES from NVML",
    "hardware/peaks.py": "the datasheet table lists NVIDIA GPUs",
    "hardware/render.py": "nvidia-smi's index, UUID and PCI bus rows",
    "hardware/selection.py": "ad.restrict_visible writes CUDA_VISIBLE_DEVICES",
    "measure/profiling.py": "ad.nvtx_range: NVTX is NVIDIA's",
}
_VENDOR_MODULES = frozenset(
    {"cuda", "nvml", "mps", "xpu", "xla", "amdsmi", "drm", "xpusmi", "ioreg"}
)


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def kind_names(source: str) -> list[int]:
    """Lines naming a device kind outside a docstring: a kind's name or a collective
    backend's as a literal (alone, or in a tuple, set, list or dict), and ``torch.<kind>``,
    ``torch.backends.<kind>`` or ``ProfilerActivity.<KIND>`` attributes."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    words = KIND_WORDS | COLLECTIVE_WORDS
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in words and id(node) not in docs:
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr.lower() in KIND_WORDS:
            owner = node.value
            if isinstance(owner, ast.Attribute) and owner.attr == "backends":
                owner = owner.value
            if isinstance(owner, ast.Name) and owner.id in ("torch", "ProfilerActivity"):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_kind_name_finder_sees_the_forms_it_counts() -> None:
    code = (
        '"""A docstring naming cuda and nccl is prose."""\n'
        'a = d.type == "cuda"\n'
        'b = {"xpu": 1, "mps": 2}\n'
        'c = backend in ("nccl", "gloo")\n'
        "d = torch.cuda.current_device()\n"
        "e = torch.backends.mps.is_available()\n"
        "f = ProfilerActivity.CUDA\n"
        'g = torch.device("cpu"), "cudax", torch.version.cuda, torch.accelerator\n'
        'h = getattr(torch, "xpu")\n'
    )
    assert kind_names(code) == [2, 3, 3, 4, 4, 5, 6, 7, 9]


def test_no_module_outside_backends_names_a_device_kind() -> None:
    """The registry is the one place a kind is named: what the rest asks, its facts say."""
    sources = _sources("hardware/backends/", "testing/")
    found = {rel: lines for rel, source in sources.items() if (lines := kind_names(source))}
    _assert_held(
        found,
        STILL_NAMING,
        "device kinds named outside backends/ (declare the fact in the kind's Kind record, "
        "hardware/backends/<kind>.py, and ask anydevice.hardware.backends)",
    )
    assert sum(STILL_NAMING.values()) <= 10


def _vendor_imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[:3] == ["anydevice", "hardware", "backends"] and len(parts) > 3:
                found.add(parts[3])
            elif parts == ["anydevice", "hardware", "backends"]:
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[3] for a in node.names if a.name.count(".") >= 3)
    return found & _VENDOR_MODULES


def test_only_a_vendors_own_features_import_its_backend() -> None:
    sources = _sources("hardware/backends/", "testing/")
    importers = {rel for rel, source in sources.items() if _vendor_imports(source)}
    assert importers == set(VENDOR_FEATURES), (
        "a module outside backends/ imports a vendor's backend module: ask the registry "
        "instead, or, if the feature is that vendor's by definition, list it in "
        f"VENDOR_FEATURES with why: {sorted(importers ^ set(VENDOR_FEATURES))}"
    )
