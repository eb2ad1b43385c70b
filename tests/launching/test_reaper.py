"""Nothing outlives a launch, and a preemption gets its grace: real launches whose workers
start processes of their own (a child, a double-forking daemon, a child in a session of
its own), ended however the launch ends; and a save slower than torch's 5 s stop that
still completes after SIGTERM to the launcher. Every process is bounded in time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ranks import finish_job, process_tree_guard, start_job, still_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


#: Each rank starts three processes that would outlive it (sleep 600 s each: far longer than
#: any launch, on however busy a machine, so a launch held open by them times out), writes their
#: pids, says so, then ends as argv[2] says: "exit" (0), or "wait" to be stopped.
KIDS = """\
import os, subprocess, sys, time
folder, how = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]
pids = [subprocess.Popen(["sleep", "600"]).pid,
        subprocess.Popen(["sleep", "600"], start_new_session=True).pid]
r, w = os.pipe()
if os.fork() == 0:  # a daemon: fork, new session, fork again, the parent exits
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        time.sleep(600)
    os._exit(0)
os.close(w)
pids.append(int(os.read(r, 32)))
with open(os.path.join(folder, f"rank{rank}.tmp"), "w") as f:
    f.write(" ".join(map(str, pids)))
os.replace(os.path.join(folder, f"rank{rank}.tmp"), os.path.join(folder, f"rank{rank}.pids"))
print("started", rank, flush=True)
if how == "wait":
    time.sleep(120)
"""

#: Saves for longer than torch's 5 s stop when the launcher is told to stop.
SLOW_SAVE = """\
import os, sys, time
import anydevice as ad

def save():
    time.sleep(float(sys.argv[2]))  # 8 s: longer than torch's agent gives a stopped worker
    with open(os.path.join(sys.argv[1], f"saved{os.environ['RANK']}"), "w") as f:
        f.write(str(time.time()))

with ad.distributed(timeout=60, on_preempt=save) as d:
    with open(os.path.join(sys.argv[1], f"rank{d.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    d.barrier()
    if d.is_main:
        print("training", flush=True)
    for _ in range(100_000):
        time.sleep(0.05)
        d.check_preemption()
"""


def _grandchildren(folder: Path, ranks: int, proc: subprocess.Popen[str]) -> list[int]:
    deadline = time.monotonic() + 150
    while len(list(folder.glob("*.pids"))) < ranks:
        assert time.monotonic() < deadline, "the workers did not start"
        if proc.poll() is not None and len(list(folder.glob("*.pids"))) < ranks:
            raise AssertionError(proc.communicate())
        time.sleep(0.1)
    return [int(p) for f in folder.glob("*.pids") for p in f.read_text().split()]


def _kill(pids: list[int]) -> None:
    for pid in still_running(pids):
        os.kill(pid, signal.SIGKILL)


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while still_running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return still_running(pids)


def test_a_launch_piped_to_cat_ends_with_its_workers_and_ends_what_they_started(tmp_path):
    """`anydevice launch -n 2 kids.py | cat`: each worker leaves three sleep-600 processes
    (a child, one in its own session, a double-forked daemon). The pipeline used to end
    only when they did; now it ends with the launch, which says it ended 6."""
    script = tmp_path / "kids.py"
    script.write_text(KIDS)
    folder = tmp_path / "pids"
    folder.mkdir()
    line = f"{sys.executable} -m anydevice launch -n 2 {script} {folder} exit | cat"
    proc = start_job(["bash", "-o", "pipefail", "-c", line], tmp_path)
    left: list[int] = []
    try:
        out, err = proc.communicate(timeout=150)  # the sleeps would hold it open for 600 s
        left = [int(p) for f in folder.glob("*.pids") for p in f.read_text().split()]
        assert proc.returncode == 0, err
        assert len(left) == 6, (out, err)
        assert _gone_within(left, 30) == [], "processes the workers started outlived the launch"
        assert "ended them" in err and "6 process(es): sleep ×4" in err, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        _kill(left)


def test_sigkill_to_the_launcher_leaves_nothing_the_workers_started(tmp_path):
    """The launcher killed outright: its guardian ends the workers and what they started."""
    script = tmp_path / "kids.py"
    script.write_text(KIDS)
    folder = tmp_path / "pids"
    folder.mkdir()
    argv = [sys.executable, "-m", "anydevice", "launch", "-n", "2", str(script), str(folder)]
    proc = start_job([*argv, "wait"], tmp_path)
    kids: list[int] = []
    try:
        with process_tree_guard():
            kids = _grandchildren(folder, 2, proc)
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
            assert _gone_within(kids, 60) == [], "the guardian left what the workers started"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        _kill(kids)


#: Each rank starts daemons without end, one every 20 ms: fork, new session, fork again,
#: exec `sleep 60` with an empty environment (nothing marks it as the launch's), the
#: parent exits. Each daemon's pid is written first; each holds the launch's stdout.
DAEMONS = """\
import os, sys, time
folder = sys.argv[1]
rank = os.environ["RANK"]
n = 0
while True:
    n += 1
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            path = os.path.join(folder, f"{rank}-{n}")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path + ".pid")
            os.execve("/bin/sleep", ["sleep", "60"], {})
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(0.02)
"""


@pytest.mark.long  # launches and waits of a minute (make test-long)
def test_sigkill_to_the_launcher_ends_daemons_started_with_an_empty_environment(tmp_path):
    """SIGKILL to the launcher while both workers keep starting daemons that nothing
    marks: those started since the guardian's last look went to init and lived on (4 of
    12), holding the launch's stdout open. Now the workers stop as the launcher dies, and
    the guardian ends their whole trees: the output ends, and no daemon is left."""
    script = tmp_path / "daemons.py"
    script.write_text(DAEMONS)
    folder = tmp_path / "pids"
    folder.mkdir()
    argv = [sys.executable, "-m", "anydevice", "launch", "-n", "2", str(script), str(folder)]
    proc = start_job(argv, tmp_path)
    daemons: list[int] = []
    workers: list[int] = []
    try:
        with process_tree_guard():
            deadline = time.monotonic() + 150
            while len({p.name[0] for p in folder.glob("*.pid")}) < 2:  # both ranks at it
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the workers did not start"
                time.sleep(0.1)
            time.sleep(1)  # many daemons, some started since the guardian's last look
            workers = [c.pid for c in psutil.Process(proc.pid).children() if "daemons.py"
                       in " ".join(c.cmdline())]  # fmt: skip
            os.kill(proc.pid, signal.SIGKILL)
            try:  # until every holder of the launch's stdout and stderr is gone
                proc.communicate(timeout=30)
                held = ""
            except subprocess.TimeoutExpired:
                held = "the launch's output was still held open 30 s after the launcher died"
            daemons = [int(p.read_text()) for p in folder.glob("*.pid")]
            assert len(daemons) >= 10, daemons
            left = _gone_within(daemons + workers, 15)
            assert not held, held
            assert left == [], f"{len(left)} of {len(daemons)} daemons outlived the launch"
            assert len(workers) == 2
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        _kill(daemons + [int(p.read_text()) for p in folder.glob("*.pid")] + workers)


@pytest.mark.long  # launches and waits of a minute (make test-long)
def test_sigterm_to_the_launcher_gives_a_slow_save_its_grace_and_reports_a_preemption(
    tmp_path,
):
    """on_preempt takes 8 s: torch's agent stopped the workers 5 s after the signal, and no
    checkpoint was left. Now they get --grace (here 300 s, far more than the save takes on
    a busy machine), both save, and the launch ends when they do, not when the grace does."""
    script = tmp_path / "job.py"
    script.write_text(SLOW_SAVE)
    argv = [sys.executable, "-m", "anydevice", "launch", "-n", "2", "--grace", "300", str(script),
            str(tmp_path)]  # fmt: skip
    proc = start_job([*argv, "8"], tmp_path)
    try:
        _wait_for_training(proc)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert sorted(p.name for p in tmp_path.glob("saved*")) == ["saved0", "saved1"], err
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert 8 <= took < 90, took  # the save's 8 s, not the 300 s grace
    assert "Preempt" in err or "preempt" in err, err
    assert "no Python traceback" not in err, err
    assert (  # where the grace is set, in both spellings
        "waiting up to 300 s for the workers to exit (ad.launch(grace=...), anydevice launch "
        "--grace); a second signal stops them now." in err
    ), err


#: Rank 1 closes its stdout, then prints; rank 0 waits for it in a barrier.
CLOSED_STDOUT = """\
import os
import anydevice as ad

def report_progress():
    print("progress", flush=True)

with ad.distributed(timeout=20) as d:
    if d.rank == 1:
        os.close(1)
        report_progress()
    d.barrier()
"""


def test_the_rank_that_failed_first_is_named_with_its_own_error_and_pid_and_frames(tmp_path):
    """Rank 1's print to a closed stdout fails first; rank 0 fails after it, waiting. The
    report blames rank 1 with its OSError (it was hidden behind "also failed after it"),
    gives its pid, and its traceback starts at the user's frames, not the runner's."""
    script = tmp_path / "closed.py"
    script.write_text(CLOSED_STDOUT)
    argv = [sys.executable, "-m", "anydevice", "launch", "-n", "2", str(script)]
    proc = start_job(argv, tmp_path)
    _, _, err = finish_job(proc, 150)
    assert proc.returncode == 1, err
    summary = err[err.index("anydevice launch: ") :]
    head = r"anydevice launch: Rank 1 \(local rank 1, pid \d+\) raised: OSError: .*Bad file"
    assert re.match(head, summary), summary
    trace = summary[summary.index("Traceback") :]
    frames = [line for line in trace.splitlines() if line.strip().startswith("File ")]
    assert frames and str(script) in frames[0], trace
    assert not any("runpy" in f or "anydevice/launching" in f for f in frames), trace


def _wait_for_training(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + 150
    for line in proc.stdout:  # the workers run
        if "training" in line or time.monotonic() > deadline:
            return


def test_a_preemption_signal_to_one_rank_is_reported_as_a_preemption(tmp_path):
    """SIGTERM to rank 1 alone: both ranks save and exit 143. It was reported as "Rank 0
    ... exited with code 143. It left no Python traceback"."""
    script = tmp_path / "job.py"
    script.write_text(SLOW_SAVE)
    argv = [sys.executable, "-m", "anydevice", "launch", "-n", "2", str(script), str(tmp_path)]
    proc = start_job([*argv, "0"], tmp_path)
    try:
        _wait_for_training(proc)
        os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert sorted(p.name for p in tmp_path.glob("saved*")) == ["saved0", "saved1"], err
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "preempted: SIGTERM reached rank(s) 1" in err, err
    assert "on_preempt ran on rank(s) 0, 1" in err, err
    assert "no Python traceback" not in err, err


#: ad.launch whose worker starts a daemon that execs with the worker's descriptors
#: (close_fds=False, as a fork + exec does): the launch must see the worker end.
AD_DAEMON = """\
import subprocess, sys, time
import anydevice as ad

def work(rank_file):
    subprocess.Popen(["sleep", "600"], close_fds=False, start_new_session=True)
    return 1

if __name__ == "__main__":
    t = time.monotonic()
    print(ad.launch(work, "x", nprocs=1, timeout=60), round(time.monotonic() - t), flush=True)
"""


def test_ad_launch_sees_its_worker_end_although_a_daemon_it_started_runs_on(tmp_path):
    """The daemon inherited the pipe whose closing tells ad.launch its worker ended, so
    the launch waited for the daemon (here 600 s: the wait below ends first); it now returns
    when the worker does, and the daemon is ended with the launch."""
    script = tmp_path / "daemon.py"
    script.write_text(AD_DAEMON)
    proc = start_job([sys.executable, str(script)], tmp_path)
    _, out, err = finish_job(proc, 150)
    assert proc.returncode == 0, err
    result, took = out.split("}")[0] + "}", int(out.split("}")[1])
    assert result == "{0: 1}", out
    assert took < 150, f"ad.launch waited {took} s: for the daemon, not the worker"
    assert "ended them" in err, err
