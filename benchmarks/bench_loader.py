"""DeviceLoader against the raw DataLoader (CPU) and against the peers' loaders (GPU).

CPU: one epoch of a small MLP training step fed by a DataLoader, iterated raw and through
DeviceLoader (prefetch on and off); target: overhead <= 3 %. Plus the bare per-batch cost
with no step at all.

GPU (``gpu_loader``): a workload where copying a batch and computing on it take about the
same time. Side by side: the naive loop (pageable ``.to``), DataLoader(pin_memory=True)
with non_blocking copies, accelerate's prepared DataLoader, Fabric's setup_dataloaders, and
DeviceLoader. Targets: DeviceLoader's step <= 1.1 x max(copy, compute), >= 1.3x faster than
the best peer, and its bandwidth within 90 % of a raw pinned copy.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anydevice as ad
from report import Result, run_interleaved, save, sync


def cpu_epoch(make: Callable[[], Iterable], step: Callable[..., None]) -> float:
    t = time.perf_counter()
    for x, y in make():
        step(x, y)
    return time.perf_counter() - t


def cpu(rounds: int) -> None:
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(8192, 64), torch.randn(8192, 1))
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    def noop(x: torch.Tensor, y: torch.Tensor) -> None:
        pass

    dl = DataLoader(ds, batch_size=64, shuffle=True)
    res = Result("loader-cpu-overhead", "s/epoch", baseline="raw DataLoader")
    samples = run_interleaved(
        {
            "raw DataLoader": lambda: cpu_epoch(lambda: dl, step),
            "DeviceLoader": lambda: cpu_epoch(lambda: ad.DeviceLoader(dl, "cpu"), step),
            "DeviceLoader(prefetch=True)": lambda: cpu_epoch(
                lambda: ad.DeviceLoader(dl, "cpu", prefetch=True), step
            ),
        },
        rounds,
    )
    for label, s in samples.items():
        res.add(label, s)
    res.notes.append(
        f"{len(dl)} batches of 64 x 64 floats, MLP 64-256-256-1 SGD step; target <= 1.03x"
    )
    save(res)

    bare = Result("loader-cpu-per-batch", "us/batch", baseline="raw DataLoader")
    n = len(dl)
    samples = run_interleaved(
        {
            "raw DataLoader": lambda: 1e6 * cpu_epoch(lambda: dl, noop) / n,
            "DeviceLoader": lambda: 1e6 * cpu_epoch(lambda: ad.DeviceLoader(dl, "cpu"), noop) / n,
            "DeviceLoader(prefetch=True)": lambda: (
                1e6 * cpu_epoch(lambda: ad.DeviceLoader(dl, "cpu", prefetch=True), noop) / n
            ),
        },
        rounds,
    )
    for label, s in samples.items():
        bare.add(label, s)
    bare.notes.append("iteration alone, no step: the fixed cost per batch")
    save(bare)


# ----------------------------------------------------------------------------- GPU


def gpu_loader(device: str = "cuda", quick: bool = False) -> Result:
    """Copy/compute overlap on CUDA, against the peers (needs accelerate and lightning).

    ``quick``: tiny batches and matrices, one round, no workers: a smoke run of every line.
    """
    dev = ad.device(device)
    rounds, batch_mb, batches, width, workers = (1, 1, 3, 32, 0) if quick else (5, 64, 24, 4096, 2)
    n = batch_mb << 20 >> 2
    host = torch.randn(batches, n)  # pageable source data
    ds = TensorDataset(host)
    w = torch.randn(width, width, device=dev)
    can_pin = dev.type == "cuda"

    def compute_once(x: torch.Tensor, reps: int) -> torch.Tensor:
        y = w
        for _ in range(reps):
            y = y @ w
        return x.sum() + y.sum()

    # Calibrate: copy time of one pinned batch, and matmuls to make compute about as long.
    pinned = host[0].clone().pin_memory() if can_pin else host[0].clone()
    copy = ad.timeit(lambda: pinned.to(dev, non_blocking=True), device=dev).median
    one = ad.timeit(lambda: w @ w, device=dev).median
    reps = max(1, round(copy / one))
    compute = max(
        ad.timeit(lambda: compute_once(pinned.to(dev), reps), device=dev).median - copy, 0
    )

    def timed(batches_iter: Callable[[], Iterable]) -> float:
        sync(dev)
        t = time.perf_counter()
        count = 0
        for b in batches_iter():
            x = b[0] if isinstance(b, (list, tuple)) else b
            compute_once(x.to(dev, non_blocking=True), reps)
            count += 1
        sync(dev)
        return (time.perf_counter() - t) / count

    def source(pin: bool = False) -> DataLoader:
        return DataLoader(ds, batch_size=1, pin_memory=pin and can_pin, num_workers=workers)

    runs: dict[str, Callable[[], float]] = {
        "naive (pageable .to)": lambda: timed(lambda: DataLoader(ds, batch_size=1)),
        "pin_memory + non_blocking": lambda: timed(lambda: source(pin=True)),
        "DeviceLoader": lambda: timed(lambda: ad.DeviceLoader(source(), dev)),
    }
    try:
        from accelerate import Accelerator

        acc = Accelerator(cpu=dev.type == "cpu")
        acc_dl = acc.prepare(source(pin=True))
        runs["accelerate prepare"] = lambda: timed(lambda: acc_dl)
    except ImportError:
        pass
    try:
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator=dev.type, devices=1)
        fab_dl = fabric.setup_dataloaders(source(pin=True))
        runs["Fabric setup_dataloaders"] = lambda: timed(lambda: fab_dl)
    except ImportError:
        pass

    res = Result("loader-gpu-overlap", "ms/step", baseline="DeviceLoader")
    for label, s in run_interleaved({k: (lambda f=f: 1e3 * f()) for k, f in runs.items()},
                                    rounds).items():  # fmt: skip
        res.add(label, s)
    floor = 1e3 * max(copy, compute)
    res.extra.update(copy_ms=1e3 * copy, compute_ms=1e3 * compute, floor_ms=floor)
    peers = [v for k, v in res.rows.items() if k != "DeviceLoader"]
    to_floor = res.rows["DeviceLoader"] / floor if floor > 0 else float("nan")
    res.notes.append(
        f"copy {1e3 * copy:.2f} ms, compute {1e3 * compute:.2f} ms per {batch_mb} MiB batch; "
        f"DeviceLoader / max(copy, compute) = {to_floor:.2f} "
        f"(target <= 1.1); best other / DeviceLoader = "
        f"{min(peers) / res.rows['DeviceLoader']:.2f} (target >= 1.3)"
    )
    loader = ad.DeviceLoader(source(), dev)
    for _ in loader:
        pass
    raw_bw = (n * 4) / copy if copy > 0 else 0.0
    bw = loader.stats.bandwidth or 0.0
    res.extra.update(loader_bandwidth=bw, raw_pinned_bandwidth=raw_bw)
    share = f"{bw / raw_bw:.0%}" if raw_bw else "n/a"
    res.notes.append(
        f"DeviceLoader copies at {bw / 1e9:.1f} GB/s, raw pinned copy {raw_bw / 1e9:.1f} GB/s "
        f"({share}; target >= 90%)"
    )
    save(res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=41)  # epochs of ~0.1 s: noisy, so many
    cpu(ap.parse_args().rounds)


if __name__ == "__main__":
    main()
