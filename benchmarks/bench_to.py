"""Per-call cost of ad.to against a hand-written loop and the peers; diagnose and checkpoints.

1. ``to-one-tensor``: one tensor already on the target (cpu): the cost of the call itself.
2. ``to-nested-batch``: the issue's batch (a dict of 16 small tensors, a list of 8, a tuple
   (tensor, str, int), a named tuple of 2, a dataclass of 2) to cpu, against a hand-written
   comprehension, accelerate's ``send_to_device``, Lightning's ``move_data_to_device`` and
   ignite's ``convert_tensor``. Every call returns new containers; tensors already on the
   target are not copied by anyone. Target: within 1.3x of the hand-written loop.
2b. ``to-1e6-tensors``: a list and a dict of 10**6 one-element tensors, to ``meta`` (every
   tensor moves) and to ``cpu`` (already there), against the plain loop
   (``[t.to(dev) for t in xs]``, ``{k: v.to(dev) for k, v in d.items()}``): at that size
   the per-leaf overhead is the whole cost. Target: within 1.2x of the plain loop.
3. ``diagnose-overhead``: a forward of a small MLP alone, inside ``with ad.diagnose`` and
   decorated with it.
4. ``checkpoint``: ``ad.save`` (atomic, fsync) against ``torch.save``; ``ad.load`` with and
   without CRC verification against ``torch.load``.
5. ``to-spec-resolution``: ``ad.to`` with a ``torch.device``, a plain ``"cpu"`` and a spec
   looked up on the machine (``"auto"``, the path ``"cuda:0"`` takes), against ``t.to``.

Each row is the median of many interleaved samples (each sample times a block of calls).
On a GPU machine, ``gpu_to_pinned_batch`` moves the batch from pinned memory to the GPU.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anydevice as ad
from report import Result, run_interleaved, save, sync

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    y: torch.Tensor


def make_batch(size: int = 4, pin: bool = False) -> dict[str, Any]:
    def t() -> torch.Tensor:
        x = torch.randn(size)
        return x.pin_memory() if pin else x

    return {
        "features": {f"f{i}": t() for i in range(16)},
        "tokens": [t() for _ in range(8)],
        "extra": (t(), "name", 3),
        "pair": Pair(t(), t()),
        "sample": Sample(t(), t()),
    }


def hand_written(batch: dict[str, Any], dev: torch.device, nb: bool = False) -> dict[str, Any]:
    extra, pair, sample = batch["extra"], batch["pair"], batch["sample"]
    return {
        "features": {k: v.to(dev, non_blocking=nb) for k, v in batch["features"].items()},
        "tokens": [v.to(dev, non_blocking=nb) for v in batch["tokens"]],
        "extra": (extra[0].to(dev, non_blocking=nb), extra[1], extra[2]),
        "pair": Pair(pair.a.to(dev, non_blocking=nb), pair.b.to(dev, non_blocking=nb)),
        "sample": Sample(sample.x.to(dev, non_blocking=nb), sample.y.to(dev, non_blocking=nb)),
    }


def peers() -> dict[str, Callable[..., Any]]:
    """The peers' batch movers that are installed, by label."""
    found: dict[str, Callable[..., Any]] = {}
    if importlib.util.find_spec("accelerate"):
        from accelerate.utils import send_to_device

        found["accelerate send_to_device"] = send_to_device
    if importlib.util.find_spec("lightning"):
        from lightning.fabric.utilities.apply_func import move_data_to_device

        found["lightning move_data_to_device"] = move_data_to_device
    if importlib.util.find_spec("ignite"):
        from ignite.utils import convert_tensor

        found["ignite convert_tensor"] = convert_tensor
    return found


def per_call_us(fn: Callable[[], object], calls: int) -> Callable[[], float]:
    def sample() -> float:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls * 1e6

    return sample


def what_peer_does(label: str, mover: Callable[..., Any], batch: dict[str, Any]) -> str | None:
    """None if the peer moves the batch like ad.to; else what it does instead."""
    try:
        out = mover(batch, torch.device("meta"))
    except Exception as e:  # recorded, not hidden: ignite rejects the int
        return f"raises {type(e).__name__}: {e}"
    if out["sample"] is batch["sample"] or out["sample"].x.device.type != "meta":
        return "leaves the dataclass where it was (not moved)"
    return None


def bench_to(rounds: int, calls: int) -> None:
    dev = torch.device("cpu")
    t = torch.randn(4)
    movers = peers()

    one: dict[str, Callable[[], float]] = {
        "hand-written t.to(dev)": per_call_us(lambda: t.to(dev), calls * 20),
        "ad.to(t, dev)": per_call_us(lambda: ad.to(t, dev), calls * 20),
        "ad.to(t, 'cpu')": per_call_us(lambda: ad.to(t, "cpu"), calls * 20),
    }
    for label, mover in movers.items():
        one[label] = per_call_us(lambda m=mover: m(t, dev), calls * 20)  # type: ignore[misc]
    result = Result("to-one-tensor", "us", baseline="hand-written t.to(dev)")
    for label, samples in run_interleaved(one, rounds).items():
        result.add(label, samples)
    result.notes.append("one tensor already on the target (cpu): the cost of the call itself")
    save(result)

    batch = make_batch()
    nested: dict[str, Callable[[], float]] = {
        "hand-written comprehension": per_call_us(lambda: hand_written(batch, dev), calls),
        "ad.to(batch, dev)": per_call_us(lambda: ad.to(batch, dev), calls),
        "ad.to(batch, 'cpu')": per_call_us(lambda: ad.to(batch, "cpu"), calls),
    }
    notes = []
    for label, mover in movers.items():
        problem = what_peer_does(label, mover, batch)
        if problem and problem.startswith("raises"):
            notes.append(f"{label} {problem}: not timed")
            continue
        if problem:
            notes.append(f"{label} {problem}")
        nested[label] = per_call_us(lambda m=mover: m(batch, dev), calls)  # type: ignore[misc]
    result = Result("to-nested-batch", "us", baseline="hand-written comprehension")
    for label, samples in run_interleaved(nested, rounds).items():
        result.add(label, samples)
    result.notes += [
        "dict of 16 tensors, list of 8, (tensor, str, int), named tuple of 2, dataclass of 2; "
        "target cpu (already there); target: ad.to within 1.3x of the hand-written loop",
        *notes,
    ]
    save(result)


def bench_spec(rounds: int, calls: int) -> None:
    """What a device spec costs per ``ad.to`` call: none, a plain name, one looked up."""
    t = torch.randn(4)
    dev = torch.device("cpu")
    rows: dict[str, Callable[[], float]] = {
        "t.to('cpu')": per_call_us(lambda: t.to("cpu"), calls),
        "ad.to(t, torch.device('cpu'))": per_call_us(lambda: ad.to(t, dev), calls),
        "ad.to(t, 'cpu')": per_call_us(lambda: ad.to(t, "cpu"), calls),
        "ad.to(t, 'auto')": per_call_us(lambda: ad.to(t, "auto"), calls),
    }
    result = Result("to-spec-resolution", "us", baseline="t.to('cpu')")
    for label, samples in run_interleaved(rows, rounds).items():
        result.add(label, samples)
    result.notes.append(
        "one tensor already on the cpu; 'auto' resolves through the inventory as 'cuda:0' "
        "does (every backend asked; NVIDIA GPUs from NVML facts read once per process)"
    )
    save(result)


def bench_many(rounds: int, n: int = 10**6) -> None:
    xs = [torch.zeros(1) for _ in range(n)]
    d = dict(enumerate(xs))
    cases: dict[str, Callable[[], float]] = {}
    for dev in (torch.device("meta"), torch.device("cpu")):
        cases |= {
            f"loop list {dev}": _seconds_of(lambda dev=dev: [t.to(dev) for t in xs]),
            f"ad.to list {dev}": _seconds_of(lambda dev=dev: ad.to(xs, dev)),
            f"loop dict {dev}": _seconds_of(lambda dev=dev: {k: v.to(dev) for k, v in d.items()}),
            f"ad.to dict {dev}": _seconds_of(lambda dev=dev: ad.to(d, dev)),
        }
    result = Result("to-1e6-tensors", "s", baseline="loop list meta")
    for label, samples in run_interleaved(cases, rounds).items():
        result.add(label, samples)
    for kind in ("list", "dict"):
        for dev in ("meta", "cpu"):
            ratio = result.ratio(f"ad.to {kind} {dev}", f"loop {kind} {dev}")
            result.notes.append(f"ad.to/loop, {kind} to {dev}: {ratio:.2f}x")
    result.notes.append(f"{n} one-element tensors; target: within 1.2x of the plain loop")
    save(result)


def _seconds_of(fn: Callable[[], object]) -> Callable[[], float]:
    def sample() -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    return sample


def bench_diagnose(rounds: int, calls: int) -> None:
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(32, 32), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(8, 32)

    def guarded() -> None:
        with ad.diagnose(model):
            model(x)

    decorated = ad.diagnose(model)(model.forward)

    with torch.inference_mode():
        result = Result("diagnose-overhead", "us", baseline="forward alone")
        for label, samples in run_interleaved(
            {
                "forward alone": per_call_us(lambda: model(x), calls),
                "with ad.diagnose(model): forward": per_call_us(guarded, calls),
                "@ad.diagnose(model) forward": per_call_us(lambda: decorated(x), calls),
            },
            rounds,
        ).items():
            result.add(label, samples)
    extra = result.rows["with ad.diagnose(model): forward"] - result.rows["forward alone"]
    result.notes.append(
        f"MLP of 8 Linear(32, 32) + ReLU, batch 8: diagnose adds {extra:.2f} us per call "
        "(it hooks nothing; the traceback is read only after an error)"
    )
    save(result)


def bench_checkpoint(rounds: int) -> None:
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(48)}  # 192 MiB
    folder = Path(tempfile.mkdtemp(prefix="anydevice-bench-"))
    a, b = folder / "ad.pt", folder / "torch.pt"
    try:
        saves = run_interleaved(
            {
                "torch.save": lambda: _seconds(lambda: torch.save(state, b)),
                "ad.save (atomic, fsync)": lambda: _seconds(lambda: ad.save(state, a)),
            },
            rounds,
        )
        loads = run_interleaved(
            {
                "torch.load": lambda: _seconds(lambda: torch.load(b, weights_only=True)),
                "ad.load(verify=False)": lambda: _seconds(lambda: ad.load(a, "cpu", verify=False)),
                "ad.load (CRC verified)": lambda: _seconds(lambda: ad.load(a, "cpu")),
            },
            rounds,
        )
        size = a.stat().st_size
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
    result = Result("checkpoint", "s", baseline="torch.save")
    for label, samples in {**saves, **loads}.items():
        result.add(label, samples)
    verify_cost = result.rows["ad.load (CRC verified)"] - result.rows["ad.load(verify=False)"]
    result.extra["verify_gb_per_s"] = size / verify_cost / 1e9 if verify_cost > 0 else None
    result.notes.append(
        f"{size / 2**20:.0f} MiB state_dict on a warm page cache; load ratios are against "
        f"torch.save's row, compare loads with torch.load ({result.rows['torch.load']:.3f} s); "
        f"CRC verification costs {verify_cost * 1000:.0f} ms"
    )
    save(result)


def _seconds(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def gpu_to_pinned_batch(device: str = "cuda", quick: bool = False) -> list[Result]:
    """The nested batch from pinned memory to the GPU: ad.to against accelerate and the rest.

    ``ad.to`` with ``non_blocking="auto"`` copies from the host blocking (the caller owns
    the buffer); its ``non_blocking=True`` row is the like-for-like comparison with the
    asynchronous hand-written loop.
    """
    dev = ad.device(device)
    calls, rounds = (5, 2) if quick else (200, 30)
    sizes = ((4, False),) if quick else ((4, True), (4096, True), (4096, False))
    results = []
    for size, pin in sizes:
        batch = make_batch(size, pin=pin and dev.type == "cuda")  # pinning needs a GPU
        movers = peers()
        commands: dict[str, Callable[[], float]] = {
            "hand-written, non_blocking=True": _gpu_per_call(
                lambda b=batch: hand_written(b, dev, nb=True), calls, dev
            ),
            "hand-written, blocking": _gpu_per_call(
                lambda b=batch: hand_written(b, dev), calls, dev
            ),
            "ad.to(batch, dev)": _gpu_per_call(lambda b=batch: ad.to(b, dev), calls, dev),
            "ad.to(batch, dev, non_blocking=True)": _gpu_per_call(
                lambda b=batch: ad.to(b, dev, non_blocking=True), calls, dev
            ),
        }
        if "accelerate send_to_device" in movers:
            send = movers["accelerate send_to_device"]
            commands["accelerate send_to_device(non_blocking=True)"] = _gpu_per_call(
                lambda b=batch, f=send: f(b, dev, non_blocking=True), calls, dev
            )
        if "lightning move_data_to_device" in movers:
            move = movers["lightning move_data_to_device"]
            commands["lightning move_data_to_device"] = _gpu_per_call(
                lambda b=batch, f=move: f(b, dev), calls, dev
            )
        out = ad.to(batch, dev)
        sync(dev)
        assert torch.equal(out["sample"].y.cpu(), batch["sample"].y)
        name = f"to-gpu-batch-{'pinned' if pin else 'pageable'}-{size}"
        result = Result(name, "us", baseline="hand-written, non_blocking=True")
        for label, samples in run_interleaved(commands, rounds).items():
            result.add(label, samples)
        result.notes.append(
            f"the nested batch ({size} float32 per tensor, {'pinned' if pin else 'pageable'}) "
            f"to {dev}, one synchronize per block of calls"
        )
        save(result)
        results.append(result)
    return results


def _gpu_per_call(fn: Callable[[], object], calls: int, dev: torch.device) -> Callable[[], float]:
    def sample() -> float:
        sync(dev)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(dev)
        return (time.perf_counter() - t) / calls * 1e6

    for _ in range(3):  # warm up: CUDA context, allocator, pinned pools
        fn()
    return sample


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--quick", action="store_true", help="a few rounds, for a smoke test")
    args = ap.parse_args()
    rounds = 5 if args.quick else args.rounds
    calls = 50 if args.quick else args.calls
    torch.set_num_threads(1)  # the MLP forward: one thread is steadier on a shared machine
    bench_to(rounds, calls)
    bench_spec(rounds, calls)
    bench_many(3 if args.quick else 7)
    bench_diagnose(rounds, calls)
    bench_checkpoint(3 if args.quick else 7)


if __name__ == "__main__":
    main()
