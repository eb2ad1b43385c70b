"""Precision: the policy on hand-built devices; autocast, scaling and step order on the CPU."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import anydevice as ad
from anydevice.hardware.facts import DeviceInfo
from anydevice.numerics.precision import Precision, StepResult
from machines import cpu_device, gpu

NO_ENV: dict[str, str] = {}


def device(kind: str, **kw: object) -> DeviceInfo:
    base: dict[str, object] = dict(kind=kind, index=0, name=f"Test {kind.upper()}")
    base.update(kw)
    return DeviceInfo(**base)  # type: ignore[arg-type]


GTX1080 = gpu(0, "V100", name="NVIDIA GeForce GTX 1080", compute_capability=(6, 1), bf16=False)

# ----------------------------------------------------------------------------- the policy

AUTO_TABLE = [
    pytest.param(gpu(0, "H100"), "bf16", "9.0", id="cuda-cc9.0-H100"),
    pytest.param(gpu(0, "A100"), "bf16", "8.0", id="cuda-cc8.0-A100"),
    pytest.param(gpu(0, "T4"), "fp16", "7.5", id="cuda-cc7.5-T4"),
    pytest.param(gpu(0, "V100"), "fp16", "7.0", id="cuda-cc7.0-V100"),
    pytest.param(GTX1080, "fp32", "6.1", id="cuda-cc6.1-no-tensor-cores"),
    pytest.param(cpu_device(bf16=True), "bf16", "native bf16", id="cpu-with-bf16"),
    pytest.param(cpu_device(bf16=False), "fp32", "has no native bf16", id="cpu-without-bf16"),
    pytest.param(cpu_device(bf16=None), "fp32", "unknown", id="cpu-bf16-unknown"),
    pytest.param(device("mps", bf16=True), "fp16", "fp16 natively", id="mps"),
    pytest.param(device("xpu", bf16=True), "bf16", "XMX", id="xpu-with-bf16"),
    pytest.param(device("xpu", bf16=False), "fp16", "no native bf16", id="xpu-without-bf16"),
    pytest.param(device("xla", name="XLA TPU", bf16=True), "bf16", "TPU", id="xla-tpu"),
    pytest.param(device("xla", bf16=None), "fp32", "not known", id="xla-other"),
    pytest.param(device("meta", index=None), "fp32", "no mixed precision", id="meta"),
]


@pytest.mark.parametrize(("info", "mode", "why"), AUTO_TABLE)
def test_auto_picks_the_mode_of_the_hardware(info: DeviceInfo, mode: str, why: str) -> None:
    p = Precision(info, environ=NO_ENV)
    assert p.mode == mode
    assert p.requested == "auto"
    assert p.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[mode]
    assert p.scaled is (mode == "fp16")
    assert why in p.reason
    assert repr(p).startswith(f"Precision({mode} on {info.spec}: ")


def test_bf16_follows_compute_capability_not_a_stale_bf16_flag() -> None:
    # compute capability decides; the flag can only veto (ROCm reports bf16=False).
    assert Precision(gpu(0, "A100", bf16=None), environ=NO_ENV).mode == "bf16"
    assert Precision(gpu(0, "V100", bf16=True), environ=NO_ENV).mode == "fp16"
    vetoed = gpu(0, "H100", bf16=False)
    assert Precision(vetoed, environ=NO_ENV).mode == "fp16"
    forced = Precision(vetoed, "bf16", environ=NO_ENV)  # allowed: the flag may be unsure
    assert forced.mode == "bf16"
    assert "does not report native bf16" in forced.reason


def test_unknown_compute_capability_falls_back_to_fp32_unless_bf16_is_known() -> None:
    unknown = gpu(0, "H100", compute_capability=None, bf16=None)
    assert Precision(unknown, environ=NO_ENV).mode == "fp32"
    assert Precision(replace(unknown, bf16=True), environ=NO_ENV).mode == "bf16"


REFUSED = [
    pytest.param(gpu(0, "V100"), "bf16", r"capability 8\.0 or later.*mode='fp16'", id="v100"),
    pytest.param(gpu(0, "T4"), "bf16", r"has 7\.5: it would be emulated", id="t4"),
    pytest.param(gpu(0, "V100", compute_capability=(5, 0)), "fp16", "starts at 5.3", id="cc5.0"),
    pytest.param(device("mps", bf16=False), "bf16", "macOS 14", id="mps-old-macos"),
    pytest.param(device("xpu", bf16=False), "bf16", "no native bf16", id="xpu"),
    pytest.param(device("xla", bf16=True), "fp16", "XLA", id="xla-fp16"),
    pytest.param(device("meta", index=None), "bf16", "fp32 only", id="meta"),
]


@pytest.mark.parametrize(("info", "mode", "match"), REFUSED)
def test_forcing_a_mode_the_device_cannot_run_raises(info: DeviceInfo, mode: str, match: str):
    with pytest.raises(ad.PrecisionError, match=match) as caught:
        Precision(info, mode, environ=NO_ENV)
    assert isinstance(caught.value, ValueError)
    assert f"mode={mode!r}" in str(caught.value)
    assert info.spec in str(caught.value)


def test_forced_modes_that_run_say_what_auto_would_do() -> None:
    cpu = Precision(cpu_device(bf16=False), "bf16", environ=NO_ENV)
    assert cpu.mode == "bf16"
    assert "emulated" in cpu.reason
    assert "auto would choose fp32" in cpu.reason
    h100 = Precision(gpu(0, "H100"), "fp16", environ=NO_ENV)
    assert (h100.mode, h100.scaled) == ("fp16", True)
    assert "auto would choose bf16" in h100.reason
    same = Precision(gpu(0, "H100"), "bf16", environ=NO_ENV)
    assert "auto agrees" in same.reason
    assert Precision(gpu(0, "V100"), "fp32", environ=NO_ENV).mode == "fp32"


@pytest.mark.parametrize(
    ("given", "mode"),
    [
        ("BF16", "bf16"),
        ("bfloat16", "bf16"),
        ("bf16-mixed", "bf16"),
        (torch.bfloat16, "bf16"),
        ("half", "fp16"),
        ("16-mixed", "fp16"),
        (torch.float16, "fp16"),
        (" float32 ", "fp32"),
        (torch.float32, "fp32"),
    ],
)
def test_mode_aliases_and_dtypes(given: str | torch.dtype, mode: str) -> None:
    p = Precision(cpu_device(bf16=True), given, environ=NO_ENV)
    assert p.mode == mode
    assert p.requested == mode


def test_unknown_modes_are_refused_with_the_choices() -> None:
    with pytest.raises(ad.PrecisionError, match=r"'fp8'.*'auto', 'bf16', 'fp16' or 'fp32'"):
        Precision(cpu_device(), "fp8", environ=NO_ENV)
    with pytest.raises(ad.PrecisionError, match="torch.int8"):
        Precision(cpu_device(), torch.int8, environ=NO_ENV)
    with pytest.raises(TypeError, match="int"):
        Precision(cpu_device(), 16, environ=NO_ENV)  # type: ignore[arg-type]


def test_env_overrides_auto_but_not_an_explicit_mode() -> None:
    env = {"ANYDEVICE_PRECISION": "fp32"}
    p = Precision(gpu(0, "H100"), environ=env)
    assert p.mode == "fp32"
    assert "ANYDEVICE_PRECISION" in p.reason
    assert Precision(gpu(0, "H100"), "bf16", environ=env).mode == "bf16"
    with pytest.raises(ad.PrecisionError, match="from ANYDEVICE_PRECISION"):
        Precision(gpu(0, "V100"), environ={"ANYDEVICE_PRECISION": "bf16"})
    with pytest.raises(ad.PrecisionError, match="from ANYDEVICE_PRECISION"):
        Precision(gpu(0, "H100"), environ={"ANYDEVICE_PRECISION": "int4"})


def test_precision_resolves_this_machines_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANYDEVICE_PRECISION", raising=False)
    info = ad.describe("cpu", telemetry=False)
    p = ad.precision("cpu")
    assert p.device == torch.device("cpu")
    assert (p.info.kind, p.info.name, p.info.bf16) == ("cpu", info.name, info.bf16)
    assert p.mode == ("bf16" if info.bf16 else "fp32")
    assert ad.precision(info, "fp16").mode == "fp16"


# ----------------------------------------------------------------------------- autocast


def cpu_precision(mode: str) -> Precision:
    return Precision(cpu_device(bf16=True), mode, environ=NO_ENV)


@pytest.mark.parametrize(
    ("mode", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)]
)
def test_autocast_runs_linear_layers_in_the_mode_dtype(mode: str, dtype: torch.dtype) -> None:
    layer = nn.Linear(4, 3)
    with cpu_precision(mode).autocast():
        y = layer(torch.randn(2, 4))
    assert y.dtype == dtype
    assert not torch.is_autocast_enabled("cpu")


def test_fp32_mode_switches_off_an_outer_autocast() -> None:
    layer = nn.Linear(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with cpu_precision("fp32").autocast():
            inner = layer(torch.randn(2, 4))
        outer = layer(torch.randn(2, 4))
    assert inner.dtype == torch.float32
    assert outer.dtype == torch.bfloat16


def test_autocast_can_be_disabled() -> None:
    with cpu_precision("bf16").autocast(enabled=False):
        y = nn.Linear(4, 3)(torch.randn(2, 4))
    assert y.dtype == torch.float32


# ----------------------------------------------------------------------------- training


def regression(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    x = torch.randn(128, 8)
    return model, x, x @ torch.linspace(-1, 1, 8).unsqueeze(1)


def train(p: Precision, steps: int = 40, *, fused: bool = False) -> list[float]:
    model, x, y = regression()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    losses = []
    for _ in range(steps):
        with p.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        p.backward(loss)
        p.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        p.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_training_under_cpu_precision_lowers_the_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANYDEVICE_PRECISION", raising=False)
    losses = train(ad.precision("cpu"))
    assert losses[-1] < 0.2 * losses[0]


@pytest.mark.parametrize("mode", ["bf16", "fp16", "fp32"])
def test_training_lowers_the_loss_in_every_mode(mode: str) -> None:
    losses = train(cpu_precision(mode), fused=mode == "fp16")
    assert losses[-1] < 0.2 * losses[0]


# ----------------------------------------------------------------------------- fp16 scaling


def one_backward(p: Precision, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.mse_loss(model(x), y)  # fp32: gradients comparable exactly
    p.backward(loss)


def test_fp16_scales_gradients_and_unscale_restores_them() -> None:
    model, x, y = regression()
    reference = copy.deepcopy(model)
    nn.functional.mse_loss(reference(x), y).backward()
    p = cpu_precision("fp16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one_backward(p, model, x, y)
    scale = p.scaler.get_scale()  # type: ignore[union-attr]
    assert scale == 2.0**16
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad * scale)  # powers of two scale exactly
    p.unscale_(opt)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_fp16_skips_a_step_with_non_finite_gradients(bad: float, fused: bool) -> None:
    model, x, y = regression()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    p = cpu_precision("fp16")
    before = [t.detach().clone() for t in model.parameters()]
    one_backward(p, model, x, y)
    model[0].weight.grad[0, 0] = bad
    result = p.step(opt)
    assert isinstance(result, StepResult)
    assert not result
    assert result.scale == 2.0**15
    assert "inf/NaN gradients, scale 65536 -> 32768" in repr(result)
    for t, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(t, b)
    opt.zero_grad()
    one_backward(p, model, x, y)
    assert p.step(opt).taken
    assert not torch.equal(model[0].weight, before[0])


def test_fp16_with_two_optimizers_skips_the_one_with_inf_and_backs_off_once() -> None:
    model, x, y = regression()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    p = cpu_precision("fp16")
    w0, w2 = model[0].weight.detach().clone(), model[2].weight.detach().clone()
    one_backward(p, model, x, y)
    model[0].weight.grad[0, 0] = float("inf")
    result = p.step(first, second)
    assert not result
    assert result.scale == 2.0**15  # one back-off for the step, not one per optimizer
    assert torch.equal(model[0].weight, w0)
    assert not torch.equal(model[2].weight, w2)


@pytest.mark.parametrize("mode", ["bf16", "fp32"])
def test_bf16_and_fp32_never_scale_or_skip(mode: str) -> None:
    model, x, y = regression()
    reference = copy.deepcopy(model)
    nn.functional.mse_loss(reference(x), y).backward()
    p = cpu_precision(mode)
    assert p.scaler is None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one_backward(p, model, x, y)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)
    p.unscale_(opt)
    result = p.step(opt)
    assert result.taken
    assert result.scale is None
    assert repr(result) == "StepResult(taken=True)"


# ----------------------------------------------------------------------------- step order


@pytest.mark.parametrize("mode", ["bf16", "fp16", "fp32"])
def test_unscale_twice_in_one_step_fails_in_every_mode(mode: str) -> None:
    model, x, y = regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = cpu_precision(mode)
    one_backward(p, model, x, y)
    p.unscale_(opt)
    with pytest.raises(ad.StepOrderError, match="already called") as caught:
        p.unscale_(opt)
    assert isinstance(caught.value, RuntimeError)
    assert p.step(opt)
    one_backward(p, model, x, y)
    p.unscale_(opt)  # a new step: allowed again


@pytest.mark.parametrize("mode", ["bf16", "fp16", "fp32"])
def test_step_or_unscale_without_backward_fails_in_every_mode(mode: str) -> None:
    model, x, y = regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = cpu_precision(mode)
    with pytest.raises(ad.StepOrderError, match="before backward"):
        p.unscale_(opt)
    with pytest.raises(ad.StepOrderError, match="without backward"):
        p.step(opt)
    one_backward(p, model, x, y)
    p.step(opt)
    with pytest.raises(ad.StepOrderError, match="without backward"):
        p.step(opt)  # the gradients of the last step were used already


def test_gradient_accumulation_is_several_backwards_then_one_step() -> None:
    model, x, y = regression()
    reference = copy.deepcopy(model)
    for half in (x[:64], x[64:]):
        nn.functional.mse_loss(reference(half), y[: len(half)]).backward()
    p = cpu_precision("fp16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for half in (x[:64], x[64:]):
        one_backward(p, model, half, y[: len(half)])
    p.unscale_(opt)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(got.grad, want.grad)
    assert p.step(opt)


def test_backward_refuses_a_loss_on_another_device() -> None:
    p = cpu_precision("bf16")
    loss = torch.ones((), device="meta", requires_grad=True)
    with pytest.raises(ad.PrecisionError, match="loss is on meta"):
        p.backward(loss)


def test_backward_inside_autocast_warns() -> None:
    model, x, y = regression()
    p = cpu_precision("bf16")
    with p.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
        with pytest.warns(UserWarning, match="inside autocast"):
            p.backward(loss)


# ----------------------------------------------------------------------------- checkpoints


def test_state_dict_round_trip_through_a_file_keeps_the_loss_scale(tmp_path) -> None:
    model, x, y = regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = cpu_precision("fp16")
    one_backward(p, model, x, y)
    model[0].weight.grad[0, 0] = float("inf")
    p.step(opt)
    torch.save(p.state_dict(), tmp_path / "precision.pt")

    resumed = cpu_precision("fp16")
    resumed.load_state_dict(torch.load(tmp_path / "precision.pt"))
    assert resumed.state_dict() == p.state_dict()
    assert resumed.scaler.get_scale() == 2.0**15  # type: ignore[union-attr]


def test_state_dicts_move_between_modes() -> None:
    model, x, y = regression()
    fp16 = cpu_precision("fp16")
    one_backward(fp16, model, x, y)
    model[0].weight.grad[0, 0] = float("inf")
    fp16.step(torch.optim.SGD(model.parameters(), lr=0.1))
    assert fp16.state_dict()["scaler"]["scale"] == 2.0**15
    bf16 = cpu_precision("bf16")
    bf16.load_state_dict(fp16.state_dict())  # an fp16 checkpoint resumed where bf16 runs
    assert bf16.state_dict() == {"mode": "bf16", "scaler": {}}
    fresh = cpu_precision("fp16")
    fresh.load_state_dict(bf16.state_dict())
    assert fresh.scaler.get_scale() == 2.0**16  # type: ignore[union-attr]
    with pytest.raises(ad.PrecisionError, match="not a Precision.state_dict"):
        fresh.load_state_dict({"scale": 2.0})
