"""What watching memory costs: ad.memory(), track_memory's sampler, free_memory().

On the CPU ``track_memory`` samples resident memory from a background thread every
millisecond. This measures how much that slows the code inside the block, for a
Python-bound loop (the sampler competes for the GIL) and a torch-bound one (torch
releases the GIL), and what each call costs. Targets: the sampler costs under 5%.

GPU (``gpu_memory``): the same calls on CUDA, where track_memory reads the allocator's
counters instead of sampling.
"""

from __future__ import annotations

import statistics
import sys
import time
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


def per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def overhead_of_sampling(result: Result, device: str, pairs: int = 15) -> dict[str, float]:
    """Slowdown of each workload inside a track_memory block: the median over ``pairs`` of
    back-to-back (plain, tracked) runs of the same calls, so drift hits both alike."""
    a = torch.randn(256, 256, device=device)
    slowdown = {}
    for name, fn in {"python loop": python_bound, "10x mm 256": torch_bound(a)}.items():
        calls = max(1, int(0.2 / per_call(fn, 3)))  # about 0.2 s per run
        plain, inside, ratios = [], [], []
        for _ in range(pairs):
            p = per_call(fn, calls)
            with ad.track_memory(device):
                q = per_call(fn, calls)
            plain.append(p * 1e3)
            inside.append(q * 1e3)
            ratios.append(q / p)
        result.add(name, plain)
        result.add(f"{name} inside track_memory", inside)
        q1, med, q3 = statistics.quantiles(ratios, n=4)
        slowdown[name] = med
        result.notes.append(
            f"{name}: {100 * (med - 1):+.1f}% inside track_memory (median of {pairs} pairs; "
            f"middle half {100 * (q1 - 1):+.1f}% to {100 * (q3 - 1):+.1f}%)"
        )
    return slowdown


def call_costs(device: str, min_time: float = 0.5) -> Result:
    costs = Result(f"memory-calls-{device}", "us")
    for name, fn in {
        "ad.memory()": lambda: ad.memory(device),
        "empty track_memory block": tracked(lambda: None, device),
        "ad.free_memory()": lambda: ad.free_memory(device),
    }.items():
        m = ad.timeit(fn, device=device, min_time=min_time, warmup=2)
        costs.add(name, [t * 1e6 for t in m.times])
    return costs


def main() -> None:
    torch.set_num_threads(1)
    result = Result("track-memory-overhead-cpu", "ms")
    result.extra["slowdown"] = overhead_of_sampling(result, "cpu")
    result.notes.append("sampler: a daemon thread reading RSS every 1 ms; torch threads 1")
    save(result)
    save(call_costs("cpu"))


def gpu_memory(device: str = "cuda", quick: bool = False) -> Result:
    """On an NVIDIA GPU: what the calls cost when they read the allocator's counters."""
    result = call_costs(device, min_time=0.01 if quick else 0.5)
    save(result)
    return result


if __name__ == "__main__":
    main()
