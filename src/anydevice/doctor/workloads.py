"""What the doctor runs: its plans (how long, how large) and the workloads its steps time.

A :class:`Plan` bounds a run (``quick`` 10 s, ``default`` 30 s, ``full`` 3 min) and its
largest sizes; :class:`Run` collects what the steps measured. The workloads — an n x n
matmul in a dtype, a host <-> device copy, the MLP training step — are shared by the
measurements (:mod:`anydevice.doctor.measure`) and the levers (:mod:`anydevice.doctor.levers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from anydevice.doctor.budget import Deadline
from anydevice.doctor.results import Lever, Measured, find
from anydevice.hardware.backends import runtime
from anydevice.numerics.matmul import fast_matmul, strict_fp32
from anydevice.numerics.precision import Precision

__all__ = ["PLANS", "Plan", "Progress", "Run", "Step"]


@dataclass(frozen=True)
class Plan:
    """How long and how big: the run's time budget and the largest size of each timing."""

    name: str
    budget: float  #: seconds of measuring in all, whatever the devices' speed
    sample: float  #: seconds a sample should last; sizes grow until a call does
    copy_mib: int  #: largest MiB per host-device copy and per memory copy
    cpu_matmul: int  #: largest n of the n x n matmul on a CPU
    gpu_matmul: int  #: largest n on an accelerator
    step: tuple[int, int]  #: (largest batch, width) of the training step run on every device
    gpu_step: tuple[int, int]  #: the same for the autocast lever's step on accelerators
    conv: tuple[int, int]  #: (largest batch, image side) of the channels_last lever on a CPU
    gpu_conv: tuple[int, int]  #: the same on an accelerator
    every_gpu: bool = False  #: measure every GPU, not one of each model


PLANS: dict[str, Plan] = {
    "quick": Plan(
        "quick", 10.0, 0.005, 64, 1024, 4096, (128, 512), (2048, 2048), (8, 32), (64, 64)
    ),
    "default": Plan(
        "default", 30.0, 0.01, 256, 2048, 8192, (256, 1024), (4096, 4096), (16, 64), (128, 128)
    ),
    "full": Plan(
        "full",
        180.0,
        0.02,
        1024,
        4096,
        16384,
        (512, 2048),
        (8192, 8192),
        (32, 128),
        (256, 224),
        True,
    ),
}


#: (steps done, steps in all, what runs next, seconds of the budget left)
Progress = Callable[[int, int, str, float], None]


Step = Callable[[Deadline], None]


@dataclass
class Run:
    """What the steps of one run collect, and the sizes they share."""

    plan: Plan
    results: list[Measured] = field(default_factory=list)
    levers: list[Lever] = field(default_factory=list)
    steps: dict[str, dict[str, tuple[float, str]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    step_size: tuple[int, int] | None = None  #: the side-by-side step, sized on the first device
    free_cores: int | None = None  #: cores other processes left free, read before measuring
    threads: int = 1  #: torch's threads when the run started

    def add(self, m: Measured) -> Measured:
        if m.threads is None:  # every number says the threads it was measured with
            m = dataclasses.replace(m, threads=torch.get_num_threads())
        self.results.append(m)
        return m

    def get(self, device: str, name: str) -> Measured | None:
        return find(self.results, device, name)


@contextlib.contextmanager
def threads_set(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def powers(lo: int, hi: int) -> list[int]:
    """``lo``, ``2 lo``, ... up to ``hi``, which is always last.

    >>> powers(64, 300)
    [64, 128, 256, 300]
    """
    out = []
    n = max(1, min(lo, hi))
    while n < hi:
        out.append(n)
        n *= 2
    return [*out, hi]


TORCH_DTYPE = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "fp32-medium": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def math_mode(dtype: str) -> contextlib.AbstractContextManager[Any]:
    """The matmul settings a dtype is timed under."""
    if dtype == "tf32":
        return fast_matmul("high")
    if dtype == "fp32-medium":
        return fast_matmul("medium")
    return strict_fp32() if dtype == "fp32" else contextlib.nullcontext()


def matmul_call(dev: torch.device, dtype: str, n: int) -> Callable[[], object]:
    """One n x n matmul of ``dtype`` on ``dev``, into a preallocated output."""
    torch_dtype = TORCH_DTYPE[dtype]
    a = torch.randn(n, n, device=dev, dtype=torch_dtype)
    b = torch.randn(n, n, device=dev, dtype=torch_dtype)
    return functools.partial(torch.mm, a, b, out=torch.empty(n, n, device=dev, dtype=torch_dtype))


def reached(size: str, capped: bool) -> str:
    """How a size was reached, for a detail line."""
    return f"{size} (the next size would not fit in the time budget)" if capped else size


def copy_call(dev: torch.device, direction: str, pinned: bool, size: int) -> Callable[[], object]:
    """One host <-> device copy of ``size`` bytes (pinned host memory where the device's
    backend pins: CUDA)."""
    pin = pinned and runtime(dev.type).pins_surely
    host = torch.ones(size, dtype=torch.uint8, pin_memory=pin)
    on_device = torch.empty(size, dtype=torch.uint8, device=dev)
    if direction == "h2d":
        return functools.partial(on_device.copy_, host, non_blocking=pin)
    return functools.partial(host.copy_, on_device, non_blocking=pin)


def mlp(width: int, device: torch.device) -> nn.Module:
    """The doctor's training-step model: LayerNorm, then 4 x (Linear(width, width), GELU)."""
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(nn.LayerNorm(width), *layers).to(device)


def train_call(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    p: Precision,
) -> Callable[[], None]:
    """One SGD training step of ``model`` on ``(x, y)`` in ``p``'s precision.

    Timed inside :func:`strict_fp32`, so "fp32" means full fp32 matmuls (no TF32); the
    autocast variant's matmuls run in its reduced dtype whatever that setting.
    """
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with p.autocast():
            loss = loss_fn(model(x).float(), y)
        p.backward(loss)
        p.step(opt)

    return step
