"""Wall time of the ``anydevice`` command as a daily tool, against ``import torch``,
``gpustat`` and ``nvidia-smi`` where they are installed.

Targets: ``anydevice --help`` and every sub-command's ``--help`` <= 0.3 s; ``info``,
``info --json``, ``select`` and ``top --once`` <= 0.5 s (``import torch`` alone takes seconds,
and ``info`` no longer imports it). ``python -c pass`` is the interpreter's own floor.

Each command runs as a user runs it (the console script), from bytecode, interleaved
round by round so drift hits all alike; the median is reported with its spread.
``select`` exits 1 on a machine without a GPU, saying so: that answer is timed too.
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, python, run_interleaved, save

HELP_TARGET_S = 0.3
COMMAND_TARGET_S = 0.5


def wall(argv: Sequence[str], ok: tuple[int, ...] = (0,)) -> Callable[[], float]:
    """A function that runs ``argv`` and returns its wall time (exit code must be in ``ok``)."""

    def go() -> float:
        t = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        elapsed = time.perf_counter() - t
        if proc.returncode not in ok:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        return elapsed

    return go


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    import anydevice

    compileall.compile_dir(Path(anydevice.__file__).parent, quiet=1)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the children read and write .pyc
    bindir = str(Path(sys.executable).parent)
    ad = shutil.which("anydevice", path=bindir) or shutil.which("anydevice")
    if ad is None:
        raise SystemExit("the anydevice console script is not installed: pip install -e .")

    helps = {
        "anydevice --help": [ad, "--help"],
        **{
            f"anydevice {c} --help": [ad, c, "--help"]
            for c in ("info", "top", "select", "doctor", "launch")
        },
    }
    commands = {
        "anydevice info": ([ad, "info"], (0,)),
        "anydevice info --json": ([ad, "info", "--json"], (0,)),
        "anydevice select -n 1": ([ad, "select", "-n", "1"], (0, 1)),
        "anydevice top --once": ([ad, "top", "--once"], (0,)),
    }
    timers: dict[str, Callable[[], float]] = {
        "python -c pass (floor)": wall(python("pass")),
        "python -c 'import torch'": wall(python("import torch")),
        **{label: wall(argv) for label, argv in helps.items()},
        **{label: wall(argv, ok) for label, (argv, ok) in commands.items()},
        "anydevice info --json --torch": wall([ad, "info", "--json", "--torch"]),
    }
    peers = []
    for tool, argv in (("gpustat", ["--json"]), ("nvidia-smi", [])):
        exe = shutil.which(tool, path=bindir) or shutil.which(tool)
        if exe is not None and subprocess.run([exe, *argv], capture_output=True).returncode == 0:
            timers[f"{tool} {' '.join(argv)}".strip()] = wall([exe, *argv])
            peers.append(tool)

    result = Result("cli-wall-time", "s", baseline="python -c 'import torch'")
    for label, samples in run_interleaved(timers, args.rounds).items():
        result.add(label, samples)
    slow = [k for k in helps if result.rows[k] > HELP_TARGET_S]
    slow += [k for k in commands if result.rows[k] > COMMAND_TARGET_S]
    result.extra["targets_s"] = {"help": HELP_TARGET_S, "commands": COMMAND_TARGET_S}
    result.extra["over_target"] = slow
    result.notes.append(
        f"targets: --help <= {HELP_TARGET_S} s, info / select / top --once <= "
        f"{COMMAND_TARGET_S} s; " + ("all met" if not slow else f"missed: {', '.join(slow)}")
    )
    speedup = result.rows["python -c 'import torch'"] / result.rows["anydevice info --json"]
    result.notes.append(f"anydevice info --json is {speedup:.1f}x faster than importing torch")
    missing = sorted({"gpustat", "nvidia-smi"} - set(peers))
    if missing:
        result.notes.append(f"not installed or no GPU, not measured: {', '.join(missing)}")
    save(result)


if __name__ == "__main__":
    main()
