"""Cases run against torch's OpenReg backend, in a process of their own.

OpenReg (``torch_openreg``, from torch's source tree:
``test/cpp_extensions/open_registration_extension``) is torch's reference out-of-tree
``privateuse1`` backend in C++: two devices, a stream per worker thread, events that time,
pinned host memory and a caching allocator with torch's counters. It is what torch tests
its device-generic API against, so it shows anydevice's generic paths with real streams
and events, not the python backend's single stream. It is not on PyPI: where it is not
installed ``tests/test_privateuse1.py`` skips these, saying so. Importing it registers the
backend for the whole process, hence the child process; nothing is registered when this file
is imported.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

NAME = "openreg"


def dev() -> torch.device:
    return torch.device(NAME, 0)  # a name torch knows only once the backend is registered


@pytest.fixture(scope="session", autouse=True)
def openreg() -> str:
    """Registers the backend, for good: only in the child process, never on import (the
    main pytest imports this file for its doctests)."""
    pytest.importorskip("torch_openreg")
    return NAME


def test_the_copier_has_its_own_stream_and_timing_events() -> None:
    from anydevice.feeding import copies, streams

    copier = copies.copier_for(torch.device(NAME))
    assert copier is not None and copier.device == dev()
    assert copier.stream is streams.copy_stream(dev())
    assert copier.stream != torch.accelerator.current_stream(0)  # a stream of its own
    assert copier.times is not None  # OpenReg's events time


def _batches(n: int) -> list[dict[str, Any]]:
    return [{"x": torch.full((256,), float(i)), "i": torch.tensor([i])} for i in range(n)]


def test_device_loader_pins_copies_on_the_copy_stream_and_times_them() -> None:
    import anydevice as ad
    from anydevice.feeding import streams

    seen_streams = []

    def transform(b: dict[str, Any]) -> dict[str, Any]:
        seen_streams.append(torch.accelerator.current_stream(0))
        return b

    data = _batches(6)
    loader = ad.DeviceLoader(data, NAME, transform=transform)
    for _epoch in range(2):
        got = [ad.to(b, "cpu") for b in loader]
        assert [int(b["i"]) for b in got] == list(range(6))
        assert all(torch.equal(b["x"], d["x"]) for b, d in zip(got, data, strict=True))
    assert all(s == streams.copy_stream(dev()) for s in seen_streams) and len(seen_streams) == 12
    stats = loader.stats
    assert stats.pinned is False  # the source's batches came pageable: the thread pinned them
    assert stats.copy_seconds is not None and stats.copy_seconds > 0
    assert stats.bytes_moved == 6 * (256 * 4 + 8)


def test_a_consumer_on_another_stream_becomes_a_home() -> None:
    """OpenReg has no ``record_stream``: the consumer's stream joins the streams every
    copy waits for instead (it raised NotImplementedError before)."""
    import anydevice as ad

    side = torch.Stream(dev())
    loader = ad.DeviceLoader(_batches(4), NAME)
    batches = iter(loader)  # the pass starts on the current stream: its home
    got = [int(ad.to(next(batches)["i"], "cpu"))]
    with side:  # the rest is read on another stream
        got += [int(ad.to(b["i"], "cpu")) for b in batches]
    assert got == [0, 1, 2, 3]


def test_memory_reads_the_allocator() -> None:
    import anydevice as ad

    x = torch.ones(2**20, device=dev())  # 4 MiB
    stats = ad.memory(NAME)
    assert stats.allocated is not None and stats.allocated >= 4 * 2**20
    with ad.track_memory(NAME) as m:
        y = torch.ones(2**21, device=dev())  # 8 MiB
        del y
    assert m.exact and m.peak - m.start >= 8 * 2**20
    del x


def test_timeit_uses_the_backends_events() -> None:
    import anydevice as ad

    x = torch.ones(1024, device=dev())
    result = ad.timeit(lambda: x + 1, device=NAME, number=2, repeat=3, warmup=1)
    assert result.clock == f"{dev().type}-event" and len(result.times) == 3


def test_side_stream_is_ordered_both_ways() -> None:
    import anydevice as ad

    before = torch.accelerator.current_stream(0)
    a = torch.zeros(2**16, device=dev())
    a.fill_(3.0)  # queued on the current stream
    with ad.side_stream(NAME) as s:
        assert isinstance(s, torch.Stream) and s != before
        assert torch.accelerator.current_stream(0) == s
        b = a * 2
    assert torch.accelerator.current_stream(0) == before
    c = b + 1
    assert torch.equal(c.cpu(), torch.full((2**16,), 7.0))
