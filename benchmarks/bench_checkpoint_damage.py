"""Damaged checkpoints, loaded as a user would: how many are caught, passed over, loaded
silently wrong, or end in a raw traceback.

A history of two checkpoints (``save_state(folder, keep=2, step=s)``: step 1's weights all
1.0, step 2's all 2.0) is saved by 2 ranks (a DCP folder) and by 1 (a single file); each
damage below is made to a copy's step 2, and the copy is loaded on 1 rank and on 2 (each
2-rank probe in a ``torchrun`` of its own, bounded), two ways:

* ``load_state(latest_in=copy)`` — **falls back** to step 1 (said at WARNING, or only at
  INFO, or not at all), **refused** (an anydevice error), **raw** (any other exception:
  DCP's, torch's), **silently wrong** (step 2 loaded with other weights), **intact** (step
  2 loaded whole: the damage was harmless), **hang** (the probe ran out of time);
* ``load_state(copy / "step-000000002")`` — **refused**, **raw**, **silently wrong**,
  **intact**, **hang**.

``python benchmarks/bench_checkpoint_damage.py [--src DIR ...]``: ``--src`` probes another
checkout's ``src`` too (e.g. the code before a change), side by side.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
BIN = Path(sys.executable).parent
WIDTH = 64


def _truncate(f: Path, keep: float = 0.5) -> None:
    f.write_bytes(f.read_bytes()[: int(f.stat().st_size * keep)])


def _flip(f: Path, at: float = 0.5) -> None:
    data = bytearray(f.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    f.write_bytes(bytes(data))


def _swap(a: Path, b: Path) -> None:
    a.rename(a.with_name("swap"))
    b.rename(a)
    a.with_name("swap").rename(b)


def _replace_by_folder(f: Path) -> None:
    f.unlink()
    f.mkdir()


#: damage -> what it does to step 2 of a 2-rank history (a folder)
SHARDED: dict[str, Callable[[Path], Any]] = {
    "shard truncated": lambda f: _truncate(f / "__1_0.distcp"),
    "shard emptied": lambda f: _truncate(f / "__0_0.distcp", 0),
    "shard bytes flipped": lambda f: _flip(f / "__0_0.distcp"),
    "shard header flipped": lambda f: _flip(f / "__1_0.distcp", 0.01),
    "shard grown": lambda f: (f / "__0_0.distcp").open("ab").write(b"junk"),
    "shard deleted": lambda f: (f / "__1_0.distcp").unlink(),
    "shard made a folder": lambda f: _replace_by_folder(f / "__1_0.distcp"),
    "shards swapped": lambda f: _swap(f / "__0_0.distcp", f / "__1_0.distcp"),
    "index deleted": lambda f: (f / ".metadata").unlink(),
    "index truncated": lambda f: _truncate(f / ".metadata"),
    "index bytes flipped": lambda f: _flip(f / ".metadata"),
    "manifest deleted": lambda f: (f / "anydevice.json").unlink(),
    "manifest emptied": lambda f: _truncate(f / "anydevice.json", 0),
    "manifest bytes flipped": lambda f: _flip(f / "anydevice.json", 0.3),
    "extra deleted": lambda f: (f / "extra.rank1.pt").unlink(),
    "extra truncated": lambda f: _truncate(f / "extra.rank0.pt"),
    "extra bytes flipped": lambda f: _flip(f / "extra.rank0.pt", 0.2),
    "a file added": lambda f: (f / "notes.txt").write_text("hello"),
    "a stray shard added": lambda f: shutil.copy(f / "__0_0.distcp", f / "__7_0.distcp"),
}

#: damage -> what it does to step 2 of a 1-rank history (a file)
SINGLE: dict[str, Callable[[Path], Any]] = {
    "file truncated": lambda f: _truncate(f),
    "file emptied": lambda f: _truncate(f, 0),
    "file tensor bytes flipped": lambda f: _flip(f, 0.5),
    "file garbage appended": lambda f: f.open("ab").write(b"\x00" * 100),
}


# ----------------------------------------------------------------------------- in the ranks

FALLBACK = {
    logging.WARNING: "falls back, said at WARNING",
    logging.INFO: "falls back, said at INFO only",
}


def _net(value: float) -> Any:
    import torch

    net = torch.nn.Linear(WIDTH, WIDTH)
    with torch.no_grad():
        net.weight.fill_(value)
        net.bias.fill_(value)
    return net


def save_history(folder: Path) -> None:
    import anydevice as ad

    if "WORLD_SIZE" not in os.environ:
        for step in (1, 2):
            ad.save_state(folder, model=_net(float(step)), keep=2, step=step)
        return
    with ad.distributed(timeout=30):
        for step in (1, 2):
            net = ad.prepare(_net(float(step)), strategy="ddp")
            ad.save_state(folder, model=net, keep=2, step=step)


def probe(cases: dict[str, str], out: Path) -> None:
    import contextlib

    import anydevice as ad

    levels: list[int] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "step-000000001" in record.getMessage():
                levels.append(record.levelno)

    logger = logging.getLogger("anydevice")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())

    def outcome(load: Callable[[Any], Any], latest: bool) -> str:
        net = _net(0.0)
        levels.clear()
        try:
            extra = load(net)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            return "refused" if isinstance(e, ad.AnydeviceError) else f"raw ({type(e).__name__})"
        step = extra.get("step")
        whole = all(bool((p.detach() == float(step)).all()) for p in ad.unwrap(net).parameters())
        if whole and step == 2:
            return "intact"
        if whole and step == 1 and latest:
            said = max(levels, default=0)
            return FALLBACK.get(said, "falls back silently")
        return "silently wrong"

    context = ad.distributed(timeout=30) if "WORLD_SIZE" in os.environ else contextlib.nullcontext()
    results = {}
    with context:
        for name, folder in cases.items():
            f = Path(folder)
            results[name] = {
                "latest_in": outcome(lambda n, f=f: ad.load_state(latest_in=f, model=n), True),
                "path": outcome(lambda n, f=f: ad.load_state(f / "step-000000002", model=n), False),
            }
    if os.environ.get("RANK", "0") == "0":
        out.write_text(json.dumps(results))


# ----------------------------------------------------------------------------- the driver


def _run(argv: list[str], src: str | None, timeout: float = 180) -> bool:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if src:
        env["PYTHONPATH"] = src
    try:
        subprocess.run(argv, env=env, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False
    return True


def _torchrun(*args: str) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(HERE), *args]


def probe_src(src: str | None, root: Path) -> dict[str, dict[str, str]]:
    """Every damage's outcome with ``src``'s anydevice, keyed ``"<damage> / <n> rank(s)"``."""
    bases = {"sharded": root / "sharded", "single": root / "single"}
    _run(_torchrun("save", str(bases["sharded"])), src)
    _run([sys.executable, str(HERE), "save", str(bases["single"])], src)
    cases: dict[str, dict[str, str]] = {"sharded": {}, "single": {}}
    for kind, damages in (("sharded", SHARDED), ("single", SINGLE)):
        for i, (name, damage) in enumerate(damages.items()):
            copy = root / f"{kind}{i}"
            shutil.copytree(bases[kind], copy)
            damage(copy / "step-000000002")
            cases[kind][name] = str(copy)
    found: dict[str, dict[str, str]] = {}
    every = {**cases["sharded"], **cases["single"]}
    out = root / "one.json"
    _run([sys.executable, str(HERE), "probe", json.dumps(every), str(out)], src, timeout=600)
    one = json.loads(out.read_text()) if out.exists() else {}
    for name in every:
        found[f"{name} / 1 rank"] = one.get(name, {"latest_in": "hang", "path": "hang"})
    for name, folder in cases["sharded"].items():  # each alone: a raw error may stop a world
        out = root / f"two-{abs(hash(name))}.json"
        ran = _run(_torchrun("probe", json.dumps({name: folder}), str(out)), src, timeout=120)
        two = json.loads(out.read_text()) if ran and out.exists() else {}
        found[f"{name} / 2 ranks"] = two.get(name, {"latest_in": "hang", "path": "hang"})
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", action="append", default=[], help="another checkout's src")
    parser.add_argument("mode", nargs="?", default="driver")
    parser.add_argument("args", nargs="*")
    args = parser.parse_args()
    if args.mode == "save":
        save_history(Path(args.args[0]))
        return
    if args.mode == "probe":
        probe(json.loads(args.args[0]), Path(args.args[1]))
        return
    sys.path.insert(0, str(HERE.parent))
    from report import Result, save

    for src in [None, *args.src]:
        label = src or "this checkout"
        with tempfile.TemporaryDirectory() as tmp:
            found = probe_src(src, Path(tmp))
        print(f"\n{label}: each damaged load (latest_in= / the path)")
        for case, ways in found.items():
            print(f"  {case:<40} {ways['latest_in']:<30} {ways['path']}")
        for way in ("latest_in", "path"):
            counts = collections.Counter(v[way] for v in found.values())
            print(f"\n{label}: load_state({way}=...) over {len(found)} damaged loads")
            for outcome, n in counts.most_common():
                print(f"  {n:3d}  {outcome}")
            result = Result(f"checkpoint-damage-{way}", "loads")
            for outcome, n in counts.items():
                result.add(outcome, [float(n)])
            result.notes.append(f"anydevice from {label}")
            result.extra["outcomes"] = {k: v[way] for k, v in found.items()}
            if src is None:
                save(result)


if __name__ == "__main__":
    main()
