"""``nn.DataParallel``: its four steps made visible, and what it buys here, measured.

    python examples/data_parallel.py
    python examples/data_parallel.py --tiny

``nn.DataParallel(model)`` runs, on every forward: **replicate** (copy the module to each
GPU), **scatter** (split the batch along dimension 0), **parallel_apply** (one thread per
GPU runs its replica) and **gather** (concatenate the outputs on the first GPU). This
program runs those four steps by hand, as DataParallel does, then measures one training
step on 1, 2, ... N GPUs and prints the scaling table. On a CPU there is nothing to
parallelise: torch's four functions raise without CUDA (shown below as they do), and
``nn.DataParallel`` silently just calls the module.

DataParallel is the slow way to use several GPUs: one Python process drives them all
(the GIL), the module is replicated on every step, and the outputs and gradients pass
through GPU 0. ``DistributedDataParallel`` (one process per GPU: ``ad.launch`` /
``anydevice launch`` with ``ad.prepare``, see ``ddp_train.py``) is faster; torch's own
documentation recommends it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import gather, parallel_apply, replicate, scatter

import anydevice as ad


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def attempt(step: str, fn: Callable[[], Any], show: Callable[[Any], str]) -> Any:
    try:
        result = fn()
    except (ValueError, AssertionError, RuntimeError) as e:
        print(f"  {step}: raised {type(e).__name__}: {e}")
        return None
    print(f"  {step}: {show(result)}")
    return result


def four_steps(model: nn.Module, x: torch.Tensor, devices: list[torch.device]) -> None:
    """replicate, scatter, parallel_apply, gather: what DataParallel.forward does. Where a
    step raises (on the CPU each does), the next one gets what the step would have made."""
    n = len(devices)
    replicas = attempt(
        "replicate", lambda: replicate(model, devices),
        # A replica keeps its weights as plain attributes, not parameters (nothing to train).
        lambda r: f"{len(r)} copies of the module, on {[str(m[0].weight.device) for m in r]}",
    ) or [model] * n  # fmt: skip
    shards = attempt(
        "scatter", lambda: scatter(x, devices),
        lambda s: f"batch {tuple(x.shape)} split into {[tuple(t.shape) for t in s]}",
    ) or list(x.chunk(n))  # fmt: skip
    outputs = attempt(
        "parallel_apply",
        lambda: parallel_apply(replicas, [(t,) for t in shards], devices=devices),
        lambda o: f"one thread per device; outputs on {[str(t.device) for t in o]}",
    ) or [m(t) for m, t in zip(replicas, shards, strict=True)]  # fmt: skip
    attempt(
        "gather", lambda: gather(outputs, devices[0]),
        lambda y: f"outputs concatenated: {tuple(y.shape)} on {y.device}",
    )  # fmt: skip


def step_time(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    return ad.timeit(step, min_time=0.1).median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--tiny", action="store_true", help="batch 64, width 64")
    args = parser.parse_args()
    batch, width = (64, 64) if args.tiny else (args.batch_size, args.width)

    gpus = [d for d in ad.devices("gpu") if d.type == "cuda"]
    first = gpus[0] if gpus else torch.device("cpu")
    why = f"{len(gpus)} CUDA GPU(s) here" if gpus else "no CUDA GPU here"
    print(f"device: {first} ({why}; DataParallel is CUDA only)")

    torch.manual_seed(0)
    model = make_model(width).to(first)
    x = torch.randn(batch, width, device=first)
    print("the four steps of DataParallel.forward, by hand:")
    four_steps(model, x, gpus or [first])
    if not gpus:
        print("  (without CUDA each step raises: DataParallel has nothing to do on a CPU)")

    dp = nn.DataParallel(model)
    print(f"nn.DataParallel(model): device_ids={dp.device_ids}, wraps the same module: "
          f"{dp.module is model}")  # fmt: skip
    with torch.no_grad():
        same = torch.allclose(dp(x), model(x), rtol=1e-4, atol=1e-5)
    print(f"  its output matches the module's: {same}"
          + ("" if gpus else " (on the CPU it only calls the module)"))  # fmt: skip

    print("one training step (forward, backward, SGD), median time:")
    print(f"  {'GPUs':>5} {'device(s)':<24} {'ms/step':>9} {'speed-up':>9} {'efficiency':>10}")
    y = torch.randint(0, 10, (batch,), device=first)
    base = 0.0
    for k in range(1, max(len(gpus), 1) + 1):
        runner = nn.DataParallel(model, device_ids=[g.index for g in gpus[:k]]) if k > 1 else model
        t = step_time(runner, x, y)
        base = base or t
        names = ", ".join(str(g) for g in gpus[:k]) if gpus else "cpu"
        print(f"  {k:>5} {names:<24} {t * 1e3:>9.2f} {base / t:>8.2f}x {base / t / k:>9.0%}")
    if len(gpus) < 2:
        print("  (rows for 2..N GPUs need several GPUs; only what is here was measured)")
    print("DistributedDataParallel is faster than DataParallel: one process per GPU, no "
          "replication per step, no GIL; see ddp_train.py.")  # fmt: skip


if __name__ == "__main__":
    main()
