"""The largest batch size that fits in memory: :func:`fit_batch_size`.

:func:`search` is the search itself, a pure function of a ``fits(size) -> bool`` callable;
:func:`fit_batch_size` runs the tries: it frees memory before each, tells out-of-memory
errors from the others, and makes the ranks of a distributed run agree.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import torch

from anydevice.errors import BatchSizeError
from anydevice.hardware.spec import DeviceLike
from anydevice.measure.clocks import active_device
from anydevice.measure.memory import free_memory, memory
from anydevice.measure.memory_history import oom_snapshot
from anydevice.measure.memory_readings import is_out_of_memory

__all__ = ["MAX_BATCH_SIZE", "fit_batch_size", "search"]

logger = logging.getLogger("anydevice")

#: Without ``high``, the search gives up past this batch size.
MAX_BATCH_SIZE = 2**31

_FITS, _OOM, _FAILED = 1, 0, -1


def fit_batch_size(
    step: Callable[[int], object],
    start: int = 1,
    low: int = 1,
    high: int | None = None,
    *,
    device: DeviceLike | None = None,
    margin: float = 1.0,
    snapshot_on_oom: str | os.PathLike[str] | None = None,
) -> int:
    """The largest batch size for which ``step(batch_size)`` runs without running out of memory.

    The search doubles from ``start`` until a size runs out of memory (or reaches
    ``high``), then bisects between the largest size that fitted and the smallest that did
    not (between ``low`` and ``start`` when ``start`` itself does not fit). Memory is
    freed before every try (garbage collected, the device's cache emptied), so one try's
    leftovers do not make the next one fail. Only out-of-memory errors are caught (see
    :func:`is_out_of_memory`: ``torch.OutOfMemoryError``, ``MemoryError``,
    and the RuntimeErrors the CPU allocator and MPS raise); any other error propagates
    untouched from the first try that raises it.

    The answer assumes that a size that fits once always fits and that memory use grows
    with the batch size. Leave some room in practice: fragmentation grows during training,
    and longer sequences need more. ``margin=0.9`` returns 90 % of the largest size that
    fits (rounded down, never below ``low``).

    **Distributed runs**: when a ``torch.distributed`` process group is initialised, the
    ranks agree after every try (an all-reduce of one number), so each rank tries the same
    sizes in the same order and all end with the same answer, the largest size that fits
    on every rank (call it with the same arguments everywhere). If ``step`` fails on one
    rank with another error, that rank re-raises it and the others raise
    :class:`~anydevice.errors.BatchSizeError`. A ``step`` that runs
    collectives itself (a DDP backward) can still leave the other ranks waiting in them when
    one rank runs out of memory midway: search with the model outside DDP when you can.

    >>> calls = []
    >>> def step(batch_size):
    ...     calls.append(batch_size)
    ...     if batch_size > 5:
    ...         raise torch.OutOfMemoryError("pretend")
    >>> fit_batch_size(step, start=2, device="cpu"), calls
    (5, [2, 4, 8, 6, 5])
    >>> fit_batch_size(step, start=8, device="cpu", margin=0.9)
    4

    Args:
        step: runs one step (forward and backward, optimizer step) at a batch size.
        start: the first size tried.
        low: the smallest acceptable size.
        high: the largest size to try; None for no limit (up to ``MAX_BATCH_SIZE``).
        device: where ``step`` allocates, to free its cache between tries; None: the
            accelerator this process is using, else the CPU.
        margin: the fraction of the largest fitting size to return, in (0, 1].
        snapshot_on_oom: CUDA: record the allocator's history during the search and write
            a snapshot (and its ``.html`` timeline) here at the first out-of-memory error,
            to see what filled the memory (:mod:`anydevice.measure.memory_history`).

    Returns:
        The largest size that fits (on every rank), times ``margin``.

    Raises:
        BatchSizeError: even ``low`` runs out of memory; or ``step`` never ran out of memory
            up to ``MAX_BATCH_SIZE`` (does it use its argument?); or another rank failed.
        TypeError: ``start``, ``low`` or ``high`` is not an int, or ``margin`` not a number.
        ValueError: ``low < 1``, ``start < low``, ``high < start``, or ``margin`` outside
            (0, 1].
    """
    _check_bounds(start, low, high, margin)
    watch = None if snapshot_on_oom is None else oom_snapshot(device, snapshot_on_oom)
    trials = _Trials(step if watch is None else watch.wrap(step), device)
    limit = high if high is not None else MAX_BATCH_SIZE
    try:
        found = search(trials.fits, start=start, low=low, high=limit)
    finally:
        trials.done()
        if watch is not None:
            watch.close()
    if found is None:
        raise BatchSizeError(trials.low_message(low))
    if high is None and found == MAX_BATCH_SIZE:
        raise BatchSizeError(
            f"step({found}) still did not run out of memory; does step use its batch size "
            "argument? Pass high= to cap the search."
        )
    return max(low, int(found * margin))


def _check_bounds(start: int, low: int, high: int | None, margin: float) -> None:
    """Refuse bounds the search cannot use, before the first try runs."""
    for name, value in (("start", start), ("low", low), ("high", high)):
        if value is None and name == "high":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            hint = f"{name}=8"
            if isinstance(value, float) and math.isfinite(value) and value >= 1:
                hint = f"{name}={int(value)}"
            raise TypeError(
                f"fit_batch_size: {name} is a batch size, a whole number, not "
                f"{type(value).__name__} ({value!r}); pass e.g. {hint}."
            )
    if low < 1:
        raise ValueError(f"fit_batch_size: low must be >= 1, not {low}.")
    if start < low:
        raise ValueError(f"fit_batch_size: start ({start}) must be >= low ({low}).")
    if high is not None and high < start:
        raise ValueError(f"fit_batch_size: high ({high}) must be >= start ({start}).")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(
            f"fit_batch_size: margin is a fraction such as 0.9, not {type(margin).__name__} "
            f"({margin!r})."
        )
    if not 0 < margin <= 1:
        raise ValueError(
            f"fit_batch_size: margin={margin!r} must be in (0, 1]: the fraction of the largest "
            "size that fits to return (0.9 leaves 10 % for fragmentation and longer inputs)."
        )


def search(fits: Callable[[int], bool], *, start: int, low: int, high: int) -> int | None:
    """The largest size in ``[low, high]`` with ``fits(size)`` True; None if not even ``low``.

    Doubles from ``start`` while sizes fit (capped at ``high``), then bisects between the
    largest size that fitted and the smallest that did not; when ``start`` does not fit,
    tries ``low`` and bisects between them. Each size is tried at most once, and ``fits``
    is assumed monotone (a size fits if a larger one does). About
    ``log2(answer / start) + log2(answer)`` tries.

    >>> search(lambda n: n <= 37, start=4, low=1, high=1000)
    37
    """
    good: int | None = None
    size = start
    while fits(size):  # grow
        good = size
        if size >= high:
            return size
        size = min(2 * size, high)
    bad = size
    if good is None:
        if bad == low or not fits(low):
            return None
        good = low
    while bad - good > 1:  # bisect: good fits, bad does not
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


class _Trials:
    """Runs the tries: frees memory before each, catches only OOM, agrees across ranks."""

    def __init__(self, step: Callable[[int], object], device: DeviceLike | None) -> None:
        self.step = step
        self.device = device
        self.agree = _agreement()
        self.last_oom = ""

    def _device(self) -> DeviceLike:
        # Resolved at each use: the first try is what initialises the GPU.
        return self.device if self.device is not None else active_device()

    def fits(self, size: int) -> bool:
        free_memory(self._device())
        status = _FITS
        try:
            self.step(size)
        except Exception as exc:
            if not is_out_of_memory(exc):
                try:
                    self.agree(_FAILED)  # so the other ranks stop instead of waiting
                except RuntimeError:  # the group is broken too; the user's error matters more
                    pass
                raise
            status = _OOM
            text = str(exc).strip()
            self.last_oom = text.splitlines()[0] if text else type(exc).__name__
        # Out of the except block: the error's traceback, which holds the failed try's
        # tensors, is released before the next try frees memory.
        agreed = self.agree(status)
        if agreed == _FAILED:
            raise BatchSizeError(
                f"another rank failed with an error other than out-of-memory while trying "
                f"batch size {size}; its own traceback says what happened."
            )
        fits = agreed == _FITS
        if status == _FITS and not fits:
            logger.debug("fit_batch_size: %d fits here but not on another rank", size)
        logger.debug("fit_batch_size: %d %s", size, "fits" if fits else "runs out of memory")
        return fits

    def done(self) -> None:
        free_memory(self._device())

    def low_message(self, low: int) -> str:
        where = self._device()
        try:
            state = repr(memory(where)).splitlines()[0]
        except Exception:  # the message must not hide the out-of-memory error behind another
            state = f"memory on {where} could not be read"
        return (
            f"even the smallest batch size, low={low}, runs out of memory "
            f"({self.last_oom or 'on another rank'}). Now: {state}. Free memory held "
            "elsewhere (other processes, tensors kept from earlier steps), or make one "
            "sample smaller: mixed precision, gradient checkpointing, a smaller model."
        )


def _agreement() -> Callable[[int], int]:
    """``status -> minimum status over all ranks``; the identity without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return lambda status: status
    from anydevice.hardware.backends import collective_device

    where = collective_device()  # the group's own device: NCCL reduces device tensors only

    def agree(status: int) -> int:
        t = torch.tensor([status], dtype=torch.int64, device=where)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    return agree
