"""The hang watch's cost: per collective and per DDP step (gloo), side by side without it.

The watch adds nothing to a collective's own path: torch's flight recorder notes each
collective (on by default in torch 2.13, ``TORCH_FR_BUFFER_SIZE=2000``), and a thread of
each rank reads it twice a second (:mod:`anydevice.launching.progress`). Three ways:

* **recorder off**: ``TORCH_FR_BUFFER_SIZE=0``, no watch thread — torch recording nothing;
* **torch default**: the recorder on (2000 entries), no watch thread — what every torch
  2.13 job pays;
* **anydevice watch**: the recorder on and the watch thread running, as in every rank of
  ``anydevice launch`` and ``ad.distributed``.

The recorder is fixed when a process starts, so "recorder off" runs in jobs of its own;
within the others the watch thread is started and stopped between blocks, so "torch
default" and "anydevice watch" take turns in the same processes. Measured, the median
over blocks:

* **one all_reduce of one float in a world of one** (gloo, no network: the least noise
  on a busy machine), ``--collectives`` per block;
* **the same on 2 ranks**, rank 0's time after a barrier;
* **one DDP step on 2 ranks** (forward, backward with its bucket reductions, SGD) of a
  ``--depth`` x ``Linear(--width)`` MLP on a batch of ``--batch``, ``--steps`` per block;
* **one tick of the watch thread** (its look at the recorder, while no collective runs),
  in a world of one: the GIL time it takes twice a second.

Ratios are to "torch default"; the load average is recorded with each result.

The watch's cost is the mean of the paired differences (each "anydevice watch" block
minus the "torch default" block run next to it, in the same processes, either first as
often), with two standard errors: on a busy machine a median per way moves more than the watch does.

``python benchmarks/bench_hangwatch.py [--rounds 3] [--blocks 40]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, save

BIN = Path(sys.executable).parent
WAYS = ("recorder off", "torch default", "anydevice watch")


def blocks(
    args: Any,
    measures: dict[str, Callable[[], float]],
    out: Path,
    rank: int,
    between: Callable[[], object] | None = None,
) -> None:
    """Each measure once per block, for each way this process runs, taking turns; then
    (rank 0) the watch's tick on its own, ``between`` run before each (not timed)."""
    from anydevice import heartbeat
    from anydevice.launching import progress

    recorder = os.environ.get("TORCH_FR_BUFFER_SIZE") != "0"
    ways = ("torch default", "anydevice watch") if recorder else ("recorder off",)
    found: dict[str, dict[str, list[float]]] = {w: {m: [] for m in measures} for w in ways}
    for measure in measures.values():
        measure()  # warm-up: DDP re-buckets after its first step
    beat = heartbeat.mine()
    for block in range(args.blocks):
        for way in ways if block % 2 else ways[::-1]:  # either way first as often
            watcher = None
            if way == "anydevice watch" and beat is not None:
                watcher = progress.Watcher(beat)
                watcher.start()
            for name, measure in measures.items():
                found[way][name].append(measure())
            if watcher is not None:
                watcher.stop()
    if rank == 0:
        if recorder and beat is not None and between is not None:  # the watch's tick
            watcher = progress.Watcher(beat)
            ticks = []
            for _ in range(200):
                between()  # a collective since the last tick: its record changes
                start = time.perf_counter()
                watcher.look()
                ticks.append(time.perf_counter() - start)
            found["anydevice watch"]["tick"] = [statistics.median(ticks)]
        out.write_text(json.dumps(found))


def world_of_one(args: Any, out: Path) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(1)

    def collective() -> float:
        start = time.perf_counter()
        for _ in range(args.collectives):
            dist.all_reduce(t)
        return (time.perf_counter() - start) / args.collectives

    blocks(args, {"collective (world of 1)": collective}, out, 0, lambda: dist.all_reduce(t))
    dist.destroy_process_group()


def two_ranks(args: Any, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [m for _ in range(args.depth) for m in (nn.Linear(args.width, args.width), nn.GELU())]
    net = nn.parallel.DistributedDataParallel(nn.Sequential(*layers, nn.Linear(args.width, 1)))
    held = {"net": net, "opt": torch.optim.SGD(net.parameters(), lr=1e-3)}
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 1)
    t = torch.ones(1)

    def collective() -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.collectives):
            dist.all_reduce(t)
        return (time.perf_counter() - start) / args.collectives

    def step() -> float:
        model, opt = held["net"], held["opt"]
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            opt.zero_grad(set_to_none=True)  # type: ignore[union-attr]
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # type: ignore[union-attr]
        return (time.perf_counter() - start) / args.steps

    measures = {"collective (2 ranks)": collective, "DDP step (2 ranks)": step}
    blocks(args, measures, out, dist.get_rank())
    held.clear()
    del net
    gc.collect()  # DDP's reducer goes while the group lives: gloo may hang at exit otherwise
    dist.barrier()
    dist.destroy_process_group()


def job(argv: list[str], recorder: bool, out: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_FR_BUFFER_SIZE": "2000" if recorder else "0",
    }
    proc = subprocess.run([*argv, str(out)], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--collectives", type=int, default=250)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("mode", nargs="?", default="driver")
    parser.add_argument("out", nargs="?", default="")
    args = parser.parse_args()
    if args.mode == "one":
        world_of_one(args, Path(args.out))
        return
    if args.mode == "two":
        two_ranks(args, Path(args.out))
        return
    names = ("width", "depth", "batch", "collectives", "steps", "blocks")
    sizes = [f"--{k}={getattr(args, k)}" for k in names]
    me = str(Path(__file__).resolve())
    argvs = {
        "one": [sys.executable, me, *sizes, "one"],
        "two": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", me, *sizes, "two"],
    }
    samples: dict[str, dict[str, list[float]]] = {w: {} for w in WAYS}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):  # jobs with and without the recorder take turns
            for mode, argv in argvs.items():
                for recorder in (False, True):
                    state = "on" if recorder else "off"
                    print(f"  round {r + 1}: {mode}, recorder {state} ...", flush=True)
                    loads.append(os.getloadavg()[0])
                    got = job(argv, recorder, Path(tmp) / f"{r}-{mode}-{recorder}.json")
                    for way, measures in got.items():
                        for name, values in measures.items():
                            samples[way].setdefault(name, []).extend(values)
    report(samples, loads, args)


def report(samples: dict[str, dict[str, list[float]]], loads: list[float], args: Any) -> None:
    params = args.depth * (args.width * args.width + args.width) + args.width + 1
    shape = (
        f"gloo, 1 thread per rank; all_reduce of 1 float, {args.collectives} per block; DDP "
        f"step of {args.depth} x Linear({args.width}) + GELU and a head ({params / 1e6:.2f} M "
        f"parameters), batch {args.batch}, {args.steps} per block; {args.blocks} blocks x "
        f"{args.rounds} rounds"
    )
    load = f"load average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}"
    results = []
    for name, unit, scale in (
        ("collective (world of 1)", "us", 1e6),
        ("collective (2 ranks)", "us", 1e6),
        ("DDP step (2 ranks)", "ms", 1e3),
    ):
        slug = name.lower().replace(" (", "-").replace(")", "").replace(" ", "-")
        res = Result(f"hangwatch-{slug}", unit, baseline="torch default")
        for way in WAYS:
            res.add(way, [v * scale for v in samples[way][name]])
        fastest = {way: min(res.samples[way]) for way in WAYS}
        res.extra["fastest_block"] = fastest
        res.notes.append(
            "fastest block (the least disturbed by the machine's other work): "
            + ", ".join(f"{way} {value:.4g} {unit}" for way, value in fastest.items())
        )
        # The watch against torch's default, block by block: each pair ran one after the
        # other in the same processes (either first as often), so the machine's other work
        # hits both alike.
        pairs = [
            w - d
            for w, d in zip(
                res.samples["anydevice watch"], res.samples["torch default"], strict=True
            )
        ]
        mean = statistics.fmean(pairs)
        error = 2 * statistics.stdev(pairs) / len(pairs) ** 0.5
        share = mean / res.rows["torch default"] * 100
        res.extra.update(paired_mean=mean, paired_2se=error, paired_percent=share)
        recorder = res.rows["torch default"] - res.rows["recorder off"]
        res.notes[:0] = [
            shape,
            load,
            f"{name}: the watch adds {mean:+.3g} ± {error:.2g} {unit} ({share:+.2f} %) to "
            f"torch's default, the mean of {len(pairs)} paired blocks (± 2 standard errors); "
            f"the recorder itself {recorder:+.3g} {unit} over none (medians, separate jobs)",
        ]
        res.extra["load_average"] = loads
        results.append(res)
    tick = samples["anydevice watch"].get("tick", [])
    if tick:
        us = statistics.median(tick) * 1e6
        share = 2 * us / 1e6 * 100  # two ticks a second
        line = (
            f"one tick of the watch thread (a collective since the last): {us:.0f} us of GIL "
            f"time, twice a second ({share:.3f} % of a core)"
        )
        for res in results:
            res.notes.append(line)
            res.extra["tick_us"] = us
    for res in results:
        save(res)


if __name__ == "__main__":
    main()
