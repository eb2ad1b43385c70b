"""A checkpoint never destroys, and what is saved loads back: ``save_state`` refuses a
folder or file of the user's (1 and 2 ranks), refuses at the call an extra ``load_state``
could not read back (naming the key and the type) and reads back all it accepts, copies
every extra it accepts for a background save, and names the call when only rank 0 makes
it. Real files, real gloo ranks."""

from __future__ import annotations

import collections
import dataclasses
import enum
import os
import pathlib
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import anydevice as ad
from ranks import process_tree_guard, run_ranks

Point = collections.namedtuple("Point", "x y")


class Colour(enum.Enum):
    RED = 1
    BLUE = 2


@dataclasses.dataclass
class Config:
    lr: float
    sizes: list[int]
    weights: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str
    tags: frozenset[str]


def _net(value: float = 1.0) -> torch.nn.Linear:
    net = torch.nn.Linear(2, 1)
    with torch.no_grad():
        net.weight.fill_(value)
    return net


def _users_folder(root: Path) -> Path:
    out = root / "outputs"
    (out / "runs").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "runs" / "log.txt").write_text("also mine")
    return out


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text() if p.is_file() else "/"
        for p in sorted(root.rglob("*"))
    }


# ----------------------------------------------------------------------------- item 4


def test_save_state_refuses_a_folder_or_file_of_the_users_and_keeps_every_byte(
    tmp_path, monkeypatch
):
    out = _users_folder(tmp_path)
    before = _tree(out)
    with pytest.raises(ad.CheckpointError) as refused:
        ad.save_state(out, model=_net(), step=1)  # accelerate's save_state(output_dir)
    said = str(refused.value)
    assert f"{out} is a folder that is not a checkpoint of ad.save_state" in said
    assert "(it holds notes.txt, runs/)" in said
    assert str(out / "checkpoint") in said and "keep=3" in said and "latest_in=" in said
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]

    weights = tmp_path / "weights.pt"
    torch.save(_net().state_dict(), weights)  # the user's own torch.save file
    kept = weights.read_bytes()
    with pytest.raises(ad.CheckpointError, match="is a file that is not a checkpoint"):
        ad.save_state(weights, model=_net())
    assert weights.read_bytes() == kept

    # the empty path: a clear error, and nothing left in the working folder
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with pytest.raises(ad.CheckpointError, match="the path is empty"):
        ad.save_state("", model=_net())
    with pytest.raises(ad.CheckpointError, match="the path is empty"):
        ad.load_state("", model=_net())
    assert list(cwd.iterdir()) == []

    # keep= writes its history beside the user's files, and its pruning leaves a step-N
    # entry that is not a checkpoint of ours alone
    (out / "step-000000001").write_text("not a checkpoint")
    for step in (2, 3, 4):
        ad.save_state(out, model=_net(step), keep=1, step=step)
    assert sorted(p.name for p in out.iterdir()) == [
        "notes.txt", "runs", "step-000000001", "step-000000004",
    ]  # fmt: skip
    assert (out / "step-000000001").read_text() == "not a checkpoint"
    net = _net(0)
    assert ad.load_state(latest_in=out, model=net) == {"step": 4}

    # its own checkpoints, and an empty folder, are replaced as before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ad.save_state(empty, model=_net(), step=5).is_file()
    ad.save_state(empty, model=_net(), step=6)
    assert ad.load_state(empty, model=_net()) == {"step": 6}


def _two_ranks_meet_a_users_folder(root: Path):
    def rank(init_method: str) -> dict:
        with ad.distributed(init_method=init_method, timeout=60) as d:
            out: dict = {}
            net = ad.prepare(_net(), strategy="ddp")
            try:
                ad.save_state(root / "outputs", model=net, step=1)
            except ad.CheckpointError as e:
                out["refused"] = str(e)
            # extras of every kind save_state accepts, per rank, read back on each rank
            mine = _accepted_extras(d.rank)
            ad.save_state(root / "ckpt", model=net, **mine)
            back = ad.load_state(root / "ckpt", model=net)
            out["same"] = _same(back, mine)
            # a rank whose extra could not be read back fails the call on every rank
            bad = {"hook": (lambda: None) if d.rank == 1 else None}
            try:
                ad.save_state(root / "ckpt", model=net, step=2, **bad)
            except ad.CheckpointError as e:
                out["bad extra"] = str(e)
            out["step"] = ad.load_state(root / "ckpt", model=net)["step"]
            return out

    return rank


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_refuse_a_users_folder_and_read_back_every_accepted_extra(tmp_path):
    out = _users_folder(tmp_path)
    before = _tree(out)
    with process_tree_guard():
        results = run_ranks(_two_ranks_meet_a_users_folder(tmp_path), 2, tmp_path, timeout=150)
    for r, res in enumerate(results):
        assert "is a folder that is not a checkpoint of ad.save_state" in res["refused"], r
        assert res["same"] == dict.fromkeys(_accepted_extras(r), True), r
        assert "extra 'hook' is a function" in res["bad extra"], r
        assert "(on rank(s) [1])" in res["bad extra"], r
        assert res["step"] == r, r  # the refused save wrote nothing: each rank its own step
    assert _tree(out) == before


# ----------------------------------------------------------------------------- item 5


def _accepted_extras(rank: int = 0) -> dict:
    rng = np.random.RandomState(rank)
    return {
        "step": rank,
        "numpy_rng": rng.get_state(),  # a tuple with an ndarray
        "generator": np.random.default_rng(rank).bit_generator.state,  # a dict
        "data": pathlib.Path("/data") / f"rank{rank}",
        "point": Point(rank, [1.5, torch.ones(2)]),
        "colour": Colour.BLUE,
        "config": Config(0.1, [1, 2], torch.arange(3.0)),
        "frozen": Frozen("a", frozenset({"x", "y"})),
        "seen": {1, 2, rank},
        "tags": frozenset({"a"}),
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "scalar": np.float64(2.5),
        "dtype": np.dtype("int16"),
        "ordered": collections.OrderedDict(b=1, a=2),
        "counts": collections.Counter("aab"),
        "size": torch.Size([2, 3]),
        "misc": (torch.float16, torch.device("cpu"), b"\x00\x01", 1 + 2j, None),
    }


def _same(back: dict, saved: dict) -> dict[str, bool]:
    """Per key: whether ``back`` holds what ``saved`` did, value for value, type for type."""
    assert set(back) == set(saved)
    return {k: _equal(back[k], saved[k]) for k in saved}


def _equal(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(b, torch.Tensor):
        return bool(torch.equal(a, b))  # type: ignore[arg-type]
    if isinstance(b, np.ndarray):
        return a.dtype == b.dtype and bool(np.array_equal(a, b))  # type: ignore[union-attr]
    if isinstance(b, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in b)  # type: ignore[index, call-overload]
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_equal, a, b))  # type: ignore[arg-type]
    if dataclasses.is_dataclass(b):
        return all(_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(b))
    return bool(a == b)


def test_every_extra_save_state_accepts_loads_back_equal_and_of_its_type(tmp_path):
    mine = _accepted_extras(3)
    path = ad.save_state(tmp_path / "extras.pt", model=_net(), **mine)
    back = ad.load_state(path, model=_net())
    assert _same(back, mine) == dict.fromkeys(mine, True)
    # torch's own list of allowed globals is as it was: the classes were allowed for the
    # load alone
    assert Point not in torch.serialization.get_safe_globals()
    assert pathlib.PosixPath not in torch.serialization.get_safe_globals()


def test_an_extra_load_state_could_not_read_back_is_refused_at_the_call_naming_key_and_type(
    tmp_path,
):
    def local_class() -> object:
        Inner = collections.namedtuple("Inner", "a")
        return Inner(1)

    layer = r"extra 'layer' is a torch\.nn\.modules\.linear\.Linear \(save its state_dict"
    refused = {
        "hook": (lambda: None, r"extra 'hook' is a function"),
        "layer": (torch.nn.Linear(1, 1), layer),
        "thing": (object(), r"extra 'thing' is an object, which load_state cannot read back"),
        "nested": ({"a": [1, {"b": open}]}, r"extra 'nested'\['a'\]\[1\]\['b'\] is a function"),
        "objects": (np.array([object()]), r"numpy array of Python objects"),
        "local": (local_class(), r"'local' is a namedtuple of class .*Inner, which load_state"),
        "defaults": (collections.defaultdict(list), r"a defaultdict"),
    }
    for key, (value, said) in refused.items():
        with pytest.raises(ad.CheckpointError, match=said):
            ad.save_state(tmp_path / "c.pt", model=_net(), **{key: value})
        assert list(tmp_path.iterdir()) == [], key  # refused before anything was written


SAVED_WITH_A_MAIN_CLASS = """
import collections, sys, torch, anydevice as ad
Pair = collections.namedtuple("Pair", "a b")
ad.save_state(sys.argv[1], model=torch.nn.Linear(2, 1), pair=Pair(1, 2))
"""


def test_a_class_the_loading_process_does_not_have_is_named(tmp_path):
    path = tmp_path / "main.pt"
    subprocess.run([sys.executable, "-c", SAVED_WITH_A_MAIN_CLASS, str(path)],
                   check=True, timeout=120)  # fmt: skip
    with pytest.raises(ad.CheckpointError, match=r"holds a __main__\.Pair, which is not defined"):
        ad.load_state(path, model=torch.nn.Linear(2, 1))


# ----------------------------------------------------------------------------- item 7


def test_a_background_save_keeps_every_extra_as_it_was_at_the_call(tmp_path):
    seen = {1, 2}
    point = Point(1, [1.0, 2.0])
    config = Config(0.1, [1, 2], torch.zeros(3))
    array = np.zeros(3)
    nested = ([1], {"k": {3}})
    tags = collections.Counter("ab")
    given = {"seen": seen, "point": point, "config": config, "array": array, "nested": nested,
             "tags": tags}  # fmt: skip
    path = ad.save_state(tmp_path / "bg.pt", model=_net(), background=True, **given)
    # the loop goes on at once, changing all of it in place
    seen.add(3)
    point.y.append(3.0)
    config.lr, config.sizes[0] = 0.5, 9
    config.weights += 1
    array += 1
    nested[0].append(2)
    nested[1]["k"].add(4)
    tags["c"] += 1
    ad.wait_for_saves()
    back = ad.load_state(path, model=_net())
    assert back["seen"] == {1, 2}
    assert back["point"] == Point(1, [1.0, 2.0]) and type(back["point"]) is Point
    assert (back["config"].lr, back["config"].sizes) == (0.1, [1, 2])
    assert torch.equal(back["config"].weights, torch.zeros(3))
    assert np.array_equal(back["array"], np.zeros(3))
    assert back["nested"] == ([1], {"k": {3}})
    assert back["tags"] == collections.Counter("ab") and type(back["tags"]) is collections.Counter


# ----------------------------------------------------------------------------- item 12


def _save_after_a_peer_was_killed(init_method: str) -> dict:
    """Rank 1 is SIGKILLed as rank 0 comes to save_state."""
    with ad.distributed(init_method=init_method, timeout=10) as d:
        net = ad.prepare(_net(), strategy="ddp")
        if d.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            ad.save_state(os.environ["CKPT"], model=net, step=1)
        except Exception as e:
            return {"type": type(e).__name__, "error": str(e), "pid": os.getpid()}
        return {"type": None}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_save_state_waiting_for_a_rank_whose_process_ended_says_so(tmp_path):
    """Not "call it on every rank": the rank did, its process died (a launcher's workers
    share a run id, by which their heartbeats are found)."""
    env = {
        "CKPT": str(tmp_path / "ckpt"),
        "TORCHELASTIC_RUN_ID": f"ended-{os.getpid()}",
        "ANYDEVICE_HEARTBEAT_DIR": str(tmp_path / "beats"),
    }
    (tmp_path / "beats").mkdir()
    with process_tree_guard(), pytest.raises(AssertionError) as failed:
        run_ranks(_save_after_a_peer_was_killed, 2, tmp_path, timeout=120, env=env)
    assert "rank 1 died without a result" in str(failed.value)
    first = pickle.loads((tmp_path / "rank0.pickle").read_bytes())[1]
    assert first["type"] == "DistributedTimeoutError", first
    assert "rank(s) [1] did not call save_state" in first["error"]
    assert "The process of rank 1 (pid " in first["error"], first["error"]
    assert "call it on every rank" not in first["error"]
    assert not (tmp_path / "ckpt").exists()


def _save_on_rank_zero_only(init_method: str) -> dict:
    """The ``torch.save`` habit: rank 0 saves, rank 1 goes on to its next all-reduce."""
    with ad.distributed(init_method=init_method, timeout=10) as d:
        net = ad.prepare(_net(), strategy="ddp")
        try:
            if d.rank == 0:
                ad.save_state(os.environ["CKPT"], model=net, step=1)
            else:
                ad.all_reduce(torch.ones(1))  # what the next backward waits in
        except Exception as e:
            return {"type": type(e).__name__, "error": str(e)}
        return {"type": None}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_save_state_on_rank_zero_alone_is_named_as_the_cause(tmp_path):
    env = {"CKPT": str(tmp_path / "ckpt")}
    with process_tree_guard():
        try:
            results = run_ranks(_save_on_rank_zero_only, 2, tmp_path, timeout=120, env=env)
        except AssertionError as e:  # rank 1 may die on the closed connection instead
            if "rank 1" not in str(e):
                raise
            results = [pickle.loads((tmp_path / "rank0.pickle").read_bytes())[1]]
    first = results[0]
    assert first["type"] == "DistributedTimeoutError", first
    assert "rank(s) [1] did not call save_state" in first["error"]
    assert "save_state is collective: call it on every rank" in first["error"]
    assert not (tmp_path / "ckpt").exists()
