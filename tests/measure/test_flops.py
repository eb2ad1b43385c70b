"""FLOP counting: exact counts of known layers, the 6·N·tokens rule, forward and backward
apart, the dtype the math ran in, meta counting, and ops the counter cannot count."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import anydevice as ad
from anydevice.measure.flops import FlopCount
from anydevice.numerics.matmul import strict_fp32


def test_linear_forward_is_two_flops_per_multiply_add():
    b, i, o = 16, 64, 32
    count = ad.flops(nn.Linear(i, o), torch.randn(b, i))
    assert count.forward == count.total == 2 * b * i * o
    assert count.backward == 0
    assert count.by_op == {"addmm": 2 * b * i * o}
    assert count.by_dtype == {"fp32": 2 * b * i * o} and count.dtype == "fp32"
    assert count.module("Linear").forward == 2 * b * i * o


def test_linear_backward_is_twice_the_forward():
    b, i, o = 8, 48, 24
    layer = nn.Linear(i, o)
    x = torch.randn(b, i, requires_grad=True)
    count = ad.flops(lambda: layer(x).sum().backward())
    assert count.forward == 2 * b * i * o
    assert count.backward == 2 * count.forward  # the gradients of the input and the weight
    assert layer.weight.grad is not None  # the call ran for real


def test_backward_without_an_input_gradient_is_the_weight_gradient_only():
    b, i, o = 8, 48, 24
    layer = nn.Linear(i, o)
    count = ad.flops(lambda: layer(torch.randn(b, i)).sum().backward())
    assert count.backward == count.forward == 2 * b * i * o


def test_conv2d_is_counted_exactly():
    n, cin, cout, k, hw = 2, 3, 8, 3, 16
    count = ad.flops(nn.Conv2d(cin, cout, k, padding=1), torch.randn(n, cin, hw, hw))
    assert count.total == 2 * n * cout * hw * hw * cin * k * k


class Block(nn.Module):
    """A pre-norm transformer block, as in GPT-2."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def test_a_transformer_block_follows_the_six_n_tokens_rule():
    d, t, b = 128, 8, 4
    block = Block(d, heads=4)
    x = torch.randn(b, t, d)
    count = ad.flops(lambda: block(x).sum().backward())
    n = sum(p.numel() for p in block.parameters())
    rule = 6 * n * b * t
    assert abs(count.total - rule) / rule < 0.02, (count.total, rule)
    # the attention itself is counted on the CPU too (torch's counter alone counts it as 0)
    assert count.by_op.get("_scaled_dot_product_flash_attention_for_cpu", 0) > 0
    assert not count.unsupported


def test_modules_are_a_tree_with_forward_and_backward_apart():
    d = 32
    block = Block(d, heads=2)
    x = torch.randn(2, 4, d)
    count = ad.flops(lambda: block(x).sum().backward())
    names = [m.name for m in count.modules]
    assert names[0] == "Block"  # the root first, every parent before its children
    for m in count.modules[1:]:
        assert names.index(m.name.rsplit(".", 1)[0]) < names.index(m.name)
    root, mlp = count.module("Block"), count.module("Block.mlp")
    assert (root.forward, root.backward) == (count.forward, count.backward)
    layers = [count.module(f"Block.mlp.{i}") for i in (0, 2)]
    assert mlp.forward == sum(m.forward for m in layers) == 2 * 2 * 2 * 4 * (d * 4 * d)
    assert mlp.backward == 2 * mlp.forward
    assert "Block.mlp" in repr(count) and "backward" in repr(count)
    with pytest.raises(KeyError, match="Block.mlp"):
        count.module("Block.nothing")


def test_meta_counts_without_running_and_leaves_the_model_alone():
    big = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096))
    weight = big[0].weight
    x = torch.randn(2048, 4096)  # a real run: 137 GFLOP, a second or more here
    count = ad.flops(big, x, meta=True)
    assert count.device == "meta"
    assert count.total == 2 * (2 * 2048 * 4096 * 4096)
    assert big[0].weight is weight and weight.device.type == "cpu"
    small = nn.Linear(16, 8)
    inputs = torch.randn(4, 16, requires_grad=True)
    real = ad.flops(lambda m, x: m(x).sum().backward(), small, inputs)
    meta = ad.flops(lambda m, x: m(x).sum().backward(), small, inputs, meta=True)
    assert (meta.forward, meta.backward) == (real.forward, real.backward)


def test_the_dtype_under_autocast_is_recorded():
    layer = nn.Linear(16, 8)  # tiny: bf16 may be emulated on this CPU
    with torch.autocast("cpu", dtype=torch.bfloat16):
        count = ad.flops(layer, torch.randn(4, 16))
    assert count.by_dtype == {"bf16": 2 * 4 * 16 * 8} and count.dtype == "bf16"


def test_ops_without_a_formula_are_named_not_silently_zero():
    lstm = nn.LSTM(8, 8)
    count = ad.flops(lambda: lstm(torch.randn(3, 2, 8))[0].sum().backward())
    assert count.total == 0
    assert any("rnn" in op for op in count.unsupported), count.unsupported
    assert "no FLOP formula" in repr(count)


def test_a_custom_op_is_named():
    @torch.library.custom_op("anydevice_test::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    count = ad.flops(lambda x: double(x) @ x, torch.randn(4, 4))
    assert count.total == 2 * 4 * 4 * 4
    assert count.unsupported == ("anydevice_test::double",)


def test_views_and_elementwise_ops_are_not_named():
    count = ad.flops(lambda x: (x.t().relu() + 1).sum(), torch.randn(4, 4))
    assert count.total == 0 and count.unsupported == ()


def test_flop_count_to_dict_is_plain():
    count = ad.flops(nn.Linear(4, 2), torch.randn(3, 4))
    d = count.to_dict()
    assert d["total"] == count.total == 2 * 3 * 4 * 2
    assert d["modules"] == [{"name": "Linear", "forward": 48, "backward": 0}]


def test_agrees_with_lightning_measure_flops():
    throughput = pytest.importorskip("lightning.fabric.utilities.throughput")
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    x = torch.randn(16, 32)
    theirs_forward = throughput.measure_flops(model, lambda: model(x))
    theirs_step = throughput.measure_flops(model, lambda: model(x), lambda y: y.sum())
    assert ad.flops(model, x).total == theirs_forward
    assert ad.flops(lambda: model(x).sum().backward()).total == theirs_step


# ----------------------------------------------------------------------------- rates


def test_measurement_rates_are_flops_over_the_median_against_the_peak():
    from anydevice.measure.throughput import Peak

    peak = Peak(4.0, "fp32", "given")
    m = ad.Measurement(times=(0.4, 0.5, 0.6), flops=10**12, peak=peak)
    assert m.tflops == pytest.approx(2.0)
    assert m.mfu == pytest.approx(0.5)
    assert "MFU 50.0% of 4 (given)" in repr(m)
    assert ad.Measurement(times=(1.0,), flops=10**12).mfu is None
    assert ad.Measurement(times=(1.0,)).tflops is None


def test_a_rate_above_the_peak_gives_no_mfu_but_the_reason():
    from anydevice.measure.throughput import Peak

    peak = Peak(1.0, "fp32", "measured: fp32 matmul 2048^3 on cpu")
    m = ad.Measurement(times=(0.5, 0.5, 0.5, 0.5, 0.5), flops=7 * 10**11, peak=peak)
    assert m.tflops == pytest.approx(1.4)
    assert m.mfu is None
    assert m.mfu_invalid is not None and m.mfu_invalid.startswith("the rate is 1.4x the peak")
    assert "measured under other conditions" in m.mfu_invalid
    assert "140" not in repr(m) and "MFU not given: the rate is 1.4x the peak" in repr(m)
    assert m.to_dict()["mfu"] is None and m.to_dict()["mfu_invalid"] == m.mfu_invalid
    assert ad.Measurement(times=(1.0,), flops=10**12, peak=peak).mfu == 1.0


def test_timeit_counts_flops_and_sets_them_against_the_cpus_measured_peak():
    from anydevice.measure.throughput import peak_tflops

    n = 128
    a = torch.randn(n, n)
    m = ad.timeit(torch.mm, a, a, flops=True, min_time=0.02)
    assert m.flops == 2 * n**3
    peak = peak_tflops("cpu", "fp32")
    assert m.peak == peak and peak is not None and peak.measured
    share = 2 * n**3 / m.median / 1e12 / peak.tflops
    if share <= 1:
        assert m.mfu == pytest.approx(share) and m.mfu_invalid is None
    else:  # a busy machine: the peak was measured at another moment, under other load
        assert m.mfu is None and "measured under other conditions" in str(m.mfu_invalid)
    assert m.to_dict()["peak_source"].startswith("measured: fp32 matmul")


def test_timeit_takes_a_flop_count_or_a_number():
    a = torch.randn(64, 64, dtype=torch.float64)
    count = ad.flops(torch.mm, a, a)
    assert count.dtype == "fp64"
    by_count = ad.timeit(torch.mm, a, a, flops=count, min_time=0.01)
    by_number = ad.timeit(torch.mm, a, a, flops=count.total, min_time=0.01)
    assert by_count.flops == by_number.flops == 2 * 64**3
    assert by_count.peak is not None and by_count.peak.dtype == "fp64"
    assert by_number.peak == by_count.peak  # the dtype read from the arguments


def test_timeit_counting_uses_the_first_warmup_call():
    calls = []

    def fn() -> None:
        calls.append(1)

    ad.timeit(fn, flops=True, warmup=2, repeat=1, number=1)
    counted_and_warm = len(calls)
    calls.clear()
    ad.timeit(fn, warmup=2, repeat=1, number=1)
    assert counted_and_warm == len(calls)
    calls.clear()
    m = ad.timeit(fn, flops=True, warmup=0, repeat=1, number=1)
    assert m.flops == 0 and m.tflops == 0.0


def test_a_negative_flop_number_is_refused():
    with pytest.raises(ValueError, match="flops must be >= 0"):
        ad.timeit(lambda: None, flops=-1, repeat=1, number=1)


def test_no_peak_is_guessed():
    from anydevice.measure.throughput import peak_tflops

    assert peak_tflops("cpu", "fp8") is None
    assert peak_tflops("cpu", "tf32") is None  # TF32 is a CUDA mode
    assert peak_tflops("meta", "fp32") is None
    assert FlopCount(forward=0).dtype is None
    assert math.isfinite(peak_tflops("cpu", "fp32").tflops)  # type: ignore[union-attr]


@pytest.mark.cuda
def test_bf16_matmul_reaches_most_of_an_h100s_peak():
    from anydevice.hardware.selection import describe

    if "H100" not in describe("cuda:0", telemetry=False).name:
        pytest.skip("the 0.7 MFU anchor is an H100's")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    m = ad.timeit(torch.mm, a, a, flops=True, min_time=0.5)
    assert m.peak is not None and m.peak.dtype == "bf16" and not m.peak.measured
    assert m.mfu is not None and m.mfu >= 0.7, m


@pytest.mark.cuda
@pytest.mark.real_gpu(
    "TF32 is a GPU's reduced-precision matmul; the simulated GPU computes in fp32"
)
def test_fp32_matmul_under_fast_matmul_is_set_against_tf32():
    a = torch.randn(1024, 1024, device="cuda")
    with ad.fast_matmul():
        count = ad.flops(torch.mm, a, a)
    assert count.by_dtype == {"tf32": 2 * 1024**3}
    assert ad.flops(torch.mm, a, a).dtype == "fp32"


# ----------------------------------------------------------------------------- TF32 settings


def cuda_shaped(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Tensors torch places on cuda:0 (shape, dtype and device propagate through real ops),
    with no data and no GPU: torch's own FakeTensorMode, which torch.compile traces with.
    The counting and the settings it reads are the real ones; no kernel runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return [torch.empty(*shape, device="cuda") for shape in shapes]


def set_new_api(path: str, value: str) -> None:
    """``torch.backends.<path>.fp32_precision = value``: torch's current TF32 API (2.9+)."""
    node: object = torch.backends
    for part in filter(None, path.split(".")):
        node = getattr(node, part)
    node.fp32_precision = value  # type: ignore[attr-defined]


NODES = [("generic", "all")] + [
    (b, op) for b in ("cuda", "mkldnn") for op in ("all", "matmul", "conv", "rnn")
]
NEW_API = pytest.mark.skipif(
    not hasattr(torch._C, "_get_fp32_precision_getter"),
    reason="torch's fp32_precision settings arrived in torch 2.9",
)


@NEW_API
@pytest.mark.parametrize(
    ("path", "value", "op", "expected"),
    [
        ("cuda.matmul", "tf32", "mm", "tf32"),  # the leaf cuBLAS reads
        ("", "tf32", "mm", "tf32"),  # the root, inherited down to the matmul leaf
        ("cudnn", "tf32", "mm", "tf32"),  # the cuda level is the matmul leaf's parent too
        ("cuda.matmul", "ieee", "mm", "fp32"),
        ("cudnn.conv", "ieee", "conv", "fp32"),  # the leaf cuDNN reads
        ("cudnn", "ieee", "conv", "fp32"),  # conv inherits from the cuda level
        ("", "ieee", "conv", "fp32"),
        ("cudnn.conv", "tf32", "conv", "tf32"),
    ],
)
def test_tf32_set_through_torchs_fp32_precision_tree_decides_the_dtype(path, value, op, expected):
    shapes = [(2, 3, 16, 16), (8, 3, 3, 3)] if op == "conv" else [(64, 64), (64, 64)]
    x, w = cuda_shaped(*shapes)
    call = torch.mm if op == "mm" else torch.nn.functional.conv2d
    with strict_fp32():  # every setting is restored exactly after the block
        for node in NODES:  # nothing set anywhere: each leaf inherits from the root
            torch._C._set_fp32_precision_setter(*node, "none")
        set_new_api(path, value)
        count = ad.flops(call, x, w)
    assert count.device == "cuda:0"
    assert count.by_dtype == {expected: count.total} and count.total > 0


def test_tf32_set_through_the_legacy_flags_decides_the_dtype_too():
    a, x, w = cuda_shaped((32, 32), (1, 3, 8, 8), (4, 3, 3, 3))
    with strict_fp32():
        assert ad.flops(torch.mm, a, a).dtype == "fp32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert ad.flops(torch.mm, a, a).dtype == "tf32"
        torch.backends.cudnn.allow_tf32 = False
        assert ad.flops(torch.nn.functional.conv2d, x, w).dtype == "fp32"
        torch.backends.cudnn.allow_tf32 = True
        assert ad.flops(torch.nn.functional.conv2d, x, w).dtype == "tf32"


def test_tf32_turned_on_inside_the_counted_call_is_seen():
    (a,) = cuda_shaped((32, 32))

    def turns_tf32_on() -> None:
        torch.mm(a, a)
        with ad.fast_matmul():
            torch.mm(a, a)

    with strict_fp32():
        count = ad.flops(turns_tf32_on)
    assert count.by_dtype == {"fp32": 2 * 32**3, "tf32": 2 * 32**3}


def test_tf32_is_a_cuda_mode_only():
    a = torch.randn(32, 32)
    with ad.fast_matmul():
        assert ad.flops(torch.mm, a, a).dtype == "fp32"


def test_an_fp8_matmul_is_counted_as_fp8():
    a = torch.randn(32, 64).to(torch.float8_e4m3fn)
    b = torch.randn(16, 64).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes
    one = torch.tensor(1.0)
    count = ad.flops(torch._scaled_mm, a, b, one, one, out_dtype=torch.bfloat16)
    assert count.by_op == {"_scaled_mm": 2 * 32 * 64 * 16}
    assert count.by_dtype == {"fp8": 2 * 32 * 64 * 16}


@pytest.mark.cuda
@NEW_API
@pytest.mark.real_gpu(
    "TF32 is a GPU's reduced-precision matmul; the simulated GPU computes in fp32"
)
def test_tf32_through_the_new_api_is_set_against_the_tf32_peak_on_a_gpu():
    n = 2048
    a = torch.randn(n, n, device="cuda")
    with strict_fp32():
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        count = ad.flops(torch.mm, a, a)
        by_count = ad.timeit(torch.mm, a, a, flops=count, min_time=0.1)
        by_number = ad.timeit(torch.mm, a, a, flops=2 * n**3, min_time=0.1)
    assert count.by_dtype == {"tf32": 2 * n**3}
    for m in (by_count, by_number):
        assert m.peak is not None and m.peak.dtype == "tf32", m
        assert m.mfu is not None and 0 < m.mfu <= 1, m


def test_control_flow_the_counter_counts_its_own_way_is_noted():
    def branch(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: x @ x, lambda x: (x @ x) @ x, (x,))

    count = ad.flops(branch, torch.randn(4, 4))
    assert any("FlopCounterMode's own total is 256" in w for w in count.warnings), count
