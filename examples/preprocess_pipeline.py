"""CPU preprocessing feeding device compute: DataLoader workers, ``ad.DeviceLoader``, and
the arithmetic part of the preprocessing done on the device.

    python examples/preprocess_pipeline.py
    python examples/preprocess_pipeline.py --tiny

The tutorial pipeline decodes, augments *and normalises* in the workers, then sends float32
batches (4x the bytes of the uint8 pixels) with a blocking ``.to(device)`` in the training
loop, so the GPU waits for every copy. Here the workers do what needs the CPU (decode, random
crop and flip, per sample) and send ``uint8``; ``ad.DeviceLoader`` copies the next batch
while the current one computes (pinned memory and a side stream on CUDA); its ``transform``
converts and normalises on the device. ``loader.stats`` says whether the step waited for data.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import anydevice as ad

MEAN = (0.49, 0.48, 0.45)
STD = (0.25, 0.24, 0.26)


class Images(Dataset[tuple[torch.Tensor, int]]):
    """Synthetic 3x40x40 uint8 "photos" of 10 classes, made per index (a stand-in for
    decoding a file), randomly cropped to 32x32 and flipped: the per-sample CPU work."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        label = i % 10
        image = torch.randint(0, 256, (3, 40, 40), generator=g, dtype=torch.uint8)
        image[label % 3] //= 2  # something the classes differ by
        top, left = torch.randint(0, 9, (2,), generator=g).tolist()
        image = image[:, top : top + 32, left : left + 32]
        if torch.rand((), generator=g) < 0.5:
            image = image.flip(-1)
        return image.contiguous(), label


def normalise(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 -> float, scaled and normalised: on the device, for the whole batch at once."""
    images, labels = batch
    mean = torch.tensor(MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=images.device).view(1, 3, 1, 1)
    return (images.float().div_(255) - mean) / std, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="512 samples")
    args = parser.parse_args()
    samples = 512 if args.tiny else args.samples

    dev = ad.device()
    why = "the best accelerator here" if dev.type != "cpu" else "no accelerator here"
    print(f"device: {dev} ({why})")

    torch.manual_seed(0)
    source = DataLoader(
        Images(samples), batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )  # fmt: skip
    loader = ad.DeviceLoader(source, dev, transform=normalise)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),
        nn.Flatten(), nn.Linear(16 * 8 * 8, 10),
    ).to(dev)  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(2):
        total = torch.zeros((), device=dev)  # summed on the device: no sync per batch
        for images, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(images), labels)
            loss.backward()
            optimizer.step()
            total += loss.detach()
        print(f"epoch {epoch}: mean loss {total.item() / len(loader):.4f}")
    mean, std = images.mean().item(), images.std().item()
    print(f"a batch as the model sees it: {images.dtype} {tuple(images.shape)} on "
          f"{images.device}, mean {mean:+.3f}, std {std:.3f}")  # fmt: skip
    print(f"workers: {args.workers} (decode, crop, flip: uint8 on the CPU)")
    print(loader.stats)


if __name__ == "__main__":
    main()
