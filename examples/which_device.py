"""The device boilerplate from every tutorial, with anydevice.

Before::

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

which initialises CUDA just to ask, ignores a full GPU, and says nothing when it falls
back. After: the same in one call, plus what is here and why.
"""

from __future__ import annotations

import os

import torch

import anydevice as ad


def why(dev: torch.device, inv: ad.Inventory) -> str:
    """Why ``ad.device()`` chose ``dev`` on the machine ``inv`` describes."""
    if os.environ.get("ANYDEVICE_DEVICE"):
        return f"ANYDEVICE_DEVICE={os.environ['ANYDEVICE_DEVICE']} asks for it"
    if os.environ.get("LOCAL_RANK"):
        return f"this rank's device (LOCAL_RANK={os.environ['LOCAL_RANK']})"
    if dev.type != "cpu":
        return "the best accelerator here"
    build = f"torch {inv.host.torch} is a {inv.host.torch_build} build"
    if inv.host.nvidia_gpus:
        return f"{inv.host.nvidia_gpus} NVIDIA GPU(s) here, but {build} that cannot use them"
    return f"no accelerator here; {build}"


def main() -> None:
    inv = ad.inventory()
    for d in inv.devices:
        print(d)
    dev = ad.device()  # or ad.device("free"), ad.device("cuda", need_memory="8GiB")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model.to(dev)
    y = model(torch.randn(8, 16, device=dev))
    print(f"ran on {dev} ({why(dev, inv)}): output {tuple(y.shape)}")


if __name__ == "__main__":
    main()
