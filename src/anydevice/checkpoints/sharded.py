"""A sharded checkpoint written by every rank, and put in place only once all have.

The folder is written under a temporary name (rank 0 makes it; every rank writes its
shards there with DCP, hashed as they are written, and its own small files); then the
ranks tell each other whether they wrote their part, with its files' sizes and CRC-32s.
Only where all did, rank 0 writes the manifest (``anydevice.json``: the world size and
every file's digest, the last file written) and renames the folder into place; else it
removes it. So a folder under the checkpoint's name is always whole, and one that is not
(a crash, a full disk) never looks whole.

A background save copies the state to host memory in the call (DCP's ``async_save``) and
writes it in DCP's thread; the agreement, the manifest and the rename follow in the save
thread, on a gloo group of their own (:func:`background_group`), so their collectives
never meet the loop's.

A failure is said once, the same on every rank, in the user's terms: which ranks could
not write and why, and where that is the disk (``ENOSPC``, a quota, a file-size limit),
the folder, its free space and about how much the checkpoint needs.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from anydevice.checkpoints import arrival, history, integrity, ondisk
from anydevice.errors import CheckpointError
from anydevice.hardware import backends
from anydevice.hardware.facts import format_bytes
from anydevice.placement import checkpoint

__all__ = ["background_group", "forget_group", "save", "state_bytes"]

logger = logging.getLogger("anydevice")

_FORMAT = 1


def save(
    target: Path,
    *,
    rank: int,
    size: int,
    state: dict[str, Any],
    side: dict[str, Any],
    call: str,
    pruned: Path | None = None,
    keep: int | None = None,
    background: bool = False,
) -> Callable[[], None]:
    """Write ``state`` (``model`` and maybe ``optimizer``) with DCP and ``side`` (file name
    -> object) under a temporary name next to ``target``; return what finishes the save:
    the agreement, the manifest, the rename and the pruning of ``pruned`` to ``keep``
    (call it now, or in the save thread where ``background``).

    Raises:
        CheckpointError: rank 0 cannot make the temporary folder (at once, on every rank).
    """
    from torch.distributed.checkpoint import state_dict_saver as dcp

    tmp_name: list[str | None] = [None]
    if rank == 0:
        ondisk.recover(target)
        ondisk.remove_leftovers(target)
        tmp = target.parent / checkpoint.temp_name(target, "tmp")
        try:
            tmp.mkdir()
            tmp_name[0] = tmp.name
        except OSError as e:
            tmp_name[0] = None
            logger.debug("save_state: cannot create %s: %s", tmp, e)
    dist.broadcast_object_list(tmp_name, src=0)
    if tmp_name[0] is None:
        raise CheckpointError(
            f"{call}: rank 0 cannot create a folder in {target.parent}. Check that it exists "
            "and is writable (on a file system every rank sees).",
            path=str(target),
        )
    tmp = target.parent / tmp_name[0]
    group = background_group() if background else None
    writer = integrity.hashing_writer(str(tmp))
    failed: BaseException | None = None
    written: Future[Any] | None = None
    digests: dict[str, tuple[int, int]] = {}
    try:
        # DCP first, on every rank: its collectives must not wait for a rank whose own
        # files failed to write.
        if background:
            written = _async_save(dcp, state, str(tmp), writer, group)
        else:
            dcp.save(state, checkpoint_id=str(tmp), storage_writer=writer)
        for name, obj in side.items():
            checkpoint.save(obj, tmp / name)
            digests[name] = integrity.digest(tmp / name)
    except Exception as e:
        failed = e
    except BaseException as e:  # DCP's CheckpointException is not an Exception
        if not _is_dcp_failure(e):
            raise
        failed = e
    needed = state_bytes(state)
    manifest = {"format": _FORMAT, "world_size": size, "optimizer": "optimizer" in state}

    def finish() -> None:
        error = failed
        if written is not None:  # on every rank: DCP's own collectives end first
            try:
                written.result()
            except BaseException as e:  # DCP's CheckpointException is not an Exception
                error = error or e
        mine = {**digests, **writer.digests}
        try:
            _agree_and_rename(target, tmp, rank, size, error, group, call,
                              (mine, needed, manifest), pruned, keep, writer.errors)  # fmt: skip
        except CheckpointError:
            raise
        except BaseException as e:  # a collective failed: a peer died or timed out
            raise CheckpointError(
                f"{call}: the ranks could not agree that every part was written "
                f"({type(e).__name__}: {str(e).strip()[:300]}); the previous checkpoint is "
                "kept.",
                path=str(target),
            ) from (error or e)

    return finish


def _is_dcp_failure(e: BaseException) -> bool:
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(e, CheckpointException)


def _async_save(dcp: Any, state: dict[str, Any], tmp: str, writer: Any, group: Any) -> Future[Any]:
    """DCP's ``async_save``: the state copied to host memory now, written in DCP's thread."""
    written = dcp.async_save(state, checkpoint_id=tmp, storage_writer=writer, process_group=group)
    upload = getattr(written, "upload_completion", written)  # a response, in some modes
    assert isinstance(upload, Future)
    return upload


def _agree_and_rename(
    target: Path,
    tmp: Path,
    rank: int,
    size: int,
    failed: BaseException | None,
    group: Any,
    call: str,
    part: tuple[dict[str, tuple[int, int]], int, dict[str, Any]],
    pruned: Path | None,
    keep: int | None,
    write_errors: list[OSError],
) -> None:
    """Every rank says whether it wrote its part (and its files' digests); rank 0 writes
    the manifest and renames only if all did, then says whether that went well."""
    problem = None if failed is None else _describe(failed, tmp, write_errors)
    said: list[Any] = [None] * size
    dist.all_gather_object(said, (problem, part[0], part[1]), group=group)
    problems = {r: p for r, (p, _, _) in enumerate(said) if p is not None}
    needed = max(n for _, _, n in said)
    outcome: list[Any] = [None]
    if rank == 0:
        if problems:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            outcome[0] = _put_in_place(target, tmp, said, part[2], pruned, keep)
    dist.broadcast_object_list(outcome, src=0, group=group)
    if problems:
        raise CheckpointError(
            _failed_message(call, problems, needed, target), path=str(target)
        ) from failed
    if outcome[0] is not None:
        raise CheckpointError(
            _failed_message(call, {0: outcome[0]}, needed, target), path=str(target)
        )


def _put_in_place(
    target: Path,
    tmp: Path,
    said: list[Any],
    manifest: dict[str, Any],
    pruned: Path | None,
    keep: int | None,
) -> str | None:
    """Rank 0: the manifest, the rename, the pruning; what failed, or None."""
    files: dict[str, tuple[int, int]] = {}
    for _, digests, _ in said:
        files.update(digests)
    try:
        integrity.write_manifest(tmp, manifest, files)
        ondisk.replace(tmp, target)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return _describe(e, tmp)
    if pruned is not None and keep is not None:
        try:
            history.prune(pruned, keep)
        except OSError as e:  # the new one is in place: an old one left is no failure
            logger.warning("save_state: could not remove an older checkpoint in %s: %s", pruned, e)
    return None


def _describe(e: BaseException, tmp: Path, write_errors: Sequence[OSError] = ()) -> str:
    """One rank's failure in a line: the disk where it is the disk, else the error."""
    causes: list[BaseException] = [*write_errors, e]
    failures = getattr(e, "failures", None)  # DCP's: rank -> (exception, traceback)
    if isinstance(failures, dict):
        causes += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    for cause in causes:
        full = checkpoint.full_disk(cause, tmp.parent)
        if full is not None:
            return f"DISK: {full}"
    inner = write_errors[0] if write_errors else causes[-1]
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[-1] if text else ''}"[:400]


def _failed_message(call: str, problems: dict[int, str], needed: int, target: Path) -> str:
    ranks = sorted(problems)
    first = problems[ranks[0]]
    if first.startswith("DISK: "):
        return (
            f"{call}: the disk is full: rank(s) {ranks} could not write their part "
            f"({first.removeprefix('DISK: ')}). This checkpoint needs about "
            f"{format_bytes(needed)} (the model's and the optimizer's state); the "
            "previous checkpoint is kept and nothing of this one is left. Free space there, "
            "keep fewer checkpoints (keep=), or save to another disk."
        )
    return (
        f"{call}: rank(s) {ranks} could not write their part (rank {ranks[0]}: {first}); "
        "the previous checkpoint is kept."
    )


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in ``state`` whole (a DTensor's global size): about what the
    checkpoint needs on disk, since DCP writes replicated tensors once."""
    if isinstance(state, torch.Tensor):
        return int(state.numel() * state.element_size())
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


#: (the default group, the gloo group of background saves made for it)
_group: tuple[Any, Any] | None = None


def background_group() -> Any:
    """The gloo group background saves run their collectives on, one per default group
    (made by every rank on the first background save). Their collectives run in another
    thread than the loop's, and two threads' collectives on one group could pair up
    differently on each rank."""
    global _group
    world = dist.group.WORLD
    if _group is None or _group[0] is not world:
        seconds = arrival.group_timeout(world)
        timeout = datetime.timedelta(seconds=seconds) if seconds else None
        _group = (world, dist.new_group(backend=backends.host().collective, timeout=timeout))
    return _group[1]


def forget_group() -> None:
    """Before the default group is destroyed, or in a forked child: the next background
    save makes a group of its own."""
    global _group
    _group = None


if hasattr(os, "register_at_fork"):  # POSIX: where a process can fork
    os.register_at_fork(after_in_child=forget_group)
