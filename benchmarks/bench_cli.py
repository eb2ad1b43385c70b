"""Wall time of the ``anydevice`` command as a daily tool, against ``import torch``,
``gpustat`` and ``nvidia-smi`` where they are installed.

Targets: ``anydevice --help`` and every sub-command's ``--help`` <= 0.3 s; ``info``,
``info --json``, ``select`` and ``top --once`` <= 0.5 s (``import torch`` alone takes seconds,
and ``info`` no longer imports it). ``python -c pass`` is the interpreter's own floor.

Each command runs as a user runs it (the console script), from bytecode, interleaved
round by round so drift hits all alike; the median is reported with its spread.
``select`` exits 1 on a machine without a GPU, saying so: that answer is timed too.

Wall time is what the targets are about, but on a shared machine it mostly measures the
other work; the CPU time each command used (user + system, from ``getrusage``) is recorded
beside it (``cli-cpu-time``), as it varies far less with the load. On an idle machine the
wall time is about the CPU time plus the deliberate waits: ``info``'s 50 ms CPU
utilisation sample and ``top``'s 100 ms first CPU reading.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
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


def wall(argv: Sequence[str], cpu: list[float], ok: tuple[int, ...] = (0,)) -> Callable[[], float]:
    """A function that runs ``argv`` and returns its wall time (exit code must be in ``ok``),
    appending the CPU time it used to ``cpu``."""

    def go() -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        elapsed = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode not in ok:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        return elapsed

    return go


def console_script() -> str:
    """The ``anydevice`` command as users run it, its package compiled to bytecode first
    (and the children allowed to read it): the path of the console script."""
    import anydevice

    compileall.compile_dir(Path(anydevice.__file__).parent, quiet=1)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the children read and write .pyc
    bindir = str(Path(sys.executable).parent)
    ad = shutil.which("anydevice", path=bindir) or shutil.which("anydevice")
    if ad is None:
        raise SystemExit("the anydevice console script is not installed: pip install -e .")
    return ad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    ad = console_script()
    bindir = str(Path(sys.executable).parent)

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
    argvs: dict[str, tuple[list[str], tuple[int, ...]]] = {
        "python -c pass (floor)": (python("pass"), (0,)),
        "python -c 'import torch'": (python("import torch"), (0,)),
        **{label: (argv, (0,)) for label, argv in helps.items()},
        **commands,
        "anydevice info --json --torch": ([ad, "info", "--json", "--torch"], (0,)),
    }
    peers = []
    for tool, argv in (("gpustat", ["--json"]), ("nvidia-smi", [])):
        exe = shutil.which(tool, path=bindir) or shutil.which(tool)
        if exe is not None and subprocess.run([exe, *argv], capture_output=True).returncode == 0:
            argvs[f"{tool} {' '.join(argv)}".strip()] = ([exe, *argv], (0,))
            peers.append(tool)
    cpu: dict[str, list[float]] = {label: [] for label in argvs}
    timers = {label: wall(argv, cpu[label], ok) for label, (argv, ok) in argvs.items()}

    result = Result("cli-wall-time", "s", baseline="python -c 'import torch'")
    load_before = os.getloadavg()[0]
    for label, samples in run_interleaved(timers, args.rounds).items():
        result.add(label, samples)
    # Other work on the machine slows every row alike; the load says how busy it was.
    result.extra["load_average_1min"] = [load_before, os.getloadavg()[0]]
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
    cpu_result = Result("cli-cpu-time", "s", baseline="python -c 'import torch'")
    for label, samples in cpu.items():
        cpu_result.add(label, samples)
    cpu_result.extra["load_average_1min"] = result.extra["load_average_1min"]
    cpu_result.notes.append("user + system CPU time of each command: steadier than wall time")
    missing = sorted({"gpustat", "nvidia-smi"} - set(peers))
    if missing:
        result.notes.append(f"not installed or no GPU, not measured: {', '.join(missing)}")
    save(result)
    save(cpu_result)


if __name__ == "__main__":
    main()
