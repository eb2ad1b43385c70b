"""Gradient accumulation on 2 ranks: gradient reductions and step time, with and without.

One optimizer step of ``N`` micro-batches, two ways, on 2 ranks started by ``torchrun
--standalone`` (gloo, 1 thread each):

* **every micro-batch**: the plain loop — ``backward`` on each micro-batch with the
  model's gradient sync on, so DDP all-reduces (FSDP2 reduce-scatters) ``N`` times per
  step;
* **d.accumulate**: ``for step in d.accumulate(model, micro, micro_batches=N)``, which
  switches the sync off for all but the last micro-batch: one reduction per step.

Both train the same model (``Linear + GELU`` blocks and a head, SGD) through
``ad.precision`` (fp32) and give the same weights. Reported per strategy (DDP, FSDP2):
the gradient reductions per step, counted from the collectives the gloo process group
ran (torch's profiler records each one; FSDP2's reduce-scatter runs as an all-reduce on
gloo; DDP reduces each gradient bucket once), and the median step time on rank 0 (the two
ways interleaved within each run).

Every configuration runs in its own job, round-robin ``--rounds`` times so that the
machine's drift hits them alike. Peers, on the same DDP model: accelerate's
``Accelerator(gradient_accumulation_steps=N)`` with ``accelerator.accumulate(model)``, and
Lightning Fabric's ``no_backward_sync``.

``python benchmarks/bench_accumulation.py [--width 1024] [--depth 4] [--micro 8]``
``[--micro-batches 8]``
"""

from __future__ import annotations

import argparse
import collections
import functools
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

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, save

BIN = Path(sys.executable).parent
WARMUP = 2
HOWS = ("every micro-batch", "d.accumulate")


def model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def one_step(d: Any, net: nn.Module, opt: Any, p: Any, micro: list[Any], how: str) -> None:
    for step in d.accumulate(net, micro, micro_batches=len(micro)):
        for x, y in step:
            if how == "every micro-batch":  # what a loop without accumulate does
                if isinstance(net, nn.parallel.DistributedDataParallel):
                    net.require_backward_grad_sync = True
                else:
                    net.set_requires_gradient_sync(True)  # type: ignore[operator]
            p.backward(step.scale(nn.functional.mse_loss(net(x), y)))
        p.step(opt)
        opt.zero_grad(set_to_none=True)


def micro_batches(args: Any, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(args.micro, args.width, generator=g), torch.randn(args.micro, 1, generator=g))
        for _ in range(args.micro_batches)
    ]


def reductions(step: Callable[[], None]) -> int:
    """The gradient reductions gloo ran during one optimizer ``step()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    names = collections.Counter(e.name for e in prof.events())
    return names["gloo:all_reduce"]


def measure(ways: dict[str, Callable[[], None]], args: Any) -> dict[str, Any]:
    """Reductions per step, and the median step time of each round, ways interleaved."""
    import torch.distributed as dist

    facts: dict[str, Any] = {}
    for how, step in ways.items():  # after a warm-up step: DDP re-buckets after its first
        step()
        facts[f"{how} reductions"] = reductions(step)
        facts[f"{how} step_s"] = []
    for _ in range(args.rounds):  # interleaved, so drift hits every way alike
        for how, step in ways.items():
            times = []
            for s in range(WARMUP + args.steps):
                dist.barrier()
                t = time.perf_counter()
                step()
                if s >= WARMUP:
                    times.append(time.perf_counter() - t)
            facts[f"{how} step_s"].append(statistics.median(times))
    return facts


# ----------------------------------------------------------------------------- workers


def worker(strategy: str, args: Any, out: Path) -> None:
    import torch.distributed as dist

    import anydevice as ad

    with ad.distributed() as d:
        net = model(args.width, args.depth)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        extra = {"precision": "fp32"} if strategy == "fsdp" else {}
        net, opt = ad.prepare(net, optimizer=opt, strategy=strategy, **extra)
        p = ad.precision(d.device, "fp32")
        micro = micro_batches(args, d.rank)
        ways = {how: functools.partial(one_step, d, net, opt, p, micro, how) for how in HOWS}
        gathered = ad.all_gather(measure(ways, args))
        if d.rank == 0:
            out.write_text(json.dumps(gathered))
        del net, opt, ways
        dist.barrier()


def accelerate_step(acc: Any, net: nn.Module, opt: Any, micro: list[Any]) -> None:
    for x, y in micro:
        with acc.accumulate(net):
            acc.backward(nn.functional.mse_loss(net(x), y))  # divides by N
            opt.step()  # steps only on the last micro-batch
            opt.zero_grad()


def accelerate_worker(args: Any, out: Path) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=args.micro_batches)
    net = model(args.width, args.depth)
    net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-3))
    micro = micro_batches(args, acc.process_index)
    ways = {"accumulate()": functools.partial(accelerate_step, acc, net, opt, micro)}
    facts = measure(ways, args)
    gathered: list[Any] = [None] * acc.num_processes
    torch.distributed.all_gather_object(gathered, facts)
    if acc.is_main_process:
        out.write_text(json.dumps(gathered))
    del net, opt, ways  # free DDP's reducer while the group lives
    gc.collect()
    acc.end_training()


def fabric_worker(args: Any, out: Path) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    net = fabric.setup_module(model(args.width, args.depth))
    opt = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=1e-3))
    micro = micro_batches(args, fabric.global_rank)

    def step() -> None:
        for i, (x, y) in enumerate(micro):
            with fabric.no_backward_sync(net, enabled=i < len(micro) - 1):
                fabric.backward(nn.functional.mse_loss(net(x), y) / len(micro))
        opt.step()
        opt.zero_grad()

    facts = measure({"no_backward_sync()": step}, args)
    gathered: list[Any] = [None] * fabric.world_size
    torch.distributed.all_gather_object(gathered, facts)
    if fabric.global_rank == 0:
        out.write_text(json.dumps(gathered))


# ----------------------------------------------------------------------------- driver


def run(label: str, argv: list[str], out: Path) -> Any:
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    try:
        err = proc.communicate(timeout=900)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # a rank hung (at exit, in gloo): the results may be there
        err = proc.communicate()[1] + "\n(timed out: killed)"
    if not out.exists():
        tail = (err.strip().splitlines() or ["(no output)"])[-1]
        print(f"  {label}: failed ({tail})")
        return tail
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--micro", type=int, default=8, help="micro-batch size per rank")
    parser.add_argument("--micro-batches", type=int, default=8, help="per step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("mode", nargs="?", default="driver")
    parser.add_argument("what", nargs="?", default="")
    parser.add_argument("out", nargs="?", default="")
    args = parser.parse_args()
    if args.mode == "ad":
        worker(args.what, args, Path(args.out))
    elif args.mode == "accelerate":
        accelerate_worker(args, Path(args.out))
    elif args.mode == "fabric":
        fabric_worker(args, Path(args.out))
    else:
        drive(args)


def drive(args: Any) -> None:
    sizes = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("width", "depth", "micro", "micro_batches", "steps")
    ] + ["--rounds=1"]  # a round per job: the jobs take turns
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    me = str(Path(__file__).resolve())
    configs = {
        "DDP": [*torchrun, me, *sizes, "ad", "ddp"],
        "FSDP2": [*torchrun, me, *sizes, "ad", "fsdp"],
        "accelerate": [*torchrun, me, *sizes, "accelerate", "-"],
        "Fabric": [sys.executable, me, *sizes, "fabric", "-"],  # Fabric starts its own ranks
    }
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):  # round-robin, so drift hits every config alike
            for label, argv in configs.items():
                if round_ and not isinstance(found.get(label), list):
                    continue  # it failed: once is enough
                print(f"  round {round_ + 1}: {label} ...", flush=True)
                out = Path(tmp) / f"{round_}-{label}.json"
                got = run(label, [*argv, str(out)], out)
                found[label] = got if not isinstance(got, list) else [*found.get(label, []), got]
    report(found, args)


def report(found: dict[str, Any], args: Any) -> None:
    params = sum(p.numel() for p in model(args.width, args.depth).parameters())
    shape = (
        f"{args.depth} x Linear({args.width}, {args.width}) + GELU, a head; {params / 1e6:.1f} M "
        f"parameters, SGD, {args.micro_batches} micro-batches of {args.micro} per rank per "
        f"step, 2 ranks (gloo, 1 thread each); {args.rounds} rounds of every configuration"
    )
    counts = Result("accumulation-reductions", "per step", baseline="DDP: every micro-batch")
    step = Result("accumulation-step-time", "ms", baseline="DDP: every micro-batch")
    failed = {k: v for k, v in found.items() if not isinstance(v, list)}
    for config, rounds in found.items():
        if config in failed:
            continue
        ranks = rounds[-1]
        ways = [k.removesuffix(" reductions") for k in ranks[0] if k.endswith(" reductions")]
        for how in ways:
            label = f"{config}: {how}"
            counts.add(label, [r[f"{how} reductions"] for r in ranks])
            step.add(label, [each[0][f"{how} step_s"][0] * 1e3 for each in rounds])
        if ways == list(HOWS):
            every, once = (f"{config}: {h}" for h in HOWS)
            counts.extra[f"{config}_fewer"] = counts.rows[every] / counts.rows[once]
            step.extra[f"{config}_speedup"] = step.rows[every] / step.rows[once]
            line = (
                f"{config}: {counts.rows[every]:g} -> {counts.rows[once]:g} gradient "
                f"reductions per step ({counts.extra[f'{config}_fewer']:.1f}x fewer); step "
                f"{step.rows[every]:.0f} -> {step.rows[once]:.0f} ms "
                f"({step.extra[f'{config}_speedup']:.2f}x faster)"
            )
            print(line)
            counts.notes.append(line)
            step.notes.append(line)
    for res in (counts, step):
        res.notes.append(shape)
        res.notes.append(
            "peers (DDP on 2 CPU ranks): accelerate's Accelerator(cpu=True, "
            "gradient_accumulation_steps=N).accumulate(model), Lightning Fabric's "
            "no_backward_sync(model, enabled=not last)"
        )
        res.extra["failed"] = failed
        for label, why in failed.items():
            res.notes.append(f"{label}: does not run here: {why}")
    save(counts)
    save(step)


if __name__ == "__main__":
    main()
