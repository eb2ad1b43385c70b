"""A small DDP training run for the infra tests: under ``anydevice launch``, ``srun`` or
across network namespaces, rank 0 appends ``step loss`` lines to ``OUT/losses.txt`` and
writes ``OUT/final.json`` (world size, launcher, the hosts the ranks ran on, a checksum of
the weights). With ``--ckpt`` a preemption signal saves at an agreed step and a rerun
resumes there; ``--sleep`` slows each step so a signal can land mid-run."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
from torch import nn

import anydevice as ad

BATCH, FEATURES = 8, 6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args()
    out = Path(a.out)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    step = 0

    def save() -> None:
        ad.save_state(a.ckpt, model=wrapped, optimizer=opt, step=step)

    with ad.distributed(device="cpu", timeout=120, on_preempt=save if a.ckpt else None) as d:
        wrapped = ad.prepare(net)
        if a.ckpt and os.path.exists(a.ckpt):
            step = int(ad.load_state(a.ckpt, model=wrapped, optimizer=opt)["step"])
        g = torch.Generator().manual_seed(123)
        x = torch.randn(a.steps, d.world_size * BATCH, FEATURES, generator=g)
        y = x.sum(dim=2, keepdim=True).sin()
        mine = slice(d.rank * BATCH, (d.rank + 1) * BATCH)
        while step < a.steps:
            opt.zero_grad()
            loss = nn.functional.mse_loss(wrapped(x[step, mine]), y[step, mine])
            loss.backward()
            opt.step()
            total = loss.detach().clone()
            ad.all_reduce(total)
            step += 1
            if d.rank == 0:
                with open(out / "losses.txt", "a") as f:
                    f.write(f"{step} {total.item() / d.world_size!r}\n")
            time.sleep(a.sleep)
            if a.ckpt:
                d.check_preemption()
        hosts: list[object] = [None] * d.world_size
        nodes: list[object] = [None] * d.world_size
        torch.distributed.all_gather_object(hosts, socket.gethostname())
        torch.distributed.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME"))
        if d.rank == 0:
            checksum = sum(float(v.double().sum()) for v in net.state_dict().values())
            (out / "final.json").write_text(
                json.dumps(
                    {
                        "world_size": d.world_size,
                        "launcher": d.launcher,
                        "hosts": hosts,
                        "nodes": nodes,
                        "checksum": checksum,
                        "master_addr": os.environ.get("MASTER_ADDR"),
                    }
                )
            )


if __name__ == "__main__":
    main()
