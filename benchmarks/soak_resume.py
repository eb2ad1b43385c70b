"""A long soak of the README's training loop on 2 gloo ranks: stopped ``--cycles`` times
(SIGTERM as a preemption that saves, or SIGKILL, at points drawn from ``--seed``), resumed
each time from ``load_state(latest_in=)``, and compared with the run never stopped: every
step's samples and loss, every epoch's sample ids (repeated, skipped), the final weights
bit for bit.

``python benchmarks/soak_resume.py [--cycles 30] [--epochs 8] [--seed S] [--generator]
[--workers W]``. The loop and the verdict are tests/soak.py's (the test suite runs it with
4 cycles: tests/checkpoints/test_soak_resume.py); this records the machine, torch and the
load average with the result in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=30, help="stops, each one resumed")
    parser.add_argument("--epochs", type=int, default=8, help="6 optimizer steps each")
    parser.add_argument("--seed", type=int, default=None, help="default: drawn, and printed")
    parser.add_argument("--generator", action="store_true", help="DataLoader(generator=...)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "tests"))
    from report import Result, save
    from soak import soak, verdict

    seed = random.SystemRandom().randrange(2**31) if args.seed is None else args.seed
    print(f"soak: seed {seed}, {args.cycles} cycles, {args.epochs} epochs", flush=True)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        result = soak(Path(tmp), seed, args.cycles, args.epochs, args.generator, args.workers)
        found = verdict(Path(tmp), result)
    after = os.getloadavg()[0]
    plan = result["plan"]
    signals = {s: sum(k["signal"] == s for k in plan) for s in ("SIGTERM", "SIGKILL")}
    ok = (
        found["identical"]
        and not found["diverged"]
        and (found["repeated"], found["skipped"]) == (0, 0)
        and found["attempts"] == [args.cycles]
    )
    print(
        f"{args.cycles} cycles ({signals['SIGTERM']} SIGTERM, {signals['SIGKILL']} SIGKILL),"
        f" {found['steps']['soak']} optimizer steps run ({found['steps']['reference']} in the"
        f" run never stopped); final weights bit-identical: {found['identical']};"
        f" steps that differed: {len(found['diverged'])}; samples repeated"
        f" {found['repeated']}, skipped {found['skipped']}: {'PASS' if ok else 'FAIL'}"
    )
    out = Result("soak-resume", "s")
    out.add("run never stopped", [result["reference"]["seconds"]])
    out.add(f"soak, {args.cycles} stops", [result["soak"]["seconds"]])
    out.baseline = "run never stopped"
    out.notes.append(
        f"{args.cycles} cycles, {found['steps']['soak']} steps run, bit-identical:"
        f" {found['identical'] and not found['diverged']}; seed {seed}"
    )
    out.notes.append(f"load average {load:.1f} before, {after:.1f} after")
    out.extra = {
        "seed": seed,
        "cycles": args.cycles,
        "epochs": args.epochs,
        "generator": args.generator,
        "workers": args.workers,
        "signals": signals,
        "passed": ok,
        "load_average": {"before": load, "after": after},
        **{k: found[k] for k in ("identical", "diverged", "repeated", "skipped", "steps")},
        "resumed_at": found["resumed_at"],
        "plan": plan,
    }
    save(out)
    print(json.dumps(out.extra["signals"]))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
