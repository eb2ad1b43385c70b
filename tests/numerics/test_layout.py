"""channels_last: the rule on hand-built devices, and real conversions of real models on CPU."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import anydevice as ad
from anydevice.hardware.facts import DeviceInfo
from anydevice.numerics.layout import channels_last_pays
from machines import cpu_device, gpu

CL, CL3D = torch.channels_last, torch.channels_last_3d


def device(kind: str, **kw: object) -> DeviceInfo:
    base: dict[str, object] = dict(kind=kind, index=0, name=f"Test {kind.upper()}")
    base.update(kw)
    return DeviceInfo(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("info", "pays", "why"),
    [
        pytest.param(gpu(0, "H100"), True, "Tensor Cores (compute capability 9.0)", id="h100"),
        pytest.param(gpu(0, "V100"), True, "fp16 autocast", id="v100"),
        pytest.param(
            gpu(0, "V100", compute_capability=(6, 1)), False, "no Tensor Cores", id="cc6.1"
        ),
        pytest.param(gpu(0, "H100", compute_capability=None), False, "unknown", id="cc-unknown"),
        pytest.param(cpu_device(), True, "oneDNN", id="cpu"),
        pytest.param(device("xpu"), True, "oneDNN", id="xpu"),
        pytest.param(device("mps"), False, "MPS", id="mps"),
        pytest.param(device("xla"), False, "XLA", id="xla"),
        pytest.param(device("meta", index=None), False, "no known gain", id="meta"),
    ],
)
def test_channels_last_pays_by_device(info: DeviceInfo, pays: bool, why: str) -> None:
    got, reason = channels_last_pays(info)
    assert got is pays
    assert why in reason


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    )


def test_converts_2d_convolutions_on_cpu_and_computes_the_same() -> None:
    model = convnet().eval()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 3, 16, 16)
    assert ad.channels_last(model) is model  # device from its parameters: the CPU
    assert model[0].weight.is_contiguous(memory_format=CL)
    assert model[3].weight.is_contiguous(memory_format=CL)
    assert not plain[0].weight.is_contiguous(memory_format=CL)
    features = model[:4](x)  # NCHW input; the first convolution's output follows its weight
    assert features.is_contiguous(memory_format=CL)
    torch.testing.assert_close(model(x), plain(x), rtol=1e-4, atol=1e-5)


def test_converts_3d_convolutions_to_channels_last_3d() -> None:
    model = nn.Sequential(nn.Conv3d(2, 4, 3), nn.ReLU())
    ad.channels_last(model, "cpu")
    assert model[0].weight.is_contiguous(memory_format=CL3D)


def test_converts_a_mix_of_2d_and_3d_convolutions_each_its_own_way() -> None:
    model = nn.ModuleDict({"image": nn.Conv2d(3, 4, 3), "video": nn.ConvTranspose3d(2, 4, 3)})
    ad.channels_last(model, "cpu")
    assert model["image"].weight.is_contiguous(memory_format=CL)
    assert model["video"].weight.is_contiguous(memory_format=CL3D)


def test_a_model_without_convolutions_is_untouched() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    pointer = model[0].weight.data_ptr()
    assert ad.channels_last(model) is model
    assert model[0].weight.data_ptr() == pointer


def test_left_as_is_where_it_does_not_pay(caplog: pytest.LogCaptureFixture) -> None:
    model = convnet()
    with caplog.at_level(logging.INFO, logger="anydevice"):
        assert ad.channels_last(model, device("mps")) is model
    assert not model[0].weight.is_contiguous(memory_format=CL)
    assert "left as is" in caplog.text
    assert "MPS" in caplog.text


def test_training_still_works_after_conversion() -> None:
    model = ad.channels_last(convnet(), "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 2, (16,))
    losses = []
    for _ in range(15):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert model[0].weight.is_contiguous(memory_format=CL)
