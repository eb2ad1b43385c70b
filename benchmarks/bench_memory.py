"""What watching memory costs: ad.memory(), track_memory's sampler, free_memory().

On the CPU ``track_memory`` samples resident memory from a background thread every
millisecond. This measures how much that slows the code inside the block, for a
Python-bound loop (the sampler competes for the GIL) and a torch-bound one (torch
releases the GIL), and what each call costs. Targets: the sampler costs under 5%.

GPU (``gpu_memory``): the same calls on CUDA, where track_memory reads the allocator's
counters instead of sampling.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

import anydevice as ad

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, save


def python_bound() -> int:
    return sum(i * i for i in range(20_000))


def torch_bound(a: torch.Tensor) -> Callable[[], object]:
    return lambda: [torch.mm(a, a) for _ in range(10)]


def tracked(fn: Callable[[], object], device: str) -> Callable[[], object]:
    def run() -> object:
        with ad.track_memory(device):
            return fn()

    return run


def overhead_of_sampling(result: Result, device: str, rounds: int = 9) -> dict[str, float]:
    """Median time of each workload, plain and inside one long track_memory block."""
    a = torch.randn(256, 256, device=device)
    ratios = {}
    for name, fn in {"python loop": python_bound, "10x mm 256": torch_bound(a)}.items():
        plain, inside = [], []
        for _ in range(rounds):  # interleaved, so drift hits both alike
            plain.append(ad.timeit(fn, device=device, min_time=0.3).median * 1e3)
            with ad.track_memory(device):
                inside.append(ad.timeit(fn, device=device, min_time=0.3).median * 1e3)
        p = result.add(f"{name}", plain)
        q = result.add(f"{name} inside track_memory", inside)
        ratios[name] = q / p
        result.notes.append(f"{name}: {100 * (q / p - 1):+.1f}% inside track_memory")
    return ratios


def call_costs(device: str) -> Result:
    costs = Result(f"memory-calls-{device}", "us")
    for name, fn in {
        "ad.memory()": lambda: ad.memory(device),
        "empty track_memory block": tracked(lambda: None, device),
        "ad.free_memory()": lambda: ad.free_memory(device),
    }.items():
        m = ad.timeit(fn, device=device, min_time=0.5, warmup=2)
        costs.add(name, [t * 1e6 for t in m.times])
    return costs


def main() -> None:
    torch.set_num_threads(1)
    result = Result("track-memory-overhead-cpu", "ms")
    ratios = overhead_of_sampling(result, "cpu")
    result.extra["slowdown"] = ratios
    result.notes.append("sampler: a daemon thread reading RSS every 1 ms; torch threads 1")
    save(result)
    save(call_costs("cpu"))


def gpu_memory() -> None:
    """On an NVIDIA GPU: what the calls cost when they read the allocator's counters."""
    save(call_costs("cuda"))


if __name__ == "__main__":
    main()
