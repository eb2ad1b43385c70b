"""The infra tests (``make test-infra``): real clusters on this machine. ``make test`` does
not collect this folder (``norecursedirs`` in pyproject.toml); each test here is marked
``infra``. What a test needs and cannot have (root, ``ip netns``, SLURM's daemons) makes it
skip with the reason, never pass silently. Everything started here is stopped by its pid
and every file, namespace and host entry made here is removed."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.runs import HERE, PYTHON, REPO, TRAIN, Losses, environ, read_run


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.infra)


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
    """``(steps, ranks) -> (losses, final)`` of the uninterrupted run on this machine
    (``anydevice launch -n RANKS``), each run once a session."""
    done: dict[tuple[int, int], tuple[Losses, dict[str, Any]]] = {}
    folder = Path(tempfile.mkdtemp(prefix="ad-infra-ref-"))

    def reference(steps: int, ranks: int = 2) -> tuple[Losses, dict[str, Any]]:
        if (steps, ranks) not in done:
            out = folder / f"{steps}x{ranks}"
            out.mkdir()
            subprocess.run(
                [PYTHON, "-m", "anydevice", "launch", "-n", str(ranks), str(TRAIN),
                 "--out", str(out), "--steps", str(steps)],
                env=environ(), check=True, timeout=120, cwd=REPO,
            )  # fmt: skip
            done[steps, ranks] = read_run(out)
        return done[steps, ranks]

    try:
        yield reference
    finally:
        shutil.rmtree(folder, ignore_errors=True)
