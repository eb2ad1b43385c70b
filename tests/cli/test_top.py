"""``anydevice top`` on real jobs: a 2-rank ``anydevice launch`` on the CPU and one on the
simulated accelerator are listed with their ranks, job and steps per second; a SIGSTOPped
rank shows as stalled; a killed job's heartbeats are flagged as left behind. Also: its
keys in a real terminal (a pty), another user's view, unknown flags, plain output.

Each job is launched as users launch it, in its own session, and ``top`` is run as a
separate command with the same heartbeat folder (a temporary one, so other tests' jobs
on this machine are not in the way)."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ranks import process_tree_guard

#: A training loop as users write it: ad.distributed, a DeviceLoader, work on the device.
WORKER = """
import time, torch, anydevice as ad
with ad.distributed() as d:
    data = torch.utils.data.DataLoader(range(1_000_000), batch_size=4)
    x = torch.zeros(1024, device=d.device)
    for batch in ad.DeviceLoader(data, d.device):
        x += batch.sum().to(x.device)
        time.sleep(0.05)
"""


@pytest.fixture
def no_process_left_behind():
    with process_tree_guard():
        yield


def top_json(env: dict[str, str], *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "anydevice", "top", "--once", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.splitlines()
    return json.loads(line)


def wait_for(env: dict[str, str], test, what: str, timeout: float = 240.0, *, job=None):
    """Run ``top --once --json`` until ``test(record)`` holds; the record. A launch
    (``job``) that ends meanwhile fails at once, with what it said."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if job is not None and job.poll() is not None:
            raise AssertionError(f"the launch ended ({job.returncode}): {job.stderr.read()}")
        last = top_json(env)
        if test(last):
            return last
        time.sleep(0.5)
    raise AssertionError(f"{what}: not seen within {timeout} s; last reading:\n{last}")


def ranks_of(record: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {p["rank"]: p for p in record["processes"] if p["role"] == "rank"}


def stepping(record: dict[str, Any]) -> bool:
    ranks = ranks_of(record)
    return set(ranks) == {0, 1} and all(
        p["progress"] and p["progress"]["steps"] >= 3 and p["progress"]["steps_per_second"] > 0
        for p in ranks.values()
    )


def launch(tmp_path: Path, *head: str, env: dict[str, str]) -> subprocess.Popen[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(WORKER))
    return subprocess.Popen(
        [sys.executable, "-m", "anydevice", "launch", "-n", "2", *head, str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=tmp_path,
        env={**{k: v for k, v in os.environ.items() if k != "ANYDEVICE_DEVICE"}, **env},
    )


def stop_all(proc: subprocess.Popen[str], pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(60)
    assert proc.stderr is not None
    proc.stderr.close()
    deadline = time.monotonic() + 60
    while any(_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # the launcher's guardian reaps the workers


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_cpu_launch_is_listed_then_a_stopped_rank_stalls_then_the_killed_job_is_flagged(
    tmp_path, no_process_left_behind
):
    env = {"ANYDEVICE_HEARTBEAT_DIR": str(tmp_path / "beats"), "ANYDEVICE_DEVICE": "cpu"}
    proc = launch(tmp_path, env=env)
    pids: list[int] = []
    try:
        first = wait_for(env, stepping, "two ranks stepping", job=proc)
        ranks = ranks_of(first)
        pids = [ranks[0]["pid"], ranks[1]["pid"]]
        assert {p["world_size"] for p in ranks.values()} == {2}
        assert ranks[0]["job"] == ranks[1]["job"] and ranks[0]["job"]
        assert {p["launcher"] for p in ranks.values()} == {"anydevice"}
        assert all(p["progress"]["step_unit"] == "batch" for p in ranks.values())
        assert all(p["device_names"] == ["cpu"] for p in ranks.values())
        (job,) = [j for j in first["jobs"] if j["key"] == ranks[0]["job_key"]]
        assert [r["rank"] for r in job["ranks"]] == [0, 1] and job["missing"] == []
        assert job["launcher_pid"] == proc.pid and job["steps_per_second"][0] > 0
        only = top_json(env, "--only", "1", "--job", ranks[0]["job"][:6])
        assert [p["rank"] for p in only["processes"]] == [1]

        os.kill(pids[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        stalled = wait_for(
            env, lambda r: ranks_of(r)[1]["status"] == "stalled", "rank 1 stalled", job=proc
        )
        row = ranks_of(stalled)[1]
        assert row["state"] == "stopped" and row["stalled_for"] is not None
        (job,) = [j for j in stalled["jobs"] if j["key"] == ranks[0]["job_key"]]
        assert job["stalled"] == [1]
        print(f"rank 1 seen stalled {time.monotonic() - stopped_at:.1f} s after SIGSTOP")

        stop_all(proc, pids)
        left = wait_for(
            env,
            lambda r: {x["pid"] for x in r["leftovers"] if x["kind"] == "record"} >= set(pids),
            "the killed ranks' heartbeats flagged",
        )
        flagged = {x["pid"]: x for x in left["leftovers"]}
        assert [flagged[p]["rank"] for p in pids] == [0, 1]
        assert {flagged[p]["job"] for p in pids} == {ranks[0]["job"]}
        assert all(p not in {q["pid"] for q in left["processes"]} for p in pids)
        # --prune removes them; read-only otherwise: they are still there until then.
        assert len(list((tmp_path / "beats").glob("*.beat"))) >= 2
        subprocess.run(
            [sys.executable, "-m", "anydevice", "top", "--once", "--json", "--prune"],
            capture_output=True,
            timeout=120,
            env={**os.environ, **env},
            check=True,
        )
        assert [x for x in top_json(env)["leftovers"] if x["pid"] in pids] == []
    finally:
        stop_all(proc, pids)


@pytest.mark.slow
@pytest.mark.timeout(600)  # the simulator may be built first (cached by content)
def test_a_launch_on_the_simulated_accelerator_lists_its_device_and_memory(
    tmp_path, no_process_left_behind
):
    # python -m anydevice.testing sets ANYDEVICE_DEVICE=sim in each worker (the launcher
    # itself has no simulator: it must not be told to use one); --no-cuda: under its own
    # name (shown as CUDA, the ranks would ask for NCCL, which a CPU torch lacks)
    env = {"ANYDEVICE_HEARTBEAT_DIR": str(tmp_path / "beats")}
    proc = launch(tmp_path, "-m", "anydevice.testing", "--no-cuda", env=env)
    pids: list[int] = []
    try:
        record = wait_for(env, stepping, "two simulator ranks stepping", timeout=400, job=proc)
        ranks = ranks_of(record)
        pids = [ranks[0]["pid"], ranks[1]["pid"]]
        assert all(p["device_names"] == ["sim:0"] for p in ranks.values())
        for p in ranks.values():
            g = p["progress"]
            assert g["allocated"] >= 4096 and g["reserved"] >= g["allocated"]
            assert g["peak"] >= g["allocated"]
        (device,) = [d for d in record["devices"] if d["torch_name"] == "sim:0"]
        assert device["source"] == "heartbeat" and device["memory_used"] > 0
        assert {u["pid"] for u in device["processes"]} == set(pids)
        on_sim = top_json(env, "--device", "sim")
        assert {p["pid"] for p in on_sim["processes"]} == set(pids)
        assert top_json(env, "--device", "cuda:0")["processes"] == []
    finally:
        stop_all(proc, pids)


# ----------------------------------------------------------------------------- keys


def _pty_top(*args: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 220, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "anydevice", "top", "--interval", "0.5", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        # The terminal's own size (220 columns), not a COLUMNS another test left behind:
        # a narrower screen wraps the question in two lines.
        env={
            **{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
            "TERM": "xterm",
            **env,
        },
        start_new_session=True,
    )
    os.close(slave)
    return proc, master


def _read_until(master: int, needle: bytes, timeout: float = 120) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
    assert needle in seen, f"{needle!r} not shown; the screen ended with {seen[-2000:]!r}"
    return seen


@pytest.fixture
def victim(tmp_path):
    """A Python process that looks like rank 0 of a job of its own (``victim.job``: tests
    running side by side have their own), to be signalled."""
    job = f"victim-{uuid.uuid4().hex[:8]}"
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)"],
        env={**os.environ, "RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": job},
    )
    p.job = job  # type: ignore[attr-defined]
    yield p
    if p.poll() is None:
        p.kill()
    p.wait(30)


def test_keys_are_read_when_a_reading_takes_longer_than_the_interval(tmp_path):
    """A loaded machine makes a reading outlast --interval: the keys must still be read
    (they were not: the wait for keys was skipped, and q never quit)."""
    proc, master = _pty_top("--interval", "1e-9", env={"ANYDEVICE_HEARTBEAT_DIR": str(tmp_path)})
    try:
        _read_until(master, b"q quit")
        os.write(master, b"q")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        os.close(master)


@pytest.mark.timeout(400)  # above its waits for the screen (120 s each), which show it
@pytest.mark.parametrize("allowed", [False, True])
def test_signals_need_the_flag_a_key_and_a_yes(victim, tmp_path, allowed):
    env = {"ANYDEVICE_HEARTBEAT_DIR": str(tmp_path)}
    flags = ["--job", victim.job, *(["--signals"] if allowed else [])]
    proc, master = _pty_top(*flags, env=env)
    try:
        # Its job's name, not its pid: a pid of three digits shows in other numbers too.
        _read_until(master, victim.job.encode())
        os.write(master, b"j")  # select the first row: the victim
        os.write(master, b"T")
        if not allowed:
            _read_until(master, b"read-only: start with --signals to send SIGTERM")
            assert victim.poll() is None
        else:
            _read_until(master, f"send SIGTERM to pid {victim.pid}".encode())
            os.write(master, b"n")  # anything but y: nothing is sent
            _read_until(master, b"not sent")
            assert victim.poll() is None
            os.write(master, b"T")
            _read_until(master, b"? y/N")
            os.write(master, b"y")
            assert victim.wait(60) == -signal.SIGTERM
        os.write(master, b"q")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        os.close(master)


# ----------------------------------------------------------------------------- bad input


def test_an_unknown_flag_is_refused_with_what_was_meant():
    out = subprocess.run(
        [sys.executable, "-m", "anydevice", "top", "--jsno", "--onse"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert (
        "unrecognized arguments: --jsno (did you mean --json?) --onse (did you mean --once?)"
        in (out.stderr)
    )
    bad = subprocess.run(
        [sys.executable, "-m", "anydevice", "top", "--only", "2-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "'2-1' is not a list of ranks, e.g. 0,2-3" in bad.stderr


def test_as_another_user_the_processes_it_cannot_read_are_skipped(victim, tmp_path):
    """nobody cannot read root's environments and maps: top lists what it can, says how
    many it could not read fully, and exits 0."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as another user")
    beats = tmp_path / "beats"
    beats.mkdir()
    os.chown(beats, 65534, 65534)
    env = {**os.environ, "ANYDEVICE_HEARTBEAT_DIR": str(beats), "HOME": str(beats)}
    argv = [
        "setpriv",
        "--reuid=nobody",
        "--regid=nogroup",
        "--clear-groups",
        sys.executable,
        "-m",
        "anydevice",
        "top",
        "--once",
    ]
    out = subprocess.run(
        [*argv, "--json"], capture_output=True, text=True, timeout=120, env=env, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert record["skipped"]["unreadable"] >= 1
    assert victim.pid not in {p["pid"] for p in record["processes"] if p["rank"] is not None}
    table = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert table.returncode == 0, table.stderr
    assert "could not be read fully" in table.stdout


def test_once_prints_plain_text_for_logs_and_notebooks(victim, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "anydevice", "top", "--once", "--job", victim.job],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ANYDEVICE_HEARTBEAT_DIR": str(tmp_path), "TERM": "dumb"},
    )
    assert out.returncode == 0, out.stderr
    assert "\x1b[" not in out.stdout  # no terminal codes in a pipe: a log, a notebook cell
    row = next(line for line in out.stdout.splitlines() if str(victim.pid) in line)
    assert victim.job in row and "0/1" in row
    assert all(len(line) <= 80 for line in out.stdout.splitlines())
