"""Data-parallel training that runs unchanged in one process or many.

    python examples/ddp_train.py                          # one process, the best device
    anydevice launch -n 2 examples/ddp_train.py           # two processes: DDP (gloo on CPU)
    torchrun --nproc-per-node 2 examples/ddp_train.py     # the same through torchrun
    python examples/ddp_train.py --spawn 2                # launched from Python: ad.launch

The tutorial version of this script reads LOCAL_RANK, picks the backend, sets the CUDA
device, calls init_process_group, builds a DistributedSampler, remembers set_epoch, passes
device_ids to DDP (but not on the CPU, where torch refuses them), averages the loss by
hand, evaluates on a padded sampler that counts some samples twice, and forgets to tear
down. Here that is ``ad.distributed()``, ``ad.prepare()``, ``ad.all_reduce()`` and
``ad.gather_for_metrics()``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import anydevice as ad


def dataset(n: int, seed: int) -> TensorDataset:
    """Two classes split by a fixed random hyperplane in 16 dimensions."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, (x @ w > 0).long())


def fit(d: ad.Distributed, epochs: int, batch_size: int, lr: float) -> float:
    """Train, evaluate, and return the test accuracy (the same on every rank).

    The DDP model lives in this function, so it is freed before ``ad.distributed`` tears
    the process group down.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    train = DataLoader(dataset(2000, seed=1), batch_size=batch_size, shuffle=True)
    test = DataLoader(dataset(999, seed=2), batch_size=256)  # 999: uneven on purpose
    model, train, optimizer = ad.prepare(model, train, optimizer)
    model, test = ad.prepare(model, test)  # an already wrapped model is left as it is
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        model.train()
        total = torch.zeros((), device=d.device)
        for x, y in train:  # on d.device already; a new shuffle every epoch, unasked
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach()
        mean_loss = ad.all_reduce(total / len(train))  # averaged over ranks
        if d.is_main:
            print(f"epoch {epoch}: loss {mean_loss.item():.4f}")
    model.eval()
    with torch.no_grad():
        outputs = [(model(x).argmax(1), y) for x, y in test]  # one pass, both on d.device
    preds = torch.cat([p for p, _ in outputs])
    labels = torch.cat([y for _, y in outputs])
    preds, labels = ad.gather_for_metrics((preds, labels), test)  # each sample once
    assert len(preds) == len(test.dataset)  # type: ignore[arg-type]
    return (preds == labels).float().mean().item()


def main(epochs: int = 3, batch_size: int = 32, lr: float = 0.05) -> float:
    with ad.distributed() as d:
        if d.is_main:
            print(f"{d.world_size} process(es), {d.backend or 'no process group'}, on {d.device}")
        accuracy = fit(d, epochs, batch_size, lr)
        if d.is_main:
            print(f"test accuracy {accuracy:.3f}")
        return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--spawn", type=int, default=0, metavar="N", help="ad.launch N procs")
    args = parser.parse_args()
    if args.spawn:
        results = ad.launch(main, args.epochs, args.batch_size, args.lr, nprocs=args.spawn)
        print(f"accuracy by rank: {results}")
    else:
        main(args.epochs, args.batch_size, args.lr)
