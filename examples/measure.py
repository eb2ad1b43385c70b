"""How fast is it, where did the memory go, how big a batch fits: with anydevice.

Before, as tutorials write it::

    start = time.time()
    y = model(x)                          # on a GPU this returns before the work is done
    print(time.time() - start)            # so this times the launch, once, cold
    print(torch.cuda.max_memory_allocated())   # since when? and a CUDA-only API

    batch = 1024                          # and then shrink by hand until it stops crashing

After: timings with warm-up, synchronisation and every sample kept; the memory one block
needed; the largest batch that fits, searched for you; implicit syncs by line. Runs on a
CPU as it does on a GPU.
"""

from __future__ import annotations

import torch

import anydevice as ad


def main() -> None:
    dev = ad.device()
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)
    ).to(dev)
    x = torch.randn(64, 256, device=dev)

    print(ad.timeit(model, x, min_time=0.1, label="forward, batch 64"))

    with ad.track_memory(dev) as used:
        model(torch.randn(4096, 256, device=dev)).sum().backward()
    print(used)

    def step(batch_size: int) -> None:
        if dev.type == "cpu" and batch_size > 512:  # stand-in for a CPU without a limit
            raise torch.OutOfMemoryError(f"pretend: {batch_size} does not fit")
        model(torch.randn(batch_size, 256, device=dev)).sum().backward()

    print("largest batch that fits:", ad.fit_batch_size(step, start=32, high=2**16, device=dev))

    print(ad.find_syncs(lambda: model(x).sum().item()))  # one sync on a GPU: .item()
    print(ad.memory(dev))


if __name__ == "__main__":
    main()
