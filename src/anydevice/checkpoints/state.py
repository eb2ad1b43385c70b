"""Training state that resumes anywhere: :func:`save_state` and :func:`load_state`.

One call saves a model (plain, DDP or FSDP), its optimizer and whatever else the loop needs
to resume (step, epoch, LR scheduler, a loader's place in its epoch, the random state);
one call restores them. Model and optimizer state go through torch's
``get_state_dict``/``set_state_dict``, which name every entry by its parameter's path in
the user's module (no ``module.`` prefix from DDP, no ``_orig_mod.`` from
``torch.compile``, full shapes for FSDP's shards). That is what makes a checkpoint
portable between wrappers and world sizes.

What lands on disk:

* **A world of one** — one file, written by :func:`anydevice.save` (atomic: a temporary
  file renamed over the target; CRC-checked on load).
* **Several ranks** — a folder in torch's distributed checkpoint format (DCP): every rank
  writes its own shards (``__<rank>_0.distcp``), rank 0 the index (``.metadata``); beside
  them ``extra.rank<r>.pt``, rank ``r``'s ``extra`` (with its random state),
  ``precision.rank<r>.pt``, its precision policy's state where one was given, and
  ``anydevice.json``, the manifest: the world size and every file's size and CRC-32
  (:mod:`~anydevice.checkpoints.integrity`), written last. The folder is put in place
  only once every rank has written its part (:mod:`~anydevice.checkpoints.sharded`), so a
  crash or a full disk mid-save leaves the previous checkpoint whole.

``save_state`` writes only where nothing else is, or its own checkpoint
(:mod:`~anydevice.checkpoints.ondisk`); it refuses, at the call and naming the key, any
extra that ``load_state`` could not read back (:mod:`~anydevice.checkpoints.extras`).
With several ranks, every rank must call it (and ``load_state``): a rank that does not
is named within the group's timeout (:mod:`~anydevice.checkpoints.arrival`).

``load_state`` checks every file against the manifest before it loads anything, and
``load_state(latest_in=folder)`` falls back to the newest intact checkpoint, saying which
and why. DCP reshards on load, so a folder saved by 2 ranks loads on 1 (no process group
needed), on 3, and into DDP or FSDP whichever saved it; a single file loads on several
ranks (each reads it whole and keeps its shards).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from anydevice.checkpoints import arrival, extras, history, intact, loop_state, ondisk, sharded
from anydevice.errors import CheckpointError
from anydevice.placement import checkpoint

if TYPE_CHECKING:
    from anydevice.numerics.precision import Precision

__all__ = ["load_state", "save_state", "wait_for_saves"]

logger = logging.getLogger("anydevice")

PathLike = str | os.PathLike[str]

_FORMAT = 1


def save_state(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    precision: Precision | None = None,
    loader: Any = None,
    scheduler: Any = None,
    rng_state: bool = True,
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
            parent folder must exist (on a file system every rank sees). Nothing else may
            be there but an earlier checkpoint of ``save_state`` (replaced) or an empty
            folder: a folder or file of yours is refused, never replaced.
        model: the model, as ``ad.prepare`` returned it (or the plain module).
        optimizer: its optimizer.
        precision: the :func:`anydevice.numerics.precision` policy of the loop: its mode and, in
            fp16, the loss scaler's scale and growth tracker are saved with the rest, so a
            resumed run does not start again at a scale of 65536 and skip steps to find it.
        loader: the :class:`~anydevice.DeviceLoader` of the loop (or anything with
            ``state_dict()``): its epoch and position within it are saved, per rank, so
            ``load_state(..., loader=loader)`` resumes mid-epoch at the next batch.
        scheduler: the LR scheduler (anything with ``state_dict()``): its state is saved,
            and ``load_state(..., scheduler=scheduler)`` restores it.
        rng_state: keep this rank's random state (torch's CPU generator, the generator of
            each accelerator the model is on, Python's ``random``, numpy's global one), so
            that a resumed run draws the dropout masks and augmentations the uninterrupted
            one would have. ``False`` leaves it out.
        keep: keep the newest ``keep`` checkpoints: ``path`` is then a folder (yours may
            hold other things), this one goes to ``path/step-<step>`` (``step=`` is
            needed) and older ones beyond ``keep`` are removed once it is whole;
            ``load_state(latest_in=path)`` resumes the newest intact one.
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
            Everything given is copied in the call (extras too: sets, namedtuples,
            dataclasses, numpy arrays), so the loop may change it at once.
        extra: anything else to restore, per rank: the step, the epoch, a config —
            tensors, numbers, strings, bytes, ``None``, dict/list/tuple/set/frozenset,
            namedtuples, dataclasses and enums defined at a module's top level,
            ``pathlib`` paths and numpy arrays. Anything else is refused here, naming
            the key and its type, since ``load_state`` could not read it back.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        CheckpointError: ``path`` holds something that is not a checkpoint of
            ``save_state``, an extra ``load_state`` could not read back, or writing
            failed (a full disk is named, with the folder and its free space); the
            previous checkpoint at ``path`` is kept, and nothing partial is left.
        DistributedTimeoutError: some rank did not call ``save_state`` (it is collective).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    wait_for_saves()  # the one in flight first: its error surfaces here
    rank, size = _world()
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a whole number of checkpoints >= 1, not {keep!r}")
    folder = _path(path, "save_state")
    target = folder if keep is None else history.numbered(folder, extra.get("step"))
    call = f"ad.save_state({str(target)!r})"
    extra = dict(extra)
    loop_state.carry(extra, model=model, loader=loader, scheduler=scheduler, rng_state=rng_state)
    precision_state = loop_state.precision_state(precision, extra)
    problem = None
    try:
        extra = _checked(extra, call, copy=background and size == 1)
    except CheckpointError as e:
        problem = str(e)
    if size > 1:
        arrival.enter("save_state", rank=rank, size=size, call=call)
        _agree_to_start(call, target, rank, size, problem)
    elif problem is not None:
        raise CheckpointError(problem, path=str(target))
    else:
        ondisk.claim(target, call)
    model_state, optim_state = _states(model, optimizer, get_state_dict)
    pruned = folder if keep is not None else None
    if size == 1:
        state = {"format": _FORMAT, "model": model_state, "optimizer": optim_state, "extra": extra}
        if precision_state is not None:
            state["precision"] = precision_state
        if not background:
            _save_one(state, target, pruned, keep)
            return target
        global _inflight
        staged = {k: v if k == "extra" else _to_host(v) for k, v in state.items()}
        _inflight = _writer().submit(_save_one, staged, target, pruned, keep)
        return target
    side = {f"extra.rank{rank}.pt": extra}
    if precision_state is not None:
        side[f"precision.rank{rank}.pt"] = precision_state
    shards: dict[str, Any] = {"model": model_state}
    if optim_state is not None:
        shards["optimizer"] = optim_state
    finish = sharded.save(target, rank=rank, size=size, state=shards, side=side, call=call,
                          pruned=pruned, keep=keep, background=background)  # fmt: skip
    if background:
        _inflight = _writer().submit(finish)
    else:
        finish()
    return target


def _path(path: PathLike, verb: str) -> Path:
    """``path`` as a ``Path``; the empty path refused before anything is written."""
    example = "one such as 'checkpoints/last' (or a folder for a history: keep=3, step=step)"
    return checkpoint.checked_path(path, verb, example)


def _checked(extra: dict[str, Any], call: str, *, copy: bool) -> dict[str, Any]:
    """``extra`` checked for what load_state reads back (copied where ``copy``)."""
    out = {}
    for key, value in extra.items():
        where = loop_state.RESERVED.get(key, f"extra {key!r}")
        out[key] = extras.prepare(value, where, call=call, copy=copy)
    return out


def _agree_to_start(call: str, target: Path, rank: int, size: int, problem: str | None) -> None:
    """Every rank names the same checkpoint and can save what it was given; rank 0 checks
    that the path is ours to write. Raised on every rank alike, before anything is written."""
    if rank == 0 and problem is None:
        try:
            ondisk.claim(target, call)
        except CheckpointError as e:
            problem = str(e)
    said: list[Any] = [None] * size
    dist.all_gather_object(said, (str(target), problem))
    targets = sorted({t for t, _ in said})
    if len(targets) > 1:
        raise CheckpointError(
            f"{call}: the ranks name different checkpoints ({', '.join(targets)}); pass the "
            "same path on every rank: each rank writes its own part of one checkpoint.",
            path=str(target),
        )
    problems = {r: p for r, (_, p) in enumerate(said) if p is not None}
    if problems:
        first = min(problems)
        where = f" (on rank(s) {sorted(problems)})" if len(problems) < size else ""
        raise CheckpointError(f"{problems[first]}{where}", path=str(target))


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
    global _pool, _inflight
    _pool, _inflight = None, None


if hasattr(os, "register_at_fork"):  # POSIX: where a process can fork
    os.register_at_fork(after_in_child=_forget_in_child)


def _at_exit() -> None:
    try:
        wait_for_saves()
    except Exception as e:  # nobody is left to raise it to: said, never lost silently
        logger.error("anydevice: the last background save_state failed: %s", e)


def finish_for_teardown() -> None:
    """Before a process group is destroyed: wait for the background save in flight (it
    needs the group) and log its error, which nobody is left to raise to; forget the
    background group."""
    _at_exit()
    sharded.forget_group()


def _to_host(state: Any) -> Any:
    """A copy of a model's or optimizer's ``state`` whose tensors live in host memory of
    their own (the step may change them from here on; extras are copied by
    :func:`~anydevice.checkpoints.extras.prepare`)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_host(v) for v in state)
    return state


def _save_one(state: dict[str, Any], target: Path, folder: Path | None, keep: int | None) -> None:
    if target.is_dir():  # a folder saved by several ranks (claimed at the call)
        ondisk.sweep(target)
        tmp = target.parent / checkpoint.temp_name(target, "tmp")
        ondisk.replace(checkpoint.save(state, tmp), target)
    else:
        checkpoint.save(state, target)
    if folder is not None and keep is not None:
        history.prune(folder, keep)


# ----------------------------------------------------------------------------- loading


def load_state(
    path: PathLike | None = None,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    precision: Precision | None = None,
    loader: Any = None,
    scheduler: Any = None,
    latest_in: PathLike | None = None,
    rng_state: bool = True,
    verify: bool = True,
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
            keep=k)`` checkpoints: the newest intact one is loaded. One that is damaged
            (a file missing, truncated or changed since it was written) or partial is
            passed over for the one before, with a warning naming it and the damage.
        loader: the loop's :class:`~anydevice.DeviceLoader`: its next pass resumes where
            the one saved with ``save_state(..., loader=loader)`` stopped (the same epoch,
            from the next batch, in the same order). A checkpoint saved without one
            leaves it as it is, with a warning.
        scheduler: the loop's LR scheduler, restored from ``save_state(...,
            scheduler=...)`` (a warning where the checkpoint has none).
        rng_state: restore the random state saved with the checkpoint (this rank's), last,
            so the next draws are those of the uninterrupted run. ``False`` leaves it.
        verify: check every file against the sizes and CRC-32s written with it before
            loading anything (for a single file, its zip records' CRC-32s); with several
            ranks each checks a share. ``False`` skips the reading this takes.

    Returns:
        This rank's ``extra`` (rank ``r`` of the saving world; on ranks that world did not
        have, rank 0's).

    Raises:
        CheckpointError: the checkpoint is missing, partial or damaged — the message names
            the file and what is wrong (missing, truncated, failing its CRC-32) — or does
            not fit the model.
        DistributedTimeoutError: some rank did not call ``load_state`` (it is collective).
    """
    loop_state.check_precision(precision)
    wait_for_saves()  # a background save of this process is whole before it is read
    if (path is None) == (latest_in is None):
        raise TypeError(
            "ad.load_state takes a path or latest_in=FOLDER (the newest intact checkpoint "
            f"saved there with keep=), one of the two; got path={path!r}, "
            f"latest_in={latest_in!r}."
        )
    rank, size = _world()
    named = _path(path if path is not None else latest_in, "load_state")  # type: ignore[arg-type]
    call = (
        f"ad.load_state({str(named)!r})"
        if path is not None
        else (f"ad.load_state(latest_in={str(named)!r})")
    )
    if size > 1:
        arrival.enter("load_state", rank=rank, size=size, call=call)
    if latest_in is not None:
        source = intact.newest_intact(named, rank, size, verify, call)
    else:
        source = ondisk.resolve(named, call)
        if rank == 0 and source == named:
            ondisk.sweep(source)  # what saves killed mid-way left beside it
        problems = intact.agreed(intact.damage(source, rank, size, verify), size)
        if problems:
            raise CheckpointError(
                f"{call}: the checkpoint is damaged: {'; '.join(problems)}. Use an earlier "
                "checkpoint (ad.load_state(latest_in=FOLDER) takes the newest intact one).",
                path=str(source),
            )
    saved_extra, saved_rank = _load(source, model, optimizer, precision, rank, size)
    own = saved_rank == rank
    return loop_state.restore(saved_extra, model=model, loader=loader, scheduler=scheduler,
                              rng_state=rng_state, source=source, own=own)  # fmt: skip


def _load(
    source: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision | None,
    rank: int,
    size: int,
) -> tuple[dict[str, Any], int]:
    """Load model, optimizer and precision from ``source`` (checked already); return the
    extra of this rank and the rank that saved it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    call = f"ad.load_state({str(source)!r})"
    if source.is_file():
        with extras.readable(source, call=call):
            saved = checkpoint.load(source, "cpu", verify=False)  # checked already
        if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
            raise CheckpointError(
                f"{call}: this file was not written by ad.save_state (no 'format' entry). "
                "Load it with ad.load and load_state_dict instead.",
                path=str(source),
            )
        _check_optimizer(source, optimizer, has_optimizer=saved["optimizer"] is not None)
        options = StateDictOptions(full_state_dict=True, strict=True) if size > 1 else None
        _set(model, optimizer, saved["model"], saved["optimizer"], set_state_dict, options, source)
        if precision is not None:
            loop_state.load_precision(precision, saved.get("precision"), source)
        return dict(saved["extra"]), 0
    manifest = intact.check_folder(source, call)  # checked, unless verify=False
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
    own = rank if rank < saved_ranks else 0
    extra_file = source / f"extra.rank{own}.pt"
    if not extra_file.exists():
        raise CheckpointError(
            f"{call}: partial checkpoint, {extra_file.name} is missing (a rank's extra "
            "state). Use an earlier checkpoint.",
            path=str(source),
        )
    if precision is not None:
        file = source / f"precision.rank{own}.pt"
        saved_precision = checkpoint.load(file, "cpu", verify=False) if file.exists() else None
        loop_state.load_precision(precision, saved_precision, source)
    with extras.readable(extra_file, call=call):
        saved_extra = checkpoint.load(extra_file, "cpu", verify=False)
    return dict(saved_extra), own


# ----------------------------------------------------------------------------- checking


def _check_keys(folder: Path, state: dict[str, Any], *, has_optimizer: bool) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    _check_optimizer(folder, state.get("optimizer"), has_optimizer=has_optimizer)
    try:
        saved = set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    except Exception as e:  # an index that cannot be read (a checkpoint saved unchecked)
        raise CheckpointError(
            f"ad.load_state({str(folder)!r}): its index (.metadata) cannot be read "
            f"({type(e).__name__}: {e}). Use an earlier checkpoint.",
            path=str(folder),
        ) from e
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
