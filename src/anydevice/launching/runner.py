"""How a launched worker runs: ``python -m anydevice.launching.runner SCRIPT ARGS``, or
:func:`call` for ``ad.launch``'s functions.

Every worker anydevice starts goes through :func:`worker`, which

* **writes whole lines**: ``sys.stdout`` and ``sys.stderr`` write each line in one piece
  (:mod:`~anydevice.launching.output`), so the ranks' lines never cut into each other;
* **ends with its launcher, and so does everything it started**: on Linux the worker is a
  child subreaper (``PR_SET_CHILD_SUBREAPER``: whatever it starts stays under it, however
  it forks and detaches) and is stopped (``PR_SET_PDEATHSIG`` with SIGSTOP) when the
  launcher dies, even by SIGKILL; the launch's guardian then ends it with all that is
  under it (:mod:`~anydevice.launching.reaper`). Elsewhere a thread watching the parent
  kills the worker;
* **dumps its Python stacks when it is stopped**: ``faulthandler`` on SIGTERM, into a file
  the launcher reads, so a rank that hung is shown where it hung (what ``py-spy dump``
  shows), then dies as SIGTERM would have it;
* **records its exception** for the launcher (:func:`anydevice.launching.failures.record`)
  and exits with code 1 without printing the traceback, which the launcher's summary
  carries (``ANYDEVICE_LAUNCH_VERBOSE=1``, ``--verbose``, prints it here too). Exiting
  through ``SystemExit`` also keeps torch from leaving a ``pytorch-errorfile-*.pickle``.

The script runs as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT
ARGS`` would give it; ``-m MODULE`` runs a module as ``python -m MODULE`` does. Outside an
anydevice launch (under torchrun, or run in place), it records the exception in torch's
error file and lets it go on, as torch's ``@record`` does.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from anydevice import heartbeat

__all__ = ["call", "main", "run", "worker"]

T = TypeVar("T")

#: Set by the launcher in every worker's environment.
LAUNCH_DIR = "ANYDEVICE_LAUNCH_DIR"  #: where workers dump their stacks
LAUNCHER_PID = "ANYDEVICE_LAUNCHER_PID"  #: the process whose death ends the workers
VERBOSE = "ANYDEVICE_LAUNCH_VERBOSE"  #: "1": print each worker's traceback as well
FORKED = "ANYDEVICE_LAUNCH_FORKED"  #: "1": this worker was forked from the launcher

_PR_SET_PDEATHSIG = 1


def run(target: str, args: Sequence[str], *, module: bool = False) -> None:
    """Run ``target`` (a script path, or a module name when ``module``) as ``__main__``
    as a launched worker (see :func:`worker`)."""
    with worker():
        _execute(target, list(args), module)


def call(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` as a launched worker: what ``ad.launch`` sends to each process."""
    with worker():
        return fn(*args)


@contextlib.contextmanager
def worker() -> Iterator[None]:
    """Arm this process as a launched worker for the block (see the module docstring)."""
    launched = LAUNCH_DIR in os.environ
    if os.environ.get(FORKED) == "1":
        _one_thread_after_fork()
    if launched:
        from anydevice.launching import output

        output.install()
        _keep_inherited_pipes()
        _die_with_launcher(int(os.environ.get(LAUNCHER_PID, "0") or 0))
        _dump_stacks_on_sigterm(os.environ[LAUNCH_DIR])
        heartbeat.mine()  # this worker's record, from its start: anydevice top, the hang watch
        from anydevice.launching import progress

        progress.watch(os.environ[LAUNCH_DIR])  # the hang watch's side in this rank
    try:
        yield
    except (Exception, KeyboardInterrupt) as e:
        from anydevice.launching import failures

        failures.record(e)
        if not launched:
            raise
        if os.environ.get(VERBOSE) == "1":
            traceback.print_exc()
        raise SystemExit(130 if isinstance(e, KeyboardInterrupt) else 1) from None


def _one_thread_after_fork() -> None:
    """Run torch's CPU ops on one thread in a worker forked from the launcher.

    GNU OpenMP (the runtime of torch's Linux wheels) cannot start threads in a process
    forked after its parent used them: the child's first parallel op waits forever for the
    parent's pool. With one thread torch never enters a parallel region. torch's own
    DataLoader workers run on one thread for the same reason.
    """
    import torch

    torch.set_num_threads(1)


def _die_with_launcher(launcher: int) -> None:
    """End with the launcher (see the module docstring).

    Why stopped rather than killed: a worker killed at once would leave what it started
    to init — a daemon that double-forked with an empty environment, just started, has
    nothing that ties it to the launch any more. Stopped, the worker stays the subreaper
    of all it started (orphans are re-parented to it, also while it is stopped) and can
    fork nothing more, so the guardian finds the whole tree under it and ends it.
    """
    if sys.platform.startswith("linux"):
        from anydevice.launching.reaper import become_subreaper

        become_subreaper()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGSTOP, 0, 0, 0)
        if os.getppid() == 1 != launcher:  # orphaned before the line above took hold
            os.kill(os.getpid(), signal.SIGKILL)  # nothing started yet: nothing to sweep
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="anydevice-launcher-watch", daemon=True).start()


def _keep_inherited_pipes() -> None:
    """Keep the descriptors this worker inherited (beyond 0, 1, 2) out of the programs its
    own children run.

    A worker ``ad.launch`` spawns holds the write end of a pipe whose closing tells the
    launcher that it ended (multiprocessing's sentinel). A process the worker starts with
    ``os.fork`` and ``exec`` (a daemon, a server) would inherit it, and the launcher would
    wait for that process to end before it sees the worker's end. ``subprocess`` closes
    them already; ``exec`` now does too.
    """
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: leave them
        return
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    os.set_inheritable(fd, False)


def _dump_stacks_on_sigterm(launch_dir: str) -> None:
    from anydevice.launching.failures import stacks_file

    rank = int(os.environ.get("RANK", "0") or 0)
    path = stacks_file(launch_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    dump = path.open("w")  # faulthandler holds it open for the life of the process
    faulthandler.register(signal.SIGTERM, file=dump, all_threads=True, chain=True)


def _execute(target: str, args: list[str], module: bool) -> None:
    if module:
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()  # as `python -m MODULE` has it
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if not os.path.isfile(target):
        raise FileNotFoundError(f"anydevice launch: no script {target!r} (cwd {os.getcwd()})")
    sys.argv = [target, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` has it
    runpy.run_path(target, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m anydevice.launching.runner [-m] TARGET ARGS...``"""
    argv = list(sys.argv[1:] if argv is None else argv)
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m anydevice.launching.runner [-m] TARGET [ARGS...]")
    run(argv[0], argv[1:], module=module)


if __name__ == "__main__":
    main()
