"""What DeviceLoader pins, and when it may reuse a copy's events — decided on the CPU.

Pinning itself needs an accelerator (this torch raises without one), so the leaf selection
is driven with a pin function that records what it was given; the real pinning of the
same walk is checked on a GPU in test_loader_cuda.py. The event bookkeeping is driven with
plain objects that have the three methods it calls.
"""

from __future__ import annotations

import random
from collections import UserDict, namedtuple
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from anydevice.feeding.transfer import CopyTimes, buffers_of, nbytes_off, pin_leaves

CUDA0 = torch.device("cuda", 0)  # only compared with, never touched


class Recorder:
    """A pin function that returns a copy and remembers which tensors it was given."""

    def __init__(self) -> None:
        self.given: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.given.append(t)
        return t.clone()


@dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    meta: dict = field(default_factory=dict)


Pair = namedtuple("Pair", ["a", "b"])


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_dense_cpu_leaves_are_pinned_everywhere_in_a_mixed_batch():
    on_device = torch.ones(2, device="meta")  # a tensor already on a device, as CUDA ones are
    shared = torch.ones(3)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,))
    batch = {
        "sample": Sample(torch.zeros(2, 2), torch.tensor([1]), {"id": "a", "mask": torch.ones(4)}),
        "pair": Pair(shared, [shared, on_device]),
        "device": on_device,
        "sparse": sparse,
        "text": "hello",
        "n": 3,
    }
    pin = Recorder()
    out, nbytes, already = pin_leaves(batch, CUDA0, pin)

    cpu_dense = [batch["sample"].image, batch["sample"].label, batch["sample"].meta["mask"], shared]
    assert [id(t) for t in pin.given] == [id(t) for t in cpu_dense]  # each once, in order
    assert isinstance(out["sample"], Sample)
    assert out["sample"].image is not batch["sample"].image  # the dataclass's tensors too
    assert torch.equal(out["sample"].image, batch["sample"].image)
    assert out["sample"].meta["id"] == "a"
    assert out["pair"].a is out["pair"].b[0]  # shared before, shared after
    assert out["pair"].b[1] is on_device and out["device"] is on_device  # left as they are
    assert out["sparse"] is sparse  # only dense tensors are pinned
    assert (out["text"], out["n"]) == ("hello", 3)
    expected = sum(t.numel() * t.element_size() for t in cpu_dense)
    expected += 2 * 8 + 2 * 4  # the sparse tensor's indices and values cross the bus too
    assert nbytes == expected
    assert already is False
    assert batch["sample"].image.data_ptr() != out["sample"].image.data_ptr()


def test_a_batch_without_cpu_tensors_is_left_alone_and_counts_as_pinned():
    batch = [torch.ones(2, device="meta"), "x"]
    pin = Recorder()
    out, nbytes, already = pin_leaves(batch, CUDA0, pin)
    assert out[0] is batch[0] and pin.given == []
    assert (nbytes, already) == (0, True)


class Pinnable:
    """A custom batch type with its own pin_memory, as the DataLoader's rule allows."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.pinned = False

    def pin_memory(self) -> Pinnable:
        out = Pinnable(self.x)
        out.pinned = True
        return out


class Movable:
    """A custom type with its own .to (anydevice.to calls it)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: torch.device) -> Movable:
        return Movable(self.x.to(device))


class Encoding(UserDict):
    """A mapping with its own .to, as a tokenizer's BatchEncoding is."""

    def to(self, device: torch.device, non_blocking: bool = False) -> Encoding:
        return Encoding({k: v.to(device, non_blocking=non_blocking) for k, v in self.items()})


def test_a_mapping_with_its_own_to_still_has_its_tensors_pinned():
    enc = Encoding({"input_ids": torch.ones(2, 3, dtype=torch.int64)})
    enc.extra = "kept"
    pin = Recorder()
    out, nbytes, _ = pin_leaves(enc, CUDA0, pin)
    assert type(out) is Encoding and out.extra == "kept"
    assert pin.given == [enc["input_ids"]] and out["input_ids"] is not enc["input_ids"]
    assert nbytes == 6 * 8


def test_modules_and_objects_with_their_own_to_are_not_walked_into():
    model = nn.Linear(2, 2)
    batch = {"model": model, "custom": Movable(torch.ones(1)), "pinnable": Pinnable(torch.ones(1))}
    pin = Recorder()
    out, _, _ = pin_leaves(batch, CUDA0, pin)
    assert out["model"] is model and out["custom"] is batch["custom"]
    assert out["pinnable"].pinned
    assert pin.given == []


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_buffers_of_a_sparse_tensor_are_its_parts():
    i = torch.tensor([[0, 1], [1, 0]])
    coo = torch.sparse_coo_tensor(i, torch.tensor([3.0, 4.0]), (2, 2)).coalesce()
    csr = coo.to_sparse_csr()
    dense = torch.ones(3)
    assert buffers_of(dense) == (dense,)
    assert [b.data_ptr() for b in buffers_of(coo)] == [
        coo._indices().data_ptr(),
        coo._values().data_ptr(),
    ]
    parts = buffers_of(csr)
    assert [p.layout for p in parts] == [torch.strided] * 3
    assert {p.data_ptr() for p in parts} == {
        csr.crow_indices().data_ptr(),
        csr.col_indices().data_ptr(),
        csr.values().data_ptr(),
    }
    assert nbytes_off({"a": coo, "b": dense}, CUDA0) == 4 * 8 + 2 * 4 + 3 * 4
    assert nbytes_off({"a": coo, "b": dense}, torch.device("cpu")) == 0


# ----------------------------------------------------------------------------- events


class Event:
    """Three methods, as CopyTimes uses them; ``done`` is set by the test (the 'GPU')."""

    made = 0

    def __init__(self) -> None:
        Event.made += 1
        self.done = False
        self.at = 0.0  # ms

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True  # waiting for an event ends with it complete

    def elapsed_time(self, end: Event) -> float:
        # torch raises for an event not yet complete; the start precedes the end on the
        # copy stream, so the end's completion is the start's too.
        assert end.done, "elapsed_time of an event not yet complete"
        return end.at - self.at


def finish(slot, ms: float) -> None:
    slot.start.done = slot.end.done = True
    slot.end.at = slot.start.at + ms


def test_a_finished_copy_whose_batch_was_not_handed_out_keeps_its_events():
    # The lost-overlap bug: copy k finished before the consumer's wait on it was issued,
    # its pair was recycled for copy k+1, and the consumer then waited for copy k+1.
    times = CopyTimes(Event)
    k = times.take()
    finish(k, 2.0)
    k1 = times.take()  # batch k+1 issued while batch k is still to be handed out
    assert k1 is not k
    assert {id(k1.start), id(k1.end)}.isdisjoint({id(k.start), id(k.end)})
    assert times.seconds == pytest.approx(0.002)  # its time is read all the same


def test_a_handed_out_batch_whose_copy_is_running_keeps_its_events():
    times = CopyTimes(Event)
    k = times.take()
    times.handed_out(k)
    assert times.take() is not k  # still running: its elapsed time cannot be read yet
    finish(k, 1.0)
    times.handed_out(times.pending[-1])
    assert times.take() is k  # now both: waited on and finished
    assert times.seconds == pytest.approx(0.001)


def test_a_discarded_pair_is_never_timed_nor_reused():
    times = CopyTimes(Event)
    slot = times.take()  # the move then raised before the events were recorded
    times.discard(slot)
    times.collect(block=True)
    assert times.pending == [] and times.free == [] and times.seconds == 0.0
    assert times.take() is not slot


def test_blocking_collection_times_everything_and_frees_only_what_was_handed_out():
    times = CopyTimes(Event)
    a, b = times.take(), times.take()
    times.handed_out(a)
    times.collect(block=True)  # as reading loader.stats does
    assert times.free == [a] and times.pending == [b]
    assert a.end.done and b.end.done
    times.collect(block=True)
    assert times.free == [a]  # b's time is not added twice, and b stays pending
    assert times.seconds == pytest.approx(0.0)


def test_without_reuse_every_copy_gets_new_events_and_finished_ones_are_dropped():
    # Backends whose wait reads the event late (OpenReg) could deadlock on a re-record.
    times = CopyTimes(Event, reuse=False)
    a = times.take()
    finish(a, 3.0)
    times.handed_out(a)
    b = times.take()  # a is finished and handed out: CUDA's CopyTimes would hand it back
    assert b is not a and {id(b.start), id(b.end)}.isdisjoint({id(a.start), id(a.end)})
    times.collect(block=True)
    assert times.free == [] and times.pending == [b]
    assert times.seconds == pytest.approx(0.003)


def record(slot) -> None:
    """What the loader does with a pair it took: record both events anew (not complete)."""
    for e in (slot.start, slot.end):
        e.done, e.at = False, 0.0


def test_no_event_is_reused_while_still_to_be_waited_on_or_running():
    # Copies finish at random moments, and the next pair is taken sometimes after the
    # current batch was handed out (the loader's order) and sometimes before (the order
    # that lost the overlap). Either way a pair is taken again only once it is both.
    rng = random.Random(0)
    Event.made = 0
    times = CopyTimes(Event)
    ready = times.take()  # batch 0
    record(ready)
    finished = 0
    for _ in range(500):
        for slot in times.pending:
            if not slot.end.done and rng.random() < 0.5:
                finish(slot, 1.0)
                finished += 1
        hand_out_first = rng.random() < 0.5
        if hand_out_first:
            times.handed_out(ready)
        in_flight = [s for s in times.pending if not (s.handed_out and s.end.done)]
        nxt = times.take()
        assert all(nxt is not s for s in in_flight)
        assert not nxt.handed_out and not nxt.timed
        record(nxt)
        if not hand_out_first:
            times.handed_out(ready)
        ready = nxt
    times.collect(block=True)
    assert times.seconds == pytest.approx(finished / 1000)  # each copy timed exactly once
    assert Event.made <= 2 * 10  # pairs are reused: a few in flight, not one per batch
