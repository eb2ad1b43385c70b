"""XLA devices through torch_xla, on a real XLA runtime.

torch_xla pins one torch version (2.9.0 for torch_xla 2.9.0), so these run in a virtualenv
of their own, built by ``scripts/xla-check.sh`` on torch_xla's CPU PJRT device
(``PJRT_DEVICE=CPU``): the same lazy tensors, graph cuts and transfers a TPU gets, on the
CPU. They are marked ``xla`` and skipped wherever torch_xla has no device (``make test``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import anydevice as ad

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def xla() -> torch.device:
    import torch_xla

    return torch.device(torch_xla.device())


@pytest.fixture(autouse=True)
def _no_leftover_graph() -> Iterator[None]:
    yield
    import torch_xla

    torch_xla.sync()


def _executions() -> int:
    """How many compiled graphs torch_xla has run in this process so far."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("ExecuteTime")
    return 0 if data is None else int(data[0])


def _data(n: int = 8, batch: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 6, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(n)
    ]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


# ----------------------------------------------------------------------------- selection


def test_auto_selects_the_xla_device(xla: torch.device) -> None:
    assert ad.device() == xla
    assert ad.device("xla") == xla and ad.device("tpu") == xla and ad.device("XLA:0") == xla


def test_a_missing_index_lists_what_is_here(xla: torch.device) -> None:
    with pytest.raises(ad.DeviceNotFoundError, match="xla:7") as e:
        ad.device("xla:7")
    assert "xla:0" in str(e.value)


def test_inventory_lists_it_with_its_pjrt_type() -> None:
    import torch_xla.runtime as xr

    found = ad.inventory().of_kind("xla")
    assert len(found) == xr.global_runtime_device_count() >= 1
    assert found[0].name == f"XLA {xr.device_type()}"


# ----------------------------------------------------------------------------- placement


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    ids: list[int]


def test_to_round_trips_nested_batches(xla: torch.device) -> None:
    batch = {"b": Batch(torch.arange(6.0).reshape(2, 3), torch.tensor([1, 0]), [3, 4]), "k": 2}
    moved = ad.to(batch, xla)
    assert moved["b"].x.device == xla and moved["b"].y.device == xla
    assert moved["b"].ids == [3, 4] and moved["k"] == 2
    back = ad.to(moved, "cpu")
    assert torch.equal(back["b"].x, batch["b"].x) and torch.equal(back["b"].y, batch["b"].y)


def test_a_training_step_matches_the_cpu(xla: torch.device) -> None:
    x, y = _data(1)[0]
    results = []
    for dev in (torch.device("cpu"), xla):
        model = ad.to(_model(), dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        xb, yb = ad.to((x, y), dev)
        for _ in range(3):
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        results.append([p.detach().cpu() for p in model.parameters()])
    for cpu, on_xla in zip(*results, strict=True):
        torch.testing.assert_close(on_xla, cpu, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- DeviceLoader


def test_device_loader_delivers_on_xla(xla: torch.device) -> None:
    data = _data(5)
    loader = ad.DeviceLoader(data, xla)
    seen = [ad.to(b, "cpu") for b in loader]
    assert all(x.device.type == "cpu" for x, _ in seen)
    for (x, y), (xs, ys) in zip(seen, data, strict=True):
        assert torch.equal(x, xs) and torch.equal(y, ys)
    assert loader.stats.batches == 5 and loader.stats.copy_seconds is None


def test_device_loader_ends_each_step_as_mpdeviceloader_does(xla: torch.device) -> None:
    """Without a graph cut per batch, a loop that never reads a value grows one lazy graph
    over the whole epoch and runs nothing until the end."""
    model = ad.to(_model(), xla)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = _executions()
    n = 6
    for x, y in ad.DeviceLoader(_data(n), xla):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()  # no loss.item(): nothing here forces the graph to run
    assert _executions() - before >= n - 1


def _seed_recipe(data: list[Any], epochs: int) -> list[torch.Tensor]:
    """The torch_xla tutorial's loop: xla_device, ParallelLoader, xm.optimizer_step."""
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl

    device = xm.xla_device()
    model = _model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(epochs):
        for x, y in pl.ParallelLoader(data, [device]).per_device_loader(device):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            xm.optimizer_step(opt)
    return [p.detach().cpu() for p in model.parameters()]


def _anydevice_recipe(data: list[Any], epochs: int) -> list[torch.Tensor]:
    """The same loop with anydevice: the device picked, the loader wrapped, a plain step."""
    device = ad.device()
    model = ad.to(_model(), device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = ad.DeviceLoader(data, device)
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore:Use torch_xla.device instead:DeprecationWarning")
def test_the_seed_recipe_rewritten_trains_the_same(xla: torch.device) -> None:
    data = _data(6)
    expected = _seed_recipe(data, epochs=2)
    got = _anydevice_recipe(data, epochs=2)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got[0], _model()[0].weight.detach())  # it trained


# ----------------------------------------------------------------------------- timing, memory


def test_timeit_waits_for_the_device(xla: torch.device) -> None:
    a = torch.randn(64, 64, device=xla)

    def step() -> None:
        import torch_xla

        (a @ a).sum()
        torch_xla.sync()

    result = ad.timeit(step, device=xla, number=2, repeat=3)
    assert result.device == str(xla) and len(result.times) == 3
    assert all(t > 0 for t in result.times)
    with ad.Timer(xla) as t:
        step()
    assert t.elapsed > 0


def test_timers_run_what_is_traced(xla: torch.device) -> None:
    """A lazy op is only traced until the graph is cut: timing it without running it
    measured the tracing (the doctor saw a 4096³ matmul at 21 PFLOP/s on the CPU)."""
    a = torch.randn(256, 256, device=xla)
    import torch_xla

    torch_xla.sync()
    before = _executions()
    result = ad.timeit(lambda: a @ a, device=xla, number=1, repeat=3, warmup=0)
    assert _executions() - before >= len(result.times)  # every sample ran its matmul
    before = _executions()
    with ad.Timer(xla):
        b = a @ a  # alive at the end of the block: it runs inside the timing
    assert _executions() - before >= 1
    del b


def test_memory_reads_or_says_why(xla: torch.device) -> None:
    import torch_xla.core.xla_model as xm

    try:
        xm.get_memory_info(xla)
        reason = None
    except RuntimeError as e:  # the CPU PJRT client keeps no allocator statistics
        reason = str(e).split(":")[-1].strip()
    if reason is not None:
        with pytest.raises(ad.MeasurementError, match="torch_xla") as raised:
            ad.memory(xla)
        assert reason in str(raised.value)
        return
    stats = ad.memory(xla)
    assert stats.allocated is not None and stats.allocated >= 0


def test_precision_and_streams_on_xla(xla: torch.device) -> None:
    import torch_xla.runtime as xr

    p = ad.precision(xla)
    assert p.dtype == (torch.bfloat16 if xr.device_type() == "TPU" else torch.float32)
    with ad.side_stream(xla) as s:  # XLA has no eager streams: a no-op, saying None
        assert s is None
