"""The device boilerplate from every tutorial, with anydevice.

Before::

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

which initialises CUDA just to ask, ignores a full GPU, and says nothing when it falls
back. After: the same in one call, plus what is here and why.
"""

from __future__ import annotations

import torch

import anydevice as ad


def main() -> None:
    inv = ad.inventory()
    for d in inv.devices:
        print(d)
    dev = ad.device()  # or ad.device("free"), ad.device("cuda", need_memory="8GiB")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model.to(dev)
    y = model(torch.randn(8, 16, device=dev))
    print(f"ran on {dev}: output {tuple(y.shape)}")


if __name__ == "__main__":
    main()
