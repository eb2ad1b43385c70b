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
    # compute-capability rules of its policies
    "cuda": {"in_use", "synchronize", "free_total", "cache_bytes", "channels_last_pays"},
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
    "hardware/peaks.py": 1,  # the datasheet table lists NVIDIA GPUs
    "hardware/render.py": 1,  # nvidia-smi's index, UUID and PCI bus rows
    "hardware/selection.py": 1,  # the grammar's word: cpu, the host in the inventory
    "hardware/spec.py": 1,  # "cpu:0" is the CPU, "cpu:1" an error
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


def test_no_module_outside_backends_gains_a_device_kind_branch() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("hardware/backends/"):
            continue
        lines = kind_branches(path.read_text())
        if lines:
            found[rel] = lines
    grown = {rel: lines for rel, lines in found.items() if len(lines) > STILL_BRANCHING.get(rel, 0)}
    assert not grown, (
        "device-kind branches outside backends/ (put the difference in the kind's backend, "
        f"as a flag or a method): {grown}"
    )
    lowered = {
        rel: len(found.get(rel, []))
        for rel, n in STILL_BRANCHING.items()
        if len(found.get(rel, [])) < n
    }
    assert not lowered, f"fewer branches than allowed: lower STILL_BRANCHING to {lowered}"
