"""Checkpoints in the background on 2 ranks: how long the loop stalls, blocking vs not.

Two ranks started by ``torchrun --standalone`` (gloo, 1 thread each) train a DDP model
(``Linear + GELU`` blocks and a head, AdamW) and save it with ``ad.save_state`` once every
window of ``--window`` steps, three ways, interleaved window by window so that the
machine's drift hits them alike:

* **no save**: the window's steps alone;
* **blocking**: ``save_state(folder, keep=2, step=...)`` after the first step of the
  window — the loop waits for DCP to write every shard and for the rename;
* **background**: the same with ``background=True`` — the call returns once the state is
  copied to host memory, and DCP writes it while the next steps run.

Reported (rank 0, medians over the windows): the time of the step that saves (the step and
its ``save_state`` call: what the loop waits for), the median time of the other steps of the
window (those during the background write), the wall time of the whole window, and the
ratios blocking / background. Each background save is waited for (``ad.wait_for_saves``)
at the end of its window, so the window includes whatever the write still held; on this
2-core machine the writing competes with the steps for the same cores, which a GPU job
does not (its steps run on the GPU while the host writes).

``python benchmarks/bench_background_save.py [--width 1024] [--depth 4] [--window 6]``
"""

from __future__ import annotations

import argparse
import json
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
HOWS = ("no save", "blocking", "background")


def model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def worker(args: Any, out: Path, folder: Path) -> None:
    import torch.distributed as dist

    import anydevice as ad

    with ad.distributed() as d:
        net, opt = ad.prepare(
            model(args.width, args.depth), optimizer=torch.optim.AdamW, strategy="ddp"
        )
        g = torch.Generator().manual_seed(d.rank)
        x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()

        kinds = ("window", "call", "saving step", "other steps")
        facts: dict[str, list[float]] = {f"{h} {k}": [] for h in HOWS for k in kinds}
        n = 0
        for w in range(args.windows + 1):  # the first window of each way warms up
            for how in HOWS:
                dist.barrier()
                start = time.perf_counter()
                call, steps = 0.0, []
                for s in range(args.window):
                    t0 = time.perf_counter()
                    step()
                    if s == 0 and how != "no save":
                        n += 1
                        t = time.perf_counter()
                        ad.save_state(folder, model=net, optimizer=opt, step=n, keep=2,
                                      background=how == "background")  # fmt: skip
                        call = time.perf_counter() - t
                    steps.append(time.perf_counter() - t0)
                ad.wait_for_saves()
                if w:
                    facts[f"{how} window"].append(time.perf_counter() - start)
                    facts[f"{how} call"].append(call)
                    facts[f"{how} saving step"].append(steps[0])
                    facts[f"{how} other steps"].append(statistics.median(steps[1:]))
        gathered = ad.all_gather(facts)
        if d.rank == 0:
            out.write_text(json.dumps(gathered))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--window", type=int, default=6, help="steps per save")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("mode", nargs="?", default="driver")
    parser.add_argument("out", nargs="?", default="")
    parser.add_argument("folder", nargs="?", default="")
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args, Path(args.out), Path(args.folder))
    else:
        drive(args)


def drive(args: Any) -> None:
    sizes = [f"--{k}={getattr(args, k)}" for k in ("width", "depth", "batch", "window", "windows")]
    ranks = two_ranks(Path(__file__).resolve(), sizes)
    report(ranks[0], args)


def report(facts: dict[str, list[float]], args: Any) -> None:
    params = sum(p.numel() for p in model(args.width, args.depth).parameters())
    shape = (
        f"DDP, {args.depth} x Linear({args.width}, {args.width}) + GELU, a head; "
        f"{params / 1e6:.1f} M parameters, AdamW (about {params * 12 / 1e6:.0f} MB of state "
        f"per checkpoint), batch {args.batch} per rank, 2 ranks (gloo, 1 thread each); a "
        f"save every {args.window} steps, {args.windows} windows of each way, interleaved"
    )
    window = Result("background-save-window", "ms", baseline="blocking")
    call = Result("background-save-stall", "ms", baseline="blocking")
    steps = Result("background-save-step-time", "ms", baseline="no save: saving step")
    for how in HOWS:
        window.add(how, [t * 1e3 for t in facts[f"{how} window"]])
        steps.add(f"{how}: saving step", [t * 1e3 for t in facts[f"{how} saving step"]])
        steps.add(f"{how}: other steps", [t * 1e3 for t in facts[f"{how} other steps"]])
        if how != "no save":
            call.add(f"save_state: {how}", [t * 1e3 for t in facts[f"{how} call"]])
    saving = steps.rows["blocking: saving step"] / steps.rows["background: saving step"]
    steps.extra["saving_step_blocking_over_background"] = saving
    window.extra["blocking_over_background"] = window.rows["blocking"] / window.rows["background"]
    stall = call.rows["save_state: blocking"] / call.rows["save_state: background"]
    call.extra["blocking_over_background"] = stall
    line = (
        f"the step that saves: blocking {steps.rows['blocking: saving step']:.0f} ms, "
        f"background {steps.rows['background: saving step']:.0f} ms ({saving:.1f}x), no "
        f"save {steps.rows['no save: saving step']:.0f} ms; the steps after it: blocking "
        f"{steps.rows['blocking: other steps']:.0f} ms, background "
        f"{steps.rows['background: other steps']:.0f} ms, no save "
        f"{steps.rows['no save: other steps']:.0f} ms; a window of {args.window} steps with a "
        f"save: blocking {window.rows['blocking']:.0f} "
        f"ms, background {window.rows['background']:.0f} ms "
        f"({window.extra['blocking_over_background']:.2f}x), no save "
        f"{window.rows['no save']:.0f} ms; the save_state call held the loop "
        f"{call.rows['save_state: blocking']:.0f} ms blocking vs "
        f"{call.rows['save_state: background']:.0f} ms background ({stall:.1f}x)"
    )
    print(line)
    for res in (steps, window, call):
        res.notes += [line, shape]
        save(res)


if __name__ == "__main__":
    main()
