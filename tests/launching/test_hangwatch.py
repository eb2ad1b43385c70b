"""The hang watch in real launches (gloo, real processes): each kind of hang ends in the
right verdict, naming the lines, well within 60 s of the hang's start; a slow rank is not
judged; two nodes print one verdict.

The launches run side by side (module fixtures): each costs seconds of torch imports per
process. Every process is bounded in time; the guard fails a test that leaves one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anydevice import heartbeat
from ranks import finish_job, free_port, process_tree_guard, start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


#: Rank 0 runs a 4th all_reduce while rank 1 runs a broadcast.
MISMATCH = """\
import os, sys, time
import torch
import torch.distributed as dist
import anydevice as ad

with ad.distributed(timeout=120) as d:
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    open(os.path.join(sys.argv[1], f"hang{d.rank}"), "w").write(repr(time.time()))
    if d.rank == 0:
        dist.all_reduce(t)  # RANK 0
    else:
        dist.broadcast(t, 0)  # RANK 1
"""

#: Rank 1 never reaches the second all_reduce; the collectives time out after 15 s.
STALL = """\
import os, sys, time
import torch
import anydevice as ad

with ad.distributed(timeout=15) as d:
    ad.all_reduce(torch.ones(1))
    open(os.path.join(sys.argv[1], f"hang{d.rank}"), "w").write(repr(time.time()))
    if d.rank == 1:
        time.sleep(600)  # STUCK
    ad.all_reduce(torch.ones(1))  # WAITS
"""

#: As STALL, but rank 1 is stuck in native code that holds the GIL (a read of a pipe
#: nobody writes, which the signal's handler restarts): its own watch thread cannot run,
#: so the launcher asks its stack by signal.
GIL = STALL.replace(
    "time.sleep(600)  # STUCK", "ctypes.PyDLL(None).read(os.pipe()[0], buf, 1)  # STUCK"
).replace(
    "import os, sys, time", "import ctypes, os, sys, time\nbuf = ctypes.create_string_buffer(1)"
)

#: Two groups of the same ranks, called in different orders.
DEADLOCK = """\
import os, sys, time
import torch
import torch.distributed as dist
import anydevice as ad

with ad.distributed(timeout=300) as d:
    a = dist.new_group([0, 1])
    b = dist.new_group([0, 1])
    t = torch.ones(2)
    dist.all_reduce(t, group=a)
    dist.all_reduce(t, group=b)
    if d.rank == 0:
        dist.all_reduce(t, group=a)  # RANK 0
        dist.all_reduce(t, group=b)
    else:
        dist.all_reduce(t, group=b)  # RANK 1
        dist.all_reduce(t, group=a)
"""

#: Steps of 4 s on both ranks, then one where rank 1 computes 5 s and rank 0 none: rank 0
#: waits 5 s, past --hang-after 2 but within twice the gaps the job has shown. (The issue's
#: 45 s of compute, scaled down: the rule is the same at any scale — it is tested on
#: states in test_verdict.py — and 45 real seconds would cost the suite a minute.)
SLOW = """\
import time
import torch
import anydevice as ad

with ad.distributed(timeout=120) as d:
    ad.all_reduce(torch.ones(1))
    for step in range(3):
        time.sleep(4)
        ad.all_reduce(torch.ones(1))
    time.sleep(5 if d.rank == 1 else 0)
    ad.all_reduce(torch.ones(1))
    print("DONE", d.rank, flush=True)
"""

#: ad.launch where rank 1 is killed while rank 0 waits for it in an all_reduce.
AD_KILL = """\
import sys
sys.path.insert(0, {tests!r})
import anydevice as ad, workers
if __name__ == "__main__":
    try:
        ad.launch(workers.killed_while_waited_for, 1, sys.argv[1], nprocs=2, timeout=60)
    except ad.WorkerFailedError as e:
        print(e, flush=True)
"""


@pytest.fixture(autouse=True)
def no_process_left_behind():
    with process_tree_guard():
        yield


def launch(tmp: Path, script: str, *args: str, **env: str) -> subprocess.Popen[str]:
    path = tmp / "job.py"
    path.write_text(script)
    notes = tmp / "notes"
    notes.mkdir()
    argv = [sys.executable, "-m", "anydevice", "launch", "-n", "2", *args, str(path), str(notes)]
    return start_job(argv, tmp, **env)


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, time of the exit); the session is killed on timeout."""
    return (*finish_job(proc, timeout), time.time())


def line_of(script: str, mark: str) -> int:
    return 1 + next(i for i, line in enumerate(script.splitlines()) if line.endswith(mark))


def hang_started(tmp: Path) -> float:
    """When the last rank reached the hang (each wrote the time before its collective)."""
    return max(float(p.read_text()) for p in (tmp / "notes").glob("hang*"))


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every case side by side: the mismatch, the stall, the slow rank, the deadlock
    stopped by SIGTERM (CLI), the killed rank (ad.launch), the mismatch on two nodes."""
    root = tmp_path_factory.mktemp("hangs")
    names = ("mismatch", "stall", "gil", "slow", "kill", "deadlock", "node0", "node1")
    folders = {name: root / name for name in names}
    for folder in folders.values():
        folder.mkdir()
    driver = folders["kill"] / "driver.py"
    driver.write_text(AD_KILL.format(tests=str(Path(__file__).parents[1])))
    (folders["kill"] / "notes").mkdir()
    beats = folders["deadlock"] / "beats"
    beats.mkdir()
    with process_tree_guard():
        procs = {
            "mismatch": launch(folders["mismatch"], MISMATCH, "--hang-after", "5"),
            "stall": launch(folders["stall"], STALL, "--hang-after", "3"),
            "gil": launch(folders["gil"], GIL, "--hang-after", "3"),
            "slow": launch(folders["slow"], SLOW, "--hang-after", "2"),
            "kill": start_job(
                [sys.executable, str(driver), str(folders["kill"] / "notes")], folders["kill"]
            ),
            "deadlock": launch(folders["deadlock"], DEADLOCK, ANYDEVICE_HEARTBEAT_DIR=str(beats)),
            **two_nodes(root, folders["node0"], folders["node1"]),
        }
        try:
            stop_when_deadlocked(procs["deadlock"], beats)
        finally:
            ended = {name: finish(proc, timeout=240) for name, proc in procs.items()}
    return {name: (folders[name], *ended[name]) for name in procs}


def two_nodes(root: Path, *folders: Path) -> dict[str, subprocess.Popen[str]]:
    """The mismatch on two launches on this machine, one rank each, meeting at a
    rendezvous, as two nodes would."""
    script = root / "two_nodes.py"
    script.write_text(MISMATCH)
    endpoint = f"127.0.0.1:{free_port()}"
    procs = {}
    for node, folder in enumerate(folders):
        (folder / "notes").mkdir()
        argv = [
            sys.executable, "-m", "anydevice", "launch", "--nnodes", "2", "--node-rank",
            str(node), "--rdzv-endpoint", endpoint, "-n", "1", "--hang-after", "5",
            "--timeout", "120", str(script), str(folder / "notes"),
        ]  # fmt: skip
        procs[f"node{node}"] = start_job(argv, folder)
    return procs


def stop_when_deadlocked(proc: subprocess.Popen[str], beats: Path) -> None:
    """SIGTERM to the launch once both ranks' records show their collectives (op and all)
    and they have waited 6 s more."""
    deadline = time.monotonic() + 180
    while True:
        calls = [b.collective for b in heartbeat.read_all(beats) if b.collective is not None]
        if len(calls) == 2 and all(c.op == "all_reduce" and c.seq == 2 for c in calls):
            break
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the ranks never reached their collectives"
        time.sleep(0.2)
    time.sleep(6)  # they have waited 5 s or more (STOP_AFTER) when the launcher stops
    os.kill(proc.pid, signal.SIGTERM)


@pytest.mark.long  # eight launches at once (make test-long)
def test_a_mismatched_collective_stops_the_job_with_both_lines(launches):
    tmp, code, _, err, ended = launches["mismatch"]
    assert code == 1, err
    script = str(tmp / "job.py")
    a, b = line_of(MISMATCH, "# RANK 0"), line_of(MISMATCH, "# RANK 1")
    assert err.startswith(
        f"anydevice launch: rank 1 runs broadcast #4 at {script}:{b} while rank 0 runs "
        f"all_reduce #4 at {script}:{a}: the ranks call different collectives. The job was "
        "stopped"
    ), err
    assert "rank 0: in all_reduce #4 on float32[4]" in err
    assert ended - hang_started(tmp) < 60
    assert "makes no progress" not in err  # said once: as the launch's failure


@pytest.mark.long  # eight launches at once (make test-long)
def test_a_rank_stuck_before_a_collective_is_named_while_the_job_goes_on(launches):
    tmp, code, _, err, ended = launches["stall"]
    script = str(tmp / "job.py")
    stuck, waits = line_of(STALL, "# STUCK"), line_of(STALL, "# WAITS")
    live = next(line for line in err.splitlines() if "makes no progress" in line)
    assert live.startswith("anydevice: the job makes no progress: rank 1 has not reached"), err
    assert f"it is at {script}:{stuck} (`time.sleep(600)  # STUCK`)" in live
    assert err.count("makes no progress") == 1, err  # not repeated while it holds
    assert "rank 0: in all_reduce #2 on float32[1] for" in err and f"{script}:{waits}" in err
    assert "The job goes on" in err
    # Not stopped: it ended at its collectives' 15 s timeout, with the verdict again.
    assert code == 1, err
    failure = err[err.index("anydevice launch: ") :]
    assert failure.startswith("anydevice launch: Rank(s) 1 never arrived"), failure
    said = "What the ranks were doing (the hang watch): rank 1 has not reached all_reduce #2"
    assert said in failure, failure
    assert f"it is at {script}:{stuck} (`time.sleep(600)  # STUCK`)" in failure
    assert "progress again" not in err
    assert ended - hang_started(tmp) < 60


@pytest.mark.long  # eight launches at once (make test-long)
def test_a_rank_stuck_holding_the_gil_is_found_by_its_stack(launches):
    tmp, code, _, err, _ = launches["gil"]
    script = str(tmp / "job.py")
    stuck = line_of(GIL, "# STUCK")
    live = next(line for line in err.splitlines() if "makes no progress" in line)
    assert (
        "rank 1 has not reached all_reduce #2 for" in live
        and f"it is at {script}:{stuck} (`ctypes.PyDLL(None).read(os.pipe()[0], buf, 1)  # STUCK`)"
        in live
    ), err
    assert code == 1, err


@pytest.mark.long  # eight launches at once (make test-long)
def test_a_slow_rank_within_the_gaps_the_job_showed_is_not_judged(launches):
    _, code, out, err, _ = launches["slow"]
    assert code == 0, err
    assert sorted(out.split()) == ["0", "1", "DONE", "DONE"]
    assert "makes no progress" not in err, err


@pytest.mark.long  # eight launches at once (make test-long)
def test_a_rank_killed_while_waited_for_is_named_gone_in_the_failure(launches):
    tmp, code, out, err, ended = launches["kill"]
    assert code == 0, err
    import workers

    source = Path(workers.__file__).read_text()
    waits = line_of(source, "# WAITED IN")
    assert out.startswith("Rank 1 (local rank 1"), out
    assert "was killed by signal 9 (SIGKILL)" in out
    shown = os.path.relpath(workers.__file__)  # the launch ran in this working directory
    assert (
        f"What the ranks were doing (the hang watch): rank 0 waits in all_reduce #2 at "
        f"{shown}:{waits}; rank 1's process is gone (killed by SIGKILL)"
    ) in out, out
    assert ended - hang_started(tmp) < 60


@pytest.mark.long  # eight launches at once (make test-long)
def test_stopping_a_deadlocked_job_prints_the_deadlock_of_both_groups(launches):
    """Default --hang-after (30 s): the job is stopped (SIGTERM) before the watch would
    speak; the verdict of that moment is printed then."""
    tmp, code, _, err, _ = launches["deadlock"]
    assert code == 143, err
    script = str(tmp / "job.py")
    a, b = line_of(DEADLOCK, "# RANK 0"), line_of(DEADLOCK, "# RANK 1")
    assert (
        "anydevice: stopped by SIGTERM while the job made no progress: rank 0 waits in "
        f"all_reduce #2 of group 1 at {script}:{a} for rank 1, which waits in all_reduce #2 of "
        f"group 2 at {script}:{b} for rank 0: a deadlock between group 1 and group 2"
    ) in err, err
    assert err.rstrip().endswith("anydevice launch: stopped by SIGTERM; the workers were stopped.")


@pytest.mark.long  # eight launches at once (make test-long)
def test_two_nodes_stop_a_mismatch_with_one_verdict(launches):
    """The verdict covers the ranks of both nodes, and one node prints it."""
    ended = [launches["node0"], launches["node1"]]
    errs = [err for _, _, _, err, _ in ended]
    assert [code for _, code, *_ in ended] == [1, 1], errs
    stopped = "the ranks call different collectives. The job was stopped"
    said = [err for err in errs if stopped in err]
    assert len(said) == 1, errs
    script = ended[0][0].parent / "two_nodes.py"
    a, b = line_of(MISMATCH, "# RANK 0"), line_of(MISMATCH, "# RANK 1")
    assert (
        f"rank 1 runs broadcast #4 at {script}:{b} while rank 0 runs all_reduce #4 at {script}:{a}"
    ) in said[0]
    other = next(err for err in errs if err is not said[0])
    assert "The job was stopped by the hang watch of node" in other, other


# ----------------------------------------------------------------------------- parts


def test_the_node_that_stops_a_mismatch_waits_until_the_other_nodes_saw_it():
    """Else the other node's workers fail first of a lost peer, and its launch says that
    rather than who stopped the job (a real store, two nodes' watches)."""
    import threading

    import torch.distributed as dist

    from anydevice.launching.hangwatch import HangWatch
    from anydevice.launching.verdict import Verdict

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    finder, other = HangWatch(5.0), HangWatch(5.0)
    finder.join(store, 0, 2)
    other.join(store, 1, 2)
    found = Verdict("mismatch", "the ranks call different collectives", (), (), (1,), ("m",))
    assert finder._claim(found, finder._store)
    waited = threading.Thread(target=finder._await_heed, args=(finder._store,))
    waited.start()
    try:
        waited.join(timeout=1.0)
        assert waited.is_alive()  # the other node has not looked yet
        assert other._heed_others(other._store)
        assert other.stopped_by.startswith("node 0 (")
        waited.join(timeout=60)
        assert not waited.is_alive()  # it saw the other node heed its verdict
    finally:
        finder.stop()
        waited.join(timeout=60)


def test_a_rank_is_asked_for_its_stack_only_once_it_listens(tmp_path):
    """The live signal is a real-time one: a process without its handler (a worker still
    starting, before the runner installed it) is ended by it, not asked (rank 1 of a
    launch died of signal 37 so on a busy machine)."""
    from anydevice.launching import progress
    from anydevice.launching.hangwatch import HangWatch

    code = (
        "import faulthandler, sys, time\n"
        "from anydevice.launching import progress\n"
        "print('up', flush=True)\n"
        "sys.stdin.readline()\n"
        "dump = progress.live_stacks_file(sys.argv[1], 1)\n"
        "dump.parent.mkdir(parents=True, exist_ok=True)\n"
        "faulthandler.register(progress.LIVE_SIGNAL, file=dump.open('a'), all_threads=True)\n"
        "print('listening', flush=True)\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "up\n"
        watch = HangWatch(5.0, launch_dir=str(tmp_path))
        progress.live_stacks_file(tmp_path, 1).parent.mkdir(parents=True)
        assert watch._ask_stack(1, child.pid) is None
        time.sleep(0.5)
        assert child.poll() is None  # not ended by the signal
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "listening\n"
        assert progress.LIVE_SIGNAL is not None
        watch._ask_stack(1, child.pid)  # frames of a -c script are not a user's file
        assert child.poll() is None
        dumped = progress.live_stacks_file(tmp_path, 1).read_text()
        # the script's own frame: at its last print or already in time.sleep(600)
        assert re.search(r'File "<string>", line [89] in <module>', dumped), dumped
    finally:
        child.kill()
        child.wait(timeout=60)


def test_how_a_process_ended_is_read_while_it_is_a_zombie():
    from anydevice.launching.hangwatch import _ended

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _ended(child.pid) == "ended" and time.monotonic() < deadline:
            time.sleep(0.05)  # not reaped yet: a zombie, whose status /proc keeps
        assert _ended(child.pid) == "killed by SIGKILL"
    finally:
        child.wait(timeout=30)
    assert _ended(child.pid) == "ended"  # reaped: nothing left to read


def test_a_faulthandler_dump_gives_the_main_threads_frames_outermost_first(tmp_path):
    from anydevice.launching.hangwatch import _faulthandler_frames

    code = (
        "import faulthandler, sys, threading, time\n"
        "def inner():\n"
        "    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)\n"
        "def outer():\n"
        "    inner()\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "outer()\n"
    )
    script = tmp_path / "dumps.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True
    )
    frames = _faulthandler_frames(out.stdout)
    assert [(Path(f).name, line, name) for f, line, name in frames] == [
        ("dumps.py", 7, "<module>"),
        ("dumps.py", 5, "outer"),
        ("dumps.py", 3, "inner"),
    ]
