"""ad.Throughput against Lightning's Throughput / ThroughputMonitor on the same training loop.

Three questions, side by side in one run:

1. **Same numbers?** One loop updates both meters at every step; their samples/s and
   TFLOP/s over the same window should agree (ratio ~1.00).
2. **What does a meter cost per step?** ``meter.step()`` against Lightning's
   ``update(time=..., batches=..., samples=..., flops=...)`` (with the clock read its recipe
   needs), each timed alone with ``ad.timeit``, as a share of one training step. Target:
   ours under 1 % of a small step.
3. **What does the loop cost with each meter?** The loop bare, with ``ad.Throughput``, and
   with Lightning's meter used as its docs say: on a GPU that recipe synchronises every step
   (``torch.cuda.synchronize()`` before reading the clock), where ours records an event.

CPU (``main``, ``make bench``): a small MLP training step. GPU (``gpu_throughput``): the same
on CUDA in bf16, whose steps are short enough that a per-step synchronisation shows.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import anydevice as ad

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, save

TARGET = 0.01  # the meter's share of a small step


def make_step(device: torch.device, width: int, batch: int, dtype: torch.dtype | None) -> Any:
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


#: Lightning is a benchmark-only peer: without it (``make test``'s smoke run) its rows are left out.
HAVE_LIGHTNING = importlib.util.find_spec("lightning") is not None


def lightning_meter(flops_peak: float | None) -> Any:
    from lightning.fabric.utilities.throughput import Throughput

    return Throughput(available_flops=flops_peak, window_size=STEPS + 1)


def lightning_monitor() -> Any:
    """Lightning's ThroughputMonitor, as Fabric users build it (loggers: none)."""
    from lightning.fabric import Fabric
    from lightning.fabric.utilities.throughput import ThroughputMonitor

    fabric = Fabric(accelerator="cpu", devices=1, loggers=[])
    return ThroughputMonitor(fabric, window_size=STEPS + 1)


STEPS = 100


def same_loop(
    step: Callable[[], None], device: torch.device, batch: int, flops: int, sync: Callable[[], None]
) -> tuple[Any, dict[str, float]]:
    """One loop, both meters updated at every step: the numbers each reports."""
    ours = ad.Throughput(
        samples_per_step=batch, flops_per_step=flops, window=STEPS, device=device, peak=None
    )
    theirs = lightning_meter(None) if HAVE_LIGHTNING else None
    sync()
    t0 = time.perf_counter()
    ours.step()
    if theirs is not None:
        theirs.update(time=0.0, batches=0, samples=0, flops=flops)
    for i in range(1, STEPS + 1):
        step()
        ours.step()
        sync()  # Lightning's clock needs the device idle; ours does not (it is only exact so)
        if theirs is not None:
            t = time.perf_counter() - t0
            theirs.update(time=t, batches=i, samples=i * batch, flops=flops)
    return ours.compute(), ({} if theirs is None else theirs.compute())


def loop_seconds(
    step: Callable[[], None], meter: str, device: torch.device, batch: int, flops: int
) -> float:
    """Seconds per step of ``STEPS`` steps with one meter, timed as a whole (one sync at end)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    ours = ad.Throughput(
        samples_per_step=batch, flops_per_step=flops, window=STEPS, device=device, peak=None
    )
    theirs = lightning_meter(None) if meter == "lightning Throughput" else None
    with ad.Timer(device) as t:
        t0 = time.perf_counter()
        for i in range(1, STEPS + 1):
            step()
            if meter == "ad.Throughput":
                ours.step()
            elif theirs is not None:
                sync()  # Lightning's documented recipe: synchronise, then read the clock
                theirs.update(
                    time=time.perf_counter() - t0, batches=i, samples=i * batch, flops=flops
                )
    return t.elapsed / STEPS


def per_call_costs(device: torch.device, batch: int, flops: int) -> dict[str, float]:
    """Seconds per meter update, each timed alone (the meter's own cost, no training)."""
    ours = ad.Throughput(samples_per_step=batch, flops_per_step=flops, window=STEPS, device=device)
    costs = {"ad.Throughput.step()": ad.timeit(ours.step, min_time=0.3, device=device).median}
    if not HAVE_LIGHTNING:
        return costs
    theirs = lightning_meter(None)
    count = [0]

    def lightning_update() -> None:
        count[0] += 1
        theirs.update(
            time=time.perf_counter() + count[0], batches=count[0], samples=count[0] * batch,
            flops=flops,
        )  # fmt: skip

    costs["lightning Throughput.update()"] = ad.timeit(
        lightning_update, min_time=0.3, device=device
    ).median
    try:
        monitor = lightning_monitor()
    except Exception as exc:  # report it, and keep the other rows
        print(f"  ThroughputMonitor not built: {exc}")
    else:
        n = [0]

        def monitor_update() -> None:
            n[0] += 1
            monitor.update(
                time=time.perf_counter() + n[0], batches=n[0], samples=n[0] * batch, flops=flops
            )

        costs["lightning ThroughputMonitor.update()"] = ad.timeit(
            monitor_update, min_time=0.3, device=device
        ).median
    return costs


def run(
    name: str,
    device: torch.device,
    width: int,
    batch: int,
    dtype: torch.dtype | None,
    rounds: int,
    check: bool = True,
) -> Result:
    step = make_step(device, width, batch, dtype)
    count = ad.flops(step)
    flops = count.total
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(5):
        step()
    result = Result(name, "ms/step", baseline="bare loop")
    meters = ("bare loop", "ad.Throughput", *(("lightning Throughput",) if HAVE_LIGHTNING else ()))
    times: dict[str, list[float]] = {m: [] for m in meters}
    for _ in range(rounds):  # interleaved, so drift hits every row alike
        for m in meters:
            times[m].append(1000 * loop_seconds(step, m, device, batch, flops))
    for m in meters:
        result.add(m, times[m])
    bare = result.rows["bare loop"] / 1000
    costs = per_call_costs(device, batch, flops)
    shares = {k: v / bare for k, v in costs.items()}
    ours, theirs = same_loop(step, device, batch, flops, sync)
    agreement = (
        {
            "samples/s ad / lightning": ours.samples_per_s / theirs["device/samples_per_sec"],
            "TFLOP/s ad / lightning": ours.tflops * 1e12 / theirs["device/flops_per_sec"],
        }
        if theirs
        else {}
    )
    ok = shares["ad.Throughput.step()"] < TARGET
    result.notes += [
        f"step: MLP {width}->{width}->{width}, batch {batch}, "
        f"{dtype or torch.float32} ({count.dtype}), {flops / 1e6:.3g} MFLOP per step "
        f"(ad.flops), {STEPS} steps per loop, {rounds} interleaved rounds, "
        f"torch threads {torch.get_num_threads()}",
        *(f"{k}: {v * 1e6:.2f} us per call = {shares[k]:.3%} of a step" for k, v in costs.items()),
        f"{'PASS' if ok else 'FAIL'} ad.Throughput.step() under {TARGET:.0%} of a step",
        *(f"same loop, {k} = {v:.4f}" for k, v in agreement.items()),
        f"ad.Throughput on the same loop: {ours!r}",
        *(() if HAVE_LIGHTNING else ("lightning is not installed: its rows are left out",)),
    ]
    result.extra.update(
        per_call_s=costs,
        share_of_step=shares,
        agreement=agreement,
        ours=ours.to_dict(),
        lightning={k: float(v) for k, v in theirs.items()},
    )
    save(result)
    if check and not ok:
        raise AssertionError(f"meter overhead {shares['ad.Throughput.step()']:.3%} of a step")
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: less exposed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run("throughput-meter-cpu", torch.device("cpu"), args.width, args.batch, None, args.rounds)


def gpu_throughput(device: str = "cuda", quick: bool = False) -> Result:
    """On an NVIDIA GPU: a short bf16 step, where a per-step synchronisation shows.

    ``device="cpu", quick=True`` runs the same code small and in fp32 (the smoke run in
    ``make test``), without the overhead check, which needs a quiet device.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if quick:
        return run("throughput-meter-gpu", dev, 64, 8, None, 1, check=False)
    return run("throughput-meter-gpu", dev, 1024, 64, torch.bfloat16, 5)


if __name__ == "__main__":
    main()
