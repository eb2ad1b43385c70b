"""What publishing the heartbeat costs a training loop (``anydevice top``'s data).

Each step point of the library (a ``DeviceLoader`` batch, ``p.step``, ``Throughput.step``)
calls ``anydevice.hardware.pulse.tick``: a time stamp, the heartbeat's seqlock write into
shared memory, and, once a second, the device allocator's counters. Measured here:

* ``tick``: nanoseconds per call, against an empty call and the heartbeat's bare
  ``step()`` (what the tick adds around it), over enough calls to span several memory
  readings on a device that has them;
* a ``DeviceLoader`` batch with publishing on and off (the same loop, interleaved rounds),
  so the share of a batch the heartbeat takes is a ratio measured on one machine.

Target: negligible: below 1 % of a DeviceLoader batch on an accelerator (``--device sim``
here: the copy stream, events and waits a GPU's batch has), and a small share of the
cheapest batch there is (a CPU loader handing out tensors it does not copy, a few
microseconds), which a training step dwarfs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, run_interleaved, save, sync

TICK = "pulse.tick('batch', device)"


def gpu_heartbeat(device: str = "cuda", quick: bool = False) -> list[Result]:
    import torch

    import anydevice as ad
    from anydevice import heartbeat
    from anydevice.hardware import pulse

    dev = ad.device(device)
    calls = 20_000 if quick else 500_000
    rounds = 3 if quick else 7
    pulse.tick("batch", dev)  # makes the record
    beat = heartbeat.mine()
    assert beat is not None, "publishing is off (ANYDEVICE_HEARTBEAT=0)"

    def per_call(fn: Any) -> float:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls * 1e9

    def nothing() -> None:
        return None

    ticks = Result("heartbeat-tick", "ns", baseline="empty call")
    timers = {
        "empty call": lambda: per_call(nothing),
        "heartbeat.step() (the record's write)": lambda: per_call(beat.step),
        TICK: lambda: per_call(lambda: pulse.tick("batch", dev)),
    }
    for label, samples in run_interleaved(timers, rounds).items():
        ticks.add(label, samples)
    ticks.extra["calls_per_sample"] = calls
    ticks.extra["device"] = str(dev)

    batches = 200 if quick else 5_000
    data = [torch.randn(64, 128, device=dev) for _ in range(batches)]
    loader = ad.DeviceLoader(data, dev)

    def per_batch(publish: bool) -> float:
        pulse._state.off = not publish
        try:
            t = time.perf_counter()
            for _ in loader:
                pass
            sync(dev)
            return (time.perf_counter() - t) / batches * 1e9
        finally:
            pulse._state.off = False

    loop = Result("heartbeat-loader-batch", "ns", baseline="DeviceLoader batch, no heartbeat")
    timers = {
        "DeviceLoader batch, no heartbeat": lambda: per_batch(False),
        "DeviceLoader batch, heartbeat published": lambda: per_batch(True),
    }
    for label, samples in run_interleaved(timers, rounds).items():
        loop.add(label, samples)
    tick = ticks.rows[TICK] - ticks.rows["empty call"]
    base = loop.rows["DeviceLoader batch, no heartbeat"]
    share = tick / base
    loop.extra.update(tick_ns=tick, share_of_batch=share, device=str(dev), batches=batches)
    loop.extra["load_average_1min"] = os.getloadavg()[0]
    loop.notes.append(
        f"one tick costs {tick:.0f} ns ({ticks.ratio(TICK):.1f}x an empty call),"
        f" {share:.2%} of a {base / 1e3:.1f} us DeviceLoader batch on {dev} "
        "(target: < 1 % of an accelerator's batch); the difference between the two loops "
        "above is within their noise where it is smaller than their IQR"
    )
    save(ticks)
    save(loop)
    return [ticks, loop]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", help="cpu, sim (the simulator), cuda, ...")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.device.startswith("sim"):  # the simulated accelerator: an accelerator's loader path
        from anydevice import testing

        testing.enable()
    gpu_heartbeat(args.device, args.quick)


if __name__ == "__main__":
    main()
