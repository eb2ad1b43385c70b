"""Which checkpoint is intact, decided by the ranks together, before anything is loaded.

:func:`damage` says what is wrong with one checkpoint, as far as this rank's share of the
checking goes: a single file's size, zip directory and record CRC-32s (rank 0), or the
files a folder's manifest lists — present, of the size written, of the CRC-32 written
(:mod:`~anydevice.checkpoints.integrity`), each rank a share of them. :func:`agreed`
gathers every rank's share, so that all decide alike. :func:`newest_intact` walks a
``keep=`` folder newest first and takes the first with no damage, saying at WARNING which
it passed over and why; with none, the error lists each and its damage.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from anydevice.checkpoints import history, integrity, ondisk
from anydevice.errors import CheckpointError
from anydevice.placement import checkpoint

__all__ = ["agreed", "check_folder", "damage", "newest_intact"]

logger = logging.getLogger("anydevice")


def newest_intact(folder: Path, rank: int, size: int, verify: bool, call: str) -> Path:
    """The newest checkpoint in ``folder`` that is whole and intact; the ones passed over
    are said at WARNING, with their damage. The ranks decide together."""
    entries = history.candidates(folder)
    if size > 1:  # one list for all: a save may be renaming its folder meanwhile
        shared: list[Any] = [entries if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        entries = shared[0]
    passed: list[str] = []
    for path in entries:
        problems = agreed(damage(path, rank, size, verify, candidate=True), size)
        if not problems:
            if passed and rank == 0:
                logger.warning(
                    "%s: resuming from %s, the newest intact checkpoint; passed over: %s",
                    call,
                    path.name,
                    "; ".join(passed),
                )
            else:
                logger.info("%s: resuming from %s, the newest intact checkpoint", call, path)
            return path
        passed.append(f"{path.name} ({', '.join(problems)})")
    found = "; ".join(passed) or "no step-N checkpoints"
    raise CheckpointError(
        f"{call}: no intact checkpoint there ({found}). Start from scratch, or pass the "
        "path of one.",
        path=str(folder),
    )


def agreed(problems: list[str], size: int) -> list[str]:
    """Every rank's share of the problems, on every rank."""
    if size == 1:
        return problems
    said: list[Any] = [None] * size
    dist.all_gather_object(said, problems)
    return sorted({p for share in said for p in share})


def damage(path: Path, rank: int, size: int, verify: bool, *, candidate: bool = False) -> list[str]:
    """What is wrong with the checkpoint at ``path``, as far as this rank's share of the
    checking goes (the files the manifest lists, or a single file on rank 0). A
    ``candidate`` of ``latest_in=`` that is not a checkpoint of ours counts as damage."""
    if path.is_file():
        if rank != 0:
            return []
        problem = checkpoint.damage(path) if verify else None
        if problem is None and candidate and not ondisk.is_state_file(path):
            problem = "not a checkpoint of ad.save_state"
        return [f"{path.name}: {problem}"] if problem else []
    try:
        manifest = check_folder(path, "")
    except CheckpointError as e:
        return [str(e)]
    if not verify or "files" not in manifest:  # saved before checksums: presence checked
        return []
    return integrity.listed_damage(path, manifest, share=(rank, size))


def check_folder(folder: Path, call: str) -> dict[str, Any]:
    """The folder's manifest, after checking that every file it needs is there.

    Raises:
        CheckpointError: what is missing or unreadable (prefixed with ``call``, if any).
    """
    said = f"{call}: " if call else ""
    missing = [n for n in (".metadata", integrity.MANIFEST) if not (folder / n).exists()]
    if missing:
        raise CheckpointError(
            f"{said}partial checkpoint, missing {' and '.join(missing)} (written last, once "
            "every rank has finished: the save did not complete, the file was removed, or "
            "this folder is not a checkpoint of ad.save_state)",
            path=str(folder),
        )
    manifest = integrity.read_manifest(folder, call=call)
    listed = manifest.get("files")
    if listed is not None:
        files = sorted(listed)
    else:  # saved before the manifest listed its files: the index does
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        try:
            metadata = FileSystemReader(str(folder)).read_metadata()
        except Exception as e:  # a damaged index, unpickled
            raise CheckpointError(
                f"{said}its index (.metadata) cannot be read ({type(e).__name__}: {e})",
                path=str(folder),
            ) from e
        files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    absent = [f for f in files if not (folder / f).exists()]
    if absent:
        raise CheckpointError(
            f"{said}partial checkpoint, missing {', '.join(absent)} ({len(absent)} of the "
            f"{len(files)} files it was written with; copy the whole folder)",
            path=str(folder),
        )
    return manifest
