"""Gradient accumulation — ``for step in d.accumulate(model, loader, micro_batches=4):``.

A step of ``N`` micro-batches gives the gradient of one batch ``N`` times larger, for
``N`` times less activation memory. Three things make it right, and the user writes none
of them:

1. **One gradient reduction per step.** DDP all-reduces gradients after every backward,
   and FSDP2 reduce-scatters them, unless told not to: the first ``N - 1`` micro-batches
   run with DDP's ``require_backward_grad_sync`` off (what ``no_sync()`` sets) or FSDP2's
   ``set_requires_gradient_sync(False)``, so each rank sums its gradients locally, and the
   last one runs with it on, so the sums are reduced once. The switch is set before each
   micro-batch is handed out, so it covers that micro-batch's forward as well as its
   backward (DDP decides at the forward). A plain model has nothing to switch.
2. **The loss scale.** ``step.scale(loss)`` is ``loss / N``: the summed gradients of
   ``N`` mean losses are then the gradient of the mean over all ``N`` micro-batches. The
   last step of an epoch may be shorter (``k`` left over); it divides by ``k``.
3. **The step boundary.** The micro-batches of each step come from one pass over the
   loader, with its length known, so every step knows its size before it starts and the
   loader is read exactly as far as training went (a saved loader position stays
   right); after the last step the loader is asked once more, so that it sees its pass
   end (a ``DeviceLoader`` then advances its sampler's epoch). A source without a length
   is read one micro-batch ahead to find its end; a short last step then divides by ``N``
   and its gradients are multiplied by ``N / k`` when it ends.

It composes with :func:`anydevice.numerics.precision` (``p.backward`` per micro-batch, then
``p.unscale_`` once, clipping, ``p.step`` once) and with
:func:`anydevice.fit_batch_size`: :func:`micro_batch_size` picks the largest micro-batch
that fits and divides a target global batch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any, Generic, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from anydevice.errors import ArgumentError, DistributedError, StepOrderError
from anydevice.hardware.backends import torch_private

__all__ = ["Accumulation", "AccumulationStep", "accumulate", "micro_batch_size"]

T = TypeVar("T")

_END = object()  #: what ``next(iterator, _END)`` gives at the end


class AccumulationStep(Generic[T]):
    """The micro-batches of one optimizer step; iterate it once, to its end.

    Made by :class:`Accumulation`. While it is iterated, the model's gradient sync is off
    for every micro-batch but the last.
    """

    def __init__(self, owner: Accumulation[T], index: int, size: int) -> None:
        self._owner = owner
        self.index = index  #: which optimizer step of this pass, from 0
        self._size = size
        self._divisor = size
        self.done = 0  #: micro-batches handed out so far
        self._started = False

    @property
    def size(self) -> int:
        """How many micro-batches this step has: ``micro_batches``, fewer for the last
        step of a pass. (For a source without a length, ``micro_batches`` until its end
        shows otherwise.)"""
        return self._size

    @property
    def finished(self) -> bool:
        """True once every micro-batch of this step was handed out."""
        return self.done >= self._size

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` divided by the number of micro-batches in this step: pass it to
        ``p.backward`` (or call ``.backward()`` on it).

        >>> step = next(iter(accumulate(nn.Linear(2, 1), range(8), micro_batches=4)))
        >>> step.scale(torch.tensor(2.0))
        tensor(0.5000)
        """
        return loss / self._divisor

    def __iter__(self) -> Iterator[T]:
        if self._started:
            raise StepOrderError(
                f"step {self.index} was already iterated: each step's micro-batches are "
                "handed out once. Write `for step in d.accumulate(...): for batch in step:`."
            )
        self._started = True
        return self._owner._micro_batches(self)

    def __repr__(self) -> str:
        return f"AccumulationStep(index={self.index}, size={self._size}, done={self.done})"


class Accumulation(Generic[T]):
    """Groups a loader's batches into optimizer steps of ``micro_batches`` each.

    Made by :func:`accumulate` (or ``d.accumulate``). Iterating it gives one
    :class:`AccumulationStep` per optimizer step; iterating a step gives its
    micro-batches. Iterate it once per epoch, as the loader itself.

    >>> net = nn.Linear(2, 1)
    >>> steps = accumulate(net, [torch.ones(3, 2)] * 5, micro_batches=2)
    >>> len(steps), [len(list(step)) for step in steps]
    (3, [2, 2, 1])
    """

    def __init__(self, model: nn.Module, source: Iterable[T] | None, micro_batches: int) -> None:
        self.model = model
        self.source = source
        self.micro_batches = micro_batches  #: micro-batches per optimizer step
        self._switches = _sync_switches(model)
        self._ahead: list[T] = []  #: the one micro-batch read ahead (sources without length)
        self._ended = False
        self._it: Iterator[T] | None = None
        self._total: int | None = None

    @property
    def syncs(self) -> bool:
        """Whether the model has a gradient sync to switch off (DDP or FSDP2)."""
        return bool(self._switches)

    def __len__(self) -> int:
        """Optimizer steps in one pass over the loader (``ceil(len(loader) / N)``).

        Raises:
            TypeError: the loader has no length (or there is no loader: endless steps).
        """
        if not isinstance(self.source, Sized):
            raise TypeError(
                "this accumulation has no length: its source "
                f"({type(self.source).__name__}) has none."
            )
        return math.ceil(len(self.source) / self.micro_batches)

    def __iter__(self) -> Iterator[AccumulationStep[T]]:
        source: Iterable[Any] = self.source if self.source is not None else ()
        self._total = len(source) if isinstance(self.source, Sized) else None
        if self._switches and self.source is not None:
            _agree_on_batches(self._total)
        self._it = iter(source)
        self._ahead, self._ended = [], False
        previous: AccumulationStep[T] | None = None
        index = 0
        try:
            while True:
                if previous is not None and not previous.finished:
                    raise StepOrderError(
                        f"step {previous.index} was left after {previous.done} of its "
                        f"{previous.size} micro-batches: its gradients are not reduced yet. "
                        "Iterate each step to its end (`for batch in step:`) before the next."
                    )
                size = self._next_size(index)
                if size == 0:
                    self._finish_pass()
                    return
                previous = AccumulationStep(self, index, size)
                yield previous
                index += 1
        finally:
            self._sync(True)

    # ------------------------------------------------------------------------- internals

    def _next_size(self, index: int) -> int:
        """The size of step ``index``: known from the length, else 0 once the source ended."""
        n = self.micro_batches
        if self.source is None:
            return n
        if self._total is not None:
            return max(0, min(n, self._total - index * n))
        if not self._ahead and not self._ended:
            self._read_ahead()
        return n if self._ahead else 0

    def _finish_pass(self) -> None:
        """Read the source to its end, so that it sees a complete pass: a ``DeviceLoader``
        advances its sampler's epoch (a new shuffle) only then."""
        if self._total is None or self._it is None:
            return  # no length: the look-ahead already met the end
        extra = next(self._it, _END)
        if extra is not _END:
            warnings.warn(
                f"the loader gave more batches than its len() of {self._total}; "
                "accumulate() stopped at its length. Give the loader a true length, or none.",
                stacklevel=3,
            )

    def _read_ahead(self) -> None:
        assert self._it is not None
        try:
            self._ahead.append(next(self._it))
        except StopIteration:
            self._ended = True

    def _next(self, step: AccumulationStep[T]) -> tuple[T, bool]:
        """The next micro-batch of ``step``, and whether it is the step's last."""
        assert self._it is not None
        if self.source is None:
            return cast(T, step.done), step.done + 1 == step.size
        if self._total is None:
            batch = self._ahead.pop()  # there is one: the step started, or was not last
            self._read_ahead()  # the source's end makes this micro-batch the last
            return batch, step.done + 1 == step.size or not self._ahead
        try:
            batch = next(self._it)
        except StopIteration:
            raise StepOrderError(
                f"the loader ended after {step.index * self.micro_batches + step.done} "
                f"batches, but its len() is {self._total}: step {step.index} cannot be "
                "completed and its gradients were not reduced. Give the loader a true "
                "length, or none."
            ) from None
        return batch, step.done + 1 == step.size

    def _micro_batches(self, step: AccumulationStep[T]) -> Iterator[T]:
        try:
            while step.done < step.size:
                batch, last = self._next(step)
                self._sync(last)  # before the forward: DDP decides there
                step.done += 1
                if last and step.done < step.size:  # a source without length ended
                    step._size = step.done
                    yield batch
                    self._correct(step)  # after this micro-batch's backward
                    return
                yield batch
        finally:
            self._sync(True)

    def _correct(self, step: AccumulationStep[T]) -> None:
        """A short last step of a source without length: its ``k`` micro-batches were
        divided by ``N``; make it a mean over ``k``."""
        factor = step._divisor / step.done
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)

    def _sync(self, on: bool) -> None:
        for switch in self._switches:
            switch(on)


def accumulate(
    model: nn.Module,
    loader: Iterable[T] | None = None,
    *,
    micro_batches: int | None = None,
    global_batch: int | None = None,
    world_size: int | None = None,
) -> Accumulation[T]:
    """Make every ``micro_batches`` batches of ``loader`` one optimizer step of ``model``.

    Usually called as ``d.accumulate(...)`` on what ``ad.distributed()`` gives::

        for step in d.accumulate(model, loader, micro_batches=4):
            for x, y in step:                      # 4 micro-batches; one all-reduce
                with p.autocast():
                    loss = loss_fn(model(x), y)
                p.backward(step.scale(loss))       # loss / 4
            p.unscale_(optimizer)                  # once, before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            p.step(optimizer)
            optimizer.zero_grad(set_to_none=True)

    >>> net = nn.Linear(2, 1)
    >>> for step in accumulate(net, [torch.ones(1, 2)] * 4, micro_batches=2):
    ...     for x in step:
    ...         step.scale(net(x).sum()).backward()
    ...     print(step.index, step.size)
    0 2
    1 2

    Args:
        model: the model as ``ad.prepare`` returned it: a DDP model or one sharded with
            FSDP2 (``fully_shard``) has its gradient sync switched off for all but the
            last micro-batch of each step; a plain model trains unchanged. A
            ``torch.compile``\\ d model is looked through.
        loader: the micro-batches (a ``DeviceLoader``, a ``DataLoader``, any iterable).
            ``None`` gives endless steps whose items are the micro-batch numbers
            ``0 .. N-1``, for loops that fetch their own batches (``get_batch()``).
        micro_batches: ``N``, the micro-batches per optimizer step.
        global_batch: instead of ``micro_batches``: the samples per optimizer step over
            all ranks; ``N = global_batch / (loader.batch_size * world_size)``, which must
            be a whole number (see :func:`micro_batch_size`).
        world_size: the ranks (default: the process group's size, else 1).

    Returns:
        An :class:`Accumulation`: iterate it once per epoch.

    Raises:
        ArgumentError: ``model`` is not a module, ``loader`` not an iterable of batches;
            neither or both of ``micro_batches`` and ``global_batch``; a count that is not
            a whole number >= 1; a ``world_size`` other than the process group's; a
            ``global_batch`` that the loader's batch size and the world size do not divide.
        DistributedError: raised when the steps are iterated, on every rank, where the
            ranks' loaders have different numbers of batches (see the module docstring).
    """
    _check_model(model)
    _check_loader(loader)
    if (micro_batches is None) == (global_batch is None):
        raise ArgumentError(
            f"accumulate() takes micro_batches= or global_batch=, exactly one (got "
            f"micro_batches={micro_batches!r}, global_batch={global_batch!r})."
        )
    world = _world(None if world_size is None else _whole("world_size", world_size))
    if micro_batches is None:
        assert global_batch is not None
        micro_batches = _from_global(loader, _whole("global_batch", global_batch), world)
    micro_batches = _whole(
        "micro_batches", micro_batches, "the number of micro-batches per optimizer step, "
    )
    return Accumulation(model, loader, micro_batches)


def micro_batch_size(global_batch: int, fits: int, world_size: int = 1) -> int:
    """The largest micro-batch size ``<= fits`` that makes ``global_batch`` exactly.

    ``fits`` is typically what :func:`anydevice.fit_batch_size` found; the answer divides
    ``global_batch / world_size``, so a whole number of micro-batches per rank makes one
    step of ``global_batch`` samples.

    >>> micro_batch_size(512, fits=37, world_size=2)   # 256 per rank: 8 x 32
    32
    >>> micro_batch_size(96, fits=100)
    96

    Raises:
        ArgumentError: ``world_size`` does not divide ``global_batch``, or a value that is
            not a whole number >= 1.
    """
    for name, value in (("global_batch", global_batch), ("fits", fits), ("world_size", world_size)):
        _whole(name, value)
    if global_batch % world_size:
        raise ArgumentError(
            f"global_batch={global_batch} cannot be split evenly over world_size={world_size} "
            f"ranks. Use a multiple of {world_size}, e.g. "
            f"{global_batch // world_size * world_size or world_size}."
        )
    per_rank = global_batch // world_size
    return max(b for b in range(1, min(fits, per_rank) + 1) if per_rank % b == 0)


# ----------------------------------------------------------------------------- internals


def _whole(name: str, value: object, what: str = "") -> int:
    """``value`` where it is a whole number >= 1 (not a bool, not a float)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(f"{name}={value!r}: pass {what}a whole number >= 1.")
    return value


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise ArgumentError(
            f"accumulate(model={model!r:.80}): pass the model the steps train, an nn.Module "
            "(the one ad.prepare returned: its gradient sync is what accumulation switches), "
            f"not a {type(model).__name__}."
        )


def _check_loader(loader: object) -> None:
    bad = (
        isinstance(loader, str | bytes | Mapping)
        or (isinstance(loader, torch.Tensor) and loader.dim() == 0)
        or (loader is not None and not isinstance(loader, Iterable))
    )
    if bad:
        raise ArgumentError(
            f"accumulate(loader={loader!r:.80}): pass the micro-batches, an iterable of "
            f"batches (a DeviceLoader, a DataLoader, a list), or None for endless steps; a "
            f"{type(loader).__name__} is not one."
        )


def _world(world_size: int | None) -> int:
    group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if world_size is None:
        return 1 if group is None else group
    if group is not None and world_size != group:
        raise ArgumentError(
            f"world_size={world_size}, but the process group has {group} ranks: global_batch "
            "would be split as if there were another number of them. Leave world_size out "
            "(d.accumulate passes the right one)."
        )
    return world_size


def _agree_on_batches(total: int | None) -> None:
    """Make sure every rank runs as many micro-batches this pass, before the first: a rank
    that finishes first leaves the others waiting in a gradient reduction it never joins
    (a hang until the timeout, or a "crash" blamed on the peer that left)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from anydevice.training.collectives import all_gather

    counts = all_gather(total)
    if len(set(counts)) == 1:
        return
    each = ", ".join(f"rank {r}: {'no len()' if c is None else c}" for r, c in enumerate(counts))
    raise DistributedError(
        f"accumulate(): the ranks' loaders have different numbers of batches this pass "
        f"({each}). With a gradient reduction in every step, the ranks must run the same "
        "steps: one that finishes first leaves the others waiting for it. Shard the data "
        "with ad.prepare (its DistributedSampler gives every rank as many batches), or cut "
        "every rank's data to the same number of batches (DataLoader(drop_last=True) over "
        "equal shards)."
    )


def _from_global(loader: object, global_batch: int, world_size: int) -> int:
    size = getattr(loader, "batch_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ArgumentError(
            f"global_batch={global_batch} needs the loader's batch size, but "
            f"{type(loader).__name__} has none (batch_size={size!r}). Pass micro_batches= "
            "instead."
        )
    per_step = size * world_size
    if global_batch % per_step:
        fit = (
            micro_batch_size(global_batch, size, world_size)
            if global_batch % world_size == 0
            else None
        )
        hint = f"a loader batch size of {fit}" if fit else f"a multiple of {per_step}"
        raise ArgumentError(
            f"global_batch={global_batch} is not a whole number of micro-batches: "
            f"{world_size} rank(s) x batch size {size} = {per_step} samples per micro-batch. "
            f"Use {hint} (inside `with ad.distributed() as d:`, "
            f"d.micro_batch_size({global_batch}, fits=<the largest batch that fits>) picks one)."
        )
    return global_batch // per_step


def _sync_switches(model: nn.Module) -> list[Any]:
    """Functions ``on -> None`` that switch the model's gradient reduction."""
    inner = model
    while isinstance(compiled := torch_private.compiled_inner(inner), nn.Module):
        inner = compiled
    if isinstance(inner, DistributedDataParallel):
        ddp = inner

        def ddp_sync(on: bool) -> None:
            ddp.require_backward_grad_sync = on

        return [ddp_sync]
    sharded = _fsdp_modules(inner)
    if sharded:

        def fsdp_sync(on: bool) -> None:
            for m in sharded:
                m.set_requires_gradient_sync(on, recurse=False)

        return [fsdp_sync]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            f"accumulate(): the model ({type(inner).__name__}) is neither DDP nor sharded "
            f"with FSDP2 in a world of {dist.get_world_size()} ranks, so no gradient sync "
            "is switched. Pass the model that ad.prepare returned, not ad.unwrap(model).",
            stacklevel=3,
        )
    return []


def _fsdp_modules(model: nn.Module) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]
