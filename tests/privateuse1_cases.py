"""Cases run against torch's own python ``privateuse1`` backend, in a process of their own.

torch registers one ``privateuse1`` backend per process, for good, so
``tests/test_privateuse1.py`` runs this file in a child pytest. The backend is torch's
extension point (``torch.utils.backend_registration._setup_privateuseone_for_python_backend``)
with a few kernels that keep each tensor's data in a numpy array: enough to place, move and
read tensors. It has no streams, no synchronisation and no allocator statistics, so what
needs those is skipped here, saying so. Nothing is registered when this file is imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

#: The backend's name: ``ANYDEVICE_TEST_BACKEND`` runs the same cases under another one.
NAME = os.environ.get("ANYDEVICE_TEST_BACKEND", "npy")


def _register() -> Any:
    from torch.utils.backend_registration import (
        _DummyBackendModule,
        _setup_privateuseone_for_python_backend,
    )

    class Module(_DummyBackendModule):
        """torch's stand-in device module, with a generator of the device's own, reached as
        a backend's module offers it (``get_rng_state`` / ``set_rng_state``)."""

        generator = torch.Generator()

        def get_rng_state(self, device: Any = None) -> torch.Tensor:
            return self.generator.get_state()

        def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
            self.generator.set_state(state)

    _setup_privateuseone_for_python_backend(NAME, backend_module=Module())

    class NpyTensor(torch.Tensor):
        raw: np.ndarray[Any, Any]

    def wrap(raw: np.ndarray[Any, Any], dtype: torch.dtype) -> torch.Tensor:
        out = torch._C._acc.create_empty_tensor(list(raw.shape), dtype)
        out.__class__ = NpyTensor
        out.raw = raw
        return out  # type: ignore[no-any-return]

    def numpy_dtype(dtype: torch.dtype | None) -> Any:
        return torch.empty((), dtype=dtype or torch.float32).numpy().dtype

    def empty(size: Any, *args: Any, dtype: torch.dtype | None = None, **kw: Any) -> torch.Tensor:
        return wrap(np.empty(tuple(size), dtype=numpy_dtype(dtype)), dtype or torch.float32)

    def copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> Any:
        if src.device.type == NAME and dst.device.type == NAME:
            dst.raw = src.raw.copy()  # type: ignore[attr-defined]
        elif src.device.type == NAME:
            dst.copy_(torch.from_numpy(src.raw))  # type: ignore[attr-defined]
        else:
            dst.raw = src.detach().contiguous().numpy().copy()  # type: ignore[attr-defined]
        return dst

    def same(t: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        return wrap(t.raw, t.dtype)  # type: ignore[attr-defined]

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty_strided", empty, "PrivateUse1")
    lib.impl("empty.memory_format", empty, "PrivateUse1")
    lib.impl("_copy_from", copy_from, "PrivateUse1")
    lib.impl("detach", same, "PrivateUse1")
    lib.impl("view", same, "PrivateUse1")
    return lib


@pytest.fixture(scope="session", autouse=True)
def npy() -> Iterator[str]:
    lib = _register()
    yield NAME
    del lib


def test_torch_reports_the_backend() -> None:
    assert str(torch.accelerator.current_accelerator()) == NAME
    assert torch.accelerator.device_count() == 1


def test_auto_selects_it() -> None:
    import anydevice as ad

    assert ad.device() == torch.device(NAME, 0)
    assert ad.devices() == [torch.device(NAME, 0)]


def test_named_and_indexed() -> None:
    import anydevice as ad

    assert ad.device(NAME) == torch.device(NAME, 0)
    assert ad.device(f"{NAME.upper()}:0") == torch.device(NAME, 0)
    assert ad.device(torch.device(NAME)) == torch.device(NAME, 0)
    from anydevice.hardware.spec import Spec, parse_spec

    assert parse_spec(f"{NAME}:0") == Spec(NAME, 0, f"{NAME}:0")


def test_bad_index_lists_what_is_here() -> None:
    import anydevice as ad

    expected = rf"'{NAME}:3'.*1 {NAME.upper()} device is visible.*{NAME}:0"
    with pytest.raises(ad.DeviceNotFoundError, match=expected):
        ad.device(f"{NAME}:3")


def test_misspelt_name_suggests_it() -> None:
    import anydevice as ad

    misspelt = NAME[:-1] + "x"
    with pytest.raises(ad.DeviceSpecError, match=rf"Did you mean '{NAME}'\?.*{NAME}\[:i\]") as e:
        ad.device(misspelt)
    assert str(e.value).count(f"{NAME}[:i]") == 1, "each kind is listed once"


def test_inventory_lists_it() -> None:
    import anydevice as ad

    inv = ad.inventory(telemetry=True)
    (found,) = inv.of_kind(NAME)
    assert (found.spec, found.index) == (f"{NAME}:0", 0)
    assert found.torch_device == torch.device(NAME, 0)
    # torch's python backend implements no memory query: unknown, and said so.
    assert found.memory_total is None and "memory unknown" in found.notes[0]
    assert inv.devices[-1].kind == "cpu"
    assert ad.inventory(kinds=(NAME, "cpu")).of_kind(NAME) == (found,)
    assert ad.inventory(kinds=("cuda", "cpu")).of_kind(NAME) == ()


def test_to_round_trip() -> None:
    import anydevice as ad

    x = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": [torch.tensor([7])]}
    moved = ad.to(x, NAME)
    assert moved["a"].device == torch.device(NAME, 0) and moved["n"][0].device.type == NAME
    back = ad.to(moved, "cpu")
    assert torch.equal(back["a"], x["a"]) and torch.equal(back["n"][0], x["n"][0])


def test_device_loader_moves_batches() -> None:
    import anydevice as ad

    batches = [(torch.full((2,), float(i)), torch.tensor([i])) for i in range(4)]
    loader = ad.DeviceLoader(batches, NAME)
    seen = []
    for x, y in loader:
        assert x.device.type == NAME and y.device.type == NAME
        seen.append((ad.to(x, "cpu"), ad.to(y, "cpu")))
    assert all(
        torch.equal(a, b) and torch.equal(c, d)
        for (a, c), (b, d) in zip(seen, batches, strict=True)
    )
    assert loader.stats.batches == 4


def test_device_loader_copies_on_the_backends_copy_stream(caplog: Any) -> None:
    import logging

    import anydevice as ad
    from anydevice.feeding import copies, streams

    dev = torch.device(NAME, 0)
    copier = copies.copier_for(dev)
    assert copier is not None, "a backend with torch.Stream gets a copy stream"
    assert isinstance(copier.stream, torch.Stream) and copier.stream.device == dev
    assert copier.stream is streams.copy_stream(dev)  # one per device, for the process
    assert copier.times is None  # its events order but cannot time (no elapsedTime)
    batches = [{"x": torch.full((3,), float(i)), "i": torch.tensor([i])} for i in range(5)]
    loader = ad.DeviceLoader(batches, NAME, transform=lambda b: {**b, "y": b["x"].detach()})
    with caplog.at_level(logging.INFO, logger="anydevice"):
        got = [ad.to(b, "cpu") for b in loader]
    assert [int(b["i"]) for b in got] == list(range(5))
    assert all(torch.equal(b["y"], s["x"]) for b, s in zip(got, batches, strict=True))
    stats = loader.stats
    # The pinning thread tried, the backend has no pinned allocator: said, not hidden.
    assert stats.pinned is False and stats.copy_seconds is None
    assert stats.bytes_moved == sum(3 * 4 + 8 for _ in batches)
    assert f"{NAME} cannot pin host memory" in caplog.text


def test_memory_says_what_the_backend_lacks() -> None:
    import anydevice as ad

    with pytest.raises(ad.MeasurementError, match=f"{NAME} backend keeps no allocator stat"):
        ad.memory(NAME)
    with pytest.raises(ad.MeasurementError, match="ad.inventory"), ad.track_memory(NAME):
        pass


def test_timed_with_a_warning_where_it_cannot_wait() -> None:
    import anydevice as ad

    with pytest.raises(RuntimeError, match="support synchronizing"):
        torch.accelerator.synchronize(NAME)  # torch's python backend: no synchronisation
    x = ad.to(torch.ones(4), NAME)
    with pytest.warns(RuntimeWarning, match=f"cannot wait for {NAME}:0"):
        result = ad.timeit(lambda: ad.to(x, "cpu"), device=NAME, number=2, repeat=3)
    assert result.device == f"{NAME}:0" and len(result.times) == 3
    # Its events cannot time (no elapsedTime in the python backend): the host clock.
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    end.record()
    with pytest.raises(RuntimeError, match="elapsedTime"):
        start.elapsed_time(end)
    assert result.clock == "perf_counter"
    with pytest.warns(RuntimeWarning, match="does not synchronise"), ad.Timer(NAME) as t:
        ad.to(x, "cpu")
    assert t.elapsed > 0


def test_synchronize() -> None:
    try:
        torch.accelerator.synchronize(NAME)
    except RuntimeError as e:
        pytest.skip(f"torch's python privateuse1 backend cannot synchronise: {e}")
    pytest.fail("the backend synchronises now: time it without the warning")


def test_allocator_stats() -> None:
    try:
        torch.accelerator.memory_allocated(0)
    except RuntimeError as e:
        pytest.skip(f"torch's python privateuse1 backend has no device allocator: {e}")
    pytest.fail("the backend reports allocator stats now: check ad.inventory's memory")


def test_side_stream_through_torch_stream() -> None:
    import anydevice as ad

    x = ad.to(torch.ones(3), NAME)
    before = torch.accelerator.current_stream(0)
    with ad.side_stream(NAME) as s:
        assert isinstance(s, torch.Stream) and s.device == torch.device(NAME, 0)
        # torch's python backend numbers every stream 0, so this shows the path, not the
        # ordering (which needs a backend with real streams: XPU, ...).
        assert torch.accelerator.current_stream(0) == s
        y = ad.to(x, "cpu")
    assert torch.accelerator.current_stream(0) == before
    with ad.side_stream() as again:  # no device: torch's current accelerator
        pass
    assert again is s  # one side stream per device, reused
    assert torch.equal(y, torch.ones(3))


def test_the_random_state_of_a_models_device_is_kept_through_its_module(tmp_path: Any) -> None:
    import anydevice as ad
    from anydevice.checkpoints import randomness

    holder = torch.nn.Module()
    holder.register_buffer("x", ad.to(torch.ones(2), NAME))
    generator = torch.get_device_module(NAME).generator
    generator.manual_seed(7)
    before = generator.get_state()
    state = randomness.capture(holder)
    assert [device for device, _ in state["devices"]] == [f"{NAME}:0"]
    path = ad.save(state, tmp_path / "rng.pt")
    torch.rand(3, generator=generator)  # the device draws on: its state moves
    assert not torch.equal(generator.get_state(), before)
    randomness.restore(ad.load(path, "cpu"), holder, where="test")
    assert torch.equal(generator.get_state(), before)


def test_a_backend_named_tpu_is_not_taken_for_torch_xla() -> None:
    import anydevice as ad

    if NAME == "tpu":
        here = torch.device("tpu", 0)
        assert ad.device("tpu") == here and ad.device("TPU:0") == here
    else:  # the alias stands: 'tpu' means torch_xla's device, absent here
        with pytest.raises(ad.DeviceNotFoundError, match="xla"):
            ad.device("tpu")
