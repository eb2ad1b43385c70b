"""Real multi-process worlds for tests, bounded in time, leaving no process behind.

``run_ranks`` forks one process per rank; they meet through a ``file://`` rendezvous in
the test's temporary directory (no port, nothing listening) and form a real gloo process
group through ``ad.distributed(init_method=...)``. Forking costs ~0.1 s where a fresh
interpreter costs seconds (importing torch). Each rank writes its result, or its
traceback, to a file; a rank that does not finish in time is killed and fails the test.

``process_tree_guard`` is the fixture-side check that a test left no child running.
``start_job``/``finish_job`` run a launcher or a script in its own session, so that a
test that times out kills its whole tree, and ``still_running`` says which of a job's
processes outlived it.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch

#: Helper processes Python keeps for the life of the parent; not leftovers of a test.
_KEPT = ("resource_tracker", "forkserver")


def run_ranks(
    fn: Callable[[str], Any],
    world_size: int,
    tmp_path: Path,
    *,
    timeout: float = 60.0,
    ranks: Iterable[int] | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(init_method)`` as each rank of a world of ``world_size`` forked processes.

    Each child gets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (plus ``env``) in
    its own environment, as a launcher would set them, and ``ANYDEVICE_DEVICE=cpu``: these
    are CPU worlds (gloo) on any machine, and a forked child could not use CUDA anyway.
    ``ranks`` starts only some of them (to leave a peer missing); then only their results
    come back.
    """
    started = list(range(world_size) if ranks is None else ranks)
    rdzv = f"file://{tmp_path / 'rdzv'}"
    ctx = mp.get_context("fork")
    gc.collect()  # collect this process's garbage here, not in the children (see _child)
    procs = []
    for rank in started:
        out = tmp_path / f"rank{rank}.pickle"
        variables = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "ANYDEVICE_DEVICE": "cpu",
            **(env or {}),
        }
        stacks = tmp_path / f"rank{rank}.stacks"
        p = ctx.Process(target=_child, args=(fn, rdzv, variables, out, stacks, timeout - 2))
        p.start()
        procs.append((rank, p, out))
    deadline = time.monotonic() + timeout
    for _, p, _ in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p, _ in procs if p.is_alive()]
    for _, p, _ in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    if hung:
        dumps = "".join(
            f"\n--- rank {r}, every thread's stack shortly before it was killed:\n"
            + (tmp_path / f"rank{r}.stacks").read_text(errors="replace")
            for r in hung
            if (tmp_path / f"rank{r}.stacks").exists()
        )
        raise AssertionError(f"rank(s) {hung} did not finish within {timeout} s (killed){dumps}")
    results, failed = [], []
    for rank, p, out in procs:
        if not out.exists():
            stacks = tmp_path / f"rank{rank}.stacks"
            where = stacks.read_text(errors="replace") if stacks.exists() else ""
            failed.append(f"rank {rank} died without a result (exit code {p.exitcode})\n{where}")
            continue
        status, value = pickle.loads(out.read_bytes())
        if status != "ok":
            failed.append(f"rank {rank} failed:\n{value}")
        results.append(value)
    if failed:  # every rank's failure: the first is often only the echo of another's
        raise AssertionError("\n".join(failed))
    return results


_FRESH = """
import importlib.util, pickle, sys
sys.path[:0] = {paths!r}
spec = importlib.util.spec_from_file_location({name!r}, {file!r})
module = importlib.util.module_from_spec(spec)
sys.modules[{name!r}] = module
spec.loader.exec_module(module)
from ranks import run_ranks
from pathlib import Path
try:
    out = ("ok", run_ranks(getattr(module, {fn!r}), {world_size!r}, Path({tmp!r}),
                           timeout={timeout!r}, env={env!r}))
except AssertionError as e:
    out = ("error", str(e))
Path({tmp!r}, "fresh.pickle").write_bytes(pickle.dumps(out))
"""


def run_ranks_fresh(
    fn: Callable[[str], Any],
    world_size: int,
    tmp_path: Path,
    *,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """:func:`run_ranks` from a fresh interpreter: the ranks fork from a process that ran
    nothing else, so no state of earlier tests (threads, process groups, torch's flight
    recorder) is theirs. ``fn`` must be a module-level function of a test file."""
    import subprocess
    import sys

    module = sys.modules[fn.__module__]
    code = _FRESH.format(
        paths=[str(Path(__file__).parent), str(Path(str(module.__file__)).parent)],
        name=fn.__module__,
        file=str(module.__file__),
        fn=fn.__name__,
        world_size=world_size,
        tmp=str(tmp_path),
        timeout=timeout,
        env=env or {},
    )
    subprocess.run([sys.executable, "-c", code], timeout=timeout + 120, check=True)
    status, value = pickle.loads((tmp_path / "fresh.pickle").read_bytes())
    if status != "ok":
        raise AssertionError(value)
    return list(value)


def _child(
    fn: Callable[[str], Any],
    rdzv: str,
    env: dict[str, str],
    out: Path,
    stacks: Path,
    dump_after: float,
) -> None:
    # What the child inherited from pytest is not its own: earlier tests' process groups,
    # stores and loader iterators may lie in unreachable cycles, and destroying them here
    # (ad.distributed's gc.collect() on exit) aborts in C++ threads the fork did not copy.
    gc.freeze()
    # pytest's process has run OpenMP regions; GNU OpenMP hangs the first parallel op of a
    # process forked after that, so a forked rank computes on one thread.
    torch.set_num_threads(1)
    code = 0
    with stacks.open("w") as dump:  # where a hung rank was, for the parent's error
        faulthandler.enable(file=dump)  # a crash (SIGABRT, SIGSEGV) leaves its stacks too
        faulthandler.dump_traceback_later(max(1.0, dump_after), file=dump)
        try:
            result: tuple[str, Any] = _call(fn, rdzv, env)
        except BaseException:
            result, code = ("error", traceback.format_exc()), 1
        faulthandler.cancel_dump_traceback_later()
    out.write_bytes(pickle.dumps(result))
    os._exit(code)  # skip the parent's atexit handlers and pytest's finalizers


def _call(fn: Callable[[str], Any], rdzv: str, env: dict[str, str]) -> tuple[str, Any]:
    os.environ.update(env)  # this child's own environment, as a launcher gives it
    return ("ok", fn(rdzv))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children() -> set[int]:
    """PIDs of this process's descendants, Python's own helper processes excluded."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if not any(k in cmdline for k in _KEPT):
            found.add(child.pid)
    return found


@contextmanager
def process_tree_guard(grace: float = 15.0) -> Iterator[None]:
    """Fail if the block leaves a child process running (after ``grace`` seconds to exit);
    kill what is left so the next test starts clean."""
    before = children()
    yield
    deadline = time.monotonic() + grace
    left = children() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = children() - before
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left behind: {sorted(left)}"


#: A launched job's environment in these tests: the CPU, one thread per process.
CPU_JOB = {"ANYDEVICE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}


def start_job(argv: list[str], tmp: Path, **env: str) -> subprocess.Popen[str]:
    """``argv`` in its own session (a timeout kills its whole tree), on the CPU, with
    ``TMPDIR`` in ``tmp`` (to see what it leaves there), its output piped."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **CPU_JOB, "TMPDIR": str(tmp), **env},
    )


def launch_job(tmp: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    """``anydevice launch *args`` as ``start_job`` starts it."""
    return start_job([sys.executable, "-m", "anydevice", "launch", *args], tmp, **env)


def finish_job(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a job ``start_job`` started; on timeout its whole
    session is killed and the test fails with what it printed to stderr."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"{proc.args} did not finish within {timeout} s:\n{err}") from None
    return proc.returncode, out, err


def still_running(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie waiting to be reaped has ended)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive
