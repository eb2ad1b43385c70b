"""A soak of the README's training loop: 2 ranks, background saves, SIGTERM at random
points, resumed each time; the final weights must be those of the run never stopped.

``python tests/soak.py FOLDER [--seed S] [--cycles N] [--epochs E] [--generator]
[--workers W]`` runs two real launches of 2 gloo ranks on the CPU, one after the other,
each in a process of its own (``ad.launch(..., start_method="fork")``, so a restart costs
a fork, not an import of torch):

* the **reference**: :func:`train` from start to end, never stopped;
* the **soak**: the same :func:`train` with ``max_restarts=N``, where each attempt but the
  last sends one rank a real signal at a point drawn from ``--seed`` (which rank, which
  optimizer step, and where in it: after the batch is handed out, after the gradient
  all-reduce, after the optimizer step, right after a background save returned while its
  write goes on, or from a timer thread a few milliseconds into the step), and which
  signal:

  - ``SIGTERM``, a preemption: ``ad.distributed(on_preempt=save)`` takes it, both ranks
    finish the step, agree at ``d.check_preemption()``, save and exit 143;
  - ``SIGKILL``: the rank dies there, the launcher stops its peer wherever that is.

  Either way the launcher starts both again, and they resume from
  ``ad.load_state(latest_in=)``.

Each rank appends what each optimizer step saw (the attempt, the epoch, the step, the
sample ids, the loss) to ``FOLDER/<run>/seen.rank<r>``; :func:`verdict` compares the two
runs: the final weights bit for bit, every step of every attempt with the reference's
step (ids and loss), and, over the steps that stood (the last attempt to run each), every
sample id once per epoch.

The tests run it small (``tests/checkpoints/test_soak_resume.py``); ``benchmarks/soak_resume.py``
runs it long and reports.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import anydevice as ad

SAMPLES = 96  #: 48 per rank: 12 micro-batches of 4, 6 optimizer steps of 2 per epoch
BATCH = 4  #: per rank
GLOBAL_BATCH = 16  #: samples per optimizer step over both ranks: 2 micro-batches each
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH
SAVE_EVERY = 2  #: optimizer steps between background saves
#: Where in optimizer step ``n`` the chosen rank is sent its signal.
PHASES = ("batch", "reduced", "stepped", "saving", "timer")
#: How a rank is stopped: a preemption (taken by ``on_preempt``) or a kill.
SIGNALS = ("SIGTERM", "SIGKILL")


class Numbered(Dataset):
    """Samples of two classes, each with its id (so every rank can say what it saw)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = (self.x[:, :3].sum(1) > 0).long()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def kill_plan(seed: int, cycles: int, epochs: int) -> list[dict[str, Any]]:
    """``cycles`` kill points drawn from ``seed``, one per attempt, at rising steps (each
    later than any step the attempt before could have saved, so every attempt but the
    last is stopped): ``{"step", "phase", "rank", "delay", "signal"}``."""
    rng = random.Random(seed)
    steps_total = epochs * STEPS_PER_EPOCH
    if not 1 <= cycles < steps_total:
        raise ValueError(
            f"cycles must be 1..{steps_total - 1} (the steps of {epochs} epochs), not {cycles}"
        )
    steps = sorted(rng.sample(range(1, steps_total), cycles))
    plan = []
    for step in steps:
        phases = PHASES if step % SAVE_EVERY == 0 else tuple(p for p in PHASES if p != "saving")
        plan.append(
            {
                "step": step,
                "phase": rng.choice(phases),
                "rank": rng.randrange(2),
                "delay": round(rng.uniform(0.0, 0.02), 4),
                "signal": rng.choice(SIGNALS),
            }
        )
    return plan


def train(
    folder: str, plan: list[dict[str, Any]], epochs: int, generator: bool, workers: int
) -> dict:
    """The README's loop (``ad.distributed(on_preempt=save)``, ``ad.prepare`` with a
    shuffled loader, ``d.accumulate``, ``ad.precision``, clipping, an LR scheduler whose
    ``state_dict()`` is saved as an extra, background saves with ``keep=2``,
    ``load_state(latest_in=)`` at the start,
    ``d.check_preemption()`` after each step), seeded as a script is; with ``plan``, this
    attempt's kill point (one per attempt) is acted on."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill = plan[attempt] if attempt < len(plan) else None
    run = Path(folder)
    ckpts = run / "ckpts"
    torch.manual_seed(0)
    at = {"epoch": 0, "step": 0}  # what a preemption's save records
    live: dict[str, Any] = {}  # what it saves, once made

    def save() -> None:
        state, lr = live["state"], live["scheduler"].state_dict()
        ad.save_state(ckpts, **state, keep=2, lr=lr, **at)

    with ad.distributed(timeout=60, on_preempt=save) as d:
        data = DataLoader(
            Numbered(),
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(7) if generator else None,
        )
        net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
        make_optimizer = functools.partial(torch.optim.AdamW, lr=0.02)
        model, loader, optimizer = ad.prepare(net, data, optimizer=make_optimizer)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
        p = ad.precision(d.device)
        state = dict(model=model, optimizer=optimizer, precision=p, loader=loader)
        live.update(state=state, scheduler=scheduler)
        start, n = 0, 0
        if any(ckpts.glob("step-*")):
            extra = ad.load_state(latest_in=ckpts, **state)
            start, n = extra["epoch"], extra["step"]
            scheduler.load_state_dict(extra["lr"])
        seen = (run / f"seen.rank{d.rank}").open("a")
        seen.write(json.dumps({"attempt": attempt, "resumed": n, "t": time.time()}) + "\n")
        seen.flush()
        timer: threading.Timer | None = None

        def maybe_kill(phase: str) -> None:
            if kill is None or kill["rank"] != d.rank or kill["step"] != n + 1:
                return
            sig = getattr(signal, kill["signal"])
            if kill["phase"] == phase == "timer":
                nonlocal timer
                timer = threading.Timer(kill["delay"], os.kill, (os.getpid(), sig))
                timer.start()
            elif kill["phase"] == phase:
                seen.write(
                    json.dumps({"attempt": attempt, "killed": n + 1, "t": time.time()}) + "\n"
                )
                seen.flush()
                os.kill(os.getpid(), sig)

        for epoch in range(start, epochs):
            model.train()
            for step in d.accumulate(model, loader, global_batch=GLOBAL_BATCH):
                maybe_kill("timer")
                ids: list[int] = []
                total = 0.0
                for x, y, i in step:
                    ids += i.tolist()
                    maybe_kill("batch")
                    with p.autocast():
                        loss = nn.functional.cross_entropy(model(x), y)
                    p.backward(step.scale(loss))
                    total += loss.item()
                maybe_kill("reduced")
                p.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                p.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                maybe_kill("stepped")
                n += 1
                at.update(epoch=epoch, step=n)
                seen.write(
                    json.dumps(
                        {
                            "attempt": attempt,
                            "epoch": epoch,
                            "step": n,
                            "ids": ids,
                            "loss": total.hex(),
                        }
                    )
                    + "\n"
                )
                seen.flush()
                if n % SAVE_EVERY == 0:
                    ad.save_state(
                        ckpts,
                        **state,
                        keep=2,
                        background=True,
                        lr=scheduler.state_dict(),
                        epoch=epoch,
                        step=n,
                    )
                    n -= 1  # the kill point is step n's, where n is counted before it
                    maybe_kill("saving")  # its write under way in the background
                    n += 1
                d.check_preemption()
        if timer is not None:
            timer.join()  # not fired yet: it stops this attempt now
            d.check_preemption()
        weights = {k: v.detach().clone() for k, v in ad.unwrap(model).state_dict().items()}
        live.clear()
        del model, optimizer, scheduler, state  # before the group ends
        return {"attempt": attempt, "steps": n, "weights": weights}


def launch(
    folder: Path, plan: list[dict[str, Any]], epochs: int, generator: bool, workers: int
) -> dict[str, Any]:
    """One run (the reference with no ``plan``, or the soak) in this process; what each
    rank returned, and how long it took."""
    folder.mkdir(parents=True)
    began = time.perf_counter()
    results = ad.launch(
        train,
        str(folder),
        plan,
        epochs,
        generator,
        workers,
        nprocs=2,
        max_restarts=len(plan),
        start_method="fork",
        timeout=120,
    )
    return {"seconds": time.perf_counter() - began, "ranks": results}


def soak(
    folder: Path,
    seed: int,
    cycles: int,
    epochs: int,
    generator: bool,
    workers: int,
    timeout: float = 1800,
) -> dict[str, Any]:
    """The reference run and the soak, one after the other, each in a process of its own
    (a second fork-started launch in one process never starts its workers) and a session of
    its own, ended whole however this ends (``timeout`` seconds each); what :func:`verdict`
    reads."""
    plan = kill_plan(seed, cycles, epochs)
    out: dict[str, Any] = {
        "seed": seed,
        "cycles": cycles,
        "epochs": epochs,
        "plan": plan,
        "generator": generator,
        "workers": workers,
    }
    for name in ("reference", "soak"):
        argv = [
            sys.executable,
            __file__,
            str(folder),
            "--only",
            name,
            "--seed",
            str(seed),
            "--cycles",
            str(cycles),
            "--epochs",
            str(epochs),
            "--workers",
            str(workers),
        ]
        proc = subprocess.Popen(argv + ["--generator"] * generator, start_new_session=True)
        try:
            code = proc.wait(timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what is left of its session
            except ProcessLookupError:
                pass
            proc.wait()
        if code != 0:
            raise RuntimeError(f"the {name} run exited with code {code}: {argv}")
        out[name] = torch.load(folder / name / "result.pt")
    return out


def _records(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the kill
            continue
    return records


def verdict(folder: Path, result: dict[str, Any]) -> dict[str, Any]:
    """What the soak shows: ``identical`` (the final weights, bit for bit, on both ranks),
    ``attempts`` (of the soak's ranks), ``diverged`` (steps of any attempt that saw other
    samples or another loss than the reference's, with the first), ``repeated`` /
    ``skipped`` (sample ids per epoch, over the steps that stood), ``resumed_at`` (the
    step each attempt resumed from)."""
    out: dict[str, Any] = {
        "seed": result["seed"],
        "identical": True,
        "diverged": [],
        "repeated": 0,
        "skipped": 0,
    }
    ref, got = result["reference"]["ranks"], result["soak"]["ranks"]
    out["attempts"] = sorted({r["attempt"] for r in got.values()})
    for rank in (0, 1):
        for key, value in ref[rank]["weights"].items():
            if not torch.equal(value, got[rank]["weights"][key]):
                out["identical"] = False
    per_epoch: dict[int, list[int]] = {}
    resumed: dict[int, int] = {}
    out["steps"] = {"reference": 0, "soak": 0}  # optimizer steps rank 0 ran, replays too
    for rank in (0, 1):
        expected = {
            r["step"]: r for r in _records(folder / "reference" / f"seen.rank{rank}") if "step" in r
        }
        stood: dict[int, dict[str, Any]] = {}
        for r in _records(folder / "soak" / f"seen.rank{rank}"):
            if "resumed" in r:
                resumed[r["attempt"]] = r["resumed"]
                continue
            if "killed" in r:
                continue
            out["steps"]["soak"] += rank == 0
            want = expected.get(r["step"])
            if want is None or (want["ids"], want["loss"]) != (r["ids"], r["loss"]):
                out["diverged"].append((rank, r["attempt"], r["step"]))
            stood[r["step"]] = r  # a later attempt's record replaces an earlier one's
        out["steps"]["reference"] = len(expected)
        if sorted(stood) != sorted(expected):
            out["diverged"].append((rank, "steps", sorted(set(expected) ^ set(stood))))
        for r in stood.values():
            per_epoch.setdefault(r["epoch"], []).extend(r["ids"])
    for epoch in range(result["epochs"]):
        ids = per_epoch.get(epoch, [])
        out["repeated"] += len(ids) - len(set(ids))
        out["skipped"] += len(set(range(SAMPLES)) - set(ids))
    out["resumed_at"] = [resumed.get(a) for a in range(len(result["plan"]) + 1)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="an empty folder for the runs")
    parser.add_argument("--seed", type=int, default=None, help="default: drawn, and printed")
    parser.add_argument("--cycles", type=int, default=10, help="signals (restarts)")
    parser.add_argument("--epochs", type=int, default=4, help=f"{STEPS_PER_EPOCH} steps each")
    parser.add_argument("--generator", action="store_true", help="DataLoader(generator=...)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    parser.add_argument("--only", choices=("reference", "soak"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    seed = random.SystemRandom().randrange(2**31) if args.seed is None else args.seed
    if args.only:  # one run, in this process
        plan = kill_plan(seed, args.cycles, args.epochs) if args.only == "soak" else []
        got = launch(args.folder / args.only, plan, args.epochs, args.generator, args.workers)
        torch.save(got, args.folder / args.only / "result.pt")
        return
    print(
        f"soak seed {seed}: python tests/soak.py FOLDER --seed {seed} --cycles {args.cycles}"
        f" --epochs {args.epochs}{' --generator' if args.generator else ''}"
        f" --workers {args.workers}",
        flush=True,
    )
    result = soak(args.folder, seed, args.cycles, args.epochs, args.generator, args.workers)
    found = verdict(args.folder, result)
    found["seconds"] = {k: result[k]["seconds"] for k in ("reference", "soak")}
    found["plan"] = result["plan"]
    (args.folder / "verdict.json").write_text(json.dumps(found))
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    sys.exit(main())
