"""ad.to, the mismatch reports and checkpoints on a real NVIDIA GPU (skipped without one)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import anydevice as ad
from anydevice.placement.mismatch import is_device_mismatch
from anydevice.placement.move import _auto_non_blocking

pytestmark = pytest.mark.cuda

CPU = torch.device("cpu")


@pytest.fixture
def gpu() -> torch.device:
    return torch.device("cuda", 0)


def pinned_batch() -> dict[str, Any]:
    return {
        "x": torch.arange(1 << 16, dtype=torch.float32).pin_memory(),
        "ids": [torch.arange(10).pin_memory(), "text"],
        "mask": torch.ones(8, dtype=torch.bool),  # pageable
    }


def test_pinned_batch_arrives_whole(gpu):
    batch = pinned_batch()
    assert batch["x"].is_pinned()
    assert _auto_non_blocking(CPU, batch["x"], "cuda") is False  # the caller owns the buffer
    assert _auto_non_blocking(CPU, batch["mask"], "cuda") is False
    out = ad.to(batch, gpu)
    assert out["x"].device == gpu and out["ids"][0].device == gpu and out["mask"].device == gpu
    # consumers on the same stream see the finished copy without a host sync
    assert torch.equal(out["x"].sum().cpu(), batch["x"].sum())
    assert out["ids"][1] == "text"


def test_refilling_a_pinned_staging_buffer_after_to_does_not_change_what_the_gpu_got(gpu):
    staging = torch.empty(1 << 22).pin_memory()
    for value in (1.0, 2.0, 3.0):
        staging.fill_(value)
        torch.cuda._sleep(100_000_000)  # queue work first: an async copy would start later
        out = ad.to({"x": staging}, gpu)["x"]
        staging.fill_(-1.0)  # the next batch arrives in the same buffer
        assert bool((out == value).all()), f"the GPU read the refilled buffer for {value}"


def test_explicit_non_blocking_from_pinned_memory_reads_the_buffer_late(gpu):
    # The hazard "auto" avoids, shown: with non_blocking=True the copy runs after to()
    # returned, behind the queued work, and sees what the host wrote meanwhile.
    staging = torch.full((1 << 22,), 1.0).pin_memory()
    torch.cuda._sleep(200_000_000)
    with shown_race() as found:
        out = ad.to(staging, gpu, non_blocking=True)
        staging.fill_(-1.0)
    torch.cuda.synchronize()
    assert bool((out == -1.0).all())
    if found is not None:  # on the simulated GPU (make test-sim), its detector names it too
        assert [r.kind for r in found] == ["write after read"], found


@contextlib.contextmanager
def shown_race() -> Iterator[list[Any] | None]:
    """A race a test makes on purpose: on the simulated GPU its race detector reports it
    (collected here: the block fails without one); on a GPU the value shows it (None)."""
    from anydevice.testing import expect_races, race_mode
    from anydevice.testing.cuda import active

    if active() is None or race_mode() == "off":
        yield None
        return

    with expect_races() as found:
        yield found


def test_device_to_host_auto_is_blocking_so_the_result_is_ready(gpu):
    x = torch.full((1 << 22,), 3.0, device=gpu)
    torch.cuda._sleep(200_000_000)  # keep the stream busy so an early read would see garbage
    y = x * 2
    host = ad.to(y, "cpu")
    assert bool((host == 6.0).all())


def test_explicit_non_blocking_to_host_is_correct_after_synchronize(gpu):
    y = torch.full((1 << 20,), 5.0, device=gpu) * 2
    host = ad.to({"y": y}, "cpu", non_blocking=True)["y"]
    torch.cuda.current_stream().synchronize()
    assert bool((host == 10.0).all())


def test_gpu_to_gpu_copy_is_asynchronous_and_correct():
    if torch.cuda.device_count() < 2:  # asked here: at collection it would initialise CUDA
        pytest.skip("needs two GPUs")
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    x = torch.arange(1000.0, device=a)
    assert _auto_non_blocking(a, x, "cuda") is True
    y = ad.to(x, b)
    assert y.device == b and torch.equal(y.cpu(), x.cpu())


@pytest.mark.parametrize("options", [{}, {"fused": True}, {"capturable": True}])
def test_optimizer_state_follows_the_model_to_the_gpu(gpu, options):
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), **{k: v for k, v in options.items() if k == "fused"})
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    ad.to(model, gpu)
    for group in opt.param_groups:
        group.update(options)
    assert ad.to(opt, gpu) is opt
    state = opt.state[model.weight]
    assert state["exp_avg"].device == gpu and state["exp_avg_sq"].device == gpu
    assert state["step"].device == (gpu if options else CPU)
    model(torch.ones(1, 4, device=gpu)).sum().backward()
    opt.step()
    assert ad.device_of(opt) == gpu


def test_device_of_and_check_devices_on_a_real_gpu(gpu):
    model = ad.to(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), gpu)
    assert ad.device_of(model) == gpu
    assert ad.check_devices(model, batch={"x": torch.ones(1, 4, device=gpu)}) == gpu
    model[1].to("cpu")
    with pytest.raises(ad.DeviceMismatchError) as info:
        ad.check_devices(model, batch={"x": torch.ones(1, 4, device=gpu)})
    assert "model.0.* on cuda:0 (2 tensors); model.1.* on cpu (2 tensors)" in str(info.value)


REAL_ERRORS = {
    "linear": (lambda g: nn.Linear(4, 2).to(g), lambda g: torch.ones(1, 4)),
    "conv2d": (lambda g: nn.Conv2d(3, 4, 3).to(g), lambda g: torch.ones(1, 3, 8, 8)),
    "embedding": (lambda g: nn.Embedding(10, 4).to(g), lambda g: torch.zeros(3, dtype=torch.long)),
    "lstm": (lambda g: nn.LSTM(4, 4).to(g), lambda g: torch.ones(2, 1, 4)),
}


@pytest.mark.parametrize("name", sorted(REAL_ERRORS))
def test_diagnose_turns_real_cuda_errors_into_reports(gpu, name):
    make_model, make_input = REAL_ERRORS[name]
    model = make_model(gpu)
    x = make_input(gpu)
    with pytest.raises(ad.DeviceMismatchError) as info, ad.diagnose(model, x=x):
        model(x)
    assert is_device_mismatch(info.value.__cause__)
    assert "It failed in model (" in str(info.value)
    assert "input x on cpu" in str(info.value)
    assert info.value.suggested == gpu


def test_cpu_tensor_indexed_with_gpu_indices_is_recognised(gpu):
    with pytest.raises(RuntimeError) as info:
        torch.arange(10.0)[torch.tensor([1, 2], device=gpu)]
    assert is_device_mismatch(info.value)


def test_checkpoint_saved_on_gpu_loads_anywhere(gpu, tmp_path):
    path = ad.save({"w": torch.arange(4.0, device=gpu)}, tmp_path / "ckpt.pt")
    assert ad.load(path, "cpu")["w"].device == CPU
    assert ad.load(path, gpu)["w"].device == gpu
    assert ad.load(path)["w"].device == ad.device()
    assert torch.equal(ad.load(path, "cpu")["w"], torch.arange(4.0))
