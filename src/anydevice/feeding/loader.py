"""``DeviceLoader``: batches that arrive on the device, copied while the last one computes.

How the CUDA path keeps copies and compute overlapped *and* ordered:

1. A background thread takes batches from the source (so data loading with
   ``num_workers=0`` overlaps the step too) and pins, leaf by leaf, the dense CPU tensors
   that are not pinned yet — pinning on the main thread is slower than a plain pageable
   copy, pinning off it is what makes the copy asynchronous.
2. Handing out batch k: the *consumer's stream* — the stream current when ``next()`` is
   called — waits on the event recorded after batch k's copy, so no kernel reads it early.
3. Then batch k+1 is issued on the copy stream. A source with a length (a list, a
   map-style DataLoader) makes it whatever the step does, so handing out batch k waits for
   it if need be; from any other iterator it is issued only if the background thread
   already holds it — a source may make batch k+1 only after the step used batch k (an RL
   rollout, a queue the step feeds) — and otherwise when the loop asks for it. The copy
   stream is one per device for the whole process
   (:func:`anydevice.feeding.streams.copy_stream`); the copy waits for the work queued so far on the
   device's default stream, copies (``non_blocking``, from pinned memory), runs
   ``transform`` and records an event. The copy engine runs it while the GPU computes
   batch k — also when the host synchronises every step (``loss.item()``): the copy waits
   only for compute k-1, which that synchronisation already finished.

Events are never re-recorded while still to be waited on: a batch's event pair is reused
only once the consumer's wait on it was issued (a wait uses the event as recorded at the
time of the call) and the copy it timed has finished (:class:`CopyTimes`). Re-recording it
earlier made the consumer wait for the *next* copy, which waited for all earlier compute:
no overlap.

Memory: batch k+1 is allocated from the copy stream's pool. A block the consumer freed on
the default stream is reused only by a later allocation on the copy stream, which always
comes after step 3's wait for the default stream — so after the consumer's reads. A
consumer on another stream ``s`` gets each tensor of its batch ``record_stream(s)``-ed
at hand-out: the allocator then keeps the block until ``s`` is past the point where it
was freed. One copy stream per device means one pool: reserved memory stays flat across
epochs, also for a loader built anew every epoch.

XPU and any other accelerator torch knows with streams get the same ordering through
``torch.Stream``/``torch.Event`` and ``torch.accelerator`` (:mod:`anydevice.feeding.copies`);
the home stream is then the one current when the pass starts, torch's generic API having
no default stream, and a batch read on another stream makes that stream a home too
instead of a ``record_stream`` (which not every backend has). On MPS and XLA the
background thread still fetches ahead and the move is a plain ``anydevice.to``; on XLA
each batch after the first also ends the step before it (``torch_xla.sync()``), as
torch_xla's ``MpDeviceLoader`` does, so the lazy graph is cut and run once per step
instead of growing over the epoch. On the CPU there is nothing to copy, so by default no
thread either: a batch costs a few microseconds more than iterating the source itself.
Without the thread (``prefetch=False``) the source is read only when the loop asks for a
batch, never ahead: reading ahead on the consumer's thread would block it on a source that
waits for the consumer. Where copies can be asynchronous (a copy stream), that batch is
then pinned on the calling thread before its copy is queued on the copy stream: a copy
from pageable memory returns only once it has landed, so the host would wait for the
compute queued before it (which the copy stream waits for) and the copy, every step. The
pin is the host-side copy the driver makes into its staging buffer anyway; with it,
``next()`` returns while the device still computes, and the host stays a step ahead. The
copy of batch k+1 still runs after the compute of batch k (it is read only then), so
``prefetch=True`` (the default on accelerators) is what overlaps them.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from anydevice.errors import ArgumentError
from anydevice.feeding.copies import Copier, copier_for
from anydevice.feeding.resume import (
    PassOrder,
    check_state,
    order_between_passes,
    shape_of,
    warn_if_unrepeatable,
)
from anydevice.feeding.startmethod import check_loader_workers
from anydevice.feeding.transfer import BatchEvents, CopyTimes, nbytes_off, pin_leaves
from anydevice.feeding.waiting import Shares
from anydevice.hardware import pulse
from anydevice.hardware.backends import runtime, torch_private
from anydevice.hardware.selection import resolve
from anydevice.hardware.spec import DeviceLike
from anydevice.placement.move import to

__all__ = ["DeviceLoader", "LoaderStats"]

T = TypeVar("T")
logger = logging.getLogger("anydevice")

_INPUT_BOUND = 0.20  #: waiting share above which a run is called input-bound
_COPY_BOUND = 0.80  #: copy-time share of the step above which it is called copy-bound
_POLL = 0.1  #: seconds between checks of the stop flag while blocked


@dataclass(frozen=True)
class LoaderStats:
    """How a pass over a :class:`DeviceLoader` went: is the step waiting for data?

    Times are seconds of wall clock on the consuming thread. ``copy_seconds`` is device
    time of the host-to-device copies (events on the copy stream), None where it is not
    measured (no copy stream, or events that cannot time).
    """

    batches: int
    bytes_moved: int  #: bytes of tensors copied to another device
    wait_seconds: float  #: time the consumer was blocked waiting for the next batch
    total_seconds: float  #: wall time from the first batch asked for to the latest
    copy_seconds: float | None
    device: str
    num_workers: int | None  #: the source DataLoader's, None for other sources
    pinned: bool | None  #: whether the source delivered pinned batches (copy streams only)
    #: what ended the pass early (``"ValueError: bad sample"``), None for a pass that ran
    #: or still runs normally; the times of an aborted pass say nothing about the loop
    aborted: str | None = None
    #: the waiting share after the first batch (start-up aside), and its spread over the
    #: pass (10th to 90th percentile of its chunks of batches); None before two batches
    steady: float | None = None
    wait_low: float | None = None
    wait_high: float | None = None
    cores: int | None = None  #: cores this process may use
    #: cores kept busy on average during the pass, by every process (this one, its
    #: DataLoader workers, others); None where it was not read
    cpu_busy: float | None = None

    @property
    def wait_fraction(self) -> float:
        """Share of the wall time spent waiting for data, 0..1."""
        return self.wait_seconds / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def bandwidth(self) -> float | None:
        """Effective host-to-device bandwidth in bytes/s, where copies are timed."""
        if not self.copy_seconds or not self.bytes_moved:
            return None
        return self.bytes_moved / self.copy_seconds

    @property
    def saturated(self) -> bool:
        """The usable cores were busy (less than half a core idle on average) during the
        pass: more DataLoader workers would wait for them too (unless loading waits on
        I/O rather than the CPU)."""
        if self.cpu_busy is None or not self.cores:
            return False
        return self.cpu_busy >= self.cores - 0.5

    @property
    def verdict(self) -> str:
        """One line: input-bound, copy-bound, or compute-bound — and what to do. A pass
        whose waiting share, chunk by chunk, lies on both sides of the 20 % line (a
        machine whose other jobs come and go) gets no advice, but "noisy"."""
        if self.aborted is not None:
            return (
                f"aborted after {self.batches} batches by {self.aborted}: no advice from a "
                "pass that did not finish"
            )
        if self.batches == 0:
            return "no batch delivered yet"
        share = self.wait_fraction if self.steady is None else self.steady
        low, high = self.wait_low, self.wait_high
        if low is not None and high is not None and low < _INPUT_BOUND <= high:
            return (
                f"noisy: {share:.0%} of the step waiting for data, from {low:.0%} to "
                f"{high:.0%} over the pass: measure again when the machine is quiet"
            )
        if share >= _INPUT_BOUND:
            fixes = []
            if self.num_workers is not None and self.saturated:
                fixes.append(
                    f"the {self.cores} usable core(s) were busy ({self.cpu_busy:.1f} on "
                    "average, every process counted): more workers would wait for them too "
                    "unless loading waits on I/O; make each sample cheaper to load (decode "
                    "or augment on the device with transform=)"
                )
            elif self.num_workers is not None:
                fixes.append(f"raise num_workers (now {self.num_workers})")
            else:
                fixes.append("make the source faster")
            if self.pinned is False:
                fixes.append("pin memory (DataLoader(pin_memory=True))")
            return f"input-bound: {share:.0%} of the step waiting for data — {', or '.join(fixes)}"
        if self.copy_seconds is not None and self.total_seconds > 0:
            copy_share = self.copy_seconds / self.total_seconds
            if copy_share >= _COPY_BOUND:
                return (
                    f"copy-bound: host-to-device copies take {copy_share:.0%} of the step — "
                    "send smaller dtypes (e.g. uint8) and convert on the device with transform="
                )
        return f"compute-bound: the next batch was ready {1 - share:.0%} of the time"

    @property
    def advice(self) -> str | None:
        """What to change, where the pass says so; None where there is nothing to do or
        nothing certain (an aborted or noisy pass)."""
        verdict = self.verdict
        if verdict.startswith(("input-bound", "copy-bound")):
            return verdict.split(" — ", 1)[-1]
        return None

    def __repr__(self) -> str:
        from anydevice.hardware.facts import format_bytes

        step = self.total_seconds / self.batches if self.batches else 0.0
        parts = [
            f"{self.batches} batches on {self.device}",
            f"{step * 1e3:.2f} ms/step",
            f"waiting {self.wait_fraction:.0%}",
            f"{format_bytes(self.bytes_moved)} moved",
        ]
        if self.bandwidth is not None:
            parts.append(f"{self.bandwidth / 1e9:.1f} GB/s")
        return f"LoaderStats({', '.join(parts)}: {self.verdict})"


class _LoaderEpoch(int):
    """An epoch this loader gave the sampler: an ``int`` in every way, but a call of the
    sampler's ``set_epoch`` by anyone else replaces it with a plain one, even with the same
    value. That is how a user's ``loader.sampler.set_epoch(e)`` is recognised while the
    sampler reads exactly what torch's would (``e`` during and after the pass)."""

    __slots__ = ()

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        return int, (int(self),)  # pickled (to a worker, a checkpoint) as a plain int


class _Counters:
    """Mutable tallies of one pass; ``LoaderStats`` is their snapshot."""

    def __init__(self, times: CopyTimes | None = None) -> None:
        self.batches = 0
        self.bytes_moved = 0
        self.wait = 0.0
        self.start: float | None = None
        self.last = 0.0
        self.pinned: bool | None = None
        self.aborted: str | None = None
        self.times = times  #: copy timings, None where copies are not timed
        self._wait_then = 0.0  #: ``wait`` at the last hand-out
        self.shares = Shares()  #: each hand-out's wait and step, after the first
        self.cores: list[int] = []  #: the cores whose busy time is read
        self.cpu: tuple[float, float] | None = None  #: (wall, busy CPU s) when the pass began

    def begin(self, now: float) -> None:
        """The pass's first fetch: its clock, and the CPU time of its cores."""
        from anydevice.hardware.backends.cpu import busy_seconds, core_ids

        self.start = now
        try:
            self.cores = core_ids()
            self.cpu = (time.perf_counter(), busy_seconds(self.cores))
        except Exception:  # advice on top of the stats, never a reason to fail the pass
            self.cpu = None

    def handed_out(self, now: float) -> None:
        """Batch ``batches`` handed out at ``now``: its wait and step join the chunks."""
        if self.batches:  # the first hand-out is the pass's start-up, not its steady state
            self.shares.add(self.wait - self._wait_then, now - self.last)
        self.batches += 1
        self.last, self._wait_then = now, self.wait

    def cpu_busy(self) -> float | None:
        if self.cpu is None:
            return None
        from anydevice.hardware.backends.cpu import busy_seconds

        wall = time.perf_counter() - self.cpu[0]
        return max(0.0, (busy_seconds(self.cores) - self.cpu[1]) / wall) if wall > 0 else None


class DeviceLoader(Generic[T]):
    """Wrap any iterable of batches so each batch arrives on ``device``.

    ``len()``, re-iteration once per epoch and ``set_epoch`` work as on the source, and any
    other attribute is the source's (``loader.dataset``, ``loader.sampler``). On CUDA,
    XPU and any accelerator with streams the next batch is pinned off the main thread and
    copied on a copy stream while the current one computes (see the module docstring for
    why that is safe); elsewhere the next batch is fetched ahead and moved with
    :func:`anydevice.to` (on XLA, ending each step as torch_xla's ``MpDeviceLoader`` does).

    With a copy stream, a batch is ready for the stream that is current when the loop asks
    for it (``with torch.cuda.stream(s): for batch in loader: ...`` works): read it on that
    stream, or order any other stream after it and ``record_stream`` there, as for any
    tensor made on one stream and used on another.

    >>> import torch, anydevice as ad
    >>> loader = ad.DeviceLoader([torch.zeros(2), torch.ones(2)], "cpu")
    >>> [b.sum().item() for b in loader], len(loader)
    ([0.0, 2.0], 2)

    Args:
        loader: a DataLoader or any iterable of batches (tensors, nested containers,
            dataclasses, objects with ``.to``).
        device: any device spec; resolved once, here.
        transform: called on each batch after it reached the device (on the copy stream where
            there is one), e.g. ``lambda b: (b[0].float() / 255, b[1])``: send uint8, get float.
        prefetch: fetch the next batch in a background thread. ``"auto"``: on
            accelerators, where the thread pins batches and overlaps their copy with
            compute; not on the CPU, where there is no copy to hide and the thread only
            competes with the step for the GIL (measured: 13 % slower on a small step).
            Pass False when the source must be read from the calling thread (e.g. it
            holds a sqlite3 connection): with a copy stream, each batch is then pinned on
            that thread and its copy queued, so ``next()`` does not wait for the device
            (no overlap of copy and compute, though). True to prefetch on the CPU anyway.
        depth: how many host batches the background thread may hold ready.

    Attributes:
        stats: :class:`LoaderStats` of the current (or last) pass.
    """

    def __init__(
        self,
        loader: Iterable[T],
        device: DeviceLike = "auto",
        transform: Callable[[Any], Any] | None = None,
        prefetch: bool | Literal["auto"] = "auto",
        *,
        depth: int = 2,
    ) -> None:
        if not hasattr(loader, "__iter__") and not hasattr(loader, "__getitem__"):
            raise TypeError(
                f"DeviceLoader's loader must be an iterable of batches (a DataLoader, a list "
                f"of tensors, a generator), not {type(loader).__name__} ({loader!r}); pass "
                "the loader first, then the device: ad.DeviceLoader(loader, device)"
            )
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        check_loader_workers(loader)  # a notebook's dataset under spawned workers: say so now
        self.loader = loader
        self.device = resolve(device)
        self.transform = transform
        if prefetch not in (True, False, "auto"):
            raise ValueError(f"prefetch must be True, False or 'auto', not {prefetch!r}")
        on_host = runtime(self.device.type).is_host  # nothing to copy: no thread to hide it
        self.prefetch: bool = not on_host if prefetch == "auto" else bool(prefetch)
        self.depth = depth
        self._counters = _Counters()
        self._epoch = 0  #: the epoch the next pass uses while the epoch is automatic
        self._epoch_is_users = False  #: set by the user (here or on the sampler): never advanced
        self._epoch_left: int | None = None  #: the sampler's epoch as this loader left it
        self._marks = False  #: the sampler keeps the _LoaderEpoch it is given
        self._active: _Pass | None = None
        self._resume: dict[str, Any] | None = None  #: load_state_dict's, for the next pass

    # ------------------------------------------------------------------ source-like API

    def __len__(self) -> int:
        try:
            n = len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"the wrapped {type(self.loader).__name__} has no len(); DeviceLoader can only "
                "report the length of a source that has one"
            ) from None
        # a resumed pass, pending or running: the batches it has left
        run = self._active
        if self._resume is not None:
            return max(0, n - int(self._resume["position"]))
        return max(0, n - run.skipped) if run is not None and not run.done else n

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: the epoch of the pass under way (or of the next), the
        batches handed out in it, whether the epoch is the user's, what the pass's order is
        drawn from (a sampler generator's state, or the seed a generator-less
        ``RandomSampler`` drew) and the loader's batch size, ranks and dataset size. Saved by
        ``ad.save_state(..., loader=loader)``; :meth:`load_state_dict` resumes there (see
        :mod:`anydevice.feeding.resume`)."""
        run = self._active
        if run is not None:  # under way, its last batch handed out included
            epoch, position, order = run.epoch, run.skipped + run.counters.batches, run.order
            drawn = order.drawn()
        else:
            epoch, position = self._epoch, 0
            if self._epoch_is_users:  # loader.sampler.set_epoch(e) leaves self._epoch behind
                now = self._sampler_epoch()
                epoch = self._epoch if now is None else int(now)
            drawn = order_between_passes(self.loader)
        return {
            "epoch": int(epoch),
            "epoch_is_users": self._epoch_is_users,
            "position": position,
            **drawn,
            **shape_of(self.loader),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where :meth:`state_dict` was taken: the next pass runs that epoch from the
        batch after the last one handed out, in the same order (see
        :mod:`anydevice.feeding.resume` for which samplers keep it), and ``len()`` counts the
        batches left until that pass ends. The sampler's epoch is set now, also an epoch
        the loader had advanced by itself, and goes on advancing after each complete pass.

        Raises:
            ArgumentError: ``state`` is not a DeviceLoader state (what is wrong with it),
                or one this loader cannot resume exactly: saved with another sampler,
                dataset size, or a batch size and number of ranks that do not split the
                samples seen into whole batches here, or a position past the epoch's end.
        """
        checked = check_state(state, self.loader)
        if checked["position"]:
            warn_if_unrepeatable(self.loader)
        epoch = checked["epoch"]
        if checked["epoch_is_users"]:
            self.set_epoch(epoch)
        else:  # the loader's, as saved: the sampler gets it now and it advances from there
            self._epoch_is_users = False
            self._epoch = epoch
            self._set_sampler_epoch(_LoaderEpoch(epoch))
            self._epoch_left = epoch
            self._marks = type(self._sampler_epoch()) is _LoaderEpoch
        self._resume = checked

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch`` to the source's sampler (e.g. a DistributedSampler), now.

        The epoch is then yours, as with torch's sampler: every pass uses the epoch you set
        last, here or with ``loader.sampler.set_epoch``. Where you never set one, each
        complete pass advances it by one, so a DistributedSampler reshuffles every epoch
        (it repeats one order otherwise); a pass you leave early (a ``break``, a peek with
        ``next(iter(loader))``, an error) does not.
        """
        self._epoch_is_users = True
        self._epoch = epoch
        self._set_sampler_epoch(epoch)

    def _epoch_targets(self) -> list[Any]:
        """The source and its samplers that take ``set_epoch``, each once."""
        targets = [self.loader, getattr(self.loader, "sampler", None)]
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        targets += [batch_sampler, getattr(batch_sampler, "sampler", None)]
        out: list[Any] = []
        for t in targets:
            takes_epoch = t is not None and callable(getattr(t, "set_epoch", None))
            if takes_epoch and t is not self and all(t is not seen for seen in out):
                out.append(t)
        return out

    def _set_sampler_epoch(self, epoch: int) -> None:
        for t in self._epoch_targets():
            t.set_epoch(epoch)

    def _sampler_epoch(self) -> int | None:
        """The epoch the sampler holds now (torch's samplers keep it in ``.epoch``)."""
        for t in self._epoch_targets():
            epoch = getattr(t, "epoch", None)
            if isinstance(epoch, int):
                return epoch
        return None

    def _begin_epoch(self) -> None:
        """Before a pass: keep the user's epoch, or set the automatic one."""
        if self._epoch_is_users:
            return
        now = self._sampler_epoch()
        if now is not None:
            if self._marks:
                # The sampler holds the _LoaderEpoch this loader set, unless someone
                # called its set_epoch since (with any value, the same one included).
                if self._epoch_left is not None and type(now) is not _LoaderEpoch:
                    self._epoch_is_users = True
                    return
            else:
                left = self._epoch if self._epoch_left is None else self._epoch_left
                if now != left:
                    self._epoch_is_users = True  # loader.sampler.set_epoch(e): theirs
                    return
        self._set_sampler_epoch(_LoaderEpoch(self._epoch))
        self._epoch_left = self._epoch
        self._marks = type(self._sampler_epoch()) is _LoaderEpoch

    def _end_epoch(self) -> None:
        """After a complete pass: advance the automatic epoch. The sampler keeps the epoch
        just run, as torch's does; the next pass sets the new one. A sampler that turns the
        epoch into a plain ``int`` cannot show whether the user set it since: it is then
        advanced at once, so that a later ``sampler.set_epoch`` to any other epoch is seen
        as the user's."""
        if self._epoch_is_users:
            return
        self._epoch += 1
        if not self._marks:
            self._set_sampler_epoch(self._epoch)
            self._epoch_left = self._epoch

    @property
    def stats(self) -> LoaderStats:
        c = self._counters
        if c.times is not None:
            c.times.collect(block=True)
        total = (c.last - c.start) if c.start is not None else 0.0
        spread = c.shares.spread()
        from anydevice.hardware.backends.cpu import usable_cores

        return LoaderStats(
            batches=c.batches,
            bytes_moved=c.bytes_moved,
            wait_seconds=c.wait,
            total_seconds=total,
            copy_seconds=c.times.seconds if c.times is not None else None,
            device=str(self.device),
            num_workers=getattr(self.loader, "num_workers", None),
            pinned=c.pinned,
            aborted=c.aborted,
            steady=c.shares.share(),
            wait_low=spread[0] if spread else None,
            wait_high=spread[1] if spread else None,
            cores=usable_cores(),
            cpu_busy=c.cpu_busy(),
        )

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        if self._active is not None:
            self._active.close()  # a new pass ends the previous one
        self._begin_epoch()
        resume, self._resume = self._resume, None
        now = self._sampler_epoch()
        epoch = self._epoch if now is None else int(now)
        if resume is not None and resume["position"] and epoch != resume["epoch"]:
            warnings.warn(
                f"this pass runs epoch {epoch}, but the loader state loaded was saved at "
                f"batch {resume['position']} of epoch {resume['epoch']}: its first "
                f"{resume['position']} batches are skipped in epoch {epoch}'s order, which "
                f"repeats and skips samples. Set the saved epoch (loader.set_epoch("
                f"{resume['epoch']})) before the resumed pass, or none at all.",
                stacklevel=2,
            )
        order = PassOrder(self.loader, resume)  # no batch loaded for what was seen
        try:
            run = _Pass(self, order, epoch)
        except BaseException:
            order.close()
            raise
        self._counters = run.counters
        self._active = run
        try:
            while True:
                try:
                    batch = run.next()
                except BaseException as e:
                    run.counters.aborted = _describe(e)
                    raise
                if batch is _END:
                    self._end_epoch()
                    return
                pulse.tick("batch", self.device)  # this process's heartbeat: anydevice top
                yield batch
        finally:
            run.close()
            if self._active is run:
                self._active = None

    def __getattr__(self, name: str) -> Any:
        # Anything DeviceLoader does not define is the source's: ``loader.dataset``,
        # ``loader.sampler``, ``loader.batch_size`` read as on the DataLoader it wraps.
        source = self.__dict__.get("loader")
        if name.startswith("__") or source is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(source, name)

    def __repr__(self) -> str:
        return (
            f"DeviceLoader({type(self.loader).__name__}, device={str(self.device)!r}, "
            f"prefetch={self.prefetch})"
        )


def _describe(e: BaseException) -> str:
    """``"ValueError: bad sample"``, cut to one short line."""
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    text = text.splitlines()[0] if text else type(e).__name__
    return text if len(text) <= 120 else text[:117] + "..."


_END: Any = object()  # end of the source
_ERROR = object()  # the producer raised


class _Producer:
    """A thread that takes batches from the source and, where copies are asynchronous,
    pins them."""

    def __init__(self, source: Iterator[Any], copier: Copier | None, depth: int):
        self.source = source
        self.copier = copier
        self.queue: queue.Queue[tuple[object, Any, int, bool | None]] = queue.Queue(depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="anydevice-prefetch", daemon=True)
        self.thread.start()

    def _put(self, item: tuple[object, Any, int, bool | None]) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        last: tuple[object, Any, int, bool | None] | None = (_END, None, 0, None)
        try:
            copier = self.copier
            if copier is not None:
                copier.set_device()  # else pinning makes a context on device 0
            for batch in self.source:
                if self.stop.is_set():
                    last = None
                    break
                nbytes, pinned = 0, None
                if copier is not None:
                    batch, nbytes, pinned = pin_leaves(batch, copier.device, copier.pin)
                if not self._put((batch, None, nbytes, pinned)):
                    last = None
                    break
        except BaseException as e:  # handed to the consumer, which raises it there
            last = (_ERROR, e, 0, None)
        # The workers end here, in the thread that iterated their DataLoader, before the
        # consumer hears of the end: a later pass then forks its workers from a process
        # whose earlier iterators are all shut down (a worker that inherits a live one
        # prints "can only test a child process" when it collects it).
        shut_down(self.source)
        self.source = iter(())
        if last is not None:
            self._put(last)

    def get(self) -> tuple[object, Any, int, bool | None]:
        return self.queue.get()

    def get_nowait(self) -> tuple[object, Any, int, bool | None]:
        return self.queue.get_nowait()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and wait until it has ended and released the source.

        A DataLoader with worker processes always answers (a batch, or an error within
        seconds of a worker's death), so its producer is waited for however long the
        machine's load makes that: it must not outlive the pass holding the workers. That
        holds when a worker died too: the consumer hears of it at once, from torch's
        SIGCHLD handler, while the producer is still inside ``next()``; it learns of it at
        torch's next status check (within 5 s) and then ends the other workers and their
        queues' threads, so when the error reaches the loop nothing of the pass is left.
        Another source's ``next()`` may wait for the consumer itself (a feedback loop):
        that wait is bounded by ``timeout``, after which the daemon thread ends once the
        source answers.
        """
        self.stop.set()
        bounded = torch_private.loader_workers(self.source)[0] is None  # no workers
        deadline = time.monotonic() + timeout
        while self.thread.is_alive():
            while True:  # unblock a producer waiting to put
                try:
                    self.queue.get_nowait()
                except queue.Empty:
                    break
            self.thread.join(_POLL)
            if bounded and time.monotonic() >= deadline:
                break
        if self.thread.is_alive():
            logger.warning(
                "the prefetch thread is still inside the source's next() after %.0f s; it "
                "stops when that batch is produced (it is a daemon thread)",
                timeout,
            )


def _has_length(source: Iterable[Any]) -> bool:
    """Whether ``source`` says how many batches it has (a DataLoader over an iterable
    dataset without ``__len__`` raises ``TypeError``: it has none)."""
    try:
        len(source)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def shut_down(source: Iterator[Any]) -> None:
    """End the worker processes of a DataLoader iterator now, unless they are persistent
    (kept for the next epoch by design); no-op for other sources. Only from the thread
    that iterates ``source``, never while another thread is inside its ``next()``."""
    end, persistent = torch_private.loader_workers(source)
    if end is not None and not persistent:
        try:
            end()
        except Exception as e:  # a worker already gone: nothing more to end
            logger.debug("shutting down DataLoader workers: %s", e)


class _Pass:
    """One pass over the source: the producer, the issued-ahead batch, the counters."""

    def __init__(self, owner: DeviceLoader[Any], order: PassOrder, epoch: int) -> None:
        self.owner = owner
        self.order = order  #: what the pass's order is drawn from; skips what was seen
        self.epoch = epoch  #: the sampler's epoch as the pass began
        self.skipped = order.position  #: batches of this epoch handed out before a resume
        self.device = owner.device
        # CUDA's streams, or torch.Stream's (XPU, ...); None: moves are synchronous. Its
        # copy stream is one per device for the whole process, never per loader or pass:
        # each stream has its own allocator pool.
        self.copier = copier_for(self.device)
        if self.copier is not None:
            self.device = self.copier.device  # with its index: compared with tensors' below
        self.backend = runtime(self.device.type)
        self.lazy = self.backend.lazy  # XLA: each step ends with a graph cut
        self.counters = _Counters(None if self.copier is None else self.copier.times)
        self.ready: tuple[Any, BatchEvents | None] | None = None  # (batch on device, its events)
        self.done = False
        self.error: BaseException | None = None  # raised by the source after batch k was issued
        self.source: Iterator[Any] = order.iterator()  # on the main thread (DataLoader wants it)
        if order.by_hand:  # a resumed pass over a source that cannot skip at its sampler
            self._skip_by_hand(order.by_hand)
        self.producer: _Producer | None = None
        if owner.prefetch:
            self.producer = _Producer(self.source, self.copier, owner.depth)
        # A source with a length (a list, a map-style DataLoader) makes batch k+1 whatever
        # the consumer does: handing out batch k may wait for it, so its copy always
        # overlaps step k. Any other iterator may make it only after the step (a feedback
        # loop): batch k+1 is then issued only if it is already there.
        self.lookahead_waits = self.producer is not None and _has_length(owner.loader)

    def _skip_by_hand(self, n: int) -> None:
        try:
            read = sum(1 for _ in itertools.islice(self.source, n))
        except BaseException:
            shut_down(self.source)
            raise
        if read < n:
            shut_down(self.source)
            raise ArgumentError(
                f"the loader state loaded resumes at batch {n} of epoch {self.epoch}, but "
                f"this {type(self.owner.loader).__name__} ended after {read} batches: "
                "resuming would skip every sample. Resume with the source as saved, or "
                "start the epoch over (load the state with position 0)."
            )

    # -- fetching on the host

    def _fetch(self, block: bool) -> tuple[Any, int, bool | None] | None:
        """The next host batch (or _END), with its byte count and whether it came pinned;
        None when ``block`` is False and no batch is ready: the source has not made it
        yet (it may be waiting for the consumer), or there is no thread to make it."""
        if not block:
            if self.producer is None:
                return None  # reading the source here could block the consumer
            try:
                batch, error, nbytes, pinned = self.producer.get_nowait()
            except queue.Empty:
                return None
            if batch is _ERROR:
                raise error
            return batch, nbytes, pinned
        c = self.counters
        t0 = time.perf_counter()
        if c.start is None:
            c.begin(t0)
        try:
            if self.producer is not None:
                batch, error, nbytes, pinned = self.producer.get()
                if batch is _ERROR:
                    raise error
                return batch, nbytes, pinned
            try:
                batch = next(self.source)
            except StopIteration:
                return _END, 0, None
            if self.copier is not None:
                # Pinned here, on the calling thread: a copy from pageable memory makes the
                # host wait until it has landed, so until the compute queued before it too
                # (the copy stream waits for it). The pin is the host-side copy the driver
                # would make into its staging buffer anyway; after it the copy is queued and
                # this returns without waiting for the device. The pinned buffer is the
                # allocator's (CUDA's caches it) and lives until the copy has read it.
                return pin_leaves(batch, self.copier.device, self.copier.pin)
            return batch, 0, None
        finally:
            c.wait += time.perf_counter() - t0

    # -- issuing on the device

    def _issue(self, block: bool = True) -> None:
        """Fetch the next host batch and start moving it; set ``self.ready``. Not
        ``block``-ing: only a batch the producer already holds (else ``ready`` stays None)."""
        fetched = self._fetch(block)
        if fetched is None:
            return
        batch, nbytes, pinned = fetched
        if batch is _END:
            self.ready = None
            self.done = True
            return
        c = self.counters
        c.bytes_moved += nbytes
        if pinned is not None:
            c.pinned = pinned if c.pinned is None else (c.pinned and pinned)
        copier = self.copier
        if copier is None:
            moved = to(batch, self.device)
            if self.owner.transform is not None:
                moved = self.owner.transform(moved)
            if not self.backend.is_host and nbytes == 0:
                c.bytes_moved += nbytes_off(batch, self.device)
            self.ready = (moved, None)
            return
        stream = copier.stream
        slot = copier.slot()
        # Memory the consumer freed on its home streams may be reused below: only after
        # what is queued there now (its last reads).
        copier.wait_for_homes()
        try:
            with copier.enter(stream):
                if slot.start is not None:
                    slot.start.record(stream)
                moved = to(batch, self.device, non_blocking=True)
                if self.owner.transform is not None:
                    moved = self.owner.transform(moved)
                slot.end.record(stream)
        except BaseException:
            copier.discard(slot)  # its events order and time nothing
            raise
        self.ready = (moved, slot)

    def _hand_out(self, batch: Any, slot: BatchEvents) -> None:
        """Order the consumer's stream (the current one) after the batch's copy, keep its
        memory for that stream, and release the event pair for reuse."""
        copier = self.copier
        assert copier is not None  # a slot is only made with a copier
        consumer = copier.current()
        consumer.wait_event(slot.end)
        if consumer != copier.home:
            copier.keep(batch, consumer)
        copier.handed_out(slot)

    def next(self) -> Any:
        if self.error is not None:
            error, self.error = self.error, None
            self.done = True
            raise error
        if self.ready is None and not self.done:
            self._issue()  # first call: batch 0
        if self.ready is None:
            self.counters.last = time.perf_counter()
            return _END
        batch, slot = self.ready
        self.ready = None
        if slot is not None:
            self._hand_out(batch, slot)  # before batch k+1 is issued: see the module docstring
        elif self.lazy and self.counters.batches:
            self.backend.end_step()  # the previous batch's step ends here, as MpDeviceLoader's
        try:
            # Batch k+1 starts moving while batch k computes. A source without a length may
            # make it only after the consumer used batch k (a feedback loop): then this
            # never waits, and the next call fetches it.
            self._issue(block=self.lookahead_waits)
        except Exception as e:  # the source failed on batch k+1: deliver k, raise next time
            self.error = e
        self.counters.handed_out(time.perf_counter())
        return batch

    def close(self) -> None:
        try:
            if self.producer is not None:
                self.producer.close()
                if not self.producer.thread.is_alive():
                    shut_down(self.source)  # done by the producer; again costs nothing
                self.producer = None
            else:
                shut_down(self.source)  # this thread iterated it
            self.source = iter(())  # release the source iterator (a DataLoader's: its workers)
            self.ready = None
            self.done = True
        finally:
            self.order.close()  # once nothing reads the sampler any more
