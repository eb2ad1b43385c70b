"""Running torch's elastic agent for a :class:`~anydevice.distributed.elastic.LaunchPlan`.

The agent is torchrun's (``LocalElasticAgent`` with the c10d rendezvous); this module
builds it by hand rather than through ``elastic_launch``, for what that cannot be told:

* **Nothing listens beyond loopback** when the nodes meet on a loopback address (one
  node, or several on this machine): the rendezvous store and the store the workers share
  serve on sockets bound to 127.0.0.1 beforehand (``TCPStore(master_listen_fd=...)``);
  torch's own listen on every interface.
* **Every wait is bounded by ``timeout``**: reaching the rendezvous store (torch waits 60 s
  per try, and tries twice), joining, the exit barrier; stopped workers get 5 s before
  SIGKILL.
* **Nothing outlives the launcher**: workers die with it (:mod:`~anydevice.distributed.runner`),
  and a small guardian process, started first, removes the launch's private directory
  (logs, error files, stacks) when the launcher is gone, even after SIGKILL.
* **Quiet**: torch's own log lines (``W1123 ... Sending process ... closing signal``) stay
  out unless ``verbose``; the failure summary is what is printed.
* **Signals**: SIGINT stops the workers and raises ``KeyboardInterrupt``; SIGTERM, SIGHUP
  and SIGQUIT stop them and raise ``SystemExit(128 + signal)``, the shell's exit code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anydevice.distributed import rendezvous
from anydevice.distributed.failures import worker_failed
from anydevice.distributed.rendezvous import LOOPBACK
from anydevice.errors import DistributedTimeoutError

if TYPE_CHECKING:
    from anydevice.distributed.elastic import LaunchPlan

__all__ = ["LOOPBACK", "run_agent", "scoped_environ"]

logger = logging.getLogger("anydevice")

#: Seconds a stopped worker gets between SIGTERM (when it dumps its stacks) and SIGKILL.
_STOP_GRACE = 5

#: The guardian: waits for its stdin to close (the launcher is gone, however it went),
#: then removes the launch directory. No imports beyond the standard library's smallest.
_GUARDIAN = """\
import os, shutil, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
sys.stdin.buffer.read()
for _ in range(20):
    shutil.rmtree(sys.argv[1], ignore_errors=True)
    if not os.path.exists(sys.argv[1]):
        break
    time.sleep(0.25)
"""

#: Torch's NCCL flight recorder: each rank's last collectives, dumped on a timeout.
_FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def run_agent(
    chosen: LaunchPlan,
    entrypoint: Callable[..., Any] | str,
    args: tuple[Any, ...] | list[Any],
    *,
    log_dir: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> dict[int, Any]:
    """Run torch's elastic agent with ``chosen`` and translate its failures.

    ``entrypoint`` is a function (run through :func:`anydevice.distributed.runner.call`),
    or an executable (``sys.executable`` with the runner's arguments, for scripts).
    """
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    from anydevice.distributed import runner  # not at import: `python -m` runs it as a script

    timeout = int(chosen.rdzv_configs["join_timeout"])
    with contextlib.ExitStack() as stack:
        private = stack.enter_context(_launch_dir())
        root = str(log_dir) if log_dir is not None else os.path.join(private, "logs")
        stack.enter_context(scoped_environ(_worker_environ(chosen, private, verbose)))
        stack.enter_context(_scoped_signal_handlers())
        stack.enter_context(_quiet_torch(verbose))
        if callable(entrypoint):
            target: Callable[..., Any] | str = runner.call
            arguments = (entrypoint, *args)
        else:
            target, arguments = entrypoint, tuple(args)
        logger.info("launching %s", chosen.describe())
        try:
            handler = stack.enter_context(rendezvous.open_rendezvous(chosen, timeout))
            spec = WorkerSpec(
                role="default",
                local_world_size=chosen.nproc_per_node,
                entrypoint=target,
                args=arguments,
                rdzv_handler=handler,
                max_restarts=chosen.max_restarts,
                monitor_interval=0.1,
                local_addr=chosen.local_addr,
            )
            agent = LocalElasticAgent(
                spec=spec,
                logs_specs=DefaultLogsSpecs(log_dir=root),
                start_method=chosen.start_method,
                exit_barrier_timeout=timeout,
                shutdown_timeout=_STOP_GRACE,
            )
            result = agent.run()
        except SignalException as e:
            if e.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise SystemExit(128 + int(e.sigval)) from None
        except RendezvousTimeoutError as e:
            raise DistributedTimeoutError(
                f"Not all nodes joined within {timeout} s: "
                f"{chosen.describe()}. Start the same launch on every node, with the same "
                f"rdzv_endpoint and run_id, and check that {chosen.rdzv_endpoint} is "
                "reachable from each; or wait longer (timeout=, --timeout)."
            ) from e
        except RendezvousConnectionError as e:
            raise rendezvous.unreachable(chosen, timeout, e) from e
        except RendezvousClosedError:  # while restarting the workers
            raise rendezvous.closed(chosen) from None
        if result is None:  # torch's agent returns nothing when the rendezvous was closed
            raise rendezvous.closed(chosen)
        if result.is_failed():
            raise worker_failed(
                result, nprocs=chosen.nproc_per_node, launch_dir=private, keep=log_dir
            )
        return dict(sorted(result.return_values.items()))


@contextlib.contextmanager
def scoped_environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Set ``updates`` in ``os.environ`` for the block, then put the whole environment back
    as it was, also on error — including what torch's launcher writes into it
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``, ``TORCHINDUCTOR_CACHE_DIR``).

    >>> with scoped_environ({"ANYDEVICE_EXAMPLE": "1"}):
    ...     os.environ["ANYDEVICE_EXAMPLE"]
    '1'
    >>> "ANYDEVICE_EXAMPLE" in os.environ
    False
    """
    saved = dict(os.environ)
    os.environ.update(updates)
    try:
        yield
    finally:
        for k in set(os.environ) - set(saved):
            del os.environ[k]
        for k, v in saved.items():
            if os.environ.get(k) != v:
                os.environ[k] = v


# ----------------------------------------------------------------------------- internals


def _worker_environ(chosen: LaunchPlan, private: str, verbose: bool) -> dict[str, str]:
    from anydevice.distributed import runner

    env = {
        **chosen.env,
        runner.LAUNCH_DIR: private,
        runner.LAUNCHER_PID: str(os.getpid()),
        runner.VERBOSE: "1" if verbose else "0",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }
    loopback = _loopback_interface()
    if chosen.local_addr in LOOPBACK and loopback:
        # The workers' own listening sockets (gloo's pairs, NCCL's bootstrap) stay on
        # loopback too: every node of this launch is on this machine.
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ:
                env[name] = loopback
    if not {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"} & set(os.environ):
        flight = Path(private) / "flight"
        flight.mkdir()
        env["TORCH_FR_DUMP_TEMP_FILE"] = str(flight / "rank")
        env.update({k: v for k, v in _FLIGHT_RECORDER.items() if k not in os.environ})
    return env


def _loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


@contextlib.contextmanager
def _launch_dir() -> Iterator[str]:
    """A private directory for the launch, removed afterwards — by this process, or by
    the guardian when this process is killed."""
    path = tempfile.mkdtemp(prefix="anydevice-launch-")
    guardian = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _GUARDIAN, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the terminal's process group spares it
    )
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if guardian.stdin is not None:
            guardian.stdin.close()
        try:
            guardian.wait(10)
        except subprocess.TimeoutExpired:
            guardian.kill()
            guardian.wait()


@contextlib.contextmanager
def _scoped_signal_handlers() -> Iterator[None]:
    """Put back the handlers torch's agent installs (SIGINT, SIGTERM, ...) when it is done:
    otherwise Ctrl-C after a launch raises torch's SignalException, not KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    saved = {s: signal.getsignal(s) for n in names if (s := getattr(signal, n, None))}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(s, handler)


@contextlib.contextmanager
def _quiet_torch(verbose: bool) -> Iterator[None]:
    """Silence torch elastic's loggers for the block (unless ``verbose``), then restore."""
    if verbose:
        yield
        return
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    names = [n for n in list(logging.Logger.manager.loggerDict) if n.startswith(prefixes)]
    loggers = [logging.getLogger(n) for n in {*names, *prefixes}]
    saved = [(lg, lg.disabled) for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, disabled in saved:
            lg.disabled = disabled
