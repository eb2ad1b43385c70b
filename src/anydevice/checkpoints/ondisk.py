"""Where a checkpoint of ``save_state`` sits: what is ours to replace, how the previous one
is replaced, and what saves cut short leave beside it.

**Ours.** ``save_state`` replaces its checkpoint whole, so it must never take a path that
holds something else: a folder of the user's (``save_state("outputs")``, as accelerate's
``save_state(output_dir)`` is called) would go with everything in it. :func:`claim` allows
a path that does not exist, an empty folder, a folder with ``save_state``'s manifest, or a
file whose pickle begins as ``save_state``'s do (``{"format": 1, ...}``, read from the
zip's ``data.pkl`` record without unpickling); it refuses anything else, naming it and
saying what to do.

**Replacing.** POSIX cannot rename a folder over a non-empty one, so :func:`replace` first
renames the previous checkpoint aside (``.<name>.<writer>.old``) and removes it once the
new one is in place; a crash between the two renames leaves it there, and
:func:`recover` / :func:`resolve` take it back. Temporary and set-aside entries name their
writer (``placement.checkpoint.temp_name``), so :func:`sweep` removes only those of
writers that died.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickletools
import shutil
import zipfile
from pathlib import Path

from anydevice.errors import CheckpointError
from anydevice.placement import checkpoint

__all__ = [
    "claim",
    "fsync",
    "is_state_file",
    "ours",
    "recover",
    "remove_leftovers",
    "replace",
    "resolve",
    "sweep",
]

logger = logging.getLogger("anydevice")

MANIFEST = "anydevice.json"
_HEX8 = "[0-9a-f]" * 8


def is_state_file(path: Path) -> bool:
    """Whether ``path`` is a file ``save_state`` wrote in a world of one: a torch zip whose
    pickle opens ``{"format": <int>, ...`` (checked on its first records, nothing loaded)."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
            if name is None:
                return False
            with archive.open(name) as member:
                head = member.read(256)
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return False
    found: list[object] = []
    with contextlib.suppress(ValueError, EOFError):  # the head cuts the pickle short
        for op, arg, _ in pickletools.genops(io.BytesIO(head)):
            if op.name in ("BINUNICODE", "SHORT_BINUNICODE", "UNICODE") or "INT" in op.name:
                found.append(arg)
            if len(found) == 2:
                break
    return len(found) == 2 and found[0] == "format" and isinstance(found[1], int)


def ours(path: Path) -> bool:
    """Whether ``path`` is a checkpoint of ``save_state`` (whole or damaged)."""
    if path.is_symlink():
        return False
    if path.is_dir():
        return (path / MANIFEST).is_file()
    return path.is_file() and is_state_file(path)


def claim(target: Path, call: str) -> None:
    """Make sure ``target`` may be written: nothing there, an empty folder, or a checkpoint
    of ours (see the module docstring).

    Raises:
        CheckpointError: something else is there; the message names it, what is in it,
            and what to pass instead.
    """
    if not target.exists() and not target.is_symlink():
        return
    if ours(target):
        return
    if target.is_dir() and not target.is_symlink():
        try:
            entries = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(target))
        except OSError:
            entries = ["(unreadable)"]
        if not entries:
            return  # an empty folder: nothing of the user's is lost
        shown = ", ".join(entries[:5]) + (
            f" and {len(entries) - 5} more" if len(entries) > 5 else ""
        )
        what = f"a folder that is not a checkpoint of ad.save_state (it holds {shown})"
    elif target.is_symlink():
        what = f"a symbolic link (to {os.readlink(target)})"
    else:
        what = "a file that is not a checkpoint of ad.save_state"
    raise CheckpointError(
        f"{call}: {target} is {what}. save_state replaces its checkpoint whole, so it never "
        f"writes over anything else: pass a path of its own, e.g. "
        f"{str(target / 'checkpoint') if target.is_dir() else str(target) + '.ckpt'!r}, or "
        f"keep a history in that folder with ad.save_state({str(target)!r}, keep=3, "
        "step=step) (it writes step-N entries beside what is there), resumed by "
        f"ad.load_state(latest_in={str(target)!r}, ...).",
        path=str(target),
    )


def replace(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` into ``target``'s place; the previous one goes aside, then away."""
    fsync(tmp)
    old = None
    if target.exists():
        old = target.parent / checkpoint.temp_name(target, "old")
        os.replace(target, old)
    os.replace(tmp, target)
    fsync(target.parent)
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def recover(target: Path) -> None:
    """A crash between :func:`replace`'s two renames leaves no ``target`` but a whole
    previous checkpoint aside: put it back."""
    if target.exists():
        return
    aside = _aside(target)
    if aside:
        logger.warning("save_state: %s restored from %s (a save was cut short)", target, aside[-1])
        os.replace(aside[-1], target)


def _aside(target: Path) -> list[Path]:
    """Previous checkpoints a cut-short :func:`replace` left aside, oldest first."""
    found = [Path(e.path) for e, _ in checkpoint.temps(target, "old")]
    found += target.parent.glob(f".{target.name}.{_HEX8}.old")  # named before writers were
    return sorted(found, key=lambda p: p.stat().st_mtime)


def remove_leftovers(target: Path) -> None:
    """Before a save: remove what earlier saves to ``target`` left (unnamed ones from
    before temporaries named their writer, and those of dead writers)."""
    for leftover in (
        *target.parent.glob(f".{target.name}.{_HEX8}.tmp"),
        *target.parent.glob(f".{target.name}.{_HEX8}.old"),
    ):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    sweep(target)


def sweep(target: Path) -> None:
    """Remove the temporary and set-aside folders beside ``target`` whose writer has died
    (a rank SIGKILLed mid-save); a live writer's are left alone, and a set-aside
    checkpoint only once ``target`` is there again."""
    dead = [e for e in checkpoint.stale_temps(target, "tmp") if e.is_dir(follow_symlinks=False)]
    if target.exists():
        dead += [
            e for e in checkpoint.stale_temps(target, "old") if e.is_dir(follow_symlinks=False)
        ]
    for entry in dead:
        shutil.rmtree(entry.path, ignore_errors=True)
    if dead:
        logger.info(
            "%s: removed %d folder(s) left by saves that were killed: %s",
            target,
            len(dead),
            ", ".join(e.name for e in dead),
        )


def fsync(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def resolve(path: Path, call: str) -> Path:
    """``path``, or where a save cut short between its renames left it aside.

    Raises:
        CheckpointError: nothing is there (an unfinished first save is named).
    """
    if path.exists():
        return path
    aside = _aside(path)
    if aside:
        logger.warning("load_state: no %s; loading %s (a save was cut short)", path, aside[-1])
        return aside[-1]
    unfinished = sorted(p.name for p in path.parent.glob(f".{path.name}.*.tmp"))
    hint = (
        f" An unfinished save is there ({', '.join(unfinished)}): the job stopped while "
        "writing its first checkpoint."
        if unfinished
        else ""
    )
    raise CheckpointError(
        f"{call}: no checkpoint there (missing: {path.name} in {path.parent}).{hint} Check "
        "the path, or start from scratch when there is none.",
        path=str(path),
    )
