"""Every rank's line arrives whole: ``WholeLines`` on real pipes with processes writing at
once, and real launches (``anydevice launch`` and ``ad.launch``, 2 ranks) printing
thousands of lines with ``print`` and with ``sys.stdout.write`` in pieces."""

from __future__ import annotations

import io
import os
import re
import select
import signal
import socket
import sys
import textwrap

import pytest

from anydevice.launching.output import PIPE_BUF, WholeLines
from ranks import process_tree_guard, start_job

#: ``rank R line N`` and ``rank R err N``, each alone on its line.
WHOLE = re.compile(r"rank \d (line|err) \d+")


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _write_in_pieces(fd: int, rank: int, lines: int) -> None:
    """A forked writer: ``lines`` lines through a text stream on WholeLines, each line in
    three writes (text, number, newline), as ``print`` and ``sys.stdout.write`` make them."""
    out = io.TextIOWrapper(WholeLines(fd), write_through=True)
    for i in range(lines):
        out.write(f"rank {rank} ")
        out.write(f"line {i}")
        out.write("\n")
    out.flush()


def test_two_processes_writing_in_pieces_never_cut_each_others_lines():
    r, w = os.pipe()
    children = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(r)
            try:
                _write_in_pieces(w, rank, 5000)
            finally:
                os._exit(0)
        children.append(pid)
    os.close(w)
    data = _read_all(r)
    os.close(r)
    for pid in children:
        os.waitpid(pid, 0)
    lines = data.decode().splitlines()
    assert len(lines) == 10_000
    assert [x for x in lines if not WHOLE.fullmatch(x)] == []


def _writes() -> tuple[int, int]:
    """A connected pair of sockets that keep each write apart: each read on the first
    returns exactly what one write to the second sent."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return a.detach(), b.detach()


def _received(fd: int) -> list[bytes]:
    """Every write that has arrived at ``fd`` (one of ``_writes``), in order."""
    got = []
    while select.select([fd], [], [], 0)[0]:
        got.append(os.read(fd, 1 << 20))
    return got


def test_each_write_carries_whole_lines_only_however_the_text_was_written():
    r, w = _writes()
    out = io.TextIOWrapper(WholeLines(w), write_through=True)
    print("rank 0 line 0", file=out)  # two writes: text, newline
    out.write("rank 0 ")
    out.write("line 1\nrank 0 line 2\nrank 0 li")
    out.write("ne 3\n")
    assert _received(r) == [b"rank 0 line 0\n", b"rank 0 line 1\nrank 0 line 2\n",
                            b"rank 0 line 3\n"]  # fmt: skip
    out.write("50%\r")
    assert _received(r) == []  # held until the line ends...
    out.flush()
    assert _received(r) == [b"50%\r"]  # ...or the writer asks for it
    out.write("partial")
    out.close()
    assert _received(r) == [b"partial"]  # at the end, what is left
    os.close(r)
    os.close(w)  # WholeLines leaves its descriptor open


def test_many_lines_go_out_in_writes_of_at_most_pipe_buf_that_end_at_a_line_end():
    r, w = _writes()
    out = WholeLines(w)
    text = b"".join(b"line %05d\n" % i for i in range(2000))  # 22 000 bytes at once
    out.write(text)
    long = b"x" * (PIPE_BUF * 3) + b"\n"
    out.write(b"short\n" + long + b"next\n")
    got = _received(r)
    assert b"".join(got) == text + b"short\n" + long + b"next\n"
    assert long in got  # a line longer than PIPE_BUF: one write of its own
    assert all(g.endswith(b"\n") and (len(g) <= PIPE_BUF or g == long) for g in got)
    assert len(got) <= len(text) // PIPE_BUF + 4  # batched, not a write per line
    os.close(r)
    os.close(w)


#: A launched rank: both ranks start together (a file barrier), print 2000 lines, half with
#: print(), half with sys.stdout.write in three pieces (now and then pausing mid-line), and
#: 500 to stderr in pieces; then rank 0 waits for rank 1 to finish and leaves a last line
#: without its newline.
SCRIPT = """\
import os, sys, time

def main(folder):
    rank = os.environ["RANK"]
    open(os.path.join(folder, "ready" + rank), "w").close()
    while len([n for n in os.listdir(folder) if n.startswith("ready")]) < 2:
        time.sleep(0.01)
    for i in range(2000):
        if i % 2:
            print(f"rank {rank} line {i}")
        else:
            sys.stdout.write(f"rank {rank} ")
            if i % 10 == 0:
                time.sleep(0.001)  # mid-line: the other rank writes meanwhile
            sys.stdout.write(f"line {i}")
            sys.stdout.write("\\n")
        if i % 4 == 0:
            sys.stderr.write(f"rank {rank} ")
            sys.stderr.write(f"err {i}\\n")
    if rank == "1":
        sys.stdout.flush()
        open(os.path.join(folder, "done1"), "w").close()
    else:
        while not os.path.exists(os.path.join(folder, "done1")):
            time.sleep(0.01)
        sys.stdout.write("rank 0 tail")  # no newline: written at exit
"""

#: The same through ad.launch: the function above, spawned.
DRIVER = """\
import sys
import anydevice as ad
{script}
if __name__ == "__main__":
    ad.launch(main, sys.argv[1], nprocs=2, timeout=120)
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_rank_line_arrives_whole_under_anydevice_launch_and_adstart_job(tmp_path):
    """2198–3096 of 4000 lines arrived merged under `anydevice launch` ("rank 1 line
    0rank 0 line 51"): `python -u` wrote each line's text and newline apart."""
    script, driver = tmp_path / "lines.py", tmp_path / "driver.py"
    script.write_text(SCRIPT + "\nmain(sys.argv[1])\n")
    driver.write_text(DRIVER.format(script=textwrap.dedent(SCRIPT)))
    runs = {}
    with process_tree_guard():
        for name, argv in {
            "cli": [sys.executable, "-m", "anydevice", "launch", "-n", "2", str(script)],
            "api": [sys.executable, str(driver)],
        }.items():
            folder = tmp_path / name
            folder.mkdir()
            runs[name] = start_job([*argv, str(folder)], folder)
        ended = {}
        for name, proc in runs.items():
            try:
                out, err = proc.communicate(timeout=300)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
            ended[name] = (proc.returncode, out, err)
    for name, (code, out, err) in ended.items():
        assert code == 0, (name, err[-2000:])
        assert out.endswith("\nrank 0 tail"), (name, out[-200:])  # the unfinished line too
        lines = out.splitlines()[:-1]
        assert len(lines) == 4000, (name, len(lines))
        merged = [x for x in lines if not WHOLE.fullmatch(x)]
        assert merged == [], (name, len(merged), merged[:5])
        errors = [x for x in err.splitlines() if x.startswith("rank ")]
        assert len(errors) == 1000, (name, err[-2000:])
        assert [x for x in errors if not WHOLE.fullmatch(x)] == [], name
        for rank in (0, 1):  # each rank's own lines in its order
            mine = [int(x.split()[-1]) for x in lines if x.startswith(f"rank {rank} ")]
            assert mine == list(range(2000)), (name, rank)


def test_whole_lines_reports_its_descriptor_and_terminal_like_the_stream_it_replaces():
    r, w = os.pipe()
    out = io.TextIOWrapper(WholeLines(w, name="<stdout>"), write_through=True)
    assert out.fileno() == w and out.isatty() is False and out.name == "<stdout>"
    out.close()
    with pytest.raises(ValueError):
        out.write("after close")
    os.close(r)
    os.close(w)
