"""What the checksums of a sharded checkpoint cost, on save and on load, on 2 ranks.

``ad.save_state`` lists every file of a sharded checkpoint in its manifest with its size
and CRC-32, hashed while DCP writes it; ``ad.load_state`` checks them before loading (each
rank a share of the files). Two ranks started by ``torchrun --standalone`` (gloo, 1 thread
each) hold a DDP model (``Linear`` blocks, AdamW state) and, round after round, interleaved
so that the machine's drift hits every way alike:

* **save**: DCP's ``dcp.save`` with torch's own ``FileSystemWriter`` (no checksum), the
  same with anydevice's hashing writer (the CRC-32 taken while writing: the cost of the
  checksums alone), and with a second pass that reads every file back to hash it (the
  design not taken); and the whole ``ad.save_state`` (temporary folder, agreement,
  manifest, rename) for scale;
* **load**: ``ad.load_state(verify=False)`` against ``ad.load_state()`` (sizes and CRC-32s
  checked first), and DCP's own ``dcp.load``.

Reported (rank 0, medians over the rounds, milliseconds) with the ratios to the baseline
of each; the page cache holds the files, as it does right after a save or on a second
load, so the reads cost memory bandwidth, not the disk's.

``python benchmarks/bench_checkpoint_checks.py [--width 1024] [--depth 4] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, save, two_ranks

BIN = Path(sys.executable).parent
SAVES = ("dcp.save", "dcp.save + CRC-32 while writing", "dcp.save + CRC-32 read back",
         "ad.save_state")  # fmt: skip
LOADS = ("dcp.load", "ad.load_state(verify=False)", "ad.load_state (checked)")


def model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def worker(args: Any, out: Path, folder: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import anydevice as ad
    from anydevice.checkpoints import integrity

    with ad.distributed() as d:
        net, opt = ad.prepare(model(args.width, args.depth), optimizer=torch.optim.AdamW,
                              strategy="ddp")  # fmt: skip
        net(torch.randn(2, args.width)).sum().backward()
        opt.step()  # AdamW's state exists
        times: dict[str, list[float]] = {k: [] for k in (*SAVES, *LOADS)}

        def timed(name: str, fn: Any, r: int) -> None:
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - start)

        def fresh(name: str) -> Path:
            path = folder / name.replace(" ", "_").replace("+", "").replace("(", "")
            if d.rank == 0 and path.exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            dist.barrier()
            return path

        def plain() -> None:
            m, o = get_state_dict(net, opt)
            path = fresh("plain")
            dcp.save({"model": m, "optimizer": o}, storage_writer=FileSystemWriter(path))

        def hashing() -> None:
            m, o = get_state_dict(net, opt)
            path = fresh("hashing")
            writer = integrity.hashing_writer(str(path))
            dcp.save({"model": m, "optimizer": o}, storage_writer=writer)

        def read_back() -> None:
            m, o = get_state_dict(net, opt)
            path = fresh("readback")
            dcp.save({"model": m, "optimizer": o}, storage_writer=FileSystemWriter(path))
            for f in sorted(path.iterdir()):
                if f.name.startswith(f"__{d.rank}_"):
                    integrity.digest(f)

        def whole() -> None:
            ad.save_state(folder / "ad", model=net, optimizer=opt)

        for r in range(args.rounds + 1):
            for name, fn in zip(SAVES, (plain, hashing, read_back, whole), strict=True):
                timed(name, fn, r)

            def dcp_load() -> None:
                m, o = get_state_dict(net, opt)
                dcp.load({"model": m, "optimizer": o}, checkpoint_id=str(folder / "plain"))

            timed(LOADS[0], dcp_load, r)
            unchecked = lambda: ad.load_state(folder / "ad", model=net, optimizer=opt,  # noqa: E731
                                              verify=False)  # fmt: skip
            timed(LOADS[1], unchecked, r)
            timed(LOADS[2], lambda: ad.load_state(folder / "ad", model=net, optimizer=opt), r)
        size = sum(f.stat().st_size for f in (folder / "ad").iterdir())
        gathered = ad.all_gather(times)
        if d.rank == 0:
            out.write_text(json.dumps({"ranks": gathered, "bytes": size}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("mode", nargs="?", default="driver")
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("folder", nargs="?", default="")
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args, Path(args.out), Path(args.folder))
    else:
        drive(args)


def drive(args: Any) -> None:
    sizes = [f"--{k}={getattr(args, k)}" for k in ("width", "depth", "rounds")]
    facts = two_ranks(Path(__file__).resolve(), sizes, timeout=3600)
    report(facts["ranks"][0], facts["bytes"], args)


def report(times: dict[str, list[float]], size: int, args: Any) -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    shape = (
        f"DDP, {args.depth} x Linear({args.width}, {args.width}), AdamW; a checkpoint of "
        f"{size / 1e6:.0f} MB (model and optimizer), 2 ranks (gloo, 1 thread each), "
        f"{args.rounds} rounds interleaved; load average {load:.1f} at the end"
    )
    saves = Result("checkpoint-checksums-save", "ms", baseline="dcp.save")
    loads = Result("checkpoint-checksums-load", "ms", baseline="ad.load_state(verify=False)")
    for name in SAVES:
        saves.add(name, [t * 1e3 for t in times[name]])
    for name in LOADS:
        loads.add(name, [t * 1e3 for t in times[name]])
    hashing = saves.rows[SAVES[1]] / saves.rows[SAVES[0]]
    reread = saves.rows[SAVES[2]] / saves.rows[SAVES[0]]
    checked = loads.rows[LOADS[2]] / loads.rows[LOADS[1]]
    saves.extra.update(hashing_over_plain=hashing, read_back_over_plain=reread)
    loads.extra["checked_over_unchecked"] = checked
    line = (
        f"save: dcp.save {saves.rows[SAVES[0]]:.0f} ms, with the CRC-32 taken while writing "
        f"{saves.rows[SAVES[1]]:.0f} ms ({hashing:.2f}x), read back to hash "
        f"{saves.rows[SAVES[2]]:.0f} ms ({reread:.2f}x), the whole ad.save_state "
        f"{saves.rows[SAVES[3]]:.0f} ms; load: ad.load_state unchecked "
        f"{loads.rows[LOADS[1]]:.0f} ms, checked {loads.rows[LOADS[2]]:.0f} ms "
        f"({checked:.2f}x), dcp.load {loads.rows[LOADS[0]]:.0f} ms "
        f"(medians; spread {statistics.pstdev(times[SAVES[1]]) * 1e3:.0f} ms on the hashed save)"
    )
    print(line)
    for res in (saves, loads):
        res.notes += [line, shape]
        save(res)


if __name__ == "__main__":
    main()
