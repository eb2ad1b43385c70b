"""The infra tests (``make test-infra``): real clusters on this machine. ``make test`` does
not collect this folder (``norecursedirs`` in pyproject.toml); each test here is marked
``infra``. What a test needs and cannot have (root, ``ip netns``, SLURM's daemons) makes it
skip with the reason, never pass silently. Everything started here is stopped by its pid
and every file, namespace and host entry made here is removed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TRAIN = HERE / "train.py"
PYTHON = sys.executable


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.infra)


def environ(**extra: str) -> dict[str, str]:
    """This environment with the worktree's ``src`` first on the path (as the unit tests)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p
    )
    env.update(extra)
    return env


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (make test-infra as root); running as uid {os.getuid()}")


def need_commands(*names: str, hint: str) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed ({hint})")


def read_run(folder: Path) -> tuple[list[tuple[int, float]], dict[str, Any]]:
    """The ``(step, loss)`` lines and ``final.json`` that tests/infra/train.py wrote."""
    losses = [
        (int(s), float(v))
        for s, v in (line.split() for line in (folder / "losses.txt").read_text().splitlines())
    ]
    return losses, json.loads((folder / "final.json").read_text())


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A folder every process of the test sees, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="ad-infra-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def one_host() -> Iterator[Any]:
    """``steps -> (losses, final)`` of the uninterrupted run on this machine, 2 ranks."""
    done: dict[int, tuple[list[tuple[int, float]], dict[str, Any]]] = {}
    folder = Path(tempfile.mkdtemp(prefix="ad-infra-ref-"))

    def reference(steps: int) -> tuple[list[tuple[int, float]], dict[str, Any]]:
        if steps not in done:
            out = folder / str(steps)
            out.mkdir()
            subprocess.run(
                [PYTHON, "-m", "anydevice", "launch", "-n", "2", str(TRAIN), "--out", str(out),
                 "--steps", str(steps)],
                env=environ(), check=True, timeout=120, cwd=REPO,
            )  # fmt: skip
            done[steps] = read_run(out)
        return done[steps]

    try:
        yield reference
    finally:
        shutil.rmtree(folder, ignore_errors=True)
