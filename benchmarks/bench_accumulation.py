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
gloo; DDP reduces each gradient bucket once), and the median step time on rank 0, the two
ways interleaved over ``--rounds``.

``python benchmarks/bench_accumulation.py [--width 1024] [--depth 4] [--micro 8]``
``[--micro-batches 8]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


def reductions(*step: Any) -> int:
    """The gradient reductions gloo ran during ``one_step(*step)``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one_step(*step)
    names = collections.Counter(e.name for e in prof.events())
    return names["gloo:all_reduce"]


def worker(strategy: str, args: Any, out: Path) -> None:
    import torch.distributed as dist

    import anydevice as ad

    with ad.distributed() as d:
        net = model(args.width, args.depth)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        extra = {"precision": "fp32"} if strategy == "fsdp" else {}
        net, opt = ad.prepare(net, optimizer=opt, strategy=strategy, **extra)
        p = ad.precision(d.device, "fp32")
        g = torch.Generator().manual_seed(d.rank)
        micro = [
            (
                torch.randn(args.micro, args.width, generator=g),
                torch.randn(args.micro, 1, generator=g),
            )
            for _ in range(args.micro_batches)
        ]
        facts: dict[str, Any] = {}
        for how in HOWS:  # after a warm-up step: DDP re-buckets after its first backward
            one_step(d, net, opt, p, micro, how)
            facts[f"{how} reductions"] = reductions(d, net, opt, p, micro, how)
            facts[f"{how} step_s"] = []
        for _ in range(args.rounds):  # interleaved, so drift hits both alike
            for how in HOWS:
                times = []
                for s in range(WARMUP + args.steps):
                    dist.barrier()
                    t = time.perf_counter()
                    one_step(d, net, opt, p, micro, how)
                    if s >= WARMUP:
                        times.append(time.perf_counter() - t)
                facts[f"{how} step_s"].append(statistics.median(times))
        gathered = ad.all_gather(facts)
        if d.rank == 0:
            out.write_text(json.dumps(gathered))
        del net, opt
        dist.barrier()


def run(argv: list[str], out: Path) -> Any:
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
        os.killpg(proc.pid, 9)
        err = proc.communicate()[1] + "\n(timed out: killed)"
    if not out.exists():
        raise RuntimeError(f"{' '.join(argv)} failed:\n{err[-3000:]}")
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
    if args.mode == "worker":
        worker(args.what, args, Path(args.out))
        return
    sizes = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("width", "depth", "micro", "micro_batches", "steps", "rounds")
    ]
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    me = str(Path(__file__).resolve())
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("ddp", "fsdp"):
            print(f"  {strategy} ...", flush=True)
            out = Path(tmp) / f"{strategy}.json"
            found[strategy] = run([*torchrun, me, *sizes, "worker", strategy, str(out)], out)
    report(found, args)


def report(found: dict[str, Any], args: Any) -> None:
    params = sum(p.numel() for p in model(args.width, args.depth).parameters())
    shape = (
        f"{args.depth} x Linear({args.width}, {args.width}) + GELU, a head; {params / 1e6:.1f} M "
        f"parameters, SGD, {args.micro_batches} micro-batches of {args.micro} per rank per "
        "step, 2 ranks (gloo, 1 thread each)"
    )
    names = {"ddp": "DDP", "fsdp": "FSDP2"}
    counts = Result("accumulation-reductions", "per step", baseline="DDP: every micro-batch")
    step = Result("accumulation-step-time", "ms", baseline="DDP: every micro-batch")
    for strategy, ranks in found.items():
        r0 = ranks[0]
        for how in HOWS:
            label = f"{names[strategy]}: {how}"
            counts.add(label, [r[f"{how} reductions"] for r in ranks])
            step.add(label, [t * 1e3 for t in r0[f"{how} step_s"]])
        every, once = (f"{names[strategy]}: {h}" for h in HOWS)
        counts.extra[f"{strategy}_fewer"] = counts.rows[every] / counts.rows[once]
        step.extra[f"{strategy}_speedup"] = step.rows[every] / step.rows[once]
        line = (
            f"{names[strategy]}: {counts.rows[every]:g} -> {counts.rows[once]:g} gradient "
            f"reductions per step ({counts.extra[f'{strategy}_fewer']:.1f}x fewer); step "
            f"{step.rows[every]:.0f} -> {step.rows[once]:.0f} ms "
            f"({step.extra[f'{strategy}_speedup']:.2f}x faster)"
        )
        print(line)
        counts.notes.append(line)
        step.notes.append(line)
    for res in (counts, step):
        res.notes.append(shape)
    save(counts)
    save(step)


if __name__ == "__main__":
    main()
