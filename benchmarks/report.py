"""How every benchmark records its results: the machine, the numbers, the ratios.

Each benchmark builds a :class:`Result` and calls :func:`save`, which prints a table and
writes ``results/<name>-<machine>.json`` (machine = GPU model or CPU model, slugged).
``ANYDEVICE_BENCH_RESULTS=<folder>`` writes them there instead (``scripts/gpu-check.sh``
and the smoke tests use it).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def results_folder() -> Path:
    """Where :func:`save` writes: ``ANYDEVICE_BENCH_RESULTS`` if set, else ``results/``."""
    override = os.environ.get("ANYDEVICE_BENCH_RESULTS", "").strip()
    return Path(override) if override else RESULTS


def sync(device: Any) -> None:
    """Wait for the device's queued work (a CUDA device; nothing to wait for on the CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    import anydevice as ad

    inv = ad.inventory(telemetry=False)
    accel = [f"{d.spec} {d.name}" for d in inv.accelerators]
    return {
        "host": inv.host.hostname,
        "cpu": inv.host.cpu_model,
        "cores_usable": inv.host.cores_usable,
        "memory_total": inv.host.memory_total,
        "accelerators": accel,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": inv.host.driver,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "load": round(os.getloadavg()[0], 1),  #: the 1-minute load average when saved
    }


def machine_slug(m: dict[str, Any]) -> str:
    name = m["accelerators"][0].split(" ", 1)[1] if m["accelerators"] else f"cpu-{m['cpu']}"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{slug}-{m['cores_usable']}core" if not m["accelerators"] else slug


@dataclass
class Result:
    name: str
    unit: str
    rows: dict[str, float] = field(default_factory=dict)  #: label -> median
    samples: dict[str, list[float]] = field(default_factory=dict)
    baseline: str | None = None  #: ratios are row / baseline
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, label: str, samples: Sequence[float]) -> float:
        self.samples[label] = [float(s) for s in samples]
        self.rows[label] = statistics.median(samples)
        return self.rows[label]

    def ratio(self, label: str, base: str | None = None) -> float:
        base = base or self.baseline
        assert base is not None
        return self.rows[label] / self.rows[base]


def save(result: Result) -> Path:
    m = machine()
    print(
        f"\n== {result.name} ({m['cpu']}; {', '.join(m['accelerators']) or 'no accelerator'};"
        f" torch {m['torch']}) =="
    )
    width = max(len(k) for k in result.rows) if result.rows else 10
    for label, value in result.rows.items():
        ratio = ""
        if result.baseline and result.baseline in result.rows and result.rows[result.baseline]:
            ratio = f"  {value / result.rows[result.baseline]:6.2f}x {result.baseline}"
        spread = ""
        s = result.samples.get(label, [])
        if len(s) >= 4:
            q = statistics.quantiles(s, n=4)
            spread = f"  (IQR {q[2] - q[0]:.3g})"
        print(f"  {label:<{width}}  {value:12.4g} {result.unit}{ratio}{spread}")
    for note in result.notes:
        print(f"  note: {note}")
    folder = results_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{result.name}-{machine_slug(m)}.json"
    path.write_text(json.dumps({"machine": m, **asdict(result)}, indent=2) + "\n")
    print(f"  -> {path}")
    return path


def run_interleaved(
    commands: dict[str, Callable[[], float]], rounds: int
) -> dict[str, list[float]]:
    """Run each command once per round, round-robin, so drift hits all of them alike."""
    out: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(rounds):
        for label, fn in commands.items():
            out[label].append(fn())
    return out


def wall(argv: Sequence[str], timeout: float = 300) -> Callable[[], float]:
    """A function that runs ``argv`` and returns its wall time in seconds (must succeed)."""

    def go() -> float:
        t = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        elapsed = time.perf_counter() - t
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-2000:]}")
        return elapsed

    return go


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def two_ranks(script: str | Path, argv: Sequence[str], timeout: float = 1800) -> Any:
    """Run ``script *argv worker OUT FOLDER`` as 2 ranks of ``torchrun --standalone`` (one
    thread each, ``FOLDER`` a fresh temporary folder); what rank 0 wrote to ``OUT`` as
    JSON. Exits with the ranks' error where they wrote nothing."""
    import tempfile

    torchrun = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out, folder = Path(tmp) / "facts.json", Path(tmp) / "ckpts"
        folder.mkdir()
        command = [*torchrun, str(script), *argv, "worker", str(out), str(folder)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)  # fmt: skip
        if not out.exists():
            sys.exit(f"the ranks failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())
