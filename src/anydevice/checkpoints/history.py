"""A folder of step-numbered checkpoints: where the next goes, which to keep, the latest.

``ad.save_state(folder, keep=k, step=s)`` writes ``folder/step-00000s`` and then removes
all but the newest ``k`` complete checkpoints there; ``ad.load_state(latest_in=folder)``
loads the newest intact one (:func:`candidates` lists them newest first; ``load_state``
checks each). Complete: a file (written atomically, so any file of that name is whole) or
a folder with its index and manifest (a sharded save renamed into place once every rank
had written). Hidden names (``.step-….tmp``, saves under way or cut short) are never
taken, and pruning removes only checkpoints of ``save_state``: anything else named
``step-N`` there is left alone.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from anydevice.checkpoints import ondisk
from anydevice.errors import CheckpointError

__all__ = ["candidates", "complete", "numbered", "prune"]

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
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(
            f"ad.save_state({str(folder)!r}, keep=...): {folder} is a file; keep= makes the "
            "path a folder of step-numbered checkpoints. Pass a folder.",
            path=str(folder),
        )
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"step-{step:09d}"


def complete(path: Path) -> bool:
    """Whether ``path`` is a whole checkpoint (see the module docstring)."""
    if path.is_file():
        return ondisk.is_state_file(path)
    return path.is_dir() and (path / ".metadata").exists() and (path / ondisk.MANIFEST).exists()


def _steps(folder: Path) -> list[tuple[int, Path]]:
    """The step-numbered entries of ``folder``, newest first."""
    found = []
    for entry in folder.iterdir() if folder.is_dir() else ():
        m = _NAME.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry))
    return sorted(found, reverse=True)


def candidates(folder: Path) -> list[Path]:
    """The step-numbered entries of ``folder``, newest first."""
    return [path for _, path in _steps(folder)]


def prune(folder: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints of ``folder`` (and partial
    ones of ours older than the oldest kept); return what was removed. What is not a
    checkpoint of ``save_state`` is never removed."""
    removed = []
    kept = 0
    for _, path in _steps(folder):
        if kept < keep and complete(path):
            kept += 1
            continue
        if kept < keep or not ondisk.ours(path):  # a save under way elsewhere; the user's
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed
