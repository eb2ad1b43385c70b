"""A folder of step-numbered checkpoints: where the next goes, which to keep, the latest.

``ad.save_state(folder, keep=k, step=s)`` writes ``folder/step-00000s`` and then removes
all but the newest ``k`` complete checkpoints there; ``ad.load_state(latest_in=folder)``
loads the newest complete one. Complete: a file (written atomically, so any file of that
name is whole) or a folder with its index and manifest (a sharded save renamed into place
once every rank had written). Hidden names (``.step-….tmp``, saves under way or cut
short) are never taken.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from anydevice.errors import CheckpointError

__all__ = ["complete", "latest", "numbered", "prune"]

_NAME = re.compile(r"^step-(\d+)$")


def numbered(folder: Path, step: object) -> Path:
    """Where the checkpoint of ``step`` goes in ``folder`` (created if need be).

    Raises:
        TypeError: ``step`` is not a whole number (``keep=`` needs ``step=``).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError(
            f"ad.save_state(..., keep=...) names each checkpoint by its step: pass step= as a "
            f"whole number >= 0 (got {step!r})."
        )
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"step-{step:09d}"


def complete(path: Path) -> bool:
    """Whether ``path`` is a whole checkpoint (see the module docstring)."""
    if path.is_file():
        return True
    return path.is_dir() and (path / ".metadata").exists() and (path / "anydevice.json").exists()


def _steps(folder: Path) -> list[tuple[int, Path]]:
    """The step-numbered entries of ``folder``, newest first."""
    found = []
    for entry in folder.iterdir() if folder.is_dir() else ():
        m = _NAME.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry))
    return sorted(found, reverse=True)


def latest(folder: Path) -> Path:
    """The newest complete checkpoint in ``folder``.

    Raises:
        CheckpointError: there is none (the message says what is there).
    """
    entries = _steps(folder)
    for _, path in entries:
        if complete(path):
            return path
    partial = ", ".join(p.name for _, p in entries) or "no step-N checkpoints"
    raise CheckpointError(
        f"ad.load_state(latest_in={str(folder)!r}): no complete checkpoint there ({partial}). "
        "Start from scratch, or pass the path of one.",
        path=str(folder),
    )


def prune(folder: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints of ``folder`` (and partial
    ones older than the oldest kept); return what was removed."""
    removed = []
    kept = 0
    for _, path in _steps(folder):
        if kept < keep and complete(path):
            kept += 1
            continue
        if kept < keep:  # a partial one newer than those kept: a save under way elsewhere
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed
