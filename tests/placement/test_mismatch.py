"""ad.device_of, ad.check_devices and ad.diagnose, against torch's own mismatch errors.

Without a GPU, ``FakeTensorMode`` builds fake ``cuda`` tensors (shapes and devices, no
data) and raises torch's real mismatch error when an operation mixes them with CPU
tensors. Autograd cannot run on fake CUDA tensors in a CPU build, so forwards run under
``torch.no_grad()``. Real CUDA checks are in test_placement_cuda.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.rnn import pack_padded_sequence

import anydevice as ad
from anydevice.placement.mismatch import is_device_mismatch, tensors

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
META = torch.device("meta")


class Pair(NamedTuple):
    a: Any
    b: Any


@contextmanager
def fake() -> Iterator[None]:
    with FakeTensorMode(), torch.no_grad():
        yield


def fake_cuda(module: nn.Module) -> nn.Module:
    """Put every parameter and buffer of ``module`` on a fake cuda:0 (call inside fake())."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cuda")))
        for name, b in list(sub.named_buffers(recurse=False)):
            sub.register_buffer(name, torch.empty(b.shape, dtype=b.dtype, device="cuda"))
    return module


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(8, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.encoder(batch["x"])) * batch["mask"]


def half_moved() -> Model:
    """The classic bug: the encoder is on the GPU, the head was left on the CPU."""
    model = Model()
    fake_cuda(model.encoder)
    return model


# ----------------------------------------------------------------------------- device_of


def test_device_of_model_batch_and_tensor():
    assert ad.device_of(nn.Linear(2, 2)) == CPU
    assert ad.device_of(nn.Linear(2, 2, device="meta")) == META
    assert ad.device_of({"x": [torch.ones(1, device="meta")], "s": "text"}) == META
    assert ad.device_of(torch.ones(1)) == CPU


def test_device_of_spread_model_raises_mismatch_with_report():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].to("meta")
    with pytest.raises(ad.DeviceMismatchError) as info:
        ad.device_of(model)
    text = str(info.value)
    assert "model.0.* on cpu (2 tensors)" in text and "model.1.* on meta (2 tensors)" in text
    assert info.value.devices == {CPU: 2, META: 2}
    assert isinstance(info.value, RuntimeError)


def test_device_of_without_tensors_is_a_clear_error():
    with pytest.raises(ad.NoTensorError, match="holds no tensor"):
        ad.device_of(nn.ReLU())
    with pytest.raises(ValueError, match="holds no tensor"):
        ad.device_of(["a", 1])


def test_devices_of_counts_every_device():
    batch = {"a": torch.ones(1), "b": [torch.ones(1, device="meta"), torch.ones(1)]}
    assert ad.devices_of(batch) == {CPU: 2, META: 1}
    assert ad.devices_of(["no tensors"]) == {}


def test_devices_of_optimizer_ignores_step_counters_on_cpu():
    model = nn.Linear(3, 2, device="meta")
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p)}
    assert ad.devices_of(opt) == {META: 4}


def test_devices_of_packed_sequence_ignores_batch_sizes():
    packed = ad.to(pack_padded_sequence(torch.ones(2, 3, 4), [3, 1], batch_first=True), META)
    assert ad.device_of(packed) == META


def test_tensors_lists_paths():
    paths = [p for p, _ in tensors({"m": nn.Linear(1, 1), "p": Pair(torch.ones(1), 0)}, "b")]
    assert paths == ["b['m'].weight", "b['m'].bias", "b['p'].a"]


# ----------------------------------------------------------------------------- recognising


def _raise(fn: Any) -> BaseException:
    with fake(), pytest.raises(Exception) as info:
        fn()
    return info.value


LONG = torch.long
REAL_MISMATCHES = {
    "add": lambda: torch.ones(3, device="cuda") + torch.ones(3),
    "mm": lambda: torch.ones(3, 3, device="cuda") @ torch.ones(3, 3),
    "linear": lambda: F.linear(torch.ones(2, 3), torch.ones(4, 3, device="cuda")),
    "embedding": lambda: F.embedding(torch.zeros(3, dtype=LONG), torch.ones(5, 2, device="cuda")),
    "cat": lambda: torch.cat([torch.ones(2, device="cuda"), torch.ones(2)]),
    "index_select": lambda: torch.ones(4).index_select(0, torch.ones(2, dtype=LONG, device="cuda")),
    "cross_entropy": lambda: F.cross_entropy(torch.ones(4, 5, device="cuda"), torch.ones(4).long()),
    "layer_norm": lambda: F.layer_norm(torch.ones(2, 4, device="cuda"), (4,), torch.ones(4)),
    "lstm": lambda: nn.LSTM(4, 4)(torch.ones(2, 1, 4, device="cuda")),
    "sdpa": lambda: F.scaled_dot_product_attention(
        torch.ones(1, 2, 4, 8, device="cuda"), torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8)
    ),
}  # fmt: skip


@pytest.mark.parametrize("op", sorted(REAL_MISMATCHES))
def test_torchs_own_mismatch_errors_are_recognised(op):
    error = _raise(REAL_MISMATCHES[op])
    assert isinstance(error, RuntimeError)
    assert is_device_mismatch(error), str(error)


def test_meta_mismatch_error_is_recognised():
    with pytest.raises(RuntimeError) as info:
        torch.ones(2) + torch.ones(2, device="meta")
    assert is_device_mismatch(info.value)


# Wordings from torch's sources that need a real GPU to trigger (conv's type check,
# checkAllSameGPU, advanced indexing, the optimizer's grouping check).
GPU_ONLY_WORDINGS = [
    "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the "
    "same or input should be a MKLDNN tensor and weight is a dense tensor",
    "Input type (CUDAFloatType) and weight type (CPUFloatType) should be the same",
    "Tensor for argument #2 'mat1' is on CPU, but expected it to be on GPU (while checking "
    "arguments for addmm)",
    "Expected tensor for argument #1 'input' to have the same device as tensor for argument "
    "#2 'weight'; but device 1 does not equal 0 (while checking arguments for cudnn_convolution)",
    "indices should be either on cpu or on the same device as the indexed tensor (cpu)",
    "Expected all tensors to be on the same device, but got mat2 is on cpu, different from "
    "other tensors on cuda:0 (when checking argument in method wrapper_CUDA_mm)",
    "Tensors of the same index must be on the same device and the same dtype except `step` "
    "tensors that can be CPU and float32/64",
]


@pytest.mark.parametrize("text", GPU_ONLY_WORDINGS)
def test_gpu_only_wordings_are_recognised(text):
    assert is_device_mismatch(RuntimeError(text))


def test_other_errors_are_not_mismatches():
    with pytest.raises(RuntimeError) as dtype_error:
        torch.ones(2, 2) @ torch.ones(2, 2, dtype=torch.float64)
    assert not is_device_mismatch(dtype_error.value)
    with pytest.raises(RuntimeError) as shape_error:
        torch.ones(2, 3) @ torch.ones(2, 3)
    assert not is_device_mismatch(shape_error.value)
    dtype_pair = (
        "Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) should "
        "be the same"
    )
    assert not is_device_mismatch(RuntimeError(dtype_pair))
    assert not is_device_mismatch(KeyError("Expected all tensors to be on the same device"))


# ----------------------------------------------------------------------------- check_devices


def test_check_devices_returns_the_one_device():
    model = Model()
    batch = {"x": torch.ones(2, 8), "mask": torch.ones(2, 2)}
    assert ad.check_devices(model, batch) == CPU
    assert ad.check_devices(None, batch=batch) == CPU


def test_check_devices_report_groups_modules_and_names_inputs():
    with fake():
        model = half_moved()
        batch = {"x": torch.ones(2, 8, device="cuda"), "mask": torch.ones(2, 2)}
        with pytest.raises(ad.DeviceMismatchError) as info:
            ad.check_devices(model, batch=batch)
    text = str(info.value)
    assert "model.encoder.* on cuda:0 (8 tensors); model.head.* on cpu (2 tensors); " in text
    assert "input batch['x'] on cuda:0; input batch['mask'] on cpu." in text
    assert 'ad.to(model, "cuda:0")' in text
    assert info.value.devices == {CUDA: 9, CPU: 3}
    assert info.value.suggested == CUDA
    assert ("model.head.*", CPU, 2) in info.value.groups


def test_check_devices_names_a_single_stray_parameter_by_its_full_path():
    with fake():
        model = fake_cuda(Model())
        model.head.weight = nn.Parameter(torch.empty(2, 8))
        with pytest.raises(ad.DeviceMismatchError) as info:
            ad.check_devices(model, torch.ones(2, 8, device="cuda"))
    text = str(info.value)
    assert (
        "model.encoder.* on cuda:0 (8 tensors); model.head.weight on cpu; model.head.bias on cuda:0"
        in text
    )
    assert "input args[0] on cuda:0" in text


def test_check_devices_flags_plain_tensor_attributes():
    class WithMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(2, 2)
            self.mask = torch.ones(2)  # not a buffer: Module.to() leaves it behind

    model = WithMask()
    model.proj.to("meta")
    with pytest.raises(ad.DeviceMismatchError) as info:
        ad.check_devices(model)
    assert "model.mask on cpu (a plain tensor attribute" in str(info.value)
    assert "register_buffer" in str(info.value)


def test_check_devices_caps_long_reports():
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(30)])
    for layer in model[::2]:
        layer.to("meta")
    with pytest.raises(ad.DeviceMismatchError) as info:
        ad.check_devices(model)
    assert "and 18 more groups" in str(info.value)
    assert len(info.value.groups) == 30


def test_check_devices_without_tensors_is_a_clear_error():
    with pytest.raises(ad.NoTensorError):
        ad.check_devices(nn.ReLU(), "text")


# ----------------------------------------------------------------------------- diagnose


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_diagnose_names_the_failing_module_and_its_tensors():
    with fake():
        model = half_moved()
        batch = {"x": torch.ones(2, 8, device="cuda"), "mask": torch.ones(2, 2, device="cuda")}
        with pytest.raises(ad.DeviceMismatchError) as info, ad.diagnose(model, batch=batch):
            model(batch)
    error = info.value
    text = str(error)
    assert text.startswith("Expected all tensors to be on the same device")
    failed = "It failed in model.head (Linear.forward): input on cuda:0; model.head.* on cpu"
    assert failed + " (2 tensors)." in text
    survey = "model.encoder.* on cuda:0 (8 tensors); model.head.* on cpu (2 tensors); "
    assert survey + "input batch on cuda:0 (2 tensors)." in text
    assert error.suggested == CUDA
    assert is_device_mismatch(error.__cause__)
    assert type(error.__cause__).__name__ == "FakeTensorDeviceMismatchError"


def test_diagnose_shows_the_intermediate_tensors_of_the_failing_forward():
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            hidden = self.proj(x)
            return hidden * scale

    with fake():
        model = fake_cuda(Gate())
        scale = torch.ones(4)  # left on the CPU
        with pytest.raises(ad.DeviceMismatchError) as info, ad.diagnose(model):
            model(torch.ones(2, 4, device="cuda"), scale)
    text = str(info.value)
    assert "It failed in model (Gate.forward): x on cuda:0; scale on cpu; hidden on cuda:0" in text


def test_diagnose_points_at_tensors_made_inside_forward():
    class MakesItsOwn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) + torch.arange(4.0)  # forgot device=x.device

    with fake():
        model = fake_cuda(MakesItsOwn())
        with pytest.raises(ad.DeviceMismatchError) as info, ad.diagnose(model):
            model(torch.ones(2, 4, device="cuda"))
    text = str(info.value)
    assert "It failed in model (MakesItsOwn.forward): x on cuda:0." in text
    assert "so the other tensor was made inside the failing call" in text


def test_diagnose_names_the_code_when_the_error_is_outside_the_model():
    def training_step(model: nn.Module, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits, targets)

    with fake():
        model = fake_cuda(nn.Linear(4, 2))
        x, targets = torch.ones(3, 4, device="cuda"), torch.zeros(3, dtype=torch.long)
        with pytest.raises(ad.DeviceMismatchError) as info, ad.diagnose(model):
            training_step(model, x, targets)
    text = str(info.value)
    assert "It failed in training_step() at " in text and "outside the model's modules" in text
    assert "x on cuda:0; targets on cpu; logits on cuda:0." in text
    assert "The model is on 1 device: cuda:0 (2 tensors)." in text


def test_diagnose_names_modules_that_are_not_part_of_the_model():
    with fake():
        model = fake_cuda(nn.Linear(4, 2))
        loss_fn = nn.CrossEntropyLoss()
        targets = torch.zeros(3, dtype=torch.long)
        with pytest.raises(ad.DeviceMismatchError) as info, ad.diagnose(model):
            loss_fn(model(torch.ones(3, 4, device="cuda")), targets)
    text = str(info.value)
    assert "It failed in CrossEntropyLoss (CrossEntropyLoss.forward, which is not part" in text
    assert "input on cuda:0; target on cpu" in text


def test_diagnose_lets_other_errors_through_untouched():
    model = nn.Linear(2, 2)
    original = ValueError("not about devices")
    with pytest.raises(ValueError) as info, ad.diagnose(model):
        raise original
    assert info.value is original
    with pytest.raises(RuntimeError) as shape, ad.diagnose(model):
        model(torch.ones(3, 5))
    assert not isinstance(shape.value, ad.DeviceMismatchError)


def test_diagnose_neither_hooks_nor_changes_the_model():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with ad.diagnose(model) as guard:
        assert _hooks(model) == 0
        out = model(torch.ones(1, 2))
    assert guard.model is model
    assert out.shape == (1, 2)


def test_diagnose_as_decorator_names_the_functions_arguments():
    with fake():
        model = fake_cuda(nn.Linear(4, 2))

        @ad.diagnose(model)
        def step(batch: dict[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
            return model(batch["x"]) * scale

        assert step.__name__ == "step"
        assert step({"x": torch.ones(1, 4, device="cuda")}).device == CUDA
        with pytest.raises(ad.DeviceMismatchError) as info:
            step({"x": torch.ones(1, 4)})
    text = str(info.value)
    assert "input batch['x'] on cpu" in text
    assert "It failed in model (Linear.forward): input on cpu; model.* on cuda:0" in text


def test_diagnose_can_nest_and_be_reused():
    with fake():
        model = half_moved()
        guard = ad.diagnose(model)
        with guard, guard:
            model.encoder(torch.ones(1, 8, device="cuda"))
        with pytest.raises(ad.DeviceMismatchError) as info, guard, guard:
            model.head(torch.ones(1, 8, device="cuda"))
    assert isinstance(info.value.__cause__, RuntimeError)  # replaced once, not twice
    assert not isinstance(info.value.__cause__, ad.DeviceMismatchError)


def test_caught_errors_inside_submodules_do_not_confuse_the_report():
    class Fallback(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.second = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                self.first(torch.ones(3, 5))  # a wrong shape, caught on purpose
            except RuntimeError:
                pass
            return self.second(x)

    with fake():
        model = Fallback()
        fake_cuda(model.first)
        with pytest.raises(ad.DeviceMismatchError) as info, ad.diagnose(model):
            model(torch.ones(2, 4, device="cuda"))
    assert "It failed in model.second (Linear.forward)" in str(info.value)


def test_diagnose_takes_only_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        ad.diagnose(lambda x: x)  # type: ignore[arg-type]


def test_report_line_format_matches_the_documented_example():
    with fake():
        model = half_moved()
        with pytest.raises(ad.DeviceMismatchError) as info:
            ad.check_devices(model, batch={"mask": torch.ones(1)})
    line = str(info.value).splitlines()[1]
    assert re.fullmatch(
        r"(model\.[\w.]+\* on \S+ \(\d+ tensors\); )+input batch\['mask'\] on cpu\.", line
    )


def test_diagnose_in_a_script_lists_only_its_tensors_not_its_containers():
    script = (
        "dataset = [torch.ones(1) for _ in range(100)]\n"
        "with fake():\n"
        "    model = fake_cuda(nn.Linear(2, 2))\n"
        "    x = torch.ones(2, device='cuda')\n"
        "    with ad.diagnose(model):\n"
        "        y = x + torch.ones(2)\n"
    )
    namespace = {"torch": torch, "nn": nn, "ad": ad, "fake": fake, "fake_cuda": fake_cuda}
    with pytest.raises(ad.DeviceMismatchError) as info:
        exec(compile(script, "train.py", "exec"), namespace)
    text = str(info.value)
    assert (
        "It failed in <module>() at train.py:6, outside the model's modules: x on cuda:0." in text
    )
    assert "dataset" not in text


# -- MPS: operators without a kernel, and the CPU fallback that must be set before import

#: torch's message for an operator MPS lacks (aten/src/ATen/mps/MPSFallback.mm).
MPS_MESSAGE = (
    "The operator 'aten::_linalg_eigh.eigenvalues' is not currently implemented for the MPS "
    "device. If you want this op to be added in priority during the prototype phase of this "
    "feature, please comment on https://github.com/pytorch/pytorch/issues/77764. As a "
    "temporary fix, you can set the environment variable `PYTORCH_ENABLE_MPS_FALLBACK=1` to "
    "use the CPU as a fallback for this op. WARNING: this will be slower than running "
    "natively on MPS."
)


def test_mps_advice_names_the_op_and_says_before_import():
    from anydevice.placement.mismatch import mps_fallback_advice

    advice = mps_fallback_advice(NotImplementedError(MPS_MESSAGE), {})
    assert advice is not None
    assert advice.startswith("aten::_linalg_eigh.eigenvalues has no MPS kernel")
    assert "before torch is imported" in advice and "PYTORCH_ENABLE_MPS_FALLBACK=1 python" in advice
    assert "too late" not in advice
    late = mps_fallback_advice(
        NotImplementedError(MPS_MESSAGE), {"PYTORCH_ENABLE_MPS_FALLBACK": "1"}
    )
    assert late is not None and "set after torch was imported, too late" in late
    assert mps_fallback_advice(RuntimeError(MPS_MESSAGE), {}) is None
    assert mps_fallback_advice(NotImplementedError("subclasses implement this"), {}) is None


def test_diagnose_adds_the_mps_advice_and_keeps_the_error():
    model = nn.Linear(2, 2)
    original = NotImplementedError(MPS_MESSAGE)
    expected = "(?s)implemented for the MPS.*before torch is imported"
    with pytest.raises(NotImplementedError, match=expected) as info, ad.diagnose(model):
        raise original
    assert info.value.__cause__ is original

    @ad.diagnose(model)
    def step(x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(MPS_MESSAGE)

    with pytest.raises(NotImplementedError, match="has no MPS kernel"):
        step(torch.ones(1, 2))
    # Any other NotImplementedError passes through untouched.
    with pytest.raises(NotImplementedError, match="^other$"), ad.diagnose(model):
        raise NotImplementedError("other")


def test_doctor_says_the_mps_fallback_needs_setting_before_import():
    from anydevice.doctor.checks import check_mps_fallback
    from machines import machine

    mac = machine(others=(ad.DeviceInfo(kind="mps", index=0, name="Apple M3 GPU"),))
    c = check_mps_fallback(mac, {})
    assert c.status == "info" and "only when imported" in c.summary
    assert c.fix == "Set it when launching: PYTORCH_ENABLE_MPS_FALLBACK=1 python train.py"
    assert check_mps_fallback(mac, {"PYTORCH_ENABLE_MPS_FALLBACK": "1"}).status == "ok"
    assert check_mps_fallback(machine(), {}).status == "skip"
