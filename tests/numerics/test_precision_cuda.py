"""Precision, fast_matmul and channels_last on a real NVIDIA GPU (skipped without one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import anydevice as ad

pytestmark = pytest.mark.cuda


@pytest.fixture
def dev(monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.device]:
    monkeypatch.delenv("ANYDEVICE_PRECISION", raising=False)
    yield torch.device("cuda", 0)
    torch.cuda.synchronize()


def regression(dev: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
    x = torch.randn(512, 64, device=dev)
    return model, x, x.sum(1, keepdim=True) / 8


# What each part runs natively, from NVIDIA's data sheets: tensor cores with bf16 from
# Ampere (8.x) on; Volta and Turing have fp16 tensor cores only.
KNOWN_PARTS = {
    "H100": "bf16", "H200": "bf16", "H20": "bf16", "GH200": "bf16", "B200": "bf16",
    "GB200": "bf16", "A100": "bf16", "A10": "bf16", "A30": "bf16", "A40": "bf16",
    "L4": "bf16", "L40": "bf16", "RTX 4090": "bf16", "RTX 3090": "bf16", "RTX A6000": "bf16",
    "V100": "fp16", "T4": "fp16", "RTX 2080": "fp16",
}  # fmt: skip


@pytest.mark.real_gpu("autocast on the simulated GPU casts nothing: its math is fp32")
def test_auto_agrees_with_torch_and_the_data_sheet_on_native_bf16(dev: torch.device) -> None:
    info = ad.describe(dev, telemetry=False)
    assert info.compute_capability == torch.cuda.get_device_capability(dev)
    p = ad.precision(dev)
    # torch's own test, which does not count emulation: bf16 exactly where it says native.
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert (p.mode == "bf16") == native, (p, native)
    words = info.name.replace("-", " ").split()
    known = [mode for part, mode in KNOWN_PARTS.items() if all(w in words for w in part.split())]
    if known:
        assert p.mode == known[0], f"{info.name}: the data sheet says {known[0]}, got {p}"
    assert (p.scaler is not None) == (p.mode == "fp16")
    with p.autocast():
        y = nn.Linear(8, 8).to(dev)(torch.randn(4, 8, device=dev))
    assert y.dtype == p.dtype


def test_training_under_auto_precision_lowers_the_loss(dev: torch.device) -> None:
    model, x, y = regression(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    p = ad.precision(dev)
    losses = []
    for _ in range(60):
        with p.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        p.backward(loss)
        p.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_fp16_scaling_skips_a_step_with_inf_gradients(dev: torch.device, fused: bool) -> None:
    model, x, y = regression(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    p = ad.precision(dev, "fp16")
    with p.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    p.backward(loss)
    assert p.scaler is not None
    assert p.scaler.get_scale() == 2.0**16
    before = [t.detach().clone() for t in model.parameters()]
    model[0].weight.grad[0, 0] = float("inf")
    result = p.step(opt)
    assert not result
    assert result.scale == 2.0**15
    for t, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(t, b)
    opt.zero_grad()
    with p.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    p.backward(loss)
    assert p.step(opt)
    assert not torch.equal(model[0].weight, before[0])


def fp16_step(p: ad.Precision, model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt) -> None:
    with p.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    p.backward(loss)
    p.unscale_(opt)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    p.step(opt)  # result not read: no reason to wait for the device
    opt.zero_grad(set_to_none=True)


@pytest.mark.real_gpu(
    "torch.cuda.set_sync_debug_mode('error'): the simulated GPU flags no syncs (refused)"
)
def test_fp16_step_with_a_fused_optimizer_needs_no_sync(dev: torch.device) -> None:
    model, x, y = regression(dev)
    p = ad.precision(dev, "fp16")
    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    fp16_step(p, model, x, y, fused)  # first step: lazy state, allowed to sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fp16_step(p, model, x, y, fused)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    foreach = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    fp16_step(p, model, x, y, foreach)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # the check can fail: GradScaler reads found_inf on the host for other optimizers
        with pytest.raises(RuntimeError, match="synchroniz"):
            fp16_step(p, model, x, y, foreach)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.real_gpu(
    "TF32 is a GPU's reduced-precision matmul; the simulated GPU computes in fp32"
)
def test_fast_matmul_engages_tf32_and_restores_ieee(dev: torch.device) -> None:
    if torch.cuda.get_device_capability(dev)[0] < 8:
        pytest.skip("TF32 needs compute capability 8.0")
    torch.manual_seed(0)
    a, b = (torch.randn(2048, 2048, device=dev) for _ in range(2))
    exact = (a.double() @ b.double()).float()

    def error() -> float:
        return float(((a @ b) - exact).abs().max() / exact.abs().max())

    before = error()
    with ad.fast_matmul():
        inside = error()
    after = error()
    assert before < 1e-5
    assert after < 1e-5
    assert inside > 10 * before  # TF32 keeps 10 mantissa bits: ~1e-3 relative


@pytest.mark.real_gpu("channels_last pays on Tensor Cores; the simulated GPU has none")
def test_channels_last_converts_on_tensor_core_gpus(dev: torch.device) -> None:
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU()).to(dev)
    ad.channels_last(model)
    cc = torch.cuda.get_device_capability(dev)
    converted = model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert converted is (cc >= (7, 0))
