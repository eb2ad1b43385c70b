"""Worker functions that tests start with ``ad.launch`` (spawned workers import them here).

The data and the model are functions of a seed, so a test can train the same model on the
concatenated batch in a single process and compare. The workers train on the CPU (gloo)
on any machine; the GPU paths have their own ``cuda`` tests.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
from torch import nn

import anydevice as ad

BATCH = 8  #: per rank
FEATURES = 6


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def batches(steps: int, world_size: int, seed: int = 123) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batches: ``(steps, world_size * BATCH, FEATURES)`` inputs and targets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, world_size * BATCH, FEATURES, generator=g)
    y = x.sum(dim=2, keepdim=True).sin() + 0.1 * torch.randn(
        steps, world_size * BATCH, 1, generator=g
    )
    return x, y


def ddp_steps(steps: int, lr: float) -> dict[str, Any]:
    """Train with DDP on this rank's slice of each global batch; report what happened."""
    with ad.distributed(timeout=60, device="cpu") as d:
        return _train(d, steps, lr)


def _train(d: ad.Distributed, steps: int, lr: float) -> dict[str, Any]:
    # Each rank starts from different weights: DDP must broadcast rank 0's.
    net = model(seed=d.rank)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    wrapped = ad.prepare(net)
    x, y = batches(steps, d.world_size)
    mine = slice(d.rank * BATCH, (d.rank + 1) * BATCH)
    for s in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(wrapped(x[s, mine]), y[s, mine])
        loss.backward()
        optimizer.step()
    return {
        "rank": d.rank,
        "world_size": d.world_size,
        "local_rank": d.local_rank,
        "backend": d.backend,
        "device": str(d.device),
        "launcher": d.launcher,
        "wrapper": type(wrapped).__name__,
        "unwrapped_is_user_module": ad.unwrap(wrapped) is net,
        "params": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "pid": os.getpid(),
    }


def fail_on(rank: int, linger: float = 0.0) -> int:
    """Rank ``rank`` raises after the group formed; the others wait in a barrier.

    With ``linger``, the failing rank waits that long after leaving the group before its
    exception goes on: its peers fail first (on the closed connection), the launcher sees
    them first and stops the failing rank before its own ``@record`` runs — the hard case
    for naming the root cause.
    """
    try:
        with ad.distributed(timeout=60, device="cpu") as d:
            if d.rank == rank:
                raise ValueError(f"injected failure on rank {d.rank}")
            d.barrier()
            return d.rank
    finally:
        if int(os.environ["RANK"]) == rank:
            time.sleep(linger)


def fail_first_attempt() -> tuple[int, int]:
    """Rank 1 fails on the first attempt only; returns (rank, restart count)."""
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with ad.distributed(timeout=60, device="cpu") as d:
        if restarts == 0 and d.rank == 1:
            raise RuntimeError("failing once")
        d.barrier()
        return d.rank, restarts


def sleep_forever(folder: str | None = None) -> None:
    """Write this process's pid to ``folder/rank<RANK>.pid``, then wait to be stopped."""
    if folder is not None:
        path = os.path.join(folder, f"rank{os.environ['RANK']}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
    time.sleep(600)


def hang_on(rank: int) -> None:
    """Rank ``rank`` never reaches the all_reduce the others wait in (10 s timeout)."""
    with ad.distributed(timeout=10, device="cpu") as d:
        d.barrier()
        if d.rank == rank:
            time.sleep(600)  # HANGS HERE
        ad.all_reduce(torch.ones(1))


def hang_on_device(rank: int) -> None:
    """As :func:`hang_on`, on each rank's own device (NCCL on GPUs)."""
    with ad.distributed(timeout=10) as d:
        d.barrier()
        if d.rank == rank:
            time.sleep(600)
        ad.all_reduce(torch.ones(1, device=d.device))
        torch.cuda.synchronize()


def killed_while_waited_for(rank: int, notes: str) -> None:
    """Rank ``rank`` is killed (SIGKILL) while the others wait for it in an all_reduce;
    each rank first writes the time to ``notes/hang<RANK>``."""
    with ad.distributed(timeout=60, device="cpu") as d:
        ad.all_reduce(torch.ones(1))
        with open(os.path.join(notes, f"hang{d.rank}"), "w") as f:
            f.write(repr(time.time()))
        if d.rank == rank:
            time.sleep(5)
            os.kill(os.getpid(), signal.SIGKILL)
        ad.all_reduce(torch.ones(1))  # WAITED IN
