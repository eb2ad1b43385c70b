"""DeviceLoader's overlap, measured on the simulated accelerator (``anydevice.testing``).

Each batch takes ~20 ms to copy over the simulated link and ~20 ms of simulated compute
(``anydevice.testing.busy``, queued on the consumer's stream as a kernel is). Copying on
the consumer's stream serialises them: a step takes about the sum, 40 ms. DeviceLoader
copies batch k+1 on its copy stream while batch k computes. Targets: its step <= 1.25 x
max(copy, compute), also with a ``.item()`` every step (the host waits each step), and
with a loader built per epoch (memory flat across epochs).

The simulator registers torch's privateuse1 backend for its whole process, so ``make
bench`` (one process for every benchmark) runs the measurement in a child process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anydevice as ad
from report import Result, run_interleaved, save

COPY = COMPUTE = 0.02  # seconds per batch
FLOATS = 2**20  # 4 MiB per batch
SERIAL = "copy on the consumer's stream"


def measure(batches: int, rounds: int) -> Result:
    from anydevice import testing

    dev = testing.enable(bandwidth=FLOATS * 4 / COPY)
    data = [torch.full((FLOATS,), float(i)) for i in range(batches)]
    pinned = [b.pin_memory() for b in data]

    def epoch(body: Callable[[], None]) -> float:
        torch.accelerator.synchronize()
        t = time.perf_counter()
        body()
        torch.accelerator.synchronize()
        return (time.perf_counter() - t) / batches

    def serial() -> None:  # the copy on the consumer's stream, then the compute
        for b in pinned:
            x = b.to(dev, non_blocking=True)
            testing.busy(COMPUTE)
            del x

    loader = ad.DeviceLoader(data, dev)

    def overlapped() -> None:
        for x in loader:
            testing.busy(COMPUTE)
            del x

    def with_item() -> None:
        for x in loader:
            testing.busy(COMPUTE)
            x[:1].sum().item()  # the host waits for this step's compute

    held: list[int] = []

    def per_epoch_loader() -> None:
        for x in ad.DeviceLoader(data, dev):
            testing.busy(COMPUTE)
            del x

    def per_epoch_and_memory() -> float:
        seconds = epoch(per_epoch_loader)
        held.append(torch.accelerator.memory_allocated(0))  # after the epoch's last sync
        return seconds

    for body in (serial, overlapped, with_item, per_epoch_loader):  # warm-up
        epoch(body)
    samples = run_interleaved(
        {
            SERIAL: lambda: epoch(serial),
            "DeviceLoader": lambda: epoch(overlapped),
            "DeviceLoader, .item() each step": lambda: epoch(with_item),
            "DeviceLoader built per epoch": per_epoch_and_memory,
        },
        rounds,
    )
    result = Result("sim_overlap", "s/step", baseline="max(copy, compute)")
    result.rows["max(copy, compute)"] = max(COPY, COMPUTE)
    result.rows["copy + compute"] = COPY + COMPUTE
    for label, values in samples.items():
        result.add(label, values)
    for label in (
        "DeviceLoader",
        "DeviceLoader, .item() each step",
        "DeviceLoader built per epoch",
    ):
        ok = result.ratio(label) <= 1.25
        result.notes.append(f"{label}: {result.ratio(label):.2f}x max (target <= 1.25): {ok}")
    result.notes.append(f"{SERIAL}: {result.rows[SERIAL] / (COPY + COMPUTE):.2f}x the sum")
    result.extra["memory_after_each_epoch"] = held
    flat = len(set(held)) == 1
    result.notes.append(
        f"memory after each per-epoch loader's epoch: {sorted(set(held))}, flat: {flat}"
    )
    result.extra["batches"], result.extra["rounds"] = batches, rounds
    save(result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--here", action="store_true", help="measure in this process")
    args = parser.parse_args()
    if args.here:
        measure(args.batches, args.rounds)
        return
    argv = [sys.executable, __file__, "--here", f"--batches={args.batches}"]
    subprocess.run([*argv, f"--rounds={args.rounds}"], check=True, timeout=1200)


if __name__ == "__main__":
    main()
