"""Test configuration: ``cuda`` tests run only where an NVIDIA GPU is really present (or
on simulated ones, asked for with ``--sim-cuda``: ``make test-sim``), and ``xla`` tests
only where torch_xla is installed and has a device.

Under pytest-xdist (``make test`` runs ``-n auto``, one worker per usable core), the tests
that start worlds of processes are handed out first, a file's worlds together (its module
fixtures are shared), then the in-process tests fill the workers as they free up. A worker
runs one test at a time, so at most one world per core runs at once: every such test holds
its timeouts on a machine this busy (they are also run with busy loops beside them). One
lane of worlds, one after another, made the suite as long as all of them together.

The CUDA check reads NVML through anydevice's own inventory, so it neither initialises CUDA
in the pytest process nor fakes anything: on a machine without a GPU the tests are skipped.
torch_xla is looked for without importing it, and imported only where it is installed
(``scripts/xla-check.sh`` builds such an environment).

SIGINT has its default meaning for the tests' processes: a run started in the background
by a shell without job control inherits it ignored, and the tests of Ctrl-C would send
their children a signal they never see.

Heartbeats go to a folder of the run's own (``ANYDEVICE_HEARTBEAT_DIR``): the machine's
shared one holds other jobs' heartbeats, which a reading of this machine (``anydevice
top``, the GPU watch) rightly shows.
"""

from __future__ import annotations

import ast
import atexit
import functools
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest

#: Test files whose tests start several processes each (launches, ranks, workers, or the
#: examples all at once). Elsewhere, a test marked ``slow`` counts as one too.
WORLDS = frozenset(
    {
        "test_examples.py",
        "test_agent.py",
        "test_collectives.py",
        "test_context.py",
        "test_elastic.py",
        "test_fsdp.py",
        "test_parallel.py",
        "test_preemption.py",
        "test_sharing.py",
        "test_state.py",
        "test_hangwatch.py",
        "test_progress.py",
    }
)


if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: This process's heartbeat folder; set again before each test (a doctest's example unsets it).
HEARTBEATS = tempfile.mkdtemp(prefix="anydevice-test-heartbeats-")
os.environ["ANYDEVICE_HEARTBEAT_DIR"] = HEARTBEATS
atexit.register(shutil.rmtree, HEARTBEATS, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    os.environ["ANYDEVICE_HEARTBEAT_DIR"] = HEARTBEATS


@functools.cache
def cuda_gpu_present() -> bool:
    from anydevice.hardware.backends.cuda import cuda_built
    from anydevice.hardware.inventory import inventory

    if not cuda_built():
        return False
    return bool(inventory(telemetry=False, kinds=("cuda", "cpu")).of_kind("cuda"))


@functools.cache
def xla_device_present() -> bool:
    from anydevice.hardware.backends.xla import installed

    if not installed():
        return False
    from anydevice.hardware.inventory import inventory

    return bool(inventory(telemetry=False, kinds=("xla", "cpu")).of_kind("xla"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs = {
        "cuda": (cuda_gpu_present, "needs an NVIDIA GPU (cuda marker); none here"),
        "xla": (
            xla_device_present,
            "needs torch_xla with a device (xla marker); scripts/xla-check.sh runs these",
        ),
    }
    for marker, (present, reason) in needs.items():
        if marker == "cuda" and config.getoption("--sim-cuda", default=False):
            continue  # they run on the simulated GPUs (anydevice.testing.pytest_plugin)
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        if marked and not present():
            for item in marked:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, where it is installed
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core this process may use (xdist counts every core)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The tests that start worlds first, a file's together (most tests first); then the
    rest, one at a time, to whichever worker is free.

    ``--dist loadgroup`` with ``xdist_group`` marks would say the same, but pytest 9.2 and
    pytest-xdist 3.8 lose the groups (pytest-dev/pytest-xdist#1386). The scheduler sees
    only node ids, so it knows a world by its file, or by a ``slow`` mark in the source.
    """
    from xdist.scheduler import LoadScopeScheduling

    slow = _slow_tests(Path(config.rootpath) / "tests")

    class WorldsFirst(LoadScopeScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return world_scope(nodeid, slow) or nodeid

        def _assign_work_unit(self, node: Any) -> None:
            if not self._ordered:  # the queue is made once, sorted by size: worlds first
                units = sorted(self.workqueue.items(), key=lambda u: not u[0].startswith("world "))
                self.workqueue.clear()
                self.workqueue.update(units)
                self._ordered = True
            super()._assign_work_unit(node)

    return WorldsFirst(config, log)


def world_scope(nodeid: str, slow: frozenset[str]) -> str | None:
    """The scheduling unit of a test that starts a world (``"world <file>"``), or None for
    one that runs in-process."""
    path, _, rest = nodeid.partition("::")
    name = rest.split("[")[0]
    return f"world {path}" if Path(path).name in WORLDS or name in slow else None


def _slow_tests(folder: Path) -> frozenset[str]:
    """The tests marked ``slow`` in the source, in ``folder`` and the folders under it
    (tests/cli/, tests/launching/, ...): each test function a ``@pytest.mark.slow``
    decorates (whatever the decorators around it), and every one of a module whose
    ``pytestmark`` has it. Read from the syntax tree, never imported."""
    found = set()
    for path in folder.rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        tests = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                 and n.name.startswith("test_")]  # fmt: skip
        whole = any(
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
            and _marks_slow(n.value)
            for n in tree.body
        )
        found.update(t.name for t in tests if whole or any(map(_marks_slow, t.decorator_list)))
    return frozenset(found)


def _marks_slow(node: ast.expr) -> bool:
    """``pytest.mark.slow`` in ``node``: the mark itself, or in a list of marks."""
    if isinstance(node, ast.List | ast.Tuple):
        return any(map(_marks_slow, node.elts))
    return ast.unparse(node) == "pytest.mark.slow"
