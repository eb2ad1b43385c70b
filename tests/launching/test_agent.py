"""Launches under faults, with real processes: what listens, what a dying launcher leaves,
how long each failure takes to surface, and whom the report blames.

Each launch costs seconds of torch imports per process, so one launch serves several
assertions (module-scoped fixtures), and launches that do not depend on each other run
side by side. Every process is bounded in time; the guard fails a test that leaves one.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import anydevice as ad
import workers
from anydevice.launching.failures import flight_summary, is_consequence, read_stacks, record
from ranks import finish_job, free_port, launch_job, process_tree_guard, start_job, still_running

#: Launches side by side on a loaded machine can take minutes to import torch everywhere;
#: each process is bounded by its own, tighter, timeout below.
pytestmark = pytest.mark.timeout(300)

#: Rank 0 lists what the launcher and every process under it listen on; rank 1 then
#: never reaches the all_reduce that ranks 0 and 2 wait in, under a 10 s timeout.
HANG = """\
import json, os, time
import psutil, torch
import anydevice as ad

with ad.distributed(timeout=10) as d:
    if d.rank == 0:
        launcher = psutil.Process(os.getppid())
        tree = [launcher, *launcher.children(recursive=True)]
        found = {
            (c.laddr.ip, c.laddr.port)
            for p in tree
            for c in p.net_connections("inet")
            if c.status == psutil.CONN_LISTEN
        }
        print("LISTENING", json.dumps(sorted(found)), flush=True)
    d.barrier()
    if d.rank == 1:
        time.sleep(600)  # HANGS HERE
    ad.all_reduce(torch.ones(1))
"""

#: Each worker says where it is, then waits to be stopped.
SLEEP = """\
import os, sys, time
path = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
time.sleep(600)
"""

#: Rank 1 raises; rank 0 waits for it in a barrier.
RAISE = """\
import anydevice as ad
with ad.distributed(timeout=60) as d:
    if d.rank == 1:
        raise ZeroDivisionError("rank one divides by zero")
    d.barrier()
"""

#: ad.launch where rank 1 raises, in a process of its own (with its own TMPDIR).
AD_RAISE = """\
import sys
sys.path.insert(0, {tests!r})
import anydevice as ad, workers
if __name__ == "__main__":
    try:
        ad.launch(workers.fail_on, 1, nprocs=2, timeout=60)
    except ad.WorkerFailedError as e:
        print(e.rank, e.traceback.count("injected failure on rank 1"), flush=True)
"""

#: ad.launch where rank 1 of 3 hangs, in a process of its own.
AD_HANG = """\
import sys
sys.path.insert(0, {tests!r})
import anydevice as ad, workers
if __name__ == "__main__":
    try:
        ad.launch(workers.hang_on, 1, nprocs=3, timeout=60)
    except ad.WorkerFailedError as e:
        print(e.rank, flush=True)
        print(e, flush=True)
"""

#: ad.launch in a process of its own, reporting how it ended.
AD_LAUNCH = """\
import sys
sys.path.insert(0, {tests!r})
import anydevice as ad, workers
if __name__ == "__main__":
    try:
        ad.launch(workers.sleep_forever, sys.argv[1], nprocs=1, timeout=60)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
        sys.exit(7)
"""


@pytest.fixture(autouse=True)
def no_process_left_behind():
    with process_tree_guard():
        yield


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds waited); the whole session is killed on timeout."""
    t = time.perf_counter()
    return (*finish_job(proc, timeout), time.perf_counter() - t)


def wait_for_pids(folder: Path, count: int, proc: subprocess.Popen[str]) -> list[int]:
    deadline = time.monotonic() + 120
    while len(list(folder.glob("*.pid"))) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)
    return [int(p.read_text()) for p in folder.glob("*.pid")]


def left_behind(tmp: Path, grace: float = 5.0) -> list[str]:
    """What is still in ``tmp`` after ``grace`` seconds (the pid files aside)."""
    deadline = time.monotonic() + grace
    while True:
        left = sorted(p.name for p in tmp.iterdir() if p.name != "pids")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# ----------------------------------------------------------------------------- a hung rank


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    """``anydevice launch -n 3`` and ``ad.launch(nprocs=3)`` side by side, where rank 1
    never reaches the collective that ranks 0 and 2 wait in."""
    tmp = tmp_path_factory.mktemp("hung")
    script = tmp / "hang.py"
    script.write_text(HANG)
    driver = tmp / "driver.py"
    driver.write_text(AD_HANG.format(tests=str(Path(__file__).parents[1])))
    cli, api = tmp / "cli", tmp / "api"
    cli.mkdir()
    api.mkdir()
    with process_tree_guard():
        procs = [
            launch_job(cli, "-n", "3", str(script)),
            start_job([sys.executable, str(driver)], api),
        ]
        (code, out, err, took), in_python = (finish(p, timeout=150) for p in procs)
    return {
        "code": code, "out": out, "err": err, "took": took, "tmp": cli, "script": script,
        "api": in_python, "api_tmp": api,
    }  # fmt: skip


@pytest.mark.slow
def test_a_standalone_launch_listens_on_loopback_only(hung):
    line = next(x for x in hung["out"].splitlines() if x.startswith("LISTENING"))
    listening = json.loads(line.split(" ", 1)[1])
    assert len(listening) >= 2, listening  # the rendezvous store, the workers' store, gloo
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening


@pytest.mark.slow
def test_a_hung_rank_is_named_with_where_it_hangs(hung):
    err = hung["err"]
    assert hung["code"] == 1, err
    summary = err[err.index("anydevice launch: ") :]
    assert summary.startswith("anydevice launch: Rank(s) 1 never arrived: rank(s) 0, 2 waited")
    assert "Timed out waiting" in summary
    line = 1 + HANG.splitlines().index("        time.sleep(600)  # HANGS HERE")
    assert f'File "{hung["script"]}", line {line} in <module>' in summary
    assert "Also failed" not in summary  # 0 and 2 are named as the ones that waited


@pytest.mark.slow
def test_ad_launch_names_a_hung_rank_too(hung):
    code, out, err, _ = hung["api"]
    assert code == 0, err
    rank, message = out.split("\n", 1)
    assert rank == "1"
    assert message.startswith("Rank(s) 1 never arrived: rank(s) 0, 2 waited")
    line = 1 + inspect.getsource(workers).splitlines().index(
        "            time.sleep(600)  # HANGS HERE"
    )
    assert f'workers.py", line {line} in hang_on' in message
    assert left_behind(hung["api_tmp"]) == []


@pytest.mark.slow
def test_a_failed_launch_prints_the_summary_alone(hung):
    err = hung["err"]
    assert "W1123" not in err and "E1123" not in err
    assert not any(line[:1] in "WEI" and line[1:5].isdigit() for line in err.splitlines())
    assert "Traceback" not in err  # no rank's own traceback: the summary has the story
    assert err.startswith("anydevice launch: ")


@pytest.mark.slow
def test_a_failed_launch_leaves_nothing_behind(hung):
    assert left_behind(hung["tmp"]) == []


# ----------------------------------------------------------------------------- the launcher dies


@pytest.mark.slow
def test_the_launcher_killed_or_stopped_takes_every_worker_with_it(tmp_path):
    """SIGKILL, SIGTERM and SIGINT to `anydevice launch`, and SIGINT to ad.launch, side
    by side: every worker ends within 5 s, the launcher's last line says how it ended,
    nothing is left."""
    script = tmp_path / "sleep.py"
    script.write_text(SLEEP)
    driver = tmp_path / "driver.py"
    driver.write_text(AD_LAUNCH.format(tests=str(Path(__file__).parents[1])))
    runs = {}
    for name, argv in {
        "SIGKILL": ["launch", "-n", "2"],
        "SIGTERM": ["launch", "-n", "1"],
        "SIGINT": ["launch", "-n", "1"],
    }.items():
        folder = tmp_path / name
        (folder / "pids").mkdir(parents=True)
        proc = start_job(
            [sys.executable, "-m", "anydevice", *argv, str(script), str(folder / "pids")],
            folder,
        )
        runs[name] = (folder, proc, 2 if name == "SIGKILL" else 1)
    api = tmp_path / "api"
    (api / "pids").mkdir(parents=True)
    in_python = start_job([sys.executable, str(driver), str(api / "pids")], api)
    pids = {
        name: wait_for_pids(folder / "pids", n, proc) for name, (folder, proc, n) in runs.items()
    }
    api_workers = wait_for_pids(api / "pids", 1, in_python)
    for name, (_, proc, _) in runs.items():
        os.kill(proc.pid, getattr(signal, name))
    os.kill(in_python.pid, signal.SIGINT)
    ended = {name: finish(proc, timeout=30) for name, (_, proc, _) in runs.items()}
    api_code, api_out, api_err, _ = finish(in_python, timeout=30)

    code, _, err, took = ended["SIGKILL"]
    assert code == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while still_running(pids["SIGKILL"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert still_running(pids["SIGKILL"]) == [], "workers outlived the launcher by 5 s"
    assert "leaked semaphore" not in err
    for name, expected in (("SIGTERM", 143), ("SIGINT", 130)):
        code, _, err, took = ended[name]
        assert code == expected, err
        # The last line says how it ended. A loaded machine may print the grace line first
        # (the worker took over a second to exit); nothing else, and no traceback.
        *before, last = err.strip().splitlines()
        assert last.startswith(
            f"anydevice launch: {'stopped by SIGTERM' if expected == 143 else 'interrupted'}"
        ), err
        assert all(line.startswith("anydevice: waiting up to 30 s") for line in before), err
        assert still_running(pids[name]) == []
        assert took < 15
    assert (api_code, api_out.strip()) == (7, "KeyboardInterrupt"), api_err
    assert still_running(api_workers) == []
    for name, (folder, _, _) in runs.items():
        assert left_behind(folder) == [], name
    assert left_behind(api) == []


# ----------------------------------------------------------------------------- timeouts


@pytest.mark.slow
def test_an_unreachable_rendezvous_fails_within_the_timeout():
    t = time.perf_counter()
    with pytest.raises(ad.DistributedTimeoutError, match="Cannot reach the rendezvous") as info:
        ad.launch(
            workers.sleep_forever,
            nprocs=1,
            nnodes=2,
            node_rank=1,
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            timeout=10,
        )
    elapsed = time.perf_counter() - t
    # torch's own store client took 2x the timeout; 10 s of slack for a busy machine
    assert 9 <= elapsed < 2 * 10, elapsed
    assert "within 10 s" in str(info.value)


# ----------------------------------------------------------------------------- the root cause


@pytest.mark.slow
def test_the_raising_rank_is_named_in_every_run(tmp_path):
    """A CLI launch and an ad.launch side by side, where rank 1 raises and rank 0
    waits in a barrier: each names rank 1, however the monitor saw the failures arrive,
    and none leaves a file in its TMPDIR (torch's ``pytorch-errorfile-*.pickle``)."""
    script = tmp_path / "raise.py"
    script.write_text(RAISE)
    driver = tmp_path / "driver.py"
    driver.write_text(AD_RAISE.format(tests=str(Path(__file__).parents[1])))
    folders = [tmp_path / "cli", tmp_path / "api"]
    for folder in folders:
        folder.mkdir()
    procs = [launch_job(folders[0], "-n", "2", str(script))]
    in_python = start_job([sys.executable, str(driver)], folders[1])
    for proc in procs:
        code, _, err, _ = finish(proc, timeout=120)
        assert code == 1, err
        assert err.startswith("anydevice launch: Rank 1 (local rank 1"), err
        assert "ZeroDivisionError: rank one divides by zero" in err
        assert err.count("Traceback") == 1  # the summary's, no worker's own
    code, out, err, _ = finish(in_python, timeout=120)
    assert (code, out.split()) == (0, ["1", "1"]), err
    for folder in folders:
        assert left_behind(folder, grace=0) == [], folder


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.real_gpu("NCCL ranks: collectives on the simulated GPUs are refused")
def test_a_hung_rank_under_nccl_is_named_with_the_flight_recorder():
    if len(ad.devices("cuda")) < 2:
        pytest.skip("needs two GPUs for two NCCL ranks")
    with pytest.raises(ad.WorkerFailedError) as info:
        ad.launch(workers.hang_on_device, 1, nprocs=2, timeout=120)
    message = str(info.value)
    assert message.startswith("Rank(s) 1 never arrived: rank(s) 0 waited"), message
    assert "NCCL flight recorder, the last collective of each rank:" in message
    assert "in hang_on_device" in message  # rank 1's stack


# ----------------------------------------------------------------------------- pure parts


def test_errors_of_a_peer_are_consequences_and_a_users_are_not():
    gone = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    assert is_consequence(gone)
    assert is_consequence(ad.DistributedTimeoutError("did not join"))
    wrapped = ValueError("while syncing")
    wrapped.__cause__ = gone
    assert is_consequence(wrapped)
    assert not is_consequence(ZeroDivisionError("division by zero"))


def test_the_first_record_of_a_worker_is_kept(tmp_path):
    path = tmp_path / "error.json"
    try:
        raise ValueError("first")
    except ValueError as e:
        wrote = record(e, str(path))
    assert wrote
    assert not record(RuntimeError("Connection closed by peer"), str(path))
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "ValueError: first"
    assert "raise ValueError" in data["message"]["extraInfo"]["py_callstack"]
    assert data["anydevice"]["consequence"] is False
    assert abs(data["anydevice"]["time"] - time.time()) < 60


def test_stacks_show_the_stopped_thread(tmp_path):
    dump = tmp_path / "rank1.txt"
    dump.write_text(
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/x/threading.py", line 10 in wait\n\n'
        "Current thread 0x00007f02 (most recent call first):\n"
        '  File "/x/train.py", line 7 in <module>\n'
    )
    assert read_stacks(dump).splitlines()[1] == '  File "/x/train.py", line 7 in <module>'
    assert read_stacks(tmp_path / "missing.txt") == ""


def test_flight_recorder_dumps_name_the_rank_behind(tmp_path):
    def dump(rank: int, seqs: list[int]) -> None:
        entries = [
            {"collective_seq_id": s, "profiling_name": "nccl:all_reduce", "state": "completed"}
            for s in seqs
        ]
        (tmp_path / f"rank{rank}").write_bytes(pickle.dumps({"entries": entries}))

    dump(0, [1, 2, 3])
    dump(1, [1, 2])
    dump(2, [1, 2, 3])
    (tmp_path / "rank3").write_bytes(b"cut short")
    lines = flight_summary(tmp_path)
    assert "  rank 1: #2 nccl:all_reduce (completed)" in lines
    assert lines[-1] == "  rank(s) 1 are behind the others."
    assert flight_summary(tmp_path / "none") == []
