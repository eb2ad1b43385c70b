"""The package's shape holds: no import circle (function-level and type-only imports, and
imports from a module's own package, included), every import goes down a layer, and each
subpackage's ``__init__`` names every module it holds.

Read from the syntax tree by ``scripts/import_graph.py``, the tool that reports the same
numbers to people."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph():
    spec = importlib.util.spec_from_file_location(
        "import_graph", ROOT / "scripts" / "import_graph.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module
    spec.loader.exec_module(module)
    return module


def test_no_import_circle_even_through_function_level_and_type_only_imports(graph) -> None:
    edges, _ = graph.graph(everything=True)
    assert graph.circles(edges) == []


def test_type_only_imports_and_a_modules_own_package_are_counted(graph, tmp_path) -> None:
    """A name imported for type checkers, or from the module's own package's ``__init__``,
    ties the modules as much as any import: each is an edge of the graph."""
    module = tmp_path / "measure.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from anydevice.doctor import resolve_devices\n"
        "if TYPE_CHECKING:\n"
        "    from anydevice.doctor.workloads import Plan\n"
        "def f():\n"
        "    from anydevice.doctor import budget\n"
    )
    known = {"anydevice.doctor", "anydevice.doctor.workloads", "anydevice.doctor.budget"}
    name = "anydevice.doctor.measure"
    assert graph.imports(module, name, True, known) == known
    assert graph.imports(module, name, False, known) == {"anydevice.doctor"}


def test_every_import_goes_down_a_layer(graph) -> None:
    edges, _ = graph.graph(everything=True)
    assert graph.layer_breaches(edges) == []


def test_a_layer_breach_and_a_circle_are_seen(graph) -> None:
    edges = {
        "anydevice.hardware.a": {"anydevice.measure.b"},
        "anydevice.measure.b": {"anydevice.hardware.a"},
        "anydevice.newthing.c": set(),
        "anydevice.cli.d": {"anydevice.newthing.c"},
    }
    assert graph.circles(edges) == [["anydevice.hardware.a", "anydevice.measure.b"]]
    assert graph.layer_breaches(edges) == [
        "anydevice.cli.d -> anydevice.newthing.c",  # a package in no layer
        "anydevice.hardware.a -> anydevice.measure.b",  # upwards
    ]


def test_each_concern_is_in_one_layer(graph) -> None:
    package = ROOT / "src" / "anydevice"
    here = {p.stem for p in package.glob("*.py")} | {
        p.parent.name for p in package.glob("*/__init__.py")
    }
    placed = set().union(*graph.LAYERS)
    assert here - {"__init__"} <= placed, f"put {sorted(here - {'__init__'} - placed)} in LAYERS"


def test_no_module_under_the_package_is_named_like_a_public_name() -> None:
    """Python records an imported submodule as an attribute of its package: a subpackage
    ``anydevice/distributed/`` would replace ``ad.distributed`` (the function) once
    imported, so no module or subpackage directly under ``anydevice`` takes a public name
    (and ``anydevice`` needs no module class of its own to guard them)."""
    package = ROOT / "src" / "anydevice"
    here = {p.stem for p in package.glob("*.py")} | {
        p.parent.name for p in package.glob("*/__init__.py")
    }
    tree = ast.parse((package / "__init__.py").read_text())
    sources = next(
        n.value
        for n in tree.body
        if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "_SOURCES"
    )
    assert isinstance(sources, ast.Dict)
    public = {k.value for k in sources.keys if isinstance(k, ast.Constant)}
    assert len(public) > 50
    assert here & public == set()
    assert "ModuleType" not in (package / "__init__.py").read_text()


def test_each_subpackage_names_its_modules_in_its_docstring() -> None:
    for init in sorted((ROOT / "src" / "anydevice").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        dotted = ".".join(init.parent.relative_to(ROOT / "src").parts)
        modules = [
            p.stem for p in init.parent.glob("*.py") if p.stem not in ("__init__", "__main__")
        ]
        modules += [p.parent.name for p in init.parent.glob("*/__init__.py")]
        unnamed = [m for m in modules if f"{dotted}.{m}" not in doc and f"``{m}``" not in doc]
        assert not unnamed, f"{dotted}'s __init__ docstring should say what {unnamed} own"


def test_the_gpu_check_finds_every_test_module_with_cuda_tests() -> None:
    """``scripts/gpu-check.sh`` runs the modules its own line lists: every one that holds a
    ``cuda`` test, wherever in tests/ it lives (the layout moved them into subfolders)."""
    script = (ROOT / "scripts" / "gpu-check.sh").read_text()
    line = next(x for x in script.splitlines() if x.startswith("mapfile -t modules"))
    listing = line.split("< <(", 1)[1].rsplit(")", 1)[0]
    found = subprocess.run(
        ["bash", "-c", listing], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    expected = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("test_*.py")
        if "pytest.mark.cuda" in p.read_text() and "infra" not in p.parts
    )
    assert len(expected) > 20
    assert sorted(found) == expected
