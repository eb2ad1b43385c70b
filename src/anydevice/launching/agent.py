"""Running torch's elastic agent for a :class:`~anydevice.launching.options.LaunchPlan`.

The agent is torchrun's (``LocalElasticAgent`` with the c10d rendezvous); this module
builds it by hand rather than through ``elastic_launch``, for what that cannot be told:

* **Nothing listens beyond the address the peers reach**: the rendezvous store and the
  store the workers share serve on sockets bound beforehand (``TCPStore(master_listen_fd=
  ...)``) to 127.0.0.1 when the nodes meet on loopback (one node, or several on this
  machine), else to this node's address (:mod:`~anydevice.launching.rendezvous`);
  torch's own listen on every interface.
* **Every wait is bounded by ``timeout``**: reaching the rendezvous store (torch waits 60 s
  per try, and tries twice), joining, the workers of each node reaching the others' after
  the rendezvous (checked before they start: :func:`~anydevice.launching.addressing.
  check_reach`), the exit barrier; stopped workers get 5 s before SIGKILL.
* **Nothing outlives the launcher**: workers die with it (:mod:`~anydevice.launching.runner`),
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
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anydevice.errors import DistributedError, DistributedTimeoutError
from anydevice.hardware.backends import torch_private
from anydevice.launching import addressing, reaper, rendezvous
from anydevice.launching.failures import preempted, preemption, worker_failed
from anydevice.launching.hangwatch import HangWatch
from anydevice.launching.rendezvous import LOOPBACK

if TYPE_CHECKING:
    from anydevice.launching.options import LaunchPlan

__all__ = ["LOOPBACK", "Preempted", "run_agent", "scoped_environ"]

logger = logging.getLogger("anydevice")

#: Seconds a worker stopped because another failed gets between SIGTERM (when it dumps
#: its stacks) and SIGKILL. After a signal to the launcher, the workers get the launch's
#: ``grace`` instead.
_STOP_GRACE = 5


class Preempted(SystemExit):
    """The workers stopped for a preemption signal: ``on_preempt`` ran on each and they
    exited with ``128 + signal`` (the exit code). ``report`` says which rank the signal
    reached and how long they took."""

    def __init__(self, code: int, report: str) -> None:
        super().__init__(code)
        self.report = report


#: Where the workers' time to exit after a signal is set, as the messages name it.
_GRACE_SETTING = "ad.launch(grace=...), anydevice launch --grace"

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

    ``entrypoint`` is a function (run through :func:`anydevice.launching.runner.call`),
    or an executable (``sys.executable`` with the runner's arguments, for scripts).
    """
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    from anydevice.launching import runner  # not at import: `python -m` runs it as a script

    timeout = int(chosen.rdzv_configs["join_timeout"])
    with contextlib.ExitStack() as stack:
        private = stack.enter_context(_launch_dir())
        root = str(log_dir) if log_dir is not None else os.path.join(private, "logs")
        stack.enter_context(scoped_environ(_worker_environ(chosen, private, verbose)))
        stack.enter_context(reaper.subreaper(private))
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
            agent = _agent_type()(
                spec=spec,
                logs_specs=DefaultLogsSpecs(log_dir=root),
                start_method=chosen.start_method,
                exit_barrier_timeout=timeout,
                shutdown_timeout=_STOP_GRACE,
                grace=chosen.grace,
                timeout=timeout,
                watch=HangWatch(chosen.hang_after, launch_dir=private),
            )
            result = agent.run()
        except SignalException as e:
            report = preempted(agent.records(), signalled=e.sigval, took=agent.took)
            if report is not None:
                raise Preempted(*report) from None
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
            report = preempted(agent.records())
            if report is not None:
                raise Preempted(*report)
            if agent.watch.stopped is not None or agent.watch.stopped_by:
                raise agent.watch.stopped_error(result)
            codes = {int(r): f.exitcode for r, f in result.failures.items()}
            raise worker_failed(
                result,
                nprocs=chosen.nproc_per_node,
                launch_dir=private,
                keep=log_dir,
                hang=agent.watch.at_failure(codes),
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
    from anydevice.launching import runner

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
    if not (verbose or chosen.standalone or "TORCH_CPP_LOG_LEVEL" in os.environ):
        # Across nodes c10d warns for every peer address without a name ("The hostname of
        # the client socket cannot be retrieved"): errors only, --verbose shows all.
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
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
    the guardian (:func:`anydevice.launching.reaper.guard`) when this process is killed,
    which then also ends what the workers left running."""
    path = tempfile.mkdtemp(prefix="anydevice-launch-")
    guardian = subprocess.Popen(
        [sys.executable, "-I", "-S", reaper.__file__, path, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the terminal's process group spares it
    )
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if guardian.stdin is not None:
            with contextlib.suppress(OSError):
                guardian.stdin.write(reaper.DONE)  # the launch's processes are ended
            with contextlib.suppress(OSError):
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


def _agent_type() -> type[Any]:
    """torch's ``LocalElasticAgent``, which gives the workers ``grace`` seconds to exit
    after a signal to the launcher (torch gives them ``shutdown_timeout``, the same as
    after a failure): the signal is passed on at once, the workers save and exit (a
    preemption's ``on_preempt``), and only those still running after ``grace`` are
    killed. A second signal kills them at once."""
    from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    class GracefulAgent(LocalElasticAgent):
        def __init__(
            self, *args: Any, grace: float, timeout: float, watch: HangWatch, **kwargs: Any
        ) -> None:
            super().__init__(*args, **kwargs)
            self.grace = grace
            self.timeout = timeout
            self.watch = watch  #: the hang watch of this node's workers
            self.signalled: signal.Signals | None = None
            self.took: float | None = None  #: seconds from the signal to the workers' exit

        def records(self) -> dict[int, str]:
            """The error file of each worker (global rank -> path) of the last attempt."""
            processes = torch_private.agent_processes(self)
            if processes is None:
                return {}
            ranks = {w.local_rank: w.global_rank for w in torch_private.agent_workers(self)}
            files = processes.error_files.items()
            return {ranks.get(local, local): str(path) for local, path in files}

        def _rendezvous(self, worker_group: Any) -> None:
            """The rendezvous, then (several nodes) the check that each node's workers
            will reach the others' (:func:`~anydevice.launching.addressing.check_reach`),
            before any worker starts: where they cannot, every node stops with what failed
            where, within ``timeout``, rather than its workers waiting out
            ``init_process_group``'s (30 minutes by default)."""
            super()._rendezvous(worker_group)
            self.watch.join(
                worker_group.store, worker_group.group_rank, worker_group.group_world_size
            )
            if worker_group.group_world_size < 2:
                return
            handler = worker_group.spec.rdzv_handler
            try:
                addressing.check_reach(
                    worker_group.store,
                    node=worker_group.group_rank,
                    nodes=worker_group.group_world_size,
                    master_addr=worker_group.master_addr,
                    # Served already where the agents share it; else a worker serves it.
                    master_port=worker_group.master_port if handler.use_agent_store else None,
                    listen_addr=worker_group.spec.local_addr,
                    timeout=self.timeout,
                )
            except DistributedError:
                raise
            except (RuntimeError, OSError) as e:  # the rendezvous store stopped answering
                raise RendezvousConnectionError(str(e)) from e

        def _invoke_run(self, role: str = DEFAULT_ROLE) -> Any:
            self.watch.start(self._pids)
            try:
                return super()._invoke_run(role)
            except SignalException as e:
                self.signalled = e.sigval
                self.watch.at_stop(e.sigval)
                raise
            finally:
                self.watch.stop()

        def _pids(self) -> dict[int, int]:
            """Each worker's pid, by global rank (none before they start)."""
            workers = torch_private.agent_workers(self)
            return {w.global_rank: w.id for w in workers if isinstance(w.id, int)}

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if self.watch.stopped is not None or self.watch.stopped_by:
                torch_private.stop_restarts(self)  # a mismatch comes back on every restart
            return result

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
            preempting = any(preemption(p) for p in self.records().values())
            if torch_private.agent_processes(self) is None or (
                self.signalled is None and not preempting
            ):
                super()._shutdown(death_sig, min(timeout, _STOP_GRACE))
                return
            try:
                left = self._wait_out(death_sig)
                super()._shutdown(signal.SIGKILL if left else death_sig, _STOP_GRACE)
            except SignalException as again:
                logger.warning("anydevice: %s again: stopping the workers now.", again.sigval.name)
                for _ in range(10):  # however many more come
                    with contextlib.suppress(SignalException):
                        super()._shutdown(signal.SIGKILL, _STOP_GRACE)
                        break

        def _wait_out(self, sig: signal.Signals) -> list[int]:
            """Pass ``sig`` on to the workers and wait up to ``grace`` seconds for them to
            exit; the pids of those still running then."""
            processes = torch_private.agent_processes(self)
            assert processes is not None
            start = time.monotonic()
            pids = [p for p in processes.pids().values() if _running(p)]
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            said = False
            while (left := [p for p in pids if _running(p)]) and (
                time.monotonic() - start < self.grace
            ):
                if not said and time.monotonic() - start > 1:
                    logger.warning(
                        "anydevice: waiting up to %g s for the workers to exit (%s); a second "
                        "signal stops them now.",
                        self.grace,
                        _GRACE_SETTING,
                    )
                    said = True
                time.sleep(0.05)
            self.took = time.monotonic() - start
            if left:
                logger.warning(
                    "anydevice: %d worker(s) still running %g s after %s (%s): killing them.",
                    len(left),
                    self.grace,
                    sig.name,
                    _GRACE_SETTING,
                )
            return left

    torch_private.warn_missing_overrides(LocalElasticAgent)
    return GracefulAgent


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended and not yet reaped, does not)."""
    if reaper.PROC:
        entry = reaper.entry(pid)
        return entry is not None and entry.state not in "ZX"
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
