"""A rank's side of the hang watch in real gloo worlds formed by ``ad.distributed`` under
a launcher that is not anydevice's: its heartbeat says which collective it is in — called
from Python, or by DDP's reducer in C++ — with torch's sequence number, the op, the shapes,
and the user's line; and where it is when it is outside any."""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import pytest
import torch

import anydevice as ad
from anydevice import heartbeat
from anydevice.launching.progress import fingerprint
from ranks import run_ranks_fresh

# A loaded machine may take a minute to show a collective's details: the ranks wait longer.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _other(rank: int, where: str, *, op: str = "", seconds: float = 150.0) -> heartbeat.Beat:
    """The record of rank ``rank`` once it is in a collective whose op is known (``op``
    where given: a rank still leaving an earlier collective shows that one a while)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for beat in heartbeat.read_all(Path(where)):
            c = beat.collective
            if beat.rank == rank and c is not None and c.op and c.op == (op or c.op):
                return beat
        time.sleep(0.1)
    last = [(b.rank, b.pid, b.alive, b.collective) for b in heartbeat.read_all(Path(where))]
    raise AssertionError(f"rank {rank} never showed {op or 'a collective'} in {where}: {last}")


def _line(fn: object, mark: str) -> int:
    lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return first + next(i for i, line in enumerate(lines) if line.rstrip().endswith(mark))


def waits_in_all_reduce(init_method: str) -> dict[str, object]:
    import os

    where = os.environ["ANYDEVICE_HEARTBEAT_DIR"]
    with ad.distributed(init_method=init_method, timeout=200) as d:
        t = torch.ones(3, dtype=torch.float64)
        torch.distributed.all_reduce(t)
        if d.rank == 0:
            torch.distributed.all_reduce(t)  # RANK 0 WAITS
            return {}
        seen = _other(0, where)
        mine = next(b for b in heartbeat.read_all(Path(where)) if b.rank == 1)
        torch.distributed.all_reduce(t)
        assert seen.collective is not None
        return {
            "call": (seen.collective.op, seen.collective.seq, seen.collective.group),
            "fingerprint": seen.collective.fingerprint,
            "details": seen.details["call"],
            "groups": seen.details["groups"],
            "seqs": mine.details["seqs"],
            "watched": mine.watched,
        }


# The ranks fork from a fresh interpreter (run_ranks_fresh): in pytest's own process,
# after hundreds of other tests, rank 0's record never showed its collective in three
# suite runs (each passed alone); the cause in the inherited state is not found yet.


def test_a_rank_in_a_collective_says_which_with_its_line(tmp_path):
    beats = tmp_path / "beats"
    beats.mkdir()
    _, seen = run_ranks_fresh(
        waits_in_all_reduce, 2, tmp_path, env={"ANYDEVICE_HEARTBEAT_DIR": str(beats)}, timeout=240
    )
    assert seen["call"] == ("all_reduce", 2, "0")  # torch's own number in the group
    assert seen["fingerprint"] == fingerprint("all_reduce", [[3]], ["Double"])
    call = seen["details"]
    assert (call["shapes"], call["dtypes"]) == ([[3]], ["Double"])
    line = _line(waits_in_all_reduce, "# RANK 0 WAITS")
    assert call["at"].endswith(f"test_progress.py:{line}"), call
    assert call["code"] == "torch.distributed.all_reduce(t)  # RANK 0 WAITS"
    assert seen["groups"]["0"] == {"ranks": [0, 1], "desc": "default_pg"}
    assert seen["seqs"] == {"0": 1}  # rank 1, before its second all_reduce
    assert seen["watched"] > 0


def waits_in_ddp_backward(init_method: str) -> tuple[str, int, str]:
    import os

    where = os.environ["ANYDEVICE_HEARTBEAT_DIR"]
    with ad.distributed(init_method=init_method, timeout=200, device="cpu") as d:
        net = ad.prepare(torch.nn.Linear(4, 1))
        loss = net(torch.ones(2, 4)).sum()
        if d.rank == 0:
            loss.backward()  # DDP REDUCES HERE
            return ("", 0, "")
        seen = _other(0, where, op="all_reduce")  # DDP's broadcasts at construction done
        loss.backward()
        assert seen.collective is not None
        return seen.collective.op, seen.collective.seq, seen.details["call"]["at"]


def test_ddps_reductions_from_cpp_are_seen_at_the_backward_that_waits(tmp_path):
    beats = tmp_path / "beats"
    beats.mkdir()
    _, (op, seq, at) = run_ranks_fresh(
        waits_in_ddp_backward, 2, tmp_path, env={"ANYDEVICE_HEARTBEAT_DIR": str(beats)}, timeout=240
    )
    assert op == "all_reduce" and seq > 1  # after DDP's own broadcasts at construction
    assert at.endswith(f"test_progress.py:{_line(waits_in_ddp_backward, '# DDP REDUCES HERE')}")


def sleeps_outside(init_method: str) -> dict[str, object]:
    import os

    where = Path(os.environ["ANYDEVICE_HEARTBEAT_DIR"])
    with ad.distributed(init_method=init_method, timeout=200) as d:
        ad.all_reduce(torch.ones(1))
        if d.rank == 1:
            time.sleep(4)  # RANK 1 SLEEPS
        else:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                other = [b for b in heartbeat.read_all(where) if b.rank == 1]
                if other and "sleep" in (other[0].details.get("where") or {}).get("code", ""):
                    break
                time.sleep(0.1)
        ad.all_reduce(torch.ones(1))
        if d.rank == 0:
            return other[0].details["where"]
        return {}


def test_a_rank_outside_any_collective_says_where_its_main_thread_is(tmp_path):
    beats = tmp_path / "beats"
    beats.mkdir()
    where, _ = run_ranks_fresh(
        sleeps_outside, 2, tmp_path, env={"ANYDEVICE_HEARTBEAT_DIR": str(beats)}, timeout=240
    )
    line = _line(sleeps_outside, "# RANK 1 SLEEPS")
    assert where["at"].endswith(f"test_progress.py:{line}"), where
    assert where["code"] == "time.sleep(4)  # RANK 1 SLEEPS"
    assert where["function"] == "sleeps_outside"
    assert where["stack"][-2:] == [where["stack"][-2], "  time.sleep(4)  # RANK 1 SLEEPS"]


def test_fingerprints_are_the_same_in_every_process():
    import subprocess
    import sys

    code = (
        "from anydevice.launching.progress import fingerprint as f\n"
        "print(f('all_reduce', [[4]], ['Float']))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert int(other.stdout) == fingerprint("all_reduce", [[4]], ["Float"])
    assert fingerprint("all_to_all", [[4]], ["Float"]) == fingerprint(
        "all_to_all", [[8]], ["Float"]
    )


#: One NCCL rank under a plain environment launcher: five all_reduces, then its record.
NCCL_RANK = """
import json, os, sys, time
from pathlib import Path
import torch
import anydevice as ad
from anydevice import heartbeat

with ad.distributed(timeout=60) as d:
    assert d.backend == "nccl", d.backend
    t = torch.ones(4, device=d.device)
    for _ in range(5):
        torch.distributed.all_reduce(t)
    torch.cuda.synchronize()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        (mine,) = [b for b in heartbeat.read_all() if b.pid == os.getpid()]
        if mine.details.get("seqs", {}).get("0", 0) >= 5:
            break
        time.sleep(0.1)
    print(json.dumps(mine.details))
"""


@pytest.mark.cuda
@pytest.mark.real_gpu("an NCCL process group: collectives on the simulated GPUs are refused")
def test_nccl_collectives_are_counted_from_the_same_record(tmp_path):
    """NCCL's collectives reach the watch through torch's flight recorder, as gloo's do
    (a world of one, in a fresh process: one GPU is enough)."""
    import json
    import os
    import subprocess
    import sys

    from ranks import free_port

    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "ANYDEVICE_HEARTBEAT_DIR": str(tmp_path),
    }
    out = subprocess.run(
        [sys.executable, "-c", NCCL_RANK], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    details = json.loads(out.stdout.strip().splitlines()[-1])
    assert details["seqs"]["0"] >= 5, details
    assert details["groups"]["0"]["ranks"] == [0]
