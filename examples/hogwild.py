"""Hogwild: several processes train one model in shared memory, without locks.

    python examples/hogwild.py                   # 2 processes
    python examples/hogwild.py --processes 4 --steps 400

The classic ``mnist_hogwild`` program from pytorch/examples, on synthetic data so that it
runs anywhere in seconds. ``ad.share(model)`` puts the parameters in shared memory (and
drops any gradients, which must stay per process); each worker process gets the same
model object, its own optimizer and its own batches, and writes its updates straight into
the shared parameters. The parent process sees the trained model when the workers finish.
"""

from __future__ import annotations

import argparse

import torch
import torch.multiprocessing as mp
from torch import nn

import anydevice as ad


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two classes separated by a fixed random direction."""
    direction = torch.randn(20, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 20, generator=torch.Generator().manual_seed(seed))
    return x, (x @ direction > 0).long()


def train(rank: int, model: Net, steps: int, batch_size: int, lr: float) -> None:
    """One Hogwild worker: its own data order and optimizer, the shared parameters."""
    torch.set_num_threads(1)  # the processes are the parallelism
    torch.manual_seed(1000 + rank)
    x, y = data(4096, seed=1 + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(steps):
        idx = torch.randint(0, len(x), (batch_size,))
        optimizer.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        optimizer.step()  # writes into shared memory, racing the other workers


def accuracy(model: Net) -> float:
    x, y = data(2000, seed=99)
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200, help="per process")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "fork", "forkserver"])
    args = parser.parse_args()

    torch.manual_seed(0)
    model = ad.share(Net())
    print(f"before: accuracy {accuracy(model):.3f}")
    ctx = mp.get_context(args.start_method)
    workers = [
        ctx.Process(target=train, args=(rank, model, args.steps, args.batch_size, args.lr))
        for rank in range(args.processes)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    failed = [w.exitcode for w in workers if w.exitcode != 0]
    if failed:
        raise SystemExit(f"{len(failed)} worker(s) failed with exit codes {failed}")
    print(f"after {args.processes} x {args.steps} steps: accuracy {accuracy(model):.3f}")


if __name__ == "__main__":
    main()
