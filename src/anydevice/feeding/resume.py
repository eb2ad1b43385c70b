"""Resuming a pass over a loader mid-epoch: where it was, and how to get there again.

A job preempted at batch 700 of 1000 should go on at batch 700, in the same order, not
start the epoch again. :class:`~anydevice.DeviceLoader` keeps the epoch, the batches
handed out in it and what the pass's order was drawn from
(:meth:`~anydevice.DeviceLoader.state_dict`); a resumed pass skips what was seen:

* a DataLoader with torch's ``BatchSampler`` (any map-style dataset with a ``batch_size``)
  skips at the sampler: the first ``k * batch_size`` indices are never drawn, so nothing
  is loaded for them, with worker processes too;
* any other source (an iterable dataset, a list, a generator, a custom batch sampler) is
  iterated and the first ``k`` batches discarded — they are loaded, then dropped.

What an order is drawn from, and how it is restored, by sampler:

* a ``DistributedSampler``: its seed and epoch. The epoch is saved and set again (also
  an epoch the loader advanced by itself), so a resumed epoch 3 is epoch 3's order.
* a ``RandomSampler`` with a ``generator``: the generator's state at the moment the
  sampler draws the pass's permutation — not when the pass begins: a DataLoader's new
  iterator first draws its workers' base seed from the same generator, and an iterator
  kept by ``persistent_workers`` does not, so the two differ from epoch 1 on.
* torch's ``RandomSampler`` without one: it seeds a generator of its own with a number
  drawn from torch's global RNG; under a ``BatchSampler`` that draw is made here, the
  same way at the same moment (the order is torch's), and the seed is saved. A resumed
  pass is then exact whatever the global RNG holds; later epochs draw from the global RNG
  as torch does, so they match the uninterrupted run's where the caller restores it
  (``torch.set_rng_state``) with the loader.
* other samplers that draw from the global RNG (no ``generator``) cannot be resumed in
  order: a warning names the fix, a ``generator=`` of their own.

A pass whose order was drawn before it was saved is resumed without drawing from any RNG
before its order: its DataLoader iterator takes its workers' base seed from a generator
of its own, so neither the caller's generator nor the global RNG moves — as in the
uninterrupted run, which drew that seed before the save.

A state saved with another batch size or number of ranks resumes where the samples seen
make a whole number of batches here (the first ``k * batch_size * ranks`` samples of an
epoch's order are the same whatever the split); otherwise, or for a state that is not a
loader's, :meth:`~anydevice.DeviceLoader.load_state_dict` raises an
:class:`~anydevice.errors.ArgumentError` saying what and why.
"""

from __future__ import annotations

import copy
import itertools
import logging
import operator
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from anydevice.errors import ArgumentError
from anydevice.hardware.backends import torch_private

__all__ = [
    "LoaderState",
    "PassOrder",
    "check_state",
    "order_between_passes",
    "shape_of",
    "warn_if_unrepeatable",
]

logger = logging.getLogger("anydevice")

#: A loader's state: ``epoch`` (of the pass under way, or the next), ``epoch_is_users``,
#: ``position`` (batches handed out in that pass), what its order is drawn from
#: (``generator``: a generator's state, ``seed``: the seed of a generator-less
#: ``RandomSampler``, ``started``: whether the pass's iterator existed, so ``generator``
#: is the state the sampler draws from rather than the state before the pass), and the
#: loader's shape (``batch_size``, ``replicas``, ``samples``, ``sampler``).
LoaderState = dict[str, Any]

_HOW = "pass what loader.state_dict() returned (ad.save_state(..., loader=loader) saves it)"
_OPTIONAL = {
    "epoch_is_users": False,
    "generator": None,
    "seed": None,
    "started": False,
    "batch_size": None,
    "replicas": 1,
    "samples": None,
    "sampler": None,
}


# ----------------------------------------------------------------------------- the order


def _draw(sampler: Any, restore: Mapping[str, Any] | None) -> tuple[Iterable[Any], LoaderState]:
    """The sampler to iterate for this pass and what its order is drawn from; with
    ``restore``, from what a saved pass's was."""
    generator = getattr(sampler, "generator", None)
    if isinstance(generator, torch.Generator):
        if restore is not None and restore.get("generator") is not None:
            generator.set_state(restore["generator"])
        return sampler, {"generator": generator.get_state(), "seed": None}
    if type(sampler) is RandomSampler and generator is None:
        seed = None if restore is None else restore.get("seed")
        if seed is None:  # as RandomSampler.__iter__ draws it: from the global RNG, now
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        own = copy.copy(sampler)  # the user's sampler keeps generator=None
        own.generator = torch.Generator().manual_seed(seed)
        return own, {"generator": None, "seed": seed}
    return sampler, {"generator": None, "seed": None}


class _Drawn:
    """The sampler a ``BatchSampler`` reads during one pass: the user's, whose order is
    drawn (or restored) and recorded when the pass first asks for an index, with the first
    ``skip`` indices left out. The record is taken under a lock, so a state saved while a
    prefetch thread starts the pass sees either the order drawn or the state it will be
    drawn from."""

    def __init__(self, sampler: Any, skip: int, restore: Mapping[str, Any] | None) -> None:
        self.sampler = sampler
        self.skip = skip
        self.restore = restore
        self._lock = threading.Lock()
        self._drawn: LoaderState | None = None

    def __iter__(self) -> Iterator[Any]:
        with self._lock:
            source, self._drawn = _draw(self.sampler, self.restore)
            it = iter(source)
            head = list(itertools.islice(it, 1))  # a lazy sampler draws its order here
        return itertools.islice(itertools.chain(head, it), self.skip, None)

    def __len__(self) -> int:
        return len(self.sampler)  # the whole pass: DeviceLoader counts the skipped batches

    def drawn(self) -> LoaderState:
        with self._lock:
            if self._drawn is not None:
                return dict(self._drawn)
            generator = getattr(self.sampler, "generator", None)  # to be drawn from this
            state = generator.get_state() if isinstance(generator, torch.Generator) else None
            return {"generator": state, "seed": None}


class PassOrder:
    """One pass's order over ``loader``: installed before the pass's iterator is made,
    undone by :meth:`close`. ``resume`` is a checked state (:func:`check_state`) or None."""

    def __init__(self, loader: Any, resume: Mapping[str, Any] | None) -> None:
        self.loader = loader
        self.resume = resume
        self.position = 0 if resume is None else int(resume["position"])
        self.by_hand = 0  #: batches the pass must read and drop (no sampler to skip at)
        self._wrapper: _Drawn | None = None
        self._batch_sampler: BatchSampler | None = None
        self._at_start: torch.Tensor | None = None  #: by hand: the generator as the pass began
        started = resume is not None and bool(resume.get("started"))
        generator = sampler_generator(loader)
        saved = None if resume is None else resume.get("generator")
        bs = getattr(loader, "batch_sampler", None)
        if type(bs) is BatchSampler:
            if saved is not None and generator is not None and not started:
                generator.set_state(saved)  # the state before the pass, as saved
            self._wrapper = _Drawn(bs.sampler, self.position * bs.batch_size,
                                   resume if started else None)  # fmt: skip
            self._batch_sampler = bs
            bs.sampler = self._wrapper
            return
        self.by_hand = self.position
        if generator is not None:
            if saved is not None:
                generator.set_state(saved)
            self._at_start = generator.get_state()

    def iterator(self) -> Iterator[Any]:
        """``iter(loader)``. For a pass resumed after its saved one had made its iterator,
        the DataLoader's workers' base seed comes from a generator of its own: the
        uninterrupted run drew it before the save, and drawing it again would move the
        caller's generator or the global RNG out of step."""
        resume = self.resume
        if resume is None or not resume.get("started") or not isinstance(self.loader, DataLoader):
            return iter(self.loader)
        original = self.loader.generator
        self.loader.generator = torch.Generator().manual_seed(int(resume["epoch"]))
        try:
            return iter(self.loader)
        finally:
            self.loader.generator = original

    def drawn(self) -> LoaderState:
        """What this pass's order is drawn from, as :meth:`DeviceLoader.state_dict` saves it."""
        if self._wrapper is not None:
            return {**self._wrapper.drawn(), "started": True}
        return {"generator": self._at_start, "seed": None, "started": False}

    def close(self) -> None:
        """Give the ``BatchSampler`` its sampler back."""
        if self._batch_sampler is not None and self._wrapper is not None:
            self._batch_sampler.sampler = self._wrapper.sampler
            self._batch_sampler = None


def order_between_passes(loader: Any) -> LoaderState:
    """What the next pass's order will be drawn from, between passes: the sampler
    generator's state now; ``started`` where ``persistent_workers`` keep the iterator (the
    next pass draws no base seed before its order)."""
    generator = sampler_generator(loader)
    kept = torch_private.iterator_kept(loader)  # torch keeps it only when persistent
    return {
        "generator": None if generator is None else generator.get_state(),
        "seed": None,
        "started": bool(kept and getattr(loader, "persistent_workers", False)),
    }


def sampler_generator(loader: Any) -> torch.Generator | None:
    """The ``generator`` of ``loader``'s sampler, whose state fixes a pass's order; None
    for other samplers (a DistributedSampler's order is its seed and epoch)."""
    sampler = getattr(loader, "sampler", None)
    generator = getattr(sampler, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def warn_if_unrepeatable(loader: Any) -> None:
    """Warn (once per place, as warnings do) where a resumed pass cannot have the saved
    pass's order: a sampler that draws it from torch's global RNG and is not torch's
    ``RandomSampler`` under a ``BatchSampler`` (whose seed is saved)."""
    sampler = getattr(loader, "sampler", None)
    if sampler is None or not hasattr(sampler, "generator") or sampler.generator is not None:
        return
    if type(sampler) is RandomSampler and type(getattr(loader, "batch_sampler", None)) is (
        BatchSampler
    ):
        return
    warnings.warn(
        f"the loader's {type(sampler).__name__} draws its order from torch's global RNG, "
        "so a pass resumed mid-epoch may repeat some samples and skip others. Give it a "
        "generator of its own, e.g. DataLoader(..., generator=torch.Generator()"
        ".manual_seed(0)) or the sampler's generator=, and its state is saved with the "
        "loader's.",
        stacklevel=3,
    )


# ----------------------------------------------------------------------------- the shape


def shape_of(loader: Any) -> LoaderState:
    """What a saved position depends on: the batch size, the ranks a ``DistributedSampler``
    deals to, the dataset's size and the sampler's kind."""
    bs = getattr(loader, "batch_sampler", None)
    size = getattr(bs, "batch_size", None) if bs is not None else None
    sampler = getattr(loader, "sampler", None)
    replicas = getattr(sampler, "num_replicas", 1)
    dataset = getattr(loader, "dataset", None)
    try:
        samples = len(dataset) if dataset is not None else None
    except TypeError:  # an iterable dataset without a length
        samples = None
    return {
        "batch_size": size if isinstance(size, int) else None,
        "replicas": replicas if isinstance(replicas, int) else 1,
        "samples": samples,
        "sampler": None if sampler is None else type(sampler).__name__,
    }


# ----------------------------------------------------------------------------- checking


def _whole(state: Mapping[str, Any], key: str, low: int = 0, optional: bool = False) -> Any:
    value = state.get(key)
    if value is None and optional:
        return None
    try:
        if isinstance(value, bool | float) or value is None:
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ArgumentError(
            f"DeviceLoader.load_state_dict: state[{key!r}]={value!r} is not a whole number; {_HOW}."
        ) from None
    if number < low:
        raise ArgumentError(
            f"DeviceLoader.load_state_dict: state[{key!r}]={number} is below {low}; {_HOW}."
        )
    return number


def check_state(state: object, loader: Any) -> LoaderState:
    """``state`` checked against what :meth:`DeviceLoader.state_dict` writes and against
    ``loader``, with its position in ``loader``'s batches (converted where it was saved
    with another batch size or number of ranks).

    Raises:
        ArgumentError: naming the key, its value and what to do.
    """
    if not isinstance(state, Mapping):
        raise ArgumentError(
            f"DeviceLoader.load_state_dict(state): state must be a dict, not "
            f"{type(state).__name__} ({state!r:.80}); {_HOW}."
        )
    missing = {"epoch", "position"} - set(state)
    if missing:
        raise ArgumentError(
            f"DeviceLoader.load_state_dict: not a DeviceLoader state, it lacks "
            f"{sorted(missing)}; {_HOW}."
        )
    unknown = set(state) - {"epoch", "position", *_OPTIONAL}
    if unknown:
        raise ArgumentError(
            f"DeviceLoader.load_state_dict: unknown keys {sorted(map(str, unknown))} in the "
            f"state; {_HOW}."
        )
    out: LoaderState = {**_OPTIONAL, **state}
    out["epoch"] = _whole(state, "epoch")
    out["position"] = _whole(state, "position")
    for key in ("epoch_is_users", "started"):
        if not isinstance(out[key], bool):
            raise ArgumentError(
                f"DeviceLoader.load_state_dict: state[{key!r}]={out[key]!r} must be True or "
                f"False; {_HOW}."
            )
    out["seed"] = _whole(state, "seed", optional=True)
    out["batch_size"] = _whole(state, "batch_size", 1, optional=True)
    out["replicas"] = _whole(out, "replicas", 1)
    out["samples"] = _whole(state, "samples", optional=True)
    if out["sampler"] is not None and not isinstance(out["sampler"], str):
        raise ArgumentError(
            f"DeviceLoader.load_state_dict: state['sampler']={out['sampler']!r} must be a "
            f"sampler's class name; {_HOW}."
        )
    _check_generator(out["generator"], loader)
    if out["position"]:
        out["position"] = _position_here(out, loader)
    else:  # a new epoch's order: nothing seen to skip, so nothing to match
        out["generator"] = out["generator"] if sampler_generator(loader) is not None else None
    return out


def _check_generator(saved: object, loader: Any) -> None:
    if saved is None:
        return
    if not isinstance(saved, torch.Tensor) or saved.dtype != torch.uint8 or saved.dim() != 1:
        what = f"a {saved.dtype} tensor" if isinstance(saved, torch.Tensor) else repr(saved)
        raise ArgumentError(
            f"DeviceLoader.load_state_dict: state['generator'] is {what:.80}, not a "
            f"generator's state (a 1-D uint8 tensor from Generator.get_state()); {_HOW}."
        )
    generator = sampler_generator(loader)
    scratch = torch.Generator(device=generator.device if generator is not None else "cpu")
    try:
        scratch.set_state(saved)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ArgumentError(
            f"DeviceLoader.load_state_dict: state['generator'] is not a valid state for a "
            f"{scratch.device.type} generator ({e}); the checkpoint is damaged or from "
            f"another loader: {_HOW}."
        ) from None


def _position_here(saved: LoaderState, loader: Any) -> int:
    """The saved position in this loader's batches; raises where it cannot be exact."""
    here = shape_of(loader)
    epoch, position = int(saved["epoch"]), int(saved["position"])
    where = f"the state was saved at batch {position} of epoch {epoch}"
    start_over = (
        f"To start epoch {epoch} over instead, load it with state['position'] = 0 "
        "(or ad.load_state without loader= and loader.set_epoch)."
    )
    for key, what in (("sampler", "a {} sampler"), ("samples", "a dataset of {} samples")):
        if saved[key] is not None and here[key] is not None and saved[key] != here[key]:
            raise ArgumentError(
                f"DeviceLoader.load_state_dict: {where} of a loader with "
                f"{what.format(saved[key])}, but this one has {what.format(here[key])}: the "
                f"samples seen cannot be found in this order. Resume with the loader as "
                f"saved. {start_over}"
            )
    if saved["replicas"] != 1 and not hasattr(getattr(loader, "sampler", None), "num_replicas"):
        raise ArgumentError(
            f"DeviceLoader.load_state_dict: {where} on {saved['replicas']} ranks, but this "
            f"loader's sampler ({here['sampler']}) does not deal to ranks: the samples seen "
            f"cannot be found in its order. Build it as saved (ad.prepare shards it). "
            f"{start_over}"
        )
    if saved["generator"] is not None and sampler_generator(loader) is None:
        raise ArgumentError(
            f"DeviceLoader.load_state_dict: {where} with a sampler generator, but this "
            f"loader's sampler has none ({here['sampler']}), so its order cannot be "
            f"restored. Build it as saved, with generator=. {start_over}"
        )
    saved_step = saved["batch_size"] * saved["replicas"] if saved["batch_size"] else None
    here_step = here["batch_size"] * here["replicas"] if here["batch_size"] else None
    if saved_step is not None and here_step is not None and saved_step != here_step:
        seen = position * saved_step
        split = (
            f"{saved['batch_size']} x {saved['replicas']} rank(s) = {saved_step} samples a "
            f"step then, {here['batch_size']} x {here['replicas']} = {here_step} here"
        )
        if seen % here_step:
            raise ArgumentError(
                f"DeviceLoader.load_state_dict: {where} ({split}): the {seen} samples seen "
                f"are not a whole number of this loader's batches, so resuming would repeat "
                f"or skip some. Resume with a batch size and number of ranks whose product "
                f"divides {seen}. {start_over}"
            )
        logger.info("DeviceLoader.load_state_dict: %s (%s): resuming at batch %d here",
                    where, split, seen // here_step)  # fmt: skip
        position = seen // here_step
    try:
        total = len(loader)
    except TypeError:  # no length: a source read past its end says so as it is skipped
        return position
    if position > total:
        raise ArgumentError(
            f"DeviceLoader.load_state_dict: {where}, but this loader's epoch has {total} "
            f"batches: resuming would skip every sample of it. Resume with the loader as "
            f"saved. {start_over}"
        )
    return position
