"""d2l's "training on multiple GPUs" loop, with ``try_gpu`` / ``try_all_gpus``.

    python examples/multi_gpu_d2l.py                 # every GPU here, else the CPU
    python examples/multi_gpu_d2l.py --replicas 2    # 2 replicas on the CPU: the same algorithm

Before (d2l)::

    def try_all_gpus():
        devices = [torch.device(f'cuda:{i}') for i in range(torch.cuda.device_count())]
        return devices if devices else [torch.device('cpu')]
    X_shards = nn.parallel.scatter(X, devices)      # CUDA only
    ...allreduce by hand, one replica of the parameters per device...

which initialises CUDA to count, raises from ``scatter`` on a CPU, and says nothing when it
falls back. After: ``ad.try_all_gpus()`` (NVML, no context, a logged reason when it falls
back), shards moved with ``ad.to``; the loop is d2l's. Each replica starts equal and, since
the gradients are summed over replicas, stays equal, and the result matches training on one
device with the whole batch: the program checks both.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import anydevice as ad


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two classes split by a fixed random hyperplane in 16 dimensions."""
    w = torch.randn(16, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return x, (x @ w > 0).long()


def init_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(16, 32, generator=g) * 0.25, torch.zeros(32),
        torch.randn(32, 2, generator=g) * 0.25, torch.zeros(2),
    ]  # fmt: skip


def net(x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return torch.relu(x @ w1 + b1) @ w2 + b2


def allreduce(grads: list[torch.Tensor]) -> None:
    """Sum on the first device, then copy the sum back to every device (d2l's allreduce)."""
    for g in grads[1:]:
        grads[0] += ad.to(g, grads[0].device)
    for g in grads[1:]:
        g.copy_(grads[0])


def train_batch(
    x: torch.Tensor, y: torch.Tensor, replicas: list[list[torch.Tensor]],
    devices: list[torch.device], lr: float,
) -> float:  # fmt: skip
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    shards = zip(x.chunk(len(devices)), y.chunk(len(devices)), strict=True)
    losses = [
        loss_fn(net(ad.to(xs, d), params), ad.to(ys, d))
        for (xs, ys), params, d in zip(shards, replicas, devices, strict=True)
    ]
    for loss in losses:  # each device computes its shard's gradients
        loss.backward()
    with torch.no_grad():
        for i in range(len(replicas[0])):
            grads = [params[i].grad for params in replicas]
            allreduce([g for g in grads if g is not None])
        for params in replicas:  # d2l's sgd: the same update on every device
            for p in params:
                if p.grad is not None:
                    p -= lr * p.grad / len(x)
                    p.grad = None
    return sum(float(loss.item()) for loss in losses) / len(x)


def train(
    devices: list[torch.device], epochs: int, batch_size: int, lr: float
) -> list[list[torch.Tensor]]:
    replicas = [[ad.to(p, d).requires_grad_() for p in init_params()] for d in devices]
    x, y = data(2048, seed=1)
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        for i in range(0, len(x), batch_size):
            idx = order[i : i + batch_size]
            total += train_batch(x[idx], y[idx], replicas, devices, lr) * len(idx)
        print(f"epoch {epoch}: loss {total / len(x):.4f}")
    return replicas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256, help="split over the replicas")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--replicas", type=int, default=0,
                        help="replicas on the CPU (default: one per GPU here)")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="  (%(name)s) %(message)s")

    print(f"try_gpu(0) -> {ad.try_gpu(0)}; try_gpu(7) -> {ad.try_gpu(7)}")
    gpus = ad.try_all_gpus()
    print(f"try_all_gpus() -> {gpus}")
    if args.replicas:
        devices = [torch.device("cpu")] * args.replicas
        why = f"--replicas {args.replicas}: the same loop with every replica on the CPU"
    else:
        devices = gpus
        why = "one replica per GPU" if gpus[0].type != "cpu" else "no GPU here: one replica"
    print(f"devices: {[str(d) for d in devices]} ({why})")

    replicas = train(devices, args.epochs, args.batch_size, args.lr)
    spread = max(
        (a.detach().cpu() - b.detach().cpu()).abs().max().item()
        for params in replicas[1:]
        for a, b in zip(replicas[0], params, strict=True)
    ) if len(replicas) > 1 else 0.0  # fmt: skip
    print(f"largest difference between replicas: {spread:.2e}")

    alone = train([devices[0]], args.epochs, args.batch_size, args.lr)  # the whole batch
    drift = max(
        (a.detach().cpu() - b.detach().cpu()).abs().max().item()
        for a, b in zip(replicas[0], alone[0], strict=True)
    )
    print(f"largest difference from training on one device: {drift:.2e}")
    x, y = data(1000, seed=2)
    with torch.inference_mode():
        params = [p.detach() for p in replicas[0]]
        accuracy = (net(ad.to(x, devices[0]), params).argmax(1).cpu() == y).float().mean()
    print(f"test accuracy {accuracy.item():.3f}")


if __name__ == "__main__":
    main()
