"""ad.timeit against the timers people trust: same kernels, side by side, one run.

CPU (``main``, run by ``make bench``): a matmul, an elementwise add and a tiny op, timed
by ``ad.timeit``, ``torch.utils.benchmark.Timer.blocked_autorange`` and the standard
library's ``timeit``; the medians should agree. The floor of each timer (what it reports
for a function that does nothing) and the wall time each takes are recorded too.

GPU (``gpu_timing``, run by ``benchmarks/gpu.py`` on an NVIDIA machine): the same three
kernels on CUDA. Warm cache: ``ad.timeit`` against ``torch.utils.benchmark``. Cold cache:
``ad.timeit(flush_l2=True)`` against ``triton.testing.do_bench`` (which flushes the L2 the
same way). Targets: medians within 5%, and our floor per call no larger than theirs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit as stdlib_timeit
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils.benchmark as tb

import anydevice as ad

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, save

AGREE = 0.05  # medians within 5%


def kernels(device: torch.device, quick: bool = False) -> dict[str, Callable[[], object]]:
    """A compute-bound, a memory-bound and a launch-bound op, plus a no-op."""
    if quick:
        a = torch.randn(16, 16, device=device)
        big = torch.randn(2**18, device=device)  # 1 MiB
        size = "16 fp32"
    elif device.type == "cuda":
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        big = torch.randn(2**26, device=device)  # 256 MiB
        size = "4096 bf16"
    else:
        a = torch.randn(256, 256, device=device)
        big = torch.randn(2**20, device=device)  # 4 MiB
        size = "256 fp32"
    tiny = torch.zeros(1, device=device)
    return {
        f"matmul {size}": lambda: torch.mm(a, a),
        f"add {big.numel() * 4 // 2**20} MiB": lambda: torch.add(big, 1.0),
        "tiny add_ (1 element)": lambda: tiny.add_(1.0),
        "no-op (timer floor)": lambda: None,
    }


def torch_benchmark(fn: Callable[[], object], min_time: float) -> float:
    timer = tb.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return float(timer.blocked_autorange(min_run_time=min_time).median)


def stdlib(fn: Callable[[], object], min_time: float) -> float:
    """timeit's own recipe: autorange for the count, then the best of 5 repeats."""
    t = stdlib_timeit.Timer(fn)
    number, _ = t.autorange()
    number = max(1, int(number * min_time / 0.2 / 5))
    return min(t.repeat(repeat=5, number=number)) / number


def wall(fn: Callable[[], float]) -> tuple[float, float]:
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def compare(
    result: Result,
    name: str,
    timers: dict[str, Callable[[], float]],
    rounds: int,
) -> dict[str, float]:
    """Run each timer ``rounds`` times, interleaved; record medians (us) and wall times (s)."""
    medians: dict[str, list[float]] = {k: [] for k in timers}
    walls: dict[str, list[float]] = {k: [] for k in timers}
    for _ in range(rounds):
        for label, run in timers.items():
            value, seconds = wall(run)
            medians[label].append(value * 1e6)
            walls[label].append(seconds)
    out = {}
    for label in timers:
        out[label] = result.add(f"{name}: {label}", medians[label])
        result.extra.setdefault("wall_s", {})[f"{name}: {label}"] = statistics.median(walls[label])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every tool")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # one thread: less exposed to other work on the host
    dev = torch.device("cpu")
    result = Result("timeit-agreement-cpu", "us")
    result.notes.append(
        f"median per call over {args.rounds} interleaved rounds; each tool given "
        f"min_time={args.min_time} s; torch threads {torch.get_num_threads()}"
    )
    ratios = {}
    for name, fn in kernels(dev).items():
        got = compare(
            result,
            name,
            {
                "ad.timeit": lambda fn=fn: ad.timeit(fn, device=dev, min_time=args.min_time).median,
                "torch.utils.benchmark": lambda fn=fn: torch_benchmark(fn, args.min_time),
                "timeit (stdlib)": lambda fn=fn: stdlib(fn, args.min_time),
            },
            args.rounds,
        )
        ratios[name] = {
            "ad/torch": got["ad.timeit"] / got["torch.utils.benchmark"],
            "ad/stdlib": got["ad.timeit"] / got["timeit (stdlib)"],
        }
        result.notes.append(
            f"{name}: ad.timeit / torch.utils.benchmark = {ratios[name]['ad/torch']:.3f}, "
            f"/ stdlib timeit = {ratios[name]['ad/stdlib']:.3f}"
        )
    result.extra["ratios"] = ratios
    save(result)


# ----------------------------------------------------------------------------- GPU


def gpu_timing(device: str = "cuda", quick: bool = False) -> Result:
    """On an NVIDIA GPU: agreement with torch.utils.benchmark and triton's do_bench.

    ``quick`` (a smoke run: tiny kernels, a few ms each) records the verdicts but does not
    fail on them: timings that short say nothing about agreement.
    """
    dev = ad.device(device)
    min_time, rounds = (0.005, 1) if quick else (0.5, 5)
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if dev.type != "cuda":
        do_bench = None  # triton times CUDA kernels only
    result = Result("timeit-agreement-gpu", "us")
    result.notes.append(
        f"median per call over {rounds} interleaved rounds; min_time {min_time} s; "
        "warm = no flush (ad.timeit vs torch.utils.benchmark), cold = L2 flushed before each "
        "call (ad.timeit(flush_l2=True) vs triton do_bench, median)"
    )
    verdicts: list[str] = []
    ratios: dict[str, dict[str, float]] = {}
    floors: dict[str, dict[str, float]] = {}
    plans: dict[str, dict[str, dict[str, float]]] = {}
    for name, fn in kernels(dev, quick).items():
        timers: dict[str, Callable[[], float]] = {
            "warm ad.timeit": lambda fn=fn: ad.timeit(fn, device=dev, min_time=min_time).median,
            "warm torch.utils.benchmark": lambda fn=fn: torch_benchmark(fn, min_time),
            "cold ad.timeit": lambda fn=fn: (
                ad.timeit(fn, device=dev, min_time=min_time, flush_l2=True).median
            ),
        }
        if do_bench is not None:
            timers["cold triton do_bench"] = lambda fn=fn: (
                do_bench(fn, rep=min_time * 1000, return_mode="median") / 1000
            )
        got = compare(result, name, timers, rounds)
        warm = ad.timeit(fn, device=dev, min_time=min_time)
        cold = ad.timeit(fn, device=dev, min_time=min_time, flush_l2=True)
        plans[name] = {
            mode: {"number": m.number, "count": m.count, "overhead_us": m.overhead * 1e6}
            for mode, m in (("warm", warm), ("cold", cold))
        }
        pairs = {"warm": ("warm ad.timeit", "warm torch.utils.benchmark")}
        if do_bench is not None:
            pairs["cold"] = ("cold ad.timeit", "cold triton do_bench")
        ratios[name] = {}
        for mode, (ours, theirs) in pairs.items():
            ratio = got[ours] / got[theirs]
            ratios[name][mode] = ratio
            if name.startswith("no-op"):
                floors[mode] = {"ours_us": got[ours], "theirs_us": got[theirs]}
                ok = got[ours] <= got[theirs] * (1 + AGREE) + 0.01  # 10 ns of slack
                verdicts.append(
                    f"{'PASS' if ok else 'FAIL'} {mode} floor: ours {got[ours]:.3f} us per call, "
                    f"{theirs} {got[theirs]:.3f} us"
                )
            else:
                ok = abs(ratio - 1) <= AGREE
                verdicts.append(
                    f"{'PASS' if ok else 'FAIL'} {mode} {name}: {ours} / {theirs} = {ratio:.3f}"
                )
    if do_bench is None:
        result.notes.append("triton is not importable: the cold-cache comparison was skipped")
    result.notes += verdicts
    result.extra.update(ratios=ratios, floors=floors, ad_timeit_plans=plans, verdicts=verdicts)
    save(result)
    failed = [v for v in verdicts if v.startswith("FAIL")]
    if failed and not quick:
        raise AssertionError("timing targets missed:\n" + "\n".join(failed))
    return result


if __name__ == "__main__":
    main()
