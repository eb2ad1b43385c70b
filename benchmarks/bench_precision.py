"""Mixed precision: a transformer block's training step, side by side.

Rows (same model init, data and fused AdamW in every row; each row runs its own copy):

* ``plain fp32``: no autocast, torch's default fp32 matmuls (the baseline);
* ``torch autocast bf16 (by hand)``: ``torch.autocast`` written out;
* ``anydevice``: ``ad.precision()`` (bf16 where the hardware has it) inside ``ad.fast_matmul()``;
* ``accelerate bf16``: ``Accelerator(mixed_precision="bf16")``;
* ``Fabric bf16-mixed``: ``Fabric(precision="bf16-mixed")``;
* on a GPU also ``anydevice fp16 (forced)``: the GradScaler path, for its cost.

Targets on an H100: anydevice >= 2x plain fp32, and no slower than accelerate or Fabric.
``channels-last`` times a small convolutional net NCHW against ``ad.channels_last``, and on a
GPU ``fast-matmul`` an fp32 matmul with and without TF32.

``python benchmarks/bench_precision.py`` runs the CPU version; ``benchmarks/gpu.py`` runs the
``gpu_*`` functions.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anydevice as ad
from report import Result, save

Step = Callable[[], torch.Tensor]
Context = Callable[[], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class Config:
    batch: int
    seq: int
    width: int
    heads: int
    steps: int  #: timed steps per round
    rounds: int
    warmup: int


CPU = Config(batch=8, seq=128, width=256, heads=4, steps=4, rounds=15, warmup=2)
GPU = Config(batch=16, seq=1024, width=1024, heads=16, steps=20, rounds=5, warmup=10)
TINY = Config(batch=2, seq=8, width=16, heads=2, steps=1, rounds=1, warmup=1)  #: smoke runs
MATMUL = Config(0, 0, 0, 0, steps=10, rounds=5, warmup=3)  #: fast-matmul's timing plan


def transformer_block(cfg: Config, device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # every row starts from the same weights
    layer = nn.TransformerEncoderLayer(
        cfg.width, cfg.heads, 4 * cfg.width, dropout=0.0, batch_first=True, norm_first=True
    )
    return nn.Sequential(layer, nn.Linear(cfg.width, cfg.width)).to(device)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def rows(cfg: Config, device: torch.device) -> tuple[dict[str, tuple[Context, Step]], list[str]]:
    """Each row: (context around its timed loop, one training step returning the loss)."""
    torch.manual_seed(1)
    x = torch.randn(cfg.batch, cfg.seq, cfg.width, device=device)
    y = torch.randn(cfg.batch, cfg.seq, cfg.width, device=device)
    mse = nn.functional.mse_loss
    out: dict[str, tuple[Context, Step]] = {}
    notes: list[str] = []

    m0 = transformer_block(cfg, device)
    o0 = adamw(m0)

    def plain() -> torch.Tensor:
        loss = mse(m0(x), y)
        loss.backward()
        o0.step()
        o0.zero_grad(set_to_none=True)
        return loss

    out["plain fp32"] = (contextlib.nullcontext, plain)

    m1 = transformer_block(cfg, device)
    o1 = adamw(m1)

    def by_hand() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = mse(m1(x).float(), y)
        loss.backward()
        o1.step()
        o1.zero_grad(set_to_none=True)
        return loss

    out["torch autocast bf16 (by hand)"] = (contextlib.nullcontext, by_hand)

    def anydevice_row(mode: str) -> Step:
        model = transformer_block(cfg, device)
        opt = adamw(model)
        p = ad.precision(device, mode)
        notes.append(f"anydevice {mode}: {p!r}")

        def step() -> torch.Tensor:
            with p.autocast():
                loss = mse(model(x).float(), y)
            p.backward(loss)
            p.step(opt)
            opt.zero_grad(set_to_none=True)
            return loss

        return step

    out["anydevice"] = (ad.fast_matmul, anydevice_row("auto"))
    if device.type == "cuda":
        out["anydevice fp16 (forced)"] = (ad.fast_matmul, anydevice_row("fp16"))

    accelerate = _peer("accelerate", "Accelerator", notes)
    if accelerate is not None:
        acc = accelerate(mixed_precision="bf16", cpu=device.type == "cpu")
        m2 = transformer_block(cfg, device)
        m2, o2 = acc.prepare(m2, adamw(m2))

        def accelerate_step() -> torch.Tensor:
            loss = mse(m2(x), y)  # accelerate autocasts forward and returns fp32
            acc.backward(loss)
            o2.step()
            o2.zero_grad(set_to_none=True)
            return loss

        out["accelerate bf16"] = (contextlib.nullcontext, accelerate_step)

    fabric_class = _peer("lightning.fabric", "Fabric", notes)
    if fabric_class is not None:
        fabric = fabric_class(accelerator=device.type, devices=1, precision="bf16-mixed")
        m3 = transformer_block(cfg, device)
        m3, o3 = fabric.setup(m3, adamw(m3))

        def fabric_step() -> torch.Tensor:
            loss = mse(m3(x), y)  # Fabric autocasts forward and returns fp32
            fabric.backward(loss)
            o3.step()
            o3.zero_grad(set_to_none=True)
            return loss

        out["Fabric bf16-mixed"] = (contextlib.nullcontext, fabric_step)
    return out, notes


def _peer(module: str, name: str, notes: list[str]) -> Any:
    """A peer's class, or None (with a note) when it is not installed or does not import."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        notes.append(f"{module} is not installed: its row is missing")
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        notes.append(f"{module} does not import ({e}): its row is missing")
        return None


def seconds_per_step(step: Step, n: int, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / n
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n


def compare(
    table: dict[str, tuple[Context, Step]], cfg: Config, device: torch.device
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Warm every row up, then time them round-robin so drift hits all alike (ms/step)."""
    last: dict[str, float] = {}
    for ctx, step in table.values():
        with ctx():
            for _ in range(cfg.warmup):
                step()
    samples: dict[str, list[float]] = {label: [] for label in table}
    for _ in range(cfg.rounds):
        for label, (ctx, step) in table.items():
            with ctx():
                samples[label].append(1000 * seconds_per_step(step, cfg.steps, device))
    for label, (ctx, step) in table.items():
        with ctx():
            # A loss, or a whole matrix (fast-matmul): its sum is a number either way.
            last[label] = float(step().detach().float().sum())
    return samples, last


def training_step(cfg: Config, device: torch.device, name: str) -> Result:
    table, notes = rows(cfg, device)
    samples, last = compare(table, cfg, device)
    result = Result(name, "ms/step", baseline="plain fp32")
    for label, s in samples.items():
        result.add(label, s)
    result.notes.extend(notes)
    base = result.rows["plain fp32"]
    mine = result.rows["anydevice"]
    for label, value in result.rows.items():
        if label != "anydevice":
            result.notes.append(f"anydevice is {value / mine:.2f}x as fast as {label}")
    result.extra = {
        "config": cfg.__dict__,
        "speedup_vs_fp32": base / mine,
        "final_loss": last,
        "tf32": "on in the anydevice rows only (ad.fast_matmul); off elsewhere (torch default)",
    }
    save(result)
    return result


def convnet(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, padding=1)]
    for _ in range(4):
        layers += [nn.BatchNorm2d(64), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
    return nn.Sequential(*layers).to(device)


def layouts(device: torch.device, batch: int, size: int, rounds: int, steps: int) -> Result:
    """fwd+bwd of a small conv net, NCHW against ad.channels_last, in fp32 and auto precision."""
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    table: dict[str, tuple[Context, Step]] = {}
    for mode in ("fp32", "auto"):
        p = ad.precision(device, mode)
        for layout in ("NCHW", "channels_last"):
            model = convnet(device)
            data = x
            if layout == "channels_last":
                model = ad.channels_last(model, device)
                data = x.to(memory_format=torch.channels_last)

            def step(model: nn.Module = model, data: torch.Tensor = data, p=p) -> torch.Tensor:
                with p.autocast():
                    loss = nn.functional.cross_entropy(model(data), y)
                loss.backward()
                model.zero_grad(set_to_none=True)
                return loss

            table[f"{layout} {p.mode}"] = (contextlib.nullcontext, step)
    cfg = Config(batch, 0, 0, 0, steps=steps, rounds=rounds, warmup=2)
    samples, _ = compare(table, cfg, device)
    result = Result("channels-last", "ms/step", baseline=next(iter(table)))
    for label, s in samples.items():
        result.add(label, s)
    for mode in {label.split()[-1] for label in table}:
        ratio = result.rows[f"NCHW {mode}"] / result.rows[f"channels_last {mode}"]
        result.notes.append(f"{mode}: channels_last is {ratio:.2f}x as fast as NCHW")
    result.extra = {"batch": batch, "size": size}
    save(result)
    return result


def gpu_precision_training_step(device: str = "cuda", quick: bool = False) -> Result:
    """The transformer block's training step on a GPU (``quick``: tiny, for a smoke run)."""
    return training_step(TINY if quick else GPU, torch.device(device), "precision-training-step")


def gpu_channels_last(device: str = "cuda", quick: bool = False) -> Result:
    """NCHW against channels_last on a GPU (``quick``: tiny, for a smoke run)."""
    if quick:
        return layouts(torch.device(device), batch=2, size=8, rounds=1, steps=1)
    return layouts(torch.device(device), batch=64, size=112, rounds=5, steps=10)


def gpu_fast_matmul(device: str = "cuda", quick: bool = False) -> Result:
    """An fp32 matmul with and without TF32, with the error of each against fp64."""
    dev = torch.device(device)
    n = 64 if quick else 8192
    checked = min(n, 2048)
    a, b = (torch.randn(n, n, device=dev) for _ in range(2))
    small_a, small_b = a[:checked, :checked], b[:checked, :checked]
    exact = (small_a.double() @ small_b.double()).float()

    def matmul() -> torch.Tensor:
        return a @ b

    table: dict[str, tuple[Context, Step]] = {
        "fp32 (IEEE, torch default)": (contextlib.nullcontext, matmul),
        "ad.fast_matmul() (TF32)": (ad.fast_matmul, matmul),
    }
    plan = Config(0, 0, 0, 0, steps=1, rounds=1, warmup=1) if quick else MATMUL
    samples, _ = compare(table, plan, dev)
    result = Result("fast-matmul", "ms", baseline="fp32 (IEEE, torch default)")
    errors = {}
    for label, s in samples.items():
        result.add(label, s)
        with table[label][0]():
            got = small_a @ small_b
        errors[label] = float(((got - exact).abs().max() / exact.abs().max()).item())
        tflops = 2 * n**3 / (statistics.median(s) / 1000) / 1e12
        error = errors[label]
        result.notes.append(f"{label}: {tflops:.1f} TFLOP/s, max relative error {error:.1e}")
    result.extra = {"n": n, "max_relative_error": errors}
    save(result)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=CPU.rounds)
    args = ap.parse_args()
    cpu = torch.device("cpu")
    cfg = Config(**{**CPU.__dict__, "rounds": args.rounds})
    training_step(cfg, cpu, "precision-training-step")
    layouts(cpu, batch=16, size=32, rounds=args.rounds, steps=3)


if __name__ == "__main__":
    main()
