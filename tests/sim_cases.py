"""Cases run on the simulated accelerator (``anydevice.testing``), in a process of their own.

torch holds one privateuse1 backend per process, and the simulator is one, so
``tests/test_testing.py`` runs this file in a child pytest; nothing is registered when
this file is imported (the main pytest imports it for its doctests).

The hazard cases write each classic ordering bug with plain torch and assert that the
simulator shows it (poisoned or stale values), then write the fix and assert it is right.
The anydevice cases run the same traffic through ``DeviceLoader``, ``side_stream``,
``ad.to`` and the timers, and assert the values are right with no extra wait.

Copies are made slow (a slow link, megabytes) and compute is simulated device time
(``busy``), so that a read that does not wait comes long before the data lands.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

NAME = os.environ.get("ANYDEVICE_SIM_NAME", "sim")
N = 2**20  # floats: 4 MiB, 0.4 s over the test link below
SLOW = "10MB/s"


def dev() -> torch.device:
    return torch.device(NAME, 0)


@pytest.fixture(scope="session", autouse=True)
def sim() -> torch.device:
    """Enables the simulator, for good: only in the child process, never on import."""
    from anydevice.errors import ExtensionError
    from anydevice.testing import SimulatorError, enable

    try:  # benchmarks/bench_races.py runs these with the detector off, then on
        return enable(NAME, bandwidth="2GB/s", races=os.environ.get("ANYDEVICE_SIM_RACES", "raise"))
    except (ExtensionError, SimulatorError) as e:
        pytest.skip(f"the simulated accelerator is not available here: {e}")


def _warm() -> None:
    """The host's first operator on the device imports torch._dynamo (torch's Python meta
    kernels are wrapped to disable it): two seconds, longer than a slow copy takes to land,
    so a test's read that should come too early would come late."""
    (torch.ones(1, device=dev()) * 1).cpu()


@pytest.fixture
def slow_link() -> Iterator[None]:
    """A link slow enough that a read that does not wait lands long before the data."""
    from anydevice import testing

    _warm()
    testing.set_bandwidth(SLOW)
    try:
        yield
    finally:
        torch.accelerator.synchronize()
        testing.set_bandwidth("2GB/s")


def pinned(value: float, n: int = N) -> torch.Tensor:
    return torch.full((n,), value).pin_memory()


def _line_of(text: str) -> int:
    """The line of this file that holds ``text`` (once)."""
    with open(__file__) as f:
        (line,) = [i for i, got in enumerate(f, start=1) if text in got and f'"{text}' not in got]
    return line


# --- the device itself ---------------------------------------------------------------


def test_memory_starts_poisoned() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert torch.isnan(torch.empty(8, dtype=dtype, device=dev()).cpu()).all(), dtype
    assert (torch.empty(8, dtype=torch.int32, device=dev()).cpu() == -1).all()
    assert torch.empty(8, dtype=torch.bool, device=dev()).cpu().all()


def test_kernels_give_the_cpus_results() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    w = torch.randn(4, 8)
    on = torch.nn.functional.linear(x.to(dev()), w.to(dev())).softmax(-1)
    assert on.device == dev()
    assert torch.allclose(on.cpu(), torch.nn.functional.linear(x, w).softmax(-1))
    v = x.to(dev())
    assert torch.equal(v.t().contiguous().cpu(), x.t().contiguous())
    assert torch.equal(v[2:5, ::3].cpu(), x[2:5, ::3])
    assert torch.equal(torch.cat([v, v]).cpu(), torch.cat([x, x]))
    assert v.sum().item() == pytest.approx(x.sum().item(), rel=1e-5)
    out = torch.empty(0, device=dev())
    torch.add(v, 1, out=out)  # an out= kernel that resizes its output
    assert torch.equal(out.cpu(), x + 1)


def test_pinned_memory_and_the_tensor_methods() -> None:
    assert pinned(1.0, 4).is_pinned() and not torch.ones(4).is_pinned()
    t = torch.ones(3)
    moved = getattr(t, NAME)()  # Tensor.sim(), made by torch for the backend
    assert moved.device == dev() and getattr(moved, f"is_{NAME}")


def test_a_pinned_non_blocking_copy_returns_before_it_lands(slow_link: None) -> None:
    src = pinned(5.0)
    stream = torch.accelerator.current_stream()
    x = src.to(dev(), non_blocking=True)
    assert not stream.query(), "queued, not done: the host did not wait"
    stream.synchronize()
    assert stream.query()
    assert (x.cpu() == 5.0).all()


def test_a_pageable_copy_stages_its_source_and_a_blocking_copy_lands_first(
    slow_link: None,
) -> None:
    from anydevice import testing

    stream = torch.accelerator.current_stream()
    src = torch.full((N,), 4.0)
    x = src.to(dev(), non_blocking=True)  # pageable: staged, as CUDA's driver does
    src.fill_(0.0)  # so the caller may reuse its buffer at once
    testing.busy(1.0)  # keeps the stream busy: the copy above was queued, not waited for
    assert not stream.query()
    y = src.to(dev())  # blocking: returns once it has landed, after the busy time
    assert stream.query()
    assert (x.cpu() == 4.0).all() and (y.cpu() == 0.0).all()


def test_events_time_the_workers_clock_and_queue_waits() -> None:
    from anydevice import testing

    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    testing.busy(0.2)  # long enough that the host asks before the worker is through
    end.record()
    assert not end.query()
    end.synchronize()
    assert end.query()
    assert start.elapsed_time(end) >= 200.0  # a sleep lasts at least as long as asked

    side = torch.Stream(dev())
    with side:
        testing.busy(0.05)
        done_on_side = torch.Event()
        done_on_side.record()
    main = torch.accelerator.current_stream()
    main.wait_event(done_on_side)  # queued: the host goes on
    after = torch.Event()
    after.record()
    after.synchronize()
    assert done_on_side.query(), "the main stream waited for the side stream's event"


def test_the_link_takes_bytes_over_bandwidth() -> None:
    from anydevice import testing

    src = pinned(1.0)
    with testing.trace() as spans:
        x = src.to(dev(), non_blocking=True)
        x.to("cpu")
        torch.accelerator.synchronize()
    h2d, d2h = (s for s in spans if s.what in ("h2d", "d2h"))
    assert (h2d.what, d2h.what) == ("h2d", "d2h") and h2d.bytes == d2h.bytes == 4 * N
    assert h2d.end - h2d.start >= 4 * N / 2e9 * 0.99
    assert d2h.start >= h2d.end  # ordered on one stream


def test_counters_cache_as_a_gpus_and_the_capacity_counts_reserved_memory() -> None:
    from anydevice import testing

    gc.collect()  # earlier tests' tensors in reference cycles: freed now, not mid-test
    torch.accelerator.synchronize()
    torch.accelerator.empty_cache()
    before = torch.accelerator.memory_allocated(0)
    reserved = torch.accelerator.memory_reserved(0)
    torch.accelerator.reset_peak_memory_stats(0)
    x = torch.empty(2**20, device=dev())  # 4 MiB: a 20 MiB segment, as CUDA's allocator
    assert torch.accelerator.memory_allocated(0) == before + 4 * 2**20
    assert torch.accelerator.memory_reserved(0) == reserved + 20 * 2**20
    del x
    assert torch.accelerator.memory_allocated(0) == before
    assert torch.accelerator.memory_reserved(0) == reserved + 20 * 2**20, "cached, not freed"
    assert torch.accelerator.max_memory_allocated(0) == before + 4 * 2**20
    again = torch.empty(2**20, device=dev())
    assert torch.accelerator.memory_reserved(0) == reserved + 20 * 2**20, "the cached block"
    del again
    torch.accelerator.empty_cache()
    assert torch.accelerator.memory_reserved(0) == reserved
    testing.set_capacity(reserved + 4 * 2**20)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
            torch.empty(2**20, device=dev())  # needs a 20 MiB segment
        torch.empty(2**10, device=dev())  # a 2 MiB segment of the small pool: within it
    finally:
        testing.set_capacity(None)


# --- hazards, written with plain torch: the simulator shows each -------------------------


def test_hazard_reading_a_copy_made_on_another_stream_without_waiting(slow_link: None) -> None:
    from anydevice.testing import expect_races

    src = pinned(7.0)
    copier = torch.Stream(dev())
    with copier:
        x = src.to(dev(), non_blocking=True)
    with expect_races() as found:
        bad = (x * 1).cpu()  # the current stream never waited for the copier
    # Read before the copy landed: the poison, or what the reused block held before.
    assert not (bad == 7.0).any()
    assert found[0].kind == "read after write" and found[0].now.line == _line_of("bad = (x * 1)")

    with copier:
        y = src.to(dev(), non_blocking=True)
        copied = torch.Event()
        copied.record()
    torch.accelerator.current_stream().wait_event(copied)  # the fix
    assert ((y * 1).cpu() == 7.0).all()


def test_hazard_reading_a_non_blocking_copy_to_the_host_before_synchronising(
    slow_link: None,
) -> None:
    from anydevice.testing import expect_races

    x = torch.full((N,), 3.0, device=dev())
    out = torch.zeros(N).pin_memory()
    out.copy_(x, non_blocking=True)
    with expect_races() as found:
        stale = bool((out == 0).all())  # read before the copy landed: the old values
    assert stale and found[0].now.stream == "the host"
    torch.accelerator.synchronize()
    assert (out == 3.0).all()

    early = x.to("cpu", non_blocking=True)  # torch gives a pinned buffer: not yet written
    with expect_races():
        poisoned = bool(torch.isnan(early).all())
    assert early.is_pinned() and poisoned
    torch.accelerator.synchronize()
    assert (early == 3.0).all()


def test_hazard_a_side_stream_that_never_waited(slow_link: None) -> None:
    from anydevice.testing import expect_races

    src = pinned(2.0)
    a = src.to(dev(), non_blocking=True)  # queued on the current stream
    side = torch.Stream(dev())
    with side, expect_races() as found:
        b = a * 2  # the side stream did not wait for the current one
    assert len(found) == 1 and found[0].now.line == _line_of("b = a * 2  # the side")
    torch.accelerator.current_stream().wait_stream(side)
    assert torch.isnan(b.cpu()).all()

    a = src.to(dev(), non_blocking=True)
    side.wait_stream(torch.accelerator.current_stream())  # the fix
    with side:
        b = a * 2
    torch.accelerator.current_stream().wait_stream(side)
    assert (b.cpu() == 4.0).all()


def test_hazard_timing_without_synchronising() -> None:
    """Order on one clock (the simulator's spans are on ``time.monotonic``): the host is
    back from the launch before the work ends, and only a sync waits for its end."""
    from anydevice import testing

    with testing.trace() as spans:
        testing.busy(0.3)
        launched = time.monotonic()
        torch.accelerator.synchronize()
        synced = time.monotonic()
    (work,) = [s for s in spans if s.what == "busy"]
    assert launched < work.end, "a host clock without a sync times the launch only"
    assert synced >= work.end


# --- the same traffic through anydevice: right without any extra wait --------------------


def test_device_loader_batches_are_ready_when_yielded(slow_link: None) -> None:
    import anydevice as ad

    batches = [torch.full((N // 4,), float(i)) for i in range(4)]
    loader = ad.DeviceLoader(batches, NAME)
    for i, x in enumerate(loader):
        assert x.device == dev()
        got = (x * 1).cpu()  # a kernel on the consumer's stream, straight away
        assert not torch.isnan(got).any() and (got == float(i)).all(), i


def test_device_loader_copies_the_next_batch_while_this_one_computes() -> None:
    """An ordering fact on the simulator's clock: the copy of batch k+1 starts before the
    compute of batch k ends (the loader overlaps them); no wall-clock threshold. The
    compute is long (0.2 s) next to the copy (20 ms), so a host that a loaded machine
    holds up for a while between two launches still issues the next copy in time."""
    import anydevice as ad
    from anydevice import testing

    testing.set_bandwidth(4 * N / 0.02)  # 20 ms per batch
    try:
        batches = [torch.full((N,), float(i)) for i in range(5)]
        with testing.trace() as spans:
            for x in ad.DeviceLoader(batches, NAME):
                testing.busy(0.2)  # 0.2 s of compute on the consumer's stream
                _ = x * 1
            torch.accelerator.synchronize()
    finally:
        testing.set_bandwidth("2GB/s")
    copies = sorted((s for s in spans if s.what == "h2d"), key=lambda s: s.start)
    computes = sorted((s for s in spans if s.what == "busy"), key=lambda s: s.start)
    assert len(copies) == 5 and len(computes) == 5
    assert all(c.stream != 0 for c in copies), "copies run on a stream of their own"
    overlapped = [copies[k + 1].start < computes[k].end for k in range(4)]
    assert all(overlapped), (overlapped, copies, computes)


def test_device_loader_without_prefetch_hands_out_before_the_compute_ends() -> None:
    """``prefetch=False``: the source is read on the calling thread when the loop asks. A
    pageable batch is pinned there, so its copy is queued and the next batch is in the
    loop's hands while the compute of the last one still runs; a copy from pageable memory
    would make the host wait for that compute and the copy. Ordering on the simulator's
    clock, with compute far longer than the host's work."""
    import anydevice as ad
    from anydevice import testing

    testing.set_bandwidth(N / 0.02)  # 20 ms per batch of N // 4 floats
    batches = [torch.full((N // 4,), float(i)) for i in range(3)]  # pageable
    loader = ad.DeviceLoader(batches, NAME, prefetch=False)
    handed: list[float] = []
    kept: list[torch.Tensor] = []
    try:
        with testing.trace() as spans:
            for x in loader:
                handed.append(time.monotonic())
                testing.busy(0.5)  # compute on the consumer's stream: queued, not run
                kept.append(x)
            torch.accelerator.synchronize()
    finally:
        testing.set_bandwidth("2GB/s")
    computes = sorted((s for s in spans if s.what == "busy"), key=lambda s: s.start)
    copies = [s for s in spans if s.what == "h2d"]
    assert len(computes) == 3 and len(copies) == 3
    early = [handed[k + 1] < computes[k].end for k in range(2)]
    assert early == [True, True], (handed, computes)
    assert [bool((x.cpu() == float(i)).all()) for i, x in enumerate(kept)] == [True] * 3
    assert loader.stats.pinned is False  # what the source delivered: pageable


def test_side_stream_waits_on_entry_and_on_exit(slow_link: None) -> None:
    import anydevice as ad

    src = pinned(2.0)
    a = src.to(dev(), non_blocking=True)  # queued on the current stream
    main = torch.accelerator.current_stream()
    with ad.side_stream(NAME) as s:
        assert s is not None and s != main
        b = a * 2  # entry wait: sees a
        c = src.to(dev(), non_blocking=True)  # queued on the side stream
    # c first: reading b takes the link's time, long enough for c to land anyway.
    assert ((c * 1).cpu() == 2.0).all(), "exit wait: the current stream waited for c"
    assert (b.cpu() == 4.0).all(), "entry wait: the side stream waited for a"


def test_two_threads_in_the_one_side_stream_each_get_their_own_stream_back() -> None:
    # The side stream is cached for the process, so two threads can be inside it at once.
    # torch.Stream's own `with` keeps the stream to restore on the stream object: the
    # second thread's entry overwrote the first's, which then got the second's stream back.
    import threading

    import anydevice as ad
    from anydevice.hardware.backends import runtime

    backend = runtime(dev().type)
    inside, first_out = threading.Barrier(2), threading.Event()
    after: dict[str, object] = {}
    before: dict[str, object] = {}

    def first() -> None:
        before["first"] = torch.accelerator.current_stream(dev())
        with ad.side_stream(dev()):
            inside.wait(timeout=30)
        after["first"] = torch.accelerator.current_stream(dev())
        first_out.set()

    def second() -> None:
        other = backend.new_stream(dev())
        with backend.use_stream(other):
            before["second"] = torch.accelerator.current_stream(dev())
            with ad.side_stream(dev()):
                inside.wait(timeout=30)
                first_out.wait(timeout=30)
            after["second"] = torch.accelerator.current_stream(dev())

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert before["first"] != before["second"]
    assert after == before


def test_to_non_blocking(slow_link: None) -> None:
    import anydevice as ad

    src = {"x": pinned(6.0)}
    moved = ad.to(src, NAME, non_blocking=True)
    assert ((moved["x"] * 1).cpu() == 6.0).all()  # same stream: ordered
    back = ad.to(moved, "cpu")  # "auto": a copy to the host stays blocking
    assert (back["x"] == 6.0).all()


def test_timeit_and_timer_wait_for_the_device() -> None:
    import anydevice as ad
    from anydevice import testing

    timer = ad.Timer(NAME)
    with timer:
        testing.busy(0.05)
    assert timer.elapsed >= 0.05
    result = ad.timeit(testing.busy, 0.01, device=NAME, warmup=1, repeat=3, number=2)
    assert min(result.times) >= 0.01 * 0.99


def test_throughput_reads_the_devices_time() -> None:
    import anydevice as ad
    from anydevice import testing

    meter = ad.Throughput(samples_per_step=8, device=NAME, peak=None)
    for _ in range(4):
        testing.busy(0.02)  # returns at once: a host clock would see ~0 per step
        meter.step()
    stats = meter.compute()
    assert stats.steps == 3 and stats.step_time >= 0.02 * 0.99, stats


# --- each of anydevice's ordering points, removed: the race detector names the line -------
#
# The wrong numbers a missing wait gives depend on timing; the detector's report does not.
# Each case removes one ordering point of anydevice's (a wait, or a host synchronisation)
# and shows that the detector reports the race, naming the line of this file that ran
# into it; the same traffic with the ordering point in place is clean (the cases above).


def _remove(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, text: str, instead: str = "pass"
) -> None:
    """Replace ``owner.name`` by its own source with the one line holding ``text`` taken
    out (or written ``instead``): anydevice's code as it is, less one ordering point."""
    import inspect
    import textwrap

    func = inspect.unwrap(getattr(owner, name))
    source, first = inspect.getsourcelines(func)
    lines = textwrap.dedent("".join(source)).splitlines()
    (i,) = [k for k, line in enumerate(lines) if text in line]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = indent + (lines[i].strip().replace(text, instead) if instead != "pass" else "pass")
    code = "\n" * (first - 1) + "\n".join(lines)  # at its own lines, as tracebacks show it
    namespace: dict[str, object] = {}
    exec(compile(code, inspect.getsourcefile(func) or "?", "exec"), func.__globals__, namespace)
    monkeypatch.setattr(owner, name, namespace[name])


def test_removed_the_loaders_wait_for_the_batchs_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    import anydevice as ad
    from anydevice.feeding import loader
    from anydevice.testing import expect_races

    _remove(monkeypatch, loader._Pass, "_hand_out", "consumer.wait_event(slot.end)")
    batches = [torch.full((N // 4,), float(i)) for i in range(3)]
    with expect_races() as found:
        for x in ad.DeviceLoader(batches, NAME):
            x * 1  # reads the batch: removed wait
    assert found[0].kind == "read after write", found[0]
    assert found[0].now.line == _line_of("x * 1  # reads the batch: removed wait"), found[0]


def test_removed_the_loaders_wait_for_the_streams_that_freed_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import anydevice as ad
    from anydevice.feeding import loader
    from anydevice.testing import expect_races

    _remove(monkeypatch, loader._Pass, "_issue", "copier.wait_for_homes()")
    batches = [torch.full((N // 4,), float(i)) for i in range(6)]
    with expect_races() as found:
        for x in ad.DeviceLoader(batches, NAME):  # batch k+3 reuses batch k's memory
            x * 1
    race = found[0]
    assert race.kind == "write after read" and race.freed is not None, race
    assert race.now.line == _line_of("for x in ad.DeviceLoader(batches, NAME):  # batch k+3"), race


def test_removed_the_side_streams_wait_on_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    from anydevice.feeding import streams
    from anydevice.testing import expect_races

    _remove(monkeypatch, streams, "side_stream", "side.enter_from(current)")
    a = pinned(2.0).to(dev(), non_blocking=True)
    with expect_races() as found, streams.side_stream(NAME):
        a * 2  # on the side stream: removed entry wait
    assert found[0].now.line == _line_of("a * 2  # on the side stream: removed entry wait")


def test_removed_the_side_streams_wait_on_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    from anydevice.feeding import streams
    from anydevice.testing import expect_races

    _remove(monkeypatch, streams, "side_stream", "current.wait_stream(stream)")
    with streams.side_stream(NAME):
        b = torch.ones(N, device=dev()) * 2
    with expect_races() as found:
        b + 1  # after the block: removed exit wait
    assert found[0].now.line == _line_of("b + 1  # after the block: removed exit wait")


def test_removed_timeits_wait_for_its_events(monkeypatch: pytest.MonkeyPatch) -> None:
    import anydevice as ad
    from anydevice import testing
    from anydevice.measure import clocks
    from anydevice.testing import expect_races

    _remove(monkeypatch, clocks._EventClock, "run", "end.synchronize()")
    with expect_races() as found:
        ad.timeit(testing.busy, 0.01, device=NAME, warmup=0, repeat=1, number=1)  # timed
    assert found[0].kind == "timing", found[0]
    assert found[0].now.line == _line_of(
        "ad.timeit(testing.busy, 0.01, device=NAME, warmup=0, repeat=1"
    )


def test_removed_throughputs_wait_for_its_newest_event(monkeypatch: pytest.MonkeyPatch) -> None:
    import anydevice as ad
    from anydevice import testing
    from anydevice.measure import throughput
    from anydevice.testing import expect_races

    _remove(monkeypatch, throughput.Throughput, "compute", "last.synchronize()")
    meter = ad.Throughput(samples_per_step=8, device=NAME, peak=None)
    for _ in range(3):
        testing.busy(0.01)
        meter.step()
    with expect_races() as found:
        meter.compute()  # reads the window's device time
    assert found[0].kind == "timing" and found[0].now.line == _line_of("meter.compute()  # reads")


def test_removed_the_loaders_wait_for_its_copy_times(monkeypatch: pytest.MonkeyPatch) -> None:
    import anydevice as ad
    from anydevice.feeding import transfer
    from anydevice.testing import expect_races

    _remove(monkeypatch, transfer.CopyTimes, "collect", "slot.end.synchronize()")
    loader = ad.DeviceLoader([torch.ones(N // 4) for _ in range(2)], NAME)
    for _ in loader:
        pass
    with expect_races() as found:
        assert loader.stats.batches == 2  # adds up the copies' device time
    assert found[0].kind == "timing" and found[0].now.line == _line_of(
        "assert loader.stats.batches == 2  # adds up"
    )


def test_removed_save_states_wait_for_its_copy_to_the_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The background save copies the state to the host with a blocking copy, then writes
    it in a thread. Made non-blocking, the writer reads the pinned buffers before the
    copies land: a read no operator makes (torch.save), seen through the pinned memory's
    protected mapping."""
    import anydevice as ad
    from anydevice.checkpoints import state
    from anydevice.testing import expect_races, set_bandwidth

    _remove(monkeypatch, state, "_to_host", '.to("cpu", copy=True)',
            instead='.to("cpu", copy=True, non_blocking=True)')  # fmt: skip
    model = torch.nn.Linear(256, 256).to(dev())
    set_bandwidth("10MB/s")  # the copies land long after the writer starts
    try:
        with expect_races() as found:
            ad.save_state(tmp_path / "ckpt", model=model, step=1, background=True)
            ad.wait_for_saves()
    finally:
        torch.accelerator.synchronize()
        set_bandwidth("2GB/s")
    race = found[0]
    assert race.kind == "read after write" and race.now.stream == "the host", race
    assert "outside torch's operators" in race.now.op, race


# --- selected like any accelerator ----------------------------------------------------------


def test_selected_like_any_accelerator() -> None:
    import anydevice as ad

    assert ad.device(NAME) == dev()
    assert ad.device() == dev()  # auto: the accelerator torch has
    (found,) = ad.inventory().of_kind(NAME)
    assert found.torch_device == dev() and found.memory_total is not None


def test_memory_and_its_peak() -> None:
    import anydevice as ad

    with ad.track_memory(NAME) as tracked:
        x = torch.empty(2**20, device=dev())
        del x
    assert tracked.peak >= 4 * 2**20


def test_enabling_again_changes_settings_not_the_backend() -> None:
    from anydevice import testing

    assert testing.enable(NAME, bandwidth="1GB/s") == dev()
    assert testing.bandwidth() == 1e9
    testing.set_bandwidth("2GB/s")
    with pytest.raises(testing.SimulatorError, match="already enabled"):
        testing.enable("other")
    with pytest.raises(testing.SimulatorError, match="fixed once"):
        testing.enable(NAME, devices=2)


class _MakesATensorWithoutDevice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = torch.eye(4)  # the bug: no device=, so it is made on the host
        return self.proj(x) @ mix


def test_a_tensor_made_in_forward_without_device_fails_naming_the_module() -> None:
    import anydevice as ad

    model = _MakesATensorWithoutDevice().to(dev())
    x = torch.randn(2, 4, device=dev())
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        model(x)  # plain torch on this device: refused, as on a GPU
    with (
        pytest.raises(ad.DeviceMismatchError, match="_MakesATensorWithoutDevice") as e,
        ad.diagnose(model),
    ):
        model(x)
    assert NAME in str(e.value) and "cpu" in str(e.value)
    assert torch.equal((x * torch.tensor(2.0)).cpu(), x.cpu() * 2), "a 0-dim host scalar is fine"
    host = torch.ones(2, 4)
    for name, op in {
        "cat": lambda: torch.cat([x, host]),
        "where": lambda: torch.where(x > 0, x, host),
        "index_select": lambda: x.index_select(0, torch.tensor([1])),
    }.items():
        with pytest.raises(RuntimeError, match="on the same device"):
            op()
            pytest.fail(f"{name} ran with a host tensor")


def test_memory_readings_and_fit_batch_size_against_the_capacity() -> None:
    import anydevice as ad
    from anydevice import testing

    torch.accelerator.synchronize()
    gc.collect()
    torch.accelerator.empty_cache()
    base = torch.accelerator.memory_reserved(0)
    stats = ad.memory(NAME)
    assert stats.reserved == base >= stats.allocated
    testing.set_capacity(base + 64 * 2**20)  # 64 MiB free

    def step(batch_size: int) -> None:
        x = torch.empty(batch_size, 2**20, device=dev())  # 4 MiB per sample
        (x * 2).sum()  # a temporary as large again

    try:
        free, total = torch.accelerator.get_memory_info(0)
        assert total == base + 64 * 2**20
        assert free == total - torch.accelerator.memory_reserved(0)  # a GPU's free memory
        best = ad.fit_batch_size(step, start=1, device=NAME)
    finally:
        testing.set_capacity(None)
    # Two segments of 4n MiB (from 10 MiB on, a block gets a segment of its own, rounded to
    # 2 MiB), and the sum's 4 bytes in a 2 MiB segment of the small pool unless one with
    # room is cached already: 8 samples need 64 or 66 MiB.
    assert best in (7, 8), best


def test_losses_match_the_cpu_without_warnings() -> None:
    import warnings

    torch.manual_seed(0)
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    for loss in (torch.nn.functional.mse_loss, torch.nn.functional.smooth_l1_loss):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warned of resizing an output before
            on = loss(a.to(dev()), b.to(dev()))
        assert on.device == dev() and torch.allclose(on.cpu(), loss(a, b))


#: Recurrent layers, their arguments, and which of their outputs the loss uses.
RECURRENT: list[tuple[str, dict[str, object], str]] = [
    ("LSTM", {"num_layers": 2}, "all"),
    ("LSTM", {"bias": False}, "all"),
    ("LSTM", {}, "output"),  # the final cell state unused: no gradient reaches it
    ("LSTM", {}, "cell"),  # only the final cell state used: no gradient for hy
    ("GRU", {"num_layers": 2}, "all"),
    ("GRU", {"bias": False}, "all"),
    ("LSTMCell", {}, "all"),
    ("GRUCell", {"bias": False}, "all"),
]


def test_recurrent_layers_give_the_cpus_outputs_and_gradients() -> None:
    """torch sends a GPU's LSTM and GRU to fused cell kernels that only CUDA has; the
    device runs them (pytorch/examples' word language model is an LSTM)."""
    for kind, kwargs, use in RECURRENT:
        case = f"{kind}({kwargs}), loss on {use}"
        torch.manual_seed(0)
        cpu = getattr(torch.nn, kind)(5, 4, **kwargs).double()
        on = getattr(torch.nn, kind)(5, 4, **kwargs).double()
        on.load_state_dict(cpu.state_dict())
        on.to(dev())
        cell = kind.endswith("Cell")
        x = torch.randn(3, 5).double() if cell else torch.randn(6, 3, 5).double()

        def loss(module: torch.nn.Module, inputs: torch.Tensor, use: str = use) -> torch.Tensor:
            out = module(inputs)
            if isinstance(module, torch.nn.GRUCell):
                terms = [out]
            elif isinstance(module, torch.nn.LSTMCell):
                terms = list(out)  # (h, c)
            else:
                output, state = out
                h, c = state if isinstance(module, torch.nn.LSTM) else (state, None)
                terms = {"all": [output, h, c], "output": [output], "cell": [c]}[use]
            return sum((t * t.cos()).sum() for t in terms if t is not None)

        expected = loss(cpu, x)
        expected.backward()
        got = loss(on, x.to(dev()))
        got.backward()
        assert got.device == dev(), case
        assert torch.allclose(got.cpu(), expected, rtol=1e-12), case
        for (name, a), b in zip(cpu.named_parameters(), on.parameters(), strict=True):
            assert b.grad is not None and b.grad.device == dev(), (case, name)
            assert torch.allclose(b.grad.cpu(), a.grad, rtol=1e-10, atol=1e-12), (case, name)


def test_busy_refuses_a_device_the_simulator_does_not_have() -> None:
    import math

    from anydevice import testing
    from anydevice.errors import DeviceSpecError

    for bad in (math.nan, -1, 1, 2**63, 1e300, "sim:5", "cpu", f"{NAME}:-3"):
        with pytest.raises(DeviceSpecError, match="device="):
            testing.busy(0.0, device=bad)
    testing.busy(0.0, device=f"{NAME}:0")  # the one it has
