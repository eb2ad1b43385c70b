"""The jobs ``bench_launch.py`` starts: the same 20-step DDP training under each launcher.

``python launch_job.py MODE`` where MODE is

* ``worker`` — a plain-torch DDP worker for a launcher that sets the env:// variables
  (torchrun, ``accelerate launch``, ``anydevice launch``);
* ``ad-launch`` — ``ad.launch`` of that same plain worker;
* ``ad-api`` — ``ad.launch`` of a worker written with ``ad.distributed`` and ``ad.prepare``;
* ``mp-spawn`` — ``torch.multiprocessing.spawn`` of the plain worker (env set by hand);
* ``fabric`` — Lightning Fabric's own launcher, with a worker written with Fabric's API.

Each prints one checksum line per rank; all ranks must agree.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

NPROCS = 2
STEPS = 20


def mlp(width: int = 32, features: int = 16, depth: int = 1) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(features, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def data(n: int = 640, features: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def _steps(model: nn.Module, loader: DataLoader[Any], steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    done = 0
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            done += 1
            if done == steps:
                return


def plain_worker(steps: int = STEPS) -> float:
    """What a torch tutorial writes: env:// init, DDP, DistributedSampler, safe teardown."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    sampler = DistributedSampler(data(), shuffle=True)
    loader = DataLoader(data(), batch_size=16, sampler=sampler)
    ddp = nn.parallel.DistributedDataParallel(mlp())
    _steps(ddp, loader, steps)
    checksum = sum(p.sum() for p in ddp.parameters()).item()
    del ddp
    gc.collect()
    dist.destroy_process_group()
    print(f"checksum rank {os.environ.get('RANK')}: {checksum:.6f}", flush=True)
    return checksum


def ad_worker(steps: int = STEPS) -> float:
    """The same job written with anydevice."""
    import anydevice as ad

    with ad.distributed() as d:
        checksum = _ad_train(steps)
        print(f"checksum rank {d.rank}: {checksum:.6f}", flush=True)
    return checksum


def _ad_train(steps: int) -> float:
    import anydevice as ad

    torch.manual_seed(0)
    model, loader = ad.prepare(mlp(), DataLoader(data(), batch_size=16, shuffle=True))
    _steps(model, loader, steps)
    return float(sum(p.sum() for p in model.parameters()).item())


def _spawned(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    plain_worker()


def fabric_main() -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=NPROCS, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(data(), batch_size=16, shuffle=True))
    done = 0
    while done < STEPS:
        for x, y in loader:
            opt.zero_grad()
            fabric.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            done += 1
            if done == STEPS:
                break
    checksum = sum(p.sum() for p in model.parameters()).item()
    print(f"checksum rank {fabric.global_rank}: {checksum:.6f}", flush=True)


def scaling_worker(steps: int, batch: int, width: int, depth: int, kind: str) -> float:
    """Samples per second of this rank's training loop (after warm-up), DDP when world > 1."""
    import anydevice as ad

    with ad.distributed(device=kind) as d:
        return _throughput(d, steps, batch, width, depth)


def _throughput(d: Any, steps: int, batch: int, width: int, depth: int) -> float:
    import anydevice as ad

    torch.manual_seed(0)
    net = mlp(width=width, features=width, depth=depth)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    model = ad.prepare(net, strategy="auto")
    x = torch.randn(batch, width, device=d.device)
    y = torch.randn(batch, 1, device=d.device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(10):
        step()
    _sync(d.device)
    d.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(d.device)
    elapsed = ad.all_reduce(time.perf_counter() - t, op="max").item()  # the slowest rank
    return d.world_size * batch * steps / elapsed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(mode: str) -> None:
    if mode == "worker":
        plain_worker()
    elif mode == "ad-launch":
        import anydevice as ad

        ad.launch(plain_worker, nprocs=NPROCS)
    elif mode == "ad-api":
        import anydevice as ad

        ad.launch(ad_worker, nprocs=NPROCS)
    elif mode == "mp-spawn":
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(NPROCS, free_port()), nprocs=NPROCS)
    elif mode == "fabric":
        fabric_main()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1])
