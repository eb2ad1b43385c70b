"""Training state that resumes anywhere: :func:`save_state` and :func:`load_state`.

One call saves a model (plain, DDP or FSDP), its optimizer and whatever else the loop needs
to resume (step, epoch, scheduler, RNG states, a sampler's epoch); one call restores them.
Model and optimizer state go through torch's ``get_state_dict``/``set_state_dict``, which
name every entry by its parameter's path in the user's module (no ``module.`` prefix from
DDP, no ``_orig_mod.`` from ``torch.compile``, full shapes for FSDP's shards). That is what
makes a checkpoint portable between wrappers and world sizes.

What lands on disk:

* **A world of one** — one file, written by :func:`anydevice.save` (atomic: a temporary
  file renamed over the target; CRC-checked on load).
* **Several ranks** — a folder in torch's distributed checkpoint format (DCP): every rank
  writes its own shards (``__<rank>_0.distcp``), rank 0 the index (``.metadata``); beside
  them ``extra.rank<r>.pt``, rank ``r``'s ``extra``, ``precision.rank<r>.pt``, its
  precision policy's state where one was given, and ``anydevice.json`` (the world
  size). The folder is written under a temporary name and renamed into place by rank 0
  once every rank has finished, so a crash mid-save leaves the previous checkpoint whole.
  POSIX cannot rename a folder over a non-empty one, so the previous checkpoint is first
  renamed aside (``.<name>.<hex>.old``) and removed after; a crash between the two renames
  leaves it there, and :func:`load_state` and the next :func:`save_state` take it back.

DCP reshards on load, so a folder saved by 2 ranks loads on 1 (no process group needed),
on 3, and into DDP or FSDP whichever saved it; a single file loads on several ranks (each
reads it whole and keeps its shards).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from anydevice.distributed import history
from anydevice.errors import CheckpointError
from anydevice.placement import checkpoint

if TYPE_CHECKING:
    from anydevice.numerics.precision import Precision

__all__ = ["load_state", "save_state", "wait_for_saves"]

logger = logging.getLogger("anydevice")

PathLike = str | os.PathLike[str]

_MANIFEST = "anydevice.json"
_FORMAT = 1


def save_state(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    precision: Precision | None = None,
    loader: Any = None,
    keep: int | None = None,
    background: bool = False,
    **extra: Any,
) -> Path:
    """Save ``model``, ``optimizer`` and ``extra`` so that :func:`load_state` resumes them.

    Call it on every rank (it is a collective when the world has several).

    >>> import tempfile, anydevice as ad
    >>> net = torch.nn.Linear(2, 1)
    >>> path = ad.save_state(f"{tempfile.mkdtemp()}/ckpt", model=net, step=7)
    >>> ad.load_state(path, model=torch.nn.Linear(2, 1))
    {'step': 7}

    Args:
        path: the checkpoint: a file in a world of one, a folder with several ranks. Its
            parent folder must exist (on a file system every rank sees).
        model: the model, as ``ad.prepare`` returned it (or the plain module).
        optimizer: its optimizer.
        precision: the :func:`anydevice.numerics.precision` policy of the loop: its mode and, in
            fp16, the loss scaler's scale and growth tracker are saved with the rest, so a
            resumed run does not start again at a scale of 65536 and skip steps to find it.
        loader: the :class:`~anydevice.DeviceLoader` of the loop (or anything with
            ``state_dict()``): its epoch and position within it are saved, per rank, so
            ``load_state(..., loader=loader)`` resumes mid-epoch at the next batch.
        keep: keep the newest ``keep`` checkpoints: ``path`` is then a folder, this one
            goes to ``path/step-<step>`` (``step=`` is needed) and older ones beyond
            ``keep`` are removed once it is whole; ``load_state(latest_in=path)`` resumes
            the newest complete one.
        background: return as soon as the state is copied to host memory and write it in
            a background thread, so the step goes on meanwhile. With several ranks the
            shards go through DCP's ``async_save`` over a gloo group of its own (made
            once, on the first such call, by every rank), so its collectives never meet
            the loop's; the ranks then agree that all wrote and rank 0 renames the folder
            into place. At most one save is in flight per process: the next
            ``save_state`` first waits for it. Its error, if any, is raised by that next
            call, by :func:`wait_for_saves` or by :func:`load_state` (and logged at the
            end of ``ad.distributed`` and at exit, where nobody waited). The write is
            atomic as ever: a process killed meanwhile leaves the previous checkpoint.
        extra: anything else to restore, per rank: the step, epoch, ``scheduler.state_dict()``,
            ``torch.get_rng_state()``, ... — tensors, numbers, strings and containers of
            them (what ``torch.load(weights_only=True)`` reads back).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        CheckpointError: writing failed; the previous checkpoint at ``path`` is kept.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    wait_for_saves()  # the one in flight first: its error surfaces here
    rank, size = _world()
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a whole number of checkpoints >= 1, not {keep!r}")
    folder = Path(os.fspath(path))
    target = folder if keep is None else history.numbered(folder, extra.get("step"))
    if loader is not None:
        extra = {**extra, _LOADER: _loader_state(loader)}
    precision_state = _precision_state(precision, extra)
    model_state, optim_state = _states(model, optimizer, get_state_dict)
    if size == 1:
        state = {"format": _FORMAT, "model": model_state, "optimizer": optim_state, "extra": extra}
        if precision_state is not None:
            state["precision"] = precision_state
        if not background:
            _save_one(state, target, folder if keep is not None else None, keep)
            return target
        global _inflight
        staged = _to_host(state)  # the step may change the tensors from here on
        _inflight = _writer().submit(_save_one, staged, target, folder if keep else None, keep)
        return target
    side = {f"extra.rank{rank}.pt": extra}
    if precision_state is not None:
        side[f"precision.rank{rank}.pt"] = precision_state
    pruned = folder if keep is not None else None
    _save_sharded(target, rank, size, model_state, optim_state, side, pruned, keep, background)
    return target


def wait_for_saves() -> None:
    """Wait for the ``save_state(..., background=True)`` in flight, if any, and raise its
    error (a :class:`~anydevice.CheckpointError` naming the path, the previous checkpoint
    kept). ``save_state`` calls it first; call it before reading a checkpoint saved in the
    background, and before exiting where the last save matters."""
    global _inflight
    pending, _inflight = _inflight, None
    if pending is not None:
        pending.result()


#: The background save in flight (one at most), and its thread.
_inflight: Future[None] | None = None
_pool: ThreadPoolExecutor | None = None


def _writer() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="anydevice-save")
        atexit.register(_at_exit)
    return _pool


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: a pool it inherited would count
    a thread that is not there and never run what is submitted to it, and the save in
    flight is the parent's to finish."""
    global _pool, _inflight, _group
    _pool, _inflight, _group = None, None, None


if hasattr(os, "register_at_fork"):  # POSIX: where a process can fork
    os.register_at_fork(after_in_child=_forget_in_child)


def _at_exit() -> None:
    try:
        wait_for_saves()
    except Exception as e:  # nobody is left to raise it to: said, never lost silently
        logger.error("anydevice: the last background save_state failed: %s", e)


def _to_host(state: Any) -> Any:
    """A copy of ``state`` whose tensors live in host memory of their own."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_host(v) for v in state)
    return state


def _save_one(state: dict[str, Any], target: Path, folder: Path | None, keep: int | None) -> None:
    if target.is_dir():  # a folder saved by several ranks: replaced the same way
        _sweep(target)
        tmp = target.parent / checkpoint.temp_name(target, "tmp")
        _replace(checkpoint.save(state, tmp), target)
    else:
        checkpoint.save(state, target)
    if folder is not None and keep is not None:
        history.prune(folder, keep)


def load_state(
    path: PathLike | None = None,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    precision: Precision | None = None,
    loader: Any = None,
    latest_in: PathLike | None = None,
) -> dict[str, Any]:
    """Restore ``model`` and ``optimizer`` from :func:`save_state`; return its ``extra``.

    Works on any world size and wrapper, whatever saved it (see the module's notes). Call
    it on every rank, after ``ad.prepare``.

    Args:
        path: what :func:`save_state` wrote.
        model: the model to restore into (plain, DDP or FSDP).
        optimizer: its optimizer; its state is restored too.
        precision: the loop's :func:`anydevice.numerics.precision` policy: the scaler state saved
            with ``save_state(..., precision=p)`` is restored into it (also across modes:
            see :meth:`~anydevice.Precision.load_state_dict`). A checkpoint saved without
            one leaves it as it is, with a warning on the ``anydevice`` logger.
        latest_in: instead of ``path`` (pass ``None``), a folder of ``save_state(...,
            keep=k)`` checkpoints: the newest complete one is loaded (a partial or
            unfinished one is skipped), and its path logged.
        loader: the loop's :class:`~anydevice.DeviceLoader`: its next pass resumes where
            the one saved with ``save_state(..., loader=loader)`` stopped (the same epoch,
            from the next batch, in the same order). A checkpoint saved without one
            leaves it as it is, with a warning.

    Returns:
        This rank's ``extra`` (rank ``r`` of the saving world; on ranks that world did not
        have, rank 0's).

    Raises:
        CheckpointError: the checkpoint is missing or partial — the message names what is
            missing (the path, ``.metadata``, a rank's shard file, the optimizer's state,
            model entries) — or damaged.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    _check_precision(precision)
    wait_for_saves()  # a background save of this process is whole before it is read
    if (path is None) == (latest_in is None):
        raise TypeError(
            "ad.load_state takes a path or latest_in=FOLDER (the newest complete checkpoint "
            f"saved there with keep=), one of the two; got path={path!r}, "
            f"latest_in={latest_in!r}."
        )
    if latest_in is not None:
        path = history.latest(Path(os.fspath(latest_in)))
        logger.info("load_state: resuming from %s, the newest complete checkpoint", path)
    assert path is not None
    rank, size = _world()
    source = _resolve(Path(os.fspath(path)))
    if rank == 0 and source == Path(os.fspath(path)):
        _sweep(source)  # what saves killed mid-way left beside it
    if source.is_file():
        saved = checkpoint.load(source, "cpu")
        if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
            raise CheckpointError(
                f"ad.load_state({str(source)!r}): this file was not written by ad.save_state "
                "(no 'format' entry). Load it with ad.load and load_state_dict instead.",
                path=str(source),
            )
        _check_optimizer(source, optimizer, has_optimizer=saved["optimizer"] is not None)
        model_state, optim_state = saved["model"], saved["optimizer"]
        options = StateDictOptions(full_state_dict=True, strict=True) if size > 1 else None
        _set(model, optimizer, model_state, optim_state, set_state_dict, options, source)
        if precision is not None:
            _load_precision(precision, saved.get("precision"), source)
        return _restore_loader(loader, dict(saved["extra"]), source)
    manifest = _check_folder(source)
    from torch.distributed.checkpoint import state_dict_loader as dcp

    model_state, optim_state = _states(model, optimizer, get_state_dict)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    _check_keys(source, state, has_optimizer=bool(manifest.get("optimizer", True)))
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(source))
    _set(model, optimizer, state["model"], state.get("optimizer"), set_state_dict, None, source)
    saved_ranks = int(manifest["world_size"])
    extra_file = source / f"extra.rank{rank if rank < saved_ranks else 0}.pt"
    if not extra_file.exists():
        raise CheckpointError(
            f"ad.load_state({str(source)!r}): partial checkpoint, {extra_file.name} is "
            "missing (a rank's extra state). Use an earlier checkpoint.",
            path=str(source),
        )
    if precision is not None:
        own = source / f"precision.rank{rank if rank < saved_ranks else 0}.pt"
        saved_precision = checkpoint.load(own, "cpu") if own.exists() else None
        _load_precision(precision, saved_precision, source)
    return _restore_loader(loader, dict(checkpoint.load(extra_file, "cpu")), source)


#: The ``extra`` entry a loader's state is saved under.
_LOADER = "_anydevice_loader"


def _loader_state(loader: Any) -> dict[str, Any]:
    state = getattr(loader, "state_dict", None)
    if not callable(state):
        raise TypeError(
            f"ad.save_state(loader=...) takes the loop's ad.DeviceLoader (or anything with "
            f"state_dict()), not a {type(loader).__name__}; wrap a DataLoader in "
            "ad.DeviceLoader to resume it mid-epoch"
        )
    return dict(state())


def _restore_loader(loader: Any, extra: dict[str, Any], source: Path) -> dict[str, Any]:
    """``extra`` without the loader's entry, which goes into ``loader``."""
    state = extra.pop(_LOADER, None)
    if loader is None:
        return extra
    if state is None:
        logger.warning(
            "load_state(%s): the checkpoint holds no loader state (saved without loader=); "
            "the loader starts its epoch from the beginning",
            source,
        )
        return extra
    loader.load_state_dict(state)
    return extra


def _precision_state(precision: Any, extra: dict[str, Any]) -> dict[str, Any] | None:
    """``precision.state_dict()``; a mapping passed as ``precision=`` (what had to be done
    by hand before) stays an ``extra`` entry, as it was."""
    from anydevice.numerics.precision import Precision

    if precision is None:
        return None
    if isinstance(precision, Precision):
        return precision.state_dict()
    extra["precision"] = precision
    return None


def _check_precision(precision: object) -> None:
    from anydevice.numerics.precision import Precision

    if precision is not None and not isinstance(precision, Precision):
        raise TypeError(
            f"ad.load_state(precision=...) takes the loop's ad.precision(...) policy, not a "
            f"{type(precision).__name__}; pass precision=p, or read a state saved as an extra "
            "from the returned dict and call p.load_state_dict on it."
        )


def _load_precision(precision: Precision, state: Any, source: Path) -> None:
    if state is None:
        logger.warning(
            "load_state(%s): the checkpoint holds no precision state (saved without "
            "precision=); %s keeps its own",
            source,
            precision,
        )
        return
    precision.load_state_dict(state)


# ----------------------------------------------------------------------------- saving


def _save_sharded(
    target: Path,
    rank: int,
    size: int,
    model_state: dict[str, Any],
    optim_state: Any,
    side: dict[str, Any],
    folder: Path | None = None,
    keep: int | None = None,
    background: bool = False,
) -> None:
    """Write the DCP folder under a temporary name, then rename it into place once every
    rank has written its part (and prune ``folder`` to ``keep``). With ``background``,
    DCP copies the state to host memory here and writes it in its own thread; the check
    that every rank wrote, the rename and the pruning follow in the save thread, their
    collectives on the background group (:func:`_background_group`)."""
    from torch.distributed.checkpoint import state_dict_saver as dcp

    tmp_name: list[str | None] = [None]
    if rank == 0:
        _recover(target)
        _remove_leftovers(target)
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
            f"ad.save_state({str(target)!r}): rank 0 cannot create a folder in "
            f"{target.parent}. Check that it exists and is writable (on a file system every "
            "rank sees).",
            path=str(target),
        )
    tmp = target.parent / tmp_name[0]
    state: dict[str, Any] = {"model": model_state}
    if optim_state is not None:
        state["optimizer"] = optim_state
    group = _background_group() if background else None
    failed: BaseException | None = None
    written: Future[Any] | None = None
    try:
        # DCP first, on every rank: its collectives must not wait for a rank whose own
        # files failed to write.
        if background:
            written = _async_save(dcp, state, str(tmp), group)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
        for name, obj in side.items():
            checkpoint.save(obj, tmp / name)
        if rank == 0:
            manifest = {"format": _FORMAT, "world_size": size, "optimizer": "optimizer" in state}
            (tmp / _MANIFEST).write_text(json.dumps(manifest))
    except Exception as e:
        failed = e

    def finish() -> None:
        error = failed
        if written is not None:  # on every rank: DCP's own collectives end first
            try:
                written.result()
            except BaseException as e:  # DCP's CheckpointException is not an Exception
                error = error or e
        try:
            _agree_and_rename(target, tmp, rank, size, error, group)
            if folder is not None and keep is not None and rank == 0:
                history.prune(folder, keep)
            dist.barrier(group=group)  # no rank reads the folder while rank 0 prunes it
        except CheckpointError:
            raise
        except BaseException as e:  # a collective failed: a peer died or timed out
            raise CheckpointError(
                f"ad.save_state({str(target)!r}): the ranks could not agree that every "
                f"part was written ({type(e).__name__}: {str(e).strip()[:300]}); the "
                "previous checkpoint is kept.",
                path=str(target),
            ) from (error or e)

    if background:
        global _inflight
        _inflight = _writer().submit(finish)
    else:
        finish()


def _async_save(dcp: Any, state: dict[str, Any], tmp: str, group: Any) -> Future[Any]:
    """DCP's ``async_save``: the state copied to host memory now, written in DCP's thread."""
    written = dcp.async_save(state, checkpoint_id=tmp, process_group=group)
    upload = getattr(written, "upload_completion", written)  # a response, in some modes
    assert isinstance(upload, Future)
    return upload


def _agree_and_rename(
    target: Path, tmp: Path, rank: int, size: int, failed: BaseException | None, group: Any
) -> None:
    """Every rank says whether it wrote its part; rank 0 renames only if all did."""
    oks: list[Any] = [None] * size
    problem = None if failed is None else f"{type(failed).__name__}: {failed}"
    dist.all_gather_object(oks, problem, group=group)
    problems = {r: p for r, p in enumerate(oks) if p is not None}
    if problems:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier(group=group)
        first = min(problems)
        raise CheckpointError(
            f"ad.save_state({str(target)!r}): rank(s) {sorted(problems)} could not write "
            f"their part (rank {first}: {problems[first]}); the previous checkpoint is kept.",
            path=str(target),
        ) from failed
    if rank == 0:
        _replace(tmp, target)


#: (the default group, the gloo group of background saves made for it)
_group: tuple[Any, Any] | None = None


def _background_group() -> Any:
    """The gloo group background saves run their collectives on, one per default group
    (made by every rank on the first background save). Their collectives run in another
    thread than the loop's, and two threads' collectives on one group could pair up
    differently on each rank."""
    global _group
    world = dist.group.WORLD
    if _group is None or _group[0] is not world:
        _group = (world, dist.new_group(backend="gloo", timeout=_timeout(world)))
    return _group[1]


def _timeout(group: Any) -> Any:
    """The collectives' timeout of ``group`` (the one ``ad.distributed(timeout=)`` set),
    or None for torch's default."""
    with contextlib.suppress(Exception):  # backends without options: torch's default
        return group._get_backend(torch.device("cpu")).options._timeout
    return None


def finish_for_teardown() -> None:
    """Before a process group is destroyed: wait for the background save in flight (it
    needs the group) and log its error, which nobody is left to raise to; forget the
    background group."""
    global _group
    _at_exit()
    _group = None


def _replace(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` into ``target``'s place; the previous one goes aside, then away."""
    _fsync(tmp)
    old = None
    if target.exists():
        old = target.parent / checkpoint.temp_name(target, "old")
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync(target.parent)
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _recover(target: Path) -> None:
    """A crash between :func:`_replace`'s two renames leaves no ``target`` but a whole
    previous checkpoint aside: put it back."""
    if target.exists():
        return
    aside = _aside(target)
    if aside:
        logger.warning("save_state: %s restored from %s (a save was cut short)", target, aside[-1])
        os.replace(aside[-1], target)


def _aside(target: Path) -> list[Path]:
    """Previous checkpoints a cut-short :func:`_replace` left aside, oldest first."""
    found = [Path(e.path) for e, _ in checkpoint.temps(target, "old")]
    found += target.parent.glob(f".{target.name}.{_HEX8}.old")  # named before writers were
    return sorted(found, key=lambda p: p.stat().st_mtime)


_HEX8 = "[0-9a-f]" * 8


def _remove_leftovers(target: Path) -> None:
    """Before a save: remove what earlier saves to ``target`` left (unnamed ones from
    before temporaries named their writer, and those of dead writers)."""
    for leftover in (
        *target.parent.glob(f".{target.name}.{_HEX8}.tmp"),
        *target.parent.glob(f".{target.name}.{_HEX8}.old"),
    ):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    _sweep(target)


def _sweep(target: Path) -> None:
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


def _fsync(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- loading


def _resolve(path: Path) -> Path:
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
        f"ad.load_state({str(path)!r}): no checkpoint there (missing: {path.name} in "
        f"{path.parent}).{hint} Check the path, or start from scratch when there is none.",
        path=str(path),
    )


def _check_folder(folder: Path) -> dict[str, Any]:
    """The folder's manifest, after checking that every file it needs is there."""
    missing = [name for name in (".metadata", _MANIFEST) if not (folder / name).exists()]
    if missing:
        raise CheckpointError(
            f"ad.load_state({str(folder)!r}): partial checkpoint, missing "
            f"{' and '.join(missing)} (written last, when every rank has finished): the "
            "save did not complete, or this folder is not a checkpoint of ad.save_state. "
            "Use an earlier checkpoint.",
            path=str(folder),
        )
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    files = {info.relative_path for info in (metadata.storage_data or {}).values()}
    absent = sorted(f for f in files if not (folder / f).exists())
    if absent:
        raise CheckpointError(
            f"ad.load_state({str(folder)!r}): partial checkpoint, missing shard file(s) "
            f"{', '.join(absent)} of {len(files)}. Copy the whole folder, or use an "
            "earlier checkpoint.",
            path=str(folder),
        )
    manifest: dict[str, Any] = json.loads((folder / _MANIFEST).read_text())
    return manifest


def _check_keys(folder: Path, state: dict[str, Any], *, has_optimizer: bool) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    _check_optimizer(folder, state.get("optimizer"), has_optimizer=has_optimizer)
    saved = set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    wanted = {f"model.{k}" for k in state["model"]}
    absent = sorted(k.removeprefix("model.") for k in wanted - saved)
    if absent:
        more = f" (and {len(absent) - 5} more)" if len(absent) > 5 else ""
        raise CheckpointError(
            f"ad.load_state({str(folder)!r}): the checkpoint has no entry for "
            f"{len(absent)} of the model's {len(wanted)} tensors: {', '.join(absent[:5])}{more}. "
            "It was saved from another model (or another version of it).",
            path=str(folder),
        )


def _check_optimizer(source: Path, optimizer: object, *, has_optimizer: bool) -> None:
    if optimizer is not None and not has_optimizer:
        raise CheckpointError(
            f"ad.load_state({str(source)!r}): it holds no optimizer state (it was saved "
            "without optimizer=), but an optimizer was passed to restore. Drop optimizer= "
            "to load the model alone.",
            path=str(source),
        )


def _set(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_state: dict[str, Any],
    optim_state: Any,
    set_state_dict: Any,
    options: Any,
    source: Path,
) -> None:
    try:
        set_state_dict(
            model,
            optimizer if optimizer is not None else [],
            model_state_dict=model_state,
            optim_state_dict=optim_state if optimizer is not None else {},
            options=options,
        )
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"ad.load_state({str(source)!r}): the saved state does not fit this model or "
            f"optimizer ({type(e).__name__}: {str(e).strip().splitlines()[0]}). It was saved "
            "from another model or optimizer.",
            path=str(source),
        ) from e


# ----------------------------------------------------------------------------- shared


def _states(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, get_state_dict: Any
) -> tuple[dict[str, Any], Any]:
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model), None
    model_state, optim_state = get_state_dict(model, optimizer)
    return model_state, optim_state


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
