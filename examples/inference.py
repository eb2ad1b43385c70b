"""Inference done right: ``eval()``, ``torch.inference_mode()``, batches on the device, and
the results brought back to the host once, not one sync per item.

    python examples/inference.py
    python examples/inference.py --tiny

The tutorial loop::

    for x, _ in loader:
        out = model(x.to(device))                 # autograd still recording, dropout on
        for p in out.argmax(1):
            predictions.append(p.item())          # one host-device sync per item

After: the model in eval mode (dropout off, batch norm on its running statistics), autograd
off for the whole loop (``inference_mode``: no graph, no version counters), batches moved
by ``ad.DeviceLoader`` ahead of time, predictions kept on the device and copied back with
one ``.cpu()`` at the end. ``ad.find_syncs`` counts the syncs of both loops on a GPU.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import anydevice as ad


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 4)
    )


def data(n: int) -> TensorDataset:
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, (x @ w).argmax(1))


def train(model: nn.Module, dev: torch.device) -> None:
    loader = ad.DeviceLoader(DataLoader(data(4096), batch_size=128, shuffle=True), dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(3):
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()


def predict_per_item(model: nn.Module, loader: ad.DeviceLoader[Any]) -> list[int]:
    """The tutorial's way: autograd on, model left in training mode, .item() per item."""
    out = []
    for x, _ in loader:
        for p in model(x).argmax(1):
            out.append(int(p.item()))
    return out


def predict(model: nn.Module, loader: ad.DeviceLoader[Any]) -> torch.Tensor:
    """eval + inference_mode, predictions kept on the device, one copy to the host."""
    model.eval()
    with torch.inference_mode():
        chunks = [model(x).argmax(1) for x, _ in loader]
        return torch.cat(chunks).cpu()  # the one sync


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--tiny", action="store_true", help="2000 samples")
    args = parser.parse_args()
    n = 2000 if args.tiny else args.samples

    dev = ad.device()
    why = "the best accelerator here" if dev.type != "cpu" else "no accelerator here"
    print(f"device: {dev} ({why})")
    torch.manual_seed(0)
    model = make_model().to(dev)
    train(model, dev)

    test = data(n)
    loader = ad.DeviceLoader(DataLoader(test, batch_size=500), dev)
    labels = test.tensors[1]

    model.train()  # as the tutorial loop leaves it
    sloppy = torch.tensor(predict_per_item(model, loader))
    print(f"per item, train mode, autograd on: accuracy "
          f"{(sloppy == labels).float().mean().item():.3f} (dropout still on)")  # fmt: skip

    predictions = predict(model, loader)
    again = predict(model, loader)
    print(f"eval + inference_mode: accuracy {(predictions == labels).float().mean().item():.3f}"
          f", {len(predictions)} predictions on {predictions.device}, "
          f"deterministic: {torch.equal(predictions, again)}")  # fmt: skip

    slow = ad.timeit(predict_per_item, model, loader, warmup=1, repeat=5, number=1)
    fast = ad.timeit(predict, model, loader, warmup=1, repeat=5, number=1)
    print(f"time for {n} samples: per item {slow.median * 1e3:.1f} ms, batched with one copy "
          f"{fast.median * 1e3:.1f} ms ({slow.median / fast.median:.1f}x)")  # fmt: skip
    print(f"syncs, per-item loop: {ad.find_syncs(predict_per_item, model, loader)}")
    print(f"syncs, batched loop: {ad.find_syncs(predict, model, loader)}")


if __name__ == "__main__":
    main()
