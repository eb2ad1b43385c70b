"""Every GPU benchmark runs on the CPU with tiny sizes, so a crash in one shows here.

Each ``gpu_*`` function of ``benchmarks/bench_*.py`` takes ``device`` and ``quick``; here it
runs with ``device="cpu", quick=True`` and writes its results into a temporary folder
(``ANYDEVICE_BENCH_RESULTS``). The numbers mean nothing at these sizes; what is checked
is that every line ran and that the result is well formed: finite, non-negative rows,
and a JSON file naming the machine.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _module(script: Path) -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_smoke_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _gpu_benchmarks() -> Iterator[Any]:
    for script in sorted(BENCHMARKS.glob("bench_*.py")):
        source = script.read_text()
        for line in source.splitlines():
            if line.startswith("def gpu_"):
                name = line.removeprefix("def ").split("(")[0]
                yield pytest.param(script, name, id=f"{script.stem}.{name}")


GPU_BENCHMARKS = list(_gpu_benchmarks())


def test_there_are_gpu_benchmarks_to_smoke_test():
    assert len(GPU_BENCHMARKS) >= 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("script", "name"), GPU_BENCHMARKS)
def test_gpu_benchmark_runs_on_the_cpu_with_tiny_sizes(script, name, tmp_path, monkeypatch):
    monkeypatch.setenv("ANYDEVICE_BENCH_RESULTS", str(tmp_path))
    monkeypatch.delenv("ANYDEVICE_DEVICE", raising=False)
    fn: Callable[..., Any] = getattr(_module(script), name)
    out = fn(device="cpu", quick=True)
    results = out if isinstance(out, list) else [out]
    assert results, f"{name} returned no result"
    for result in results:
        assert result.rows, f"{name}: {result.name} has no rows"
        for label, value in result.rows.items():
            assert math.isfinite(value) and value >= 0, f"{name}: {label} = {value}"
        written = json.loads((tmp_path / _file_of(tmp_path, result.name)).read_text())
        assert written["name"] == result.name and written["rows"] == result.rows
        assert written["machine"]["torch"] and "cpu" in written["machine"]


def _file_of(folder: Path, name: str) -> str:
    [found] = [p.name for p in folder.glob(f"{name}-*.json")]
    return found
