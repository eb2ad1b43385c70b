"""FSDP on 2 ranks: memory per rank, step time and checkpoints, against DDP and the peers.

Every configuration trains the same model (a stack of ``Linear + GELU`` blocks and a head,
AdamW) on 2 ranks started by ``torchrun --standalone`` (Fabric by its own launcher), and
reports from each rank:

* **memory**: the bytes of parameters + gradients + optimizer state this rank holds after
  a step (each storage counted once; a ``DTensor`` by its local shard). DDP also keeps
  gradient buckets (another copy of the gradients) that this count leaves out, so DDP's
  real footprint is larger still. The process's peak RSS is recorded beside it.
  Target: FSDP ≈ 1/2 of DDP's on 2 ranks.
* **step time**: the median wall time of a training step on rank 0 after warm-up steps
  (configurations run round-robin, ``--rounds`` times).
* **checkpoints** (anydevice's runs): ``ad.save_state`` / ``ad.load_state`` (a DCP folder,
  every rank writing its shards, fsync'd and renamed into place) against ``torch.save`` of
  the full state from rank 0 and ``torch.load`` + ``load_state_dict`` on every rank (for
  FSDP the full state is gathered first with ``get_state_dict(full_state_dict=True)``).

Peers, run where they can on a CPU with gloo:

* Lightning Fabric: ``strategy="fsdp"`` refuses the CPU (the error is recorded);
  ``ModelParallelStrategy`` (FSDP2 through a ``parallelize_fn`` the user writes) runs.
* accelerate: the FSDP plugin with ``Accelerator(cpu=True)`` is silently ignored: the model
  comes back in DDP (the distributed type and wrapper are recorded).

``python benchmarks/bench_fsdp.py [--width 1024] [--depth 8] [--steps 12]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
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

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
WARMUP = 3


def model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def held_bytes(net: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state held by this rank."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    for p in net.parameters():
        add(p)
        add(p.grad)
    for state in opt.state.values():
        for v in state.values():
            add(v)
    return sum(seen.values())


def train(net: nn.Module, opt: torch.optim.Optimizer, args: Any, backward: Any = None) -> dict:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, 1, generator=g)
    times = []
    for s in range(WARMUP + args.steps):
        t = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        (backward or torch.Tensor.backward)(loss)
        opt.step()
        if s >= WARMUP:
            times.append(time.perf_counter() - t)
    return {
        "step_s": statistics.median(times),
        "held_bytes": held_bytes(net, opt),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


# ----------------------------------------------------------------------------- workers


def ad_worker(strategy: str, args: Any, out: Path) -> None:
    import torch.distributed as dist

    import anydevice as ad

    with ad.distributed() as d:
        net = model(args.width, args.depth)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        net, opt = ad.prepare(net, optimizer=opt, strategy=strategy)
        facts = train(net, opt, args)
        facts["wrapper"] = type(net).__name__
        facts.update(checkpoints(net, opt, strategy, d.rank, args))
        gathered = ad.all_gather(facts)
        if d.rank == 0:
            out.write_text(json.dumps(gathered))
        del net, opt
        dist.barrier()


def checkpoints(net: nn.Module, opt: torch.optim.Optimizer, strategy: str, rank: int, args: Any):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    import anydevice as ad

    folder = Path(args.scratch)
    timings: dict[str, list[float]] = {k: [] for k in ("save", "load", "torch_save", "torch_load")}
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for _ in range(args.repeat):
        dist.barrier()
        t = time.perf_counter()
        ad.save_state(folder / f"{strategy}-ckpt", model=net, optimizer=opt, step=1)
        timings["save"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        ad.load_state(folder / f"{strategy}-ckpt", model=net, optimizer=opt)
        dist.barrier()
        timings["load"].append(time.perf_counter() - t)
        # the usual way: the full state, saved by rank 0, loaded by every rank
        dist.barrier()
        t = time.perf_counter()
        msd, osd = get_state_dict(net, opt, options=full)
        if rank == 0:
            torch.save({"model": msd, "optimizer": osd, "step": 1}, folder / f"{strategy}.pt")
        dist.barrier()
        timings["torch_save"].append(time.perf_counter() - t)
        t = time.perf_counter()
        state = torch.load(folder / f"{strategy}.pt", weights_only=True)
        set_state_dict(
            net,
            opt,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
        dist.barrier()
        timings["torch_load"].append(time.perf_counter() - t)
    return {f"{k}_s": statistics.median(v) for k, v in timings.items()}


def accelerate_worker(args: Any, out: Path) -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    net = model(args.width, args.depth)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, opt = acc.prepare(net, opt)
    facts = train(net, opt, args, backward=acc.backward)
    facts["wrapper"] = f"{type(net).__name__} ({acc.distributed_type})"
    gathered = [None] * acc.num_processes
    torch.distributed.all_gather_object(gathered, facts)
    if acc.is_main_process:
        out.write_text(json.dumps(gathered))
    del net, opt  # free DDP's reducer while the group lives (gloo can hang at exit otherwise)
    gc.collect()
    acc.end_training()


def fabric_worker(strategy_name: str, args: Any, out: Path) -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    def parallelize(net: nn.Module, mesh: Any) -> nn.Module:
        for block in list(net)[:-1]:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(net, mesh=mesh["data_parallel"])
        return net

    strategy: Any = strategy_name
    if strategy_name == "model_parallel":
        strategy = ModelParallelStrategy(
            parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1
        )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    net = fabric.setup_module(model(args.width, args.depth))
    opt = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=1e-3))
    facts = train(net, opt, args, backward=fabric.backward)
    facts["wrapper"] = type(fabric.strategy).__name__
    gathered: list[Any] = [None] * fabric.world_size
    torch.distributed.all_gather_object(gathered, facts)
    if fabric.global_rank == 0:
        out.write_text(json.dumps(gathered))


# ----------------------------------------------------------------------------- driver


def run(label: str, argv: list[str], out: Path, env: dict[str, str] | None = None) -> Any:
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        start_new_session=True,
    )
    try:
        err = proc.communicate(timeout=600)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # a rank hung (at exit, in gloo): the results may be there
        err = proc.communicate()[1] + "\n(timed out: killed)"
    if not out.exists():
        tail = (err.strip().splitlines() or ["(no output)"])[-1]
        print(f"  {label}: failed ({tail})")
        return tail
    if proc.returncode != 0:
        print(f"  {label}: results written, then exit code {proc.returncode}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scratch", default="")
    parser.add_argument("mode", nargs="?", default="driver")
    parser.add_argument("what", nargs="?", default="")
    parser.add_argument("out", nargs="?", default="")
    args = parser.parse_args()
    if args.mode == "ad":
        ad_worker(args.what, args, Path(args.out))
    elif args.mode == "accelerate":
        accelerate_worker(args, Path(args.out))
    elif args.mode == "fabric":
        fabric_worker(args.what, args, Path(args.out))
    else:
        drive(args)


def drive(args: Any) -> None:
    sizes = ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
             "--steps", str(args.steps), "--repeat", str(args.repeat)]  # fmt: skip
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    me = str(Path(__file__).resolve())
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = ["--scratch", tmp]
        configs = {
            "DDP (ad.prepare)": ([*torchrun, me, *sizes, *scratch, "ad", "ddp"], None),
            "FSDP2 (ad.prepare)": ([*torchrun, me, *sizes, *scratch, "ad", "fsdp"], None),
            "Fabric ModelParallelStrategy (FSDP2)": (
                [sys.executable, me, *sizes, "fabric", "model_parallel"],
                None,
            ),
            "Fabric strategy='fsdp'": ([sys.executable, me, *sizes, "fabric", "fsdp"], None),
            "accelerate FSDP plugin (cpu=True)": (
                [*torchrun, me, *sizes, "accelerate", "-"],
                {"ACCELERATE_USE_CPU": "1"},
            ),
        }
        for round_ in range(args.rounds):  # round-robin, so drift hits every config alike
            for i, (label, (argv, env)) in enumerate(configs.items()):
                if round_ and not isinstance(found.get(label), list):
                    continue  # it failed: once is enough
                out = Path(tmp) / f"{round_}-{i}.json"
                print(f"  round {round_ + 1}: {label} ...", flush=True)
                got = run(label, [*argv, str(out)], out, env)
                found[label] = got if not isinstance(got, list) else [*found.get(label, []), got]
    report(found, args)


def report(found: dict[str, Any], args: Any) -> None:
    params = sum(p.numel() for p in model(args.width, args.depth).parameters())
    shape = (
        f"{args.depth} x Linear({args.width}, {args.width}) + GELU, a head; {params / 1e6:.1f} M "
        f"parameters, AdamW, batch {args.batch} per rank, 2 ranks (gloo, 1 thread each)"
    )
    rounds = {k: v for k, v in found.items() if isinstance(v, list)}
    ran = {k: v[-1] for k, v in rounds.items()}  # memory does not change between rounds
    failed = {k: v for k, v in found.items() if not isinstance(v, list)}
    memory = Result("fsdp-memory-per-rank", "MB", baseline="DDP (ad.prepare)")
    step = Result("fsdp-step-time", "ms", baseline="DDP (ad.prepare)")
    for label, ranks in ran.items():
        memory.add(label, [r["held_bytes"] / 1e6 for r in ranks])
        step.add(label, [each[0]["step_s"] * 1e3 for each in rounds[label]])
        memory.extra.setdefault("peak_rss_mb", {})[label] = [r["peak_rss"] / 1e6 for r in ranks]
        memory.extra.setdefault("wrapper", {})[label] = ranks[0]["wrapper"]
    for res in (memory, step):
        res.notes.append(shape)
        res.extra["failed"] = failed
        for label, why in failed.items():
            res.notes.append(f"{label}: does not run here: {why}")
    if "FSDP2 (ad.prepare)" in memory.rows:
        ratio = memory.ratio("FSDP2 (ad.prepare)")
        memory.extra["fsdp_vs_ddp"] = ratio
        memory.notes.append(
            f"FSDP2 holds {ratio:.2f} of DDP's parameters + gradients + optimizer state per "
            "rank (target 0.5; DDP's gradient buckets, not counted, add another copy of the "
            "gradients to DDP)"
        )
    memory.notes.append(
        "wrappers: " + ", ".join(f"{k} -> {v}" for k, v in memory.extra["wrapper"].items())
    )
    save(memory)
    save(step)
    ckpt = Result("fsdp-checkpoint", "s", baseline="DDP: torch.save of the full state")
    for label, name in (("DDP", "DDP (ad.prepare)"), ("FSDP2", "FSDP2 (ad.prepare)")):
        if name not in ran:
            continue
        r0 = [each[0] for each in rounds[name]]
        ckpt.add(f"{label}: ad.save_state", [r["save_s"] for r in r0])
        ckpt.add(f"{label}: torch.save of the full state", [r["torch_save_s"] for r in r0])
        ckpt.add(f"{label}: ad.load_state", [r["load_s"] for r in r0])
        ckpt.add(f"{label}: torch.load + load_state_dict", [r["torch_load_s"] for r in r0])
    ckpt.notes.append(shape)
    ckpt.notes.append(
        f"median of {args.repeat} per round, {args.rounds} rounds; ad.save_state writes a "
        "DCP folder from every rank, fsyncs it and renames it into place; torch.save writes "
        "one file from rank 0 (no fsync) after gathering the full state; loads on every rank"
    )
    save(ckpt)


if __name__ == "__main__":
    main()
