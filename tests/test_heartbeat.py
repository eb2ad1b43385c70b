"""Heartbeats: written by one process, read by another, consistent, cleaned up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from anydevice import heartbeat as hb


@pytest.fixture
def where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ANYDEVICE_HEARTBEAT_DIR", str(tmp_path))
    return tmp_path


def _child(code: str, where: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "ANYDEVICE_HEARTBEAT_DIR": str(where), **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_another_process_reads_who_it_is_and_how_far_it_got(where: Path) -> None:
    child = _child(
        """
        import sys
        from anydevice import heartbeat
        beat = heartbeat.mine()
        for _ in range(3):
            beat.step()
        beat.memory(10, 30, 20)
        beat.enter("broadcast", 4, "default", fingerprint=99)
        print("ready", flush=True)
        sys.stdin.readline()
        """,
        where,
        RANK="1",
        LOCAL_RANK="1",
        WORLD_SIZE="2",
        TORCHELASTIC_RUN_ID="job-7",
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        (beat,) = hb.read_all(where)
        assert (beat.pid, beat.rank, beat.local_rank, beat.world_size) == (child.pid, 1, 1, 2)
        assert beat.steps == 3 and beat.last_step > 0
        assert (beat.allocated, beat.reserved, beat.peak) == (10, 30, 20)
        assert beat.collective is not None
        assert (beat.collective.op, beat.collective.seq, beat.collective.group) == (
            "broadcast",
            4,
            "default",
        )
        assert beat.collective.fingerprint == 99
        assert beat.details["run_id"] == "job-7"
        assert beat.alive
    finally:
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    assert hb.read_all(where) == []  # removed at a normal exit


def test_a_killed_process_leaves_its_last_state_flagged_as_gone(where: Path) -> None:
    child = _child(
        """
        from anydevice import heartbeat
        heartbeat.mine().enter("all_reduce", 812)
        print("in", flush=True)
        import time
        time.sleep(600)
        """,
        where,
    )
    assert child.stdout is not None and child.stdout.readline() == "in\n"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    (left,) = hb.read_all(where, prune=False)
    assert left.pid == child.pid and not left.alive
    assert left.collective is not None and left.collective.seq == 812
    assert hb.read_all(where) != []  # returned once more, then removed
    assert hb.read_all(where) == []


def test_a_killed_process_not_yet_reaped_is_gone_too(where: Path) -> None:
    """A zombie (ended, its parent has not waited for it yet) writes nothing any more."""
    child = _child(
        """
        from anydevice import heartbeat
        heartbeat.mine()
        print("in", flush=True)
        import time
        time.sleep(600)
        """,
        where,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "in\n"
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{child.pid}/stat").read_bytes().split(b") ")[1][:1] != b"Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (left,) = hb.read_all(where, prune=False)
        assert left.pid == child.pid and not left.alive
    finally:
        child.kill()
        child.wait(timeout=60)


def test_a_reader_never_sees_a_half_written_record(where: Path) -> None:
    beat = hb.Heartbeat.create()
    stop = threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            beat.enter("all_reduce", i, fingerprint=i)  # seq and fingerprint move together
            beat.describe(n=i)

    writer = threading.Thread(target=write)
    writer.start()
    seen = 0
    try:
        deadline = time.monotonic() + 60
        while seen < 300 and time.monotonic() < deadline:
            got = hb.read_file(beat.path)
            if got is None or got.collective is None:
                continue
            assert got.collective.fingerprint == got.collective.seq
            seen += 1
    finally:
        stop.set()
        writer.join()
        beat.close()
    assert seen == 300


def test_a_reused_pid_is_not_the_process_that_wrote(where: Path) -> None:
    beat = hb.Heartbeat.create()
    try:
        (read,) = hb.read_all(where)
        assert read.alive
        # The same pid with another start time: a later process.
        other = hb.Beat(**{**read.__dict__, "start_ticks": read.start_ticks + 1})
        assert not other.alive
    finally:
        beat.close()


def test_not_a_record_is_skipped(where: Path) -> None:
    (where / "123.beat").write_bytes(b"not a heartbeat")
    (where / "124.beat").write_bytes(b"\0" * hb.SIZE)
    assert hb.read_all(where) == []


def test_publishing_off_makes_no_record(where: Path) -> None:
    child = _child(
        "from anydevice import heartbeat; print(heartbeat.mine())", where, ANYDEVICE_HEARTBEAT="0"
    )
    out, _ = child.communicate(timeout=60)
    assert out.strip() == "None"
    assert list(where.iterdir()) == []


def test_a_forked_child_gets_its_own_and_leaves_the_parents(where: Path) -> None:
    child = _child(
        """
        import os
        from anydevice import heartbeat
        parent = heartbeat.mine()
        pid = os.fork()
        if pid == 0:
            mine = heartbeat.mine()
            print(mine is not parent and mine.path != parent.path, flush=True)
            raise SystemExit(0)  # runs atexit: must not remove the parent's record
        os.waitpid(pid, 0)
        print(parent.path.exists(), flush=True)
        """,
        where,
    )
    out, _ = child.communicate(timeout=60)
    assert out.split() == ["True", "True"]


def test_a_watcher_sets_the_time_entered_the_count_done_and_its_tick(where: Path) -> None:
    beat = hb.Heartbeat.create()
    try:
        (fresh,) = hb.read_all(where)
        assert fresh.watched == 0.0  # no watcher yet
        beat.tick(now=1234.5)
        beat.enter("all_reduce", 9, "0", fingerprint=5, entered=1000.0)
        (inside,) = hb.read_all(where)
        assert inside.watched == 1234.5
        assert inside.collective is not None and inside.collective.entered == 1000.0
        beat.leave(done=42)
        beat.leave()
        (out,) = hb.read_all(where)
        assert out.collective is None and out.collectives_done == 43
    finally:
        beat.close()


def test_a_new_record_clears_only_the_long_ended_ones(
    where: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed process's record stays for readers (how it ended), until a process making
    its record finds it older than ``KEPT_AFTER_EXIT``; a running process's record stays."""
    code = """
        import sys
        from anydevice import heartbeat
        heartbeat.mine().step()
        print("ready", flush=True)
        sys.stdin.readline()
        """
    killed, running = _child(code, where), _child(code, where)
    try:
        for child in (killed, running):
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
        killed.kill()
        killed.wait(timeout=60)
        fresh = hb.Heartbeat.create(where=where)  # the killed one's record is recent
        assert {b.pid for b in hb.read_all(where, prune=False)} == {
            killed.pid, running.pid, os.getpid()
        }  # fmt: skip
        fresh.close()
        # A record not yet filled in (its pid still 0) is not one of a process long gone.
        unfilled = where / f"{os.getppid()}.beat"
        head = hb._HEAD.pack(hb.MAGIC, hb.VERSION, 0)
        unfilled.write_bytes(head + bytes(hb.SIZE - len(head)))
        monkeypatch.setattr(hb, "KEPT_AFTER_EXIT", 0.0)
        later = hb.Heartbeat.create(where=where)
        assert {b.pid for b in hb.read_all(where, prune=False)} == {running.pid, os.getpid(), 0}
        assert unfilled.exists()
        later.close()
    finally:
        for child in (killed, running):
            child.kill()
            child.wait(timeout=60)
