"""A damaged checkpoint is seen before anything is loaded: ``load_state(path)`` names the
file and the damage, ``load_state(latest_in=)`` falls back to the newest intact one and
says which and why at WARNING, on 1 and 2 ranks; a full disk (a real one: a small tmpfs in
a mount namespace of its own) is named, and leaves nothing that looks complete.

Every damage is made to real files of a real checkpoint: truncation, flipped bytes,
missing, emptied, swapped, extra files."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import anydevice as ad
from ranks import process_tree_guard, run_ranks

WIDTH = 64  # 16 KiB of weights: most of every shard is tensor data


def _net(value: float) -> torch.nn.Linear:
    net = torch.nn.Linear(WIDTH, WIDTH)
    with torch.no_grad():
        net.weight.fill_(value)
        net.bias.fill_(value)
    return net


def _truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def _flip(file: Path, at: float = 0.5) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    file.write_bytes(bytes(data))


def _flip_directory_crc(file: Path) -> None:
    """Flip a byte of the CRC-32 the zip directory keeps for the file's last record."""
    data = bytearray(file.read_bytes())
    data[data.rfind(b"PK\x01\x02") + 16] ^= 0x10
    file.write_bytes(bytes(data))


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def _as_folder(file: Path) -> None:
    file.unlink()
    file.mkdir()


#: damage -> (what it does to a sharded checkpoint, the file the error must name; None:
#: harmless, the checkpoint still loads whole)
SHARDED: dict[str, tuple[Callable[[Path], None], str | None]] = {
    "shard truncated": (lambda f: _truncate(f / "__1_0.distcp"), "__1_0.distcp"),
    "shard emptied": (lambda f: _truncate(f / "__0_0.distcp", 0), "__0_0.distcp"),
    "shard bytes flipped": (lambda f: _flip(f / "__0_0.distcp"), "__0_0.distcp"),
    "shard header flipped": (lambda f: _flip(f / "__1_0.distcp", 0.01), "__1_0.distcp"),
    "shard grown": (lambda f: (f / "__0_0.distcp").open("ab").write(b"junk"), "__0_0.distcp"),
    "shard deleted": (lambda f: (f / "__1_0.distcp").unlink(), "__1_0.distcp"),
    "shard made a folder": (lambda f: _as_folder(f / "__1_0.distcp"), "__1_0.distcp"),
    "shards swapped": (lambda f: _swap(f / "__0_0.distcp", f / "__1_0.distcp"), "__0_0.distcp"),
    "index deleted": (lambda f: (f / ".metadata").unlink(), ".metadata"),
    "index truncated": (lambda f: _truncate(f / ".metadata"), ".metadata"),
    "index bytes flipped": (lambda f: _flip(f / ".metadata"), ".metadata"),
    "manifest deleted": (lambda f: (f / "anydevice.json").unlink(), "anydevice.json"),
    "manifest emptied": (lambda f: _truncate(f / "anydevice.json", 0), "anydevice.json"),
    "manifest bytes flipped": (lambda f: _flip(f / "anydevice.json", 0.3), "anydevice.json"),
    "extra deleted": (lambda f: (f / "extra.rank1.pt").unlink(), "extra.rank1.pt"),
    "extra truncated": (lambda f: _truncate(f / "extra.rank0.pt"), "extra.rank0.pt"),
    "extra bytes flipped": (lambda f: _flip(f / "extra.rank0.pt", 0.2), "extra.rank0.pt"),
    "a file added": (lambda f: (f / "notes.txt").write_text("hello"), None),
    "a stray shard added": (lambda f: shutil.copy(f / "__0_0.distcp", f / "__7_0.distcp"), None),
}

#: the same for a single-file checkpoint (a world of one)
SINGLE: dict[str, tuple[Callable[[Path], None], str | None]] = {
    "truncated": (lambda f: _truncate(f), "step-000000002"),
    "emptied": (lambda f: _truncate(f, 0), "step-000000002"),
    "tensor bytes flipped": (lambda f: _flip(f, 0.5), "step-000000002"),
    "zip directory flipped": (_flip_directory_crc, "step-000000002"),
    "garbage appended": (lambda f: f.open("ab").write(b"\x00" * 100), None),
}


def _copies(base: Path, root: Path, cases: dict) -> dict[str, Path]:
    """A damaged copy of the history in ``base`` per case: its step 2 damaged."""
    out = {}
    for i, (name, (damage, _)) in enumerate(cases.items()):
        folder = root / f"case{i}"
        shutil.copytree(base, folder)
        damage(folder / "step-000000002")
        out[name] = folder
    return out


def _outcome(folder: Path) -> dict:
    """What ``latest_in=`` and the plain path make of a damaged history, on this rank."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.WARNING)
    logging.getLogger("anydevice").addHandler(handler)
    out: dict = {}
    try:
        net = _net(0.0)
        try:
            out["latest step"] = ad.load_state(latest_in=folder, model=net)["step"]
            out["latest weight"] = float(ad.unwrap(net).weight.detach()[0, 0])
        except Exception as e:
            out["latest error"] = f"{type(e).__name__}: {e}"
        out["warnings"] = [r.getMessage() for r in records]
        try:
            net = _net(0.0)
            out["path step"] = ad.load_state(folder / "step-000000002", model=net)["step"]
            out["path weight"] = float(ad.unwrap(net).weight.detach()[0, 0])
        except Exception as e:
            out["path error"] = f"{type(e).__name__}: {e}"
    finally:
        logging.getLogger("anydevice").removeHandler(handler)
    return out


def _check(name: str, out: dict, named: str | None, rank: int = 0) -> None:
    where = f"{name} (rank {rank}): {out}"
    if named is None:  # harmless: the newest loads, whole
        assert (out.get("latest step"), out.get("latest weight")) == (2, 2.0), where
        assert (out.get("path step"), out.get("path weight")) == (2, 2.0), where
        return
    # latest_in= falls back to step 1 and says which and why at WARNING (rank 0 says it)
    assert (out.get("latest step"), out.get("latest weight")) == (1, 1.0), where
    if rank == 0:
        [said] = [w for w in out["warnings"] if "passed over" in w]
        assert "resuming from step-000000001" in said and "step-000000002" in said, where
        assert named in said, where
    # the plain path is refused, naming the file (never raw, never silently wrong)
    assert out.get("path error", "").startswith("CheckpointError: "), where
    assert named in out["path error"], where


def _save_history(folder: Path) -> Callable[[str], None]:
    def rank(init_method: str) -> None:
        with ad.distributed(init_method=init_method, timeout=60):
            for step in (1, 2):
                net = ad.prepare(_net(float(step)), strategy="ddp")
                ad.save_state(folder, model=net, keep=2, step=step)

    return rank


def _probe(cases: dict[str, Path]) -> Callable[[str], dict]:
    def rank(init_method: str) -> dict:
        with ad.distributed(init_method=init_method, timeout=60):
            return {name: _outcome(folder) for name, folder in cases.items()}

    return rank


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_damage_to_a_sharded_checkpoint_is_named_or_passed_over_on_one_and_two_ranks(
    tmp_path,
):
    base = tmp_path / "base"
    (tmp_path / "save").mkdir()
    with process_tree_guard():
        run_ranks(_save_history(base), 2, tmp_path / "save", timeout=120)
    cases = _copies(base, tmp_path / "cases", SHARDED)
    for name, folder in cases.items():  # a world of one reads them without a group
        _check(name, _outcome(folder), SHARDED[name][1])
    (tmp_path / "two").mkdir()
    with process_tree_guard():
        ranks = run_ranks(_probe(cases), 2, tmp_path / "two", timeout=300)
    for r, outcomes in enumerate(ranks):
        for name, out in outcomes.items():
            _check(name, out, SHARDED[name][1], r)


def test_every_damage_to_a_single_file_checkpoint_is_named_or_passed_over(tmp_path):
    base = tmp_path / "base"
    for step in (1, 2):
        ad.save_state(base, model=_net(float(step)), keep=2, step=step)
    for name, folder in _copies(base, tmp_path / "cases", SINGLE).items():
        _check(name, _outcome(folder), SINGLE[name][1])


def test_without_an_intact_checkpoint_latest_in_names_each_and_its_damage(tmp_path):
    folder = tmp_path / "ckpts"
    for step in (1, 2):
        ad.save_state(folder, model=_net(float(step)), keep=2, step=step)
    _truncate(folder / "step-000000001")
    _flip(folder / "step-000000002")
    with pytest.raises(ad.CheckpointError) as e:
        ad.load_state(latest_in=folder, model=_net(0))
    said = str(e.value)
    assert "no intact checkpoint there" in said
    assert "step-000000002 (step-000000002: corrupt" in said
    assert "step-000000001 (step-000000001: truncated" in said
    # verify=False loads what is there without reading it first (the user's choice)
    net = _net(0)
    assert ad.load_state(folder / "step-000000002", model=net, verify=False) == {"step": 2}


# ----------------------------------------------------------------------------- a full disk

FULL_DISK = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])  # tests/, for ranks.py
    import torch
    import anydevice as ad
    from ranks import run_ranks

    disk, out = Path(sys.argv[1]), Path(sys.argv[2])
    disk.mkdir()
    # a disk of 1 MiB, in this process's own mount namespace: gone when it exits
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)

    def rank(init_method):
        result = {}
        with ad.distributed(init_method=init_method, timeout=60):
            net = ad.prepare(torch.nn.Linear(8, 8), strategy="ddp")
            ad.save_state(disk / "ckpts", model=net, keep=3, step=1)
            big = ad.prepare(torch.nn.Linear(600, 600), strategy="ddp")  # ~1.4 MB
            try:
                ad.save_state(disk / "ckpts", model=big, keep=3, step=2)
            except ad.CheckpointError as e:
                result["error"] = str(e)
            result["left"] = sorted(os.listdir(disk / "ckpts"))
            result["beside"] = sorted(os.listdir(disk))
            result["resumed"] = ad.load_state(latest_in=disk / "ckpts", model=net)
        return result

    results = run_ranks(rank, 2, out, timeout=120)
    (out / "results.json").write_text(json.dumps(results))
    """
)


def _can_mount() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root on Linux and unshare(1) to mount a small tmpfs"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                           capture_output=True, timeout=30)  # fmt: skip
    return None if probe.returncode == 0 else "this machine refuses mount namespaces"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_full_disk_on_two_ranks_is_named_and_leaves_the_previous_checkpoint(tmp_path):
    why = _can_mount()
    if why:
        pytest.skip(why)
    tests = Path(__file__).resolve().parents[1]
    argv = ["unshare", "-m", "--propagation", "private", sys.executable, "-c", FULL_DISK,
            str(tmp_path / "disk"), str(tmp_path), str(tests)]  # fmt: skip
    with process_tree_guard():
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    for r, res in enumerate(json.loads((tmp_path / "results.json").read_text())):
        said = res["error"]
        assert said.startswith(f"ad.save_state('{tmp_path / 'disk' / 'ckpts' / 'step-000000002'}')")
        assert "the disk is full" in said and "no space left on the disk" in said, said
        assert "free of 1.0 MiB in" in said, said  # the free space, and the disk's size
        assert "This checkpoint needs about 1." in said, said  # ~1.4 MB of weights
        assert len(said.splitlines()) == 1, said  # one line, not DCP's traceback
        assert res["left"] == ["step-000000001"], (r, res)  # nothing partial, nothing hidden
        assert res["beside"] == ["ckpts"], (r, res)
        assert res["resumed"] == {"step": 1}, (r, res)
    assert not (tmp_path / "disk").is_mount()  # the mount went with its namespace
