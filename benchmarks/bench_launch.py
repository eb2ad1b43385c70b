"""Launching 2 CPU processes: ad.launch against torchrun, mp.spawn, accelerate and Fabric.

Part 1 — launch overhead: the wall time of a fresh ``python`` (or launcher command) that
starts 2 worker processes, trains a small MLP with DDP for 20 steps, and exits. The
workers run the same plain-torch code under every launcher that sets torchrun's
variables; Fabric runs its own API. Runs are interleaved round-robin. Target: ``ad.launch``
within 1.1x of ``torchrun --standalone``.

Part 2 — scaling: training samples/s with 1 and 2 processes on this machine's CPU (DDP,
gloo; the per-process batch fixed, so 2 processes train twice the samples per step). The
GPU variant, ``gpu_launch_scaling``, compares 1 GPU with all of them.

Notes: ``accelerate launch`` needs ``--multi_gpu`` and ``ACCELERATE_USE_CPU=1`` to start
2 processes on a CPU (``--cpu --num_processes 2`` starts one); most of every launch is
importing torch (and ``torch._dynamo``, which the first optimizer or DDP loads) in each
fresh worker.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, run_interleaved, save

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "launch_job.py")
BIN = Path(sys.executable).parent


def timed(argv: list[str], env: dict[str, str] | None = None, expect: int = 2):
    """A function that runs ``argv`` and returns its wall time; checks the ranks agreed."""

    def go() -> float:
        t = time.perf_counter()
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        elapsed = time.perf_counter() - t
        found = re.findall(r"checksum rank \S+: (-?[0-9.]+)", proc.stdout)
        sums, count = set(found), len(found)
        if proc.returncode != 0 or count != expect or len(sums) != 1:
            raise RuntimeError(
                f"{' '.join(argv)}: rc {proc.returncode}, {count} checksum lines {sums}\n"
                f"{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
            )
        return elapsed

    return go


def launchers() -> dict[str, object]:
    py = sys.executable
    cmds = {
        "torchrun --standalone": timed(
            [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", JOB, "worker"]
        ),
        "ad.launch": timed([py, JOB, "ad-launch"]),
        "anydevice launch": timed([py, "-m", "anydevice", "launch", "-n", "2", JOB, "worker"]),
        "ad.launch + ad.distributed/prepare": timed([py, JOB, "ad-api"]),
        "torch.multiprocessing.spawn": timed([py, JOB, "mp-spawn"]),
    }
    accelerate = shutil.which("accelerate", path=str(BIN))
    if accelerate:
        cmds["accelerate launch --multi_gpu (CPU)"] = timed(
            [accelerate, "launch", "--multi_gpu", "--num_processes", "2",
             "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
             JOB, "worker"],
            env={"ACCELERATE_USE_CPU": "1"},
        )  # fmt: skip
    try:
        import lightning  # noqa: F401

        cmds["Fabric(strategy='ddp').launch()"] = timed([py, JOB, "fabric"])
    except ImportError:
        pass
    return cmds


def overhead(rounds: int) -> Result:
    res = Result("launch-overhead", "s", baseline="torchrun --standalone")
    for label, samples in run_interleaved(launchers(), rounds).items():  # type: ignore[arg-type]
        res.add(label, samples)
    floor = timed([sys.executable, "-c", "import torch; print('checksum rank 0: 0')"], expect=1)
    res.add("python -c 'import torch' (floor)", [floor() for _ in range(3)])
    ratio = res.ratio("ad.launch")
    fastest = {label: min(s) for label, s in res.samples.items()}
    best = fastest["ad.launch"] / fastest["torchrun --standalone"]
    res.extra["ad_launch_vs_torchrun"] = ratio
    res.extra["fastest_s"] = fastest
    res.extra["ad_launch_vs_torchrun_fastest"] = best
    res.notes.append(
        f"2 CPU processes x 20 DDP steps of a 16-32-1 MLP, fresh interpreter each; "
        f"ad.launch / torchrun = {ratio:.2f} by median, {best:.2f} by fastest run "
        "(target <= 1.10)"
    )
    res.notes.append(
        "fastest runs: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in fastest.items() if "floor" not in k)
    )
    return res


def scaling(
    steps: int,
    kind: str = "cpu",
    counts: tuple[int, ...] = (1, 2),
    repeats: int = 3,
    shape: tuple[int, int, int] | None = None,
) -> Result:
    import anydevice as ad
    import launch_job

    width, depth, batch = shape or ((512, 3, 64) if kind == "cpu" else (4096, 4, 512))
    res = Result(f"launch-scaling-{kind}", "samples/s", baseline=f"1 {kind} process")
    for n in counts:
        rates = []
        for _ in range(repeats):
            out = ad.launch(launch_job.scaling_worker, steps, batch, width, depth, kind, nprocs=n)
            rates.append(out[0])
        res.add(f"{n} {kind} process{'es' if n > 1 else ''}", rates)
    first = res.rows[f"1 {kind} process"]
    for label, value in list(res.rows.items())[1:]:
        res.extra[f"speedup {label}"] = value / first
    res.notes.append(
        f"MLP {width} wide, {depth} hidden layers, batch {batch} per process, {steps} timed "
        "steps after 10 warm-up; samples/s of all ranks together (DDP when > 1); on the CPU "
        "1 process uses every core, N processes share them (OMP_NUM_THREADS = cores / N)"
    )
    return res


def gpu_launch_scaling(device: str = "cuda", quick: bool = False) -> Result:
    """1 GPU against every GPU of this machine (``make gpu-check``).

    ``quick``: one process, one launch, a tiny model: a smoke run of every line.
    """
    import torch

    kind = torch.device(device).type
    count = torch.cuda.device_count() if kind == "cuda" else 1
    counts = (1, count) if count > 1 and not quick else (1,)
    if quick:
        res = scaling(steps=2, kind=kind, counts=counts, repeats=1, shape=(16, 1, 4))
    else:
        res = scaling(steps=200, kind=kind, counts=counts)
    if count == 1:
        res.notes.append(f"one {kind} process here: the multi-GPU row needs several GPUs")
    save(res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    save(overhead(args.rounds))
    save(scaling(args.steps))


if __name__ == "__main__":
    main()
