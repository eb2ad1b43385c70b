"""Helpers of the infra tests: running tests/infra/train.py, reading what it wrote, and
skipping (saying why) where this machine lacks what a test needs."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TRAIN = HERE / "train.py"
PYTHON = sys.executable

Losses = list[tuple[int, float]]


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


def read_run(folder: Path) -> tuple[Losses, dict[str, Any]]:
    """The ``(step, loss)`` lines and ``final.json`` that tests/infra/train.py wrote."""
    losses = [
        (int(s), float(v))
        for s, v in (line.split() for line in (folder / "losses.txt").read_text().splitlines())
    ]
    return losses, json.loads((folder / "final.json").read_text())
