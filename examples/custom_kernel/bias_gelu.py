"""A custom C++/CUDA operator, fused bias + GELU, that builds and runs on any machine.

    python examples/custom_kernel/bias_gelu.py            # 4096 x 1024
    python examples/custom_kernel/bias_gelu.py --tiny     # 256 x 256

The tutorial recipe, ``torch.utils.cpp_extension.load("ext", ["op.cpp", "op.cu"])``, fails
on a machine without CUDA, builds for every GPU architecture, and rebuilds in every fresh
environment. Here one call builds the CPU kernel everywhere and the CUDA kernel where it can
run (for the GPU that is here), cached by content:

    ad.load_extension("ad_examples_bias_gelu", ["bias_gelu.cpp", "bias_gelu_cuda.cu"])

The operator is one torch custom op, ``torch.ops.ad_examples.bias_gelu``: its schema and CPU
kernel in ``bias_gelu.cpp`` (``TORCH_LIBRARY``), its CUDA kernel in ``bias_gelu_cuda.cu``
(``TORCH_LIBRARY_IMPL(ad_examples, CUDA, m)``), a fake (meta) implementation and a backward
formula registered here in Python, so that ``torch.compile`` traces it and autograd
differentiates it. ``torch.library.opcheck`` checks the registrations; the result is compared
with plain torch (``F.gelu(x + bias)``) and both are timed with ``ad.timeit``: on a CPU the
kernel's scalar loop loses to torch's vectorised GELU (the ratio is printed, whichever way
it goes).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import anydevice as ad

HERE = Path(__file__).resolve().parent


def build() -> float:
    """Build (or reuse) and load the extension; the seconds it took."""
    t0 = time.perf_counter()
    ad.load_extension(
        "ad_examples_bias_gelu",
        [HERE / "bias_gelu.cpp", HERE / "bias_gelu_cuda.cu"],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
    )
    return time.perf_counter() - t0


def register_python_parts() -> None:
    """The fake implementation (shapes only, for torch.compile and meta tensors) and the
    backward formula."""

    def fake(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[-1] == bias.shape[0], lambda: "x and bias do not match")
        return torch.empty_like(x)

    torch.library.register_fake("ad_examples::bias_gelu", fake)

    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, bias = ctx.saved_tensors
        v = x + bias
        cdf = 0.5 * (1.0 + torch.erf(v * (1.0 / math.sqrt(2.0))))
        pdf = torch.exp(-0.5 * v * v) / math.sqrt(2.0 * math.pi)
        grad_v = grad * (cdf + v * pdf)
        return grad_v, grad_v.reshape(-1, bias.numel()).sum(0)

    torch.library.register_autograd("ad_examples::bias_gelu", backward, setup_context=setup_context)


def has_kernel(key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("ad_examples::bias_gelu", key)


def reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--tiny", action="store_true", help="256 x 256, for a quick check")
    args = parser.parse_args()
    rows, cols = (256, 256) if args.tiny else (args.rows, args.cols)

    seconds = build()
    register_python_parts()
    kernels = [k for k in ("CPU", "CUDA") if has_kernel(k)]
    print(f"built/loaded in {seconds:.1f} s; kernels registered: {', '.join(kernels)}")

    dev = ad.device()
    if dev.type == "cuda" and has_kernel("CUDA"):
        why = f"the CUDA kernel was built for {ad.describe(dev).name}"
    elif dev.type != "cpu":
        why = f"{dev} is here but this operator has no kernel for it; the CPU kernel runs"
        dev = torch.device("cpu")
    else:
        why = "no GPU here, so the CPU kernel runs"
    print(f"device: {dev} ({why})")

    op = torch.ops.ad_examples.bias_gelu.default
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g).to(dev)
    bias = torch.randn(cols, generator=g).to(dev)

    # Schema, fake implementation, autograd registration and torch.compile's tracing.
    samples = [
        (torch.randn(3, 5, device=dev), torch.randn(5, device=dev)),
        (torch.randn(2, 3, 4, device=dev, requires_grad=True),
         torch.randn(4, device=dev, requires_grad=True)),
    ]  # fmt: skip
    for sample in samples:
        torch.library.opcheck(op, sample)
    print(f"opcheck: passed on {len(samples)} samples")

    y = op(x, bias)
    err = (y - reference(x, bias)).abs().max().item()
    print(f"max abs difference from F.gelu(x + bias): {err:.2e}")
    if err > 1e-5:
        raise SystemExit(f"the kernel disagrees with the reference by {err:.2e}")

    xg = x[:64].clone().requires_grad_()
    bg = bias.clone().requires_grad_()
    gx, gb = torch.autograd.grad(op(xg, bg).square().sum(), (xg, bg))
    rx, rb = torch.autograd.grad(reference(xg, bg).square().sum(), (xg, bg))
    grad_err = max((gx - rx).abs().max().item(), (gb - rb).abs().max().item())
    print(f"max abs difference of the gradients: {grad_err:.2e}")

    compiled = torch.compile(lambda t: op(t, bias) * 2.0, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), y * 2.0)
    print("torch.compile(fullgraph=True) traced it through the fake implementation")

    fused = ad.timeit(op, x, bias, label="custom kernel", min_time=0.1)
    plain = ad.timeit(reference, x, bias, label="F.gelu(x + bias)", min_time=0.1)
    print(fused)
    print(plain)
    print(
        f"custom kernel: {fused.median * 1e3:.3f} ms, plain torch: {plain.median * 1e3:.3f} ms "
        f"({plain.median / fused.median:.2f}x) for {rows} x {cols} on {dev}"
    )


if __name__ == "__main__":
    main()
