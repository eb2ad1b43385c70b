"""The /proc reader on real processes: this one, children with a launcher's variables, a
zombie, a process in its own PID namespace, another user's process, and processes that
end while the reader reads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from anydevice.hardware import processes
from anydevice.hardware.processes import ProcessReader

PY_SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def child():
    started: list[subprocess.Popen] = []

    def start(argv: list[str], **env: str) -> subprocess.Popen:
        p = subprocess.Popen(argv, env={**os.environ, **env})
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def wait_for(read, deadline_s: float = 60.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = read()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("not seen in time")


def test_this_process_is_read_deeply_with_libtorch_mapped():
    import torch  # noqa: F401  # mapped into this process now

    me = ProcessReader().sample(os.getpid(), deep=True)
    assert me is not None and me.deep and me.pid == os.getpid()
    assert me.ppid == os.getppid() and me.state in "RS"
    assert me.torch is True and me.rss and me.rss > 10 * 2**20
    with open("/proc/self/cmdline", "rb") as f:
        assert me.cmdline == tuple(a.decode() for a in f.read().split(b"\0") if a)
    assert me.ns_pids[0] == os.getpid() and me.container_pid is None
    assert set(me.environ or {}) <= set(processes.LAUNCH_VARIABLES)


def test_a_child_with_a_launchers_variables_is_a_rank_and_sleep_is_read_shallow(child):
    rank = child(PY_SLEEP, RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", TORCHELASTIC_RUN_ID="j7")
    other = child(["sleep", "120"], RANK="5")
    reader = ProcessReader()

    def read():
        scan = reader.scan()
        s = scan.samples.get(rank.pid)
        return scan if s is not None and s.cmdline and "time.sleep" in " ".join(s.cmdline) else None

    scan = wait_for(read)
    s = scan.samples[rank.pid]
    assert (s.launch.rank, s.launch.world_size, s.launch.local_rank) == (3, 8, 1)
    assert s.launch.run_id == "j7" and s.launch.launcher == "torchrun"
    assert s.torch is False  # a Python that never imported torch
    shallow = scan.samples[other.pid]
    assert not shallow.deep and shallow.environ is None  # not a Python: not looked into
    deep = reader.scan(wanted=[other.pid]).samples[other.pid]
    assert deep.deep and deep.launch.rank == 5  # a GPU's process is looked into by pid


def test_an_ended_process_is_none_and_a_zombie_is_read_shallow(child):
    p = child(["true"])
    deadline = time.monotonic() + 60
    reader = ProcessReader()
    while time.monotonic() < deadline:  # exited, not yet reaped: a zombie
        s = reader.sample(p.pid)
        if s is not None and s.state == "Z":
            break
        time.sleep(0.02)
    assert s is not None and s.state == "Z" and not s.deep
    p.wait(30)
    assert reader.sample(p.pid) is None


def test_a_process_in_its_own_pid_namespace_shows_its_pid_there(child):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (util-linux) for a PID namespace")
    outer = child(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "120"])
    reader = ProcessReader()

    def inner():
        scan = reader.scan()
        found = [s for s in scan.samples.values() if s.ppid == outer.pid and s.name == "sleep"]
        return found[0] if found else None

    s = wait_for(inner)
    deep = reader.sample(s.pid, deep=True)
    assert deep is not None and deep.ns_pids == (s.pid, 1) and deep.container_pid == 1
    assert processes.in_initial_pid_namespace() is True


def test_another_users_process_is_read_without_its_environment_and_maps(child, tmp_path):
    """A process this user may not look into (root's, read as nobody) is skipped in part:
    its name, state and CPU are read, its environment and maps are said unreadable."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to read as another user")
    target = child(PY_SLEEP, RANK="2", WORLD_SIZE="4")
    code = (
        "import json, sys; from anydevice.hardware.processes import ProcessReader; "
        f"s = ProcessReader().sample({target.pid}, deep=True); "
        "scan = ProcessReader().scan(); "
        "print(json.dumps([s.deep, s.environ, s.torch, list(s.unreadable), s.state, "
        "scan.unreadable]))"
    )
    out = subprocess.run(
        [
            "setpriv",
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    import json

    deep, environ, torch, unreadable, state, skipped = json.loads(out.stdout)
    assert deep and environ is None and torch is None and state in "RS"
    assert set(unreadable) >= {"environ", "maps"}
    assert skipped >= 1  # root's processes, nobody cannot look into them


def test_processes_that_end_while_a_scan_reads_never_break_it():
    stop = threading.Event()
    started = [0]

    def churn() -> None:
        while not stop.is_set():
            subprocess.run([sys.executable, "-S", "-c", "pass"], check=False)
            started[0] += 1

    spinner = threading.Thread(target=churn)
    spinner.start()
    reader = ProcessReader()
    try:
        end = time.monotonic() + 60
        scans = 0
        while (scans < 30 or started[0] < 5) and time.monotonic() < end:
            scan = reader.scan()
            assert all(pid == s.pid for pid, s in scan.samples.items())
            scans += 1
    finally:
        stop.set()
        spinner.join(60)
    assert scans >= 30 and started[0] >= 5


def test_a_busy_process_has_a_cpu_share(child):
    busy = child([sys.executable, "-c", "while True: pass"])
    reader = ProcessReader()
    first = wait_for(lambda: reader.sample(busy.pid, deep=False))

    def later():
        s = reader.sample(busy.pid, deep=False)
        return s if s is not None and s.cpu_ticks > first.cpu_ticks else None

    second = wait_for(later)
    share = processes.cpu_percent(first, second)
    assert share is not None and share > 0
    assert processes.cpu_percent(None, second) is None
    assert processes.cpu_percent(second, second) is None  # no time between them


def test_psutil_reads_the_same_processes_where_there_is_no_proc(child):
    p = child(PY_SLEEP, RANK="1")
    scan = wait_for(lambda: (s := processes._psutil_scan({p.pid})).samples.get(p.pid) and s)
    s = scan.samples[p.pid]
    assert s.deep and s.launch.rank == 1 and s.ppid == os.getpid()
    assert s.cmdline is not None and s.cmdline[-1] == "import time; time.sleep(120)"
