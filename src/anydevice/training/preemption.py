"""Preemption: save on the scheduler's signal, at a step every rank agrees on, then exit.

Clusters stop jobs with ``SIGTERM`` (SLURM's time limit and ``scancel``, Kubernetes, a
preemptible VM, torchrun passing on its own ``SIGTERM``), and SLURM can send ``SIGUSR1``
ahead of the time limit (``#SBATCH --signal=USR1@120``). ``ad.distributed(on_preempt=fn)``
catches them for the block and ``d.check_preemption()``, called once per training step,
turns them into a clean stop:

1. The signal handler only records the signal: the step under way finishes (a handler that
   saved there could catch the model halfway through ``optimizer.step()``).
2. At each ``check_preemption()`` every rank contributes what it has seen to one
   ``all_reduce(MAX)`` of a one-element CPU tensor (gloo, on its own group when the main
   group is NCCL, so no GPU sync). The signal reaches the ranks at different moments —
   one may see it a step before another — but the reduction at step ``k`` returns the
   same answer on every rank, so all stop after the same step ``k``. A rank cannot skip
   a check while the others wait in it, because every rank makes the same calls in the
   same order.
3. ``fn`` runs on every rank (typically ``ad.save_state``, itself a collective), then the
   process exits with ``SystemExit(128 + signal)``, the code a shell gives a process the
   signal killed, so schedulers and launchers see a terminated job, not a finished one.
   Under a launcher the rank first records that it stopped for a preemption (which
   signal, whether it received it itself) in its error file: ``anydevice launch`` reports
   a preemption, not a failure, and gives the other ranks its grace to finish saving.
4. Under SLURM, on ``SIGUSR1`` (the early warning), rank 0 first runs ``scontrol requeue
   <job id>`` so the job comes back and resumes from the checkpoint. ``SIGTERM`` is not
   requeued: it also means ``scancel``, and SLURM requeues preempted jobs itself when
   its configuration says so. A job that may not be requeued gets a warning.

Repeated signals change nothing: a job often gets the same ``SIGTERM`` twice (from
``srun`` and again from torchrun passing it on), and acting on the second would kill a rank
in the middle of its save. A loop that never calls ``check_preemption`` is ended by the
scheduler's ``SIGKILL`` after its grace period, as it would have been without us.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from anydevice.errors import DistributedError
from anydevice.hardware import backends
from anydevice.launching import failures

__all__ = ["REQUEUE_SIGNAL", "Preemption", "requeue_command", "requeue_signal", "watch"]

logger = logging.getLogger("anydevice")

#: ``SIGTERM`` outranks the early warning when ranks saw different ones: no requeue after a
#: cancel.
_RANK = {signal.SIGUSR1: 1, signal.SIGUSR2: 1, signal.SIGTERM: 2}

#: The early-warning signal under SLURM, ``USR1`` unless this variable names ``USR2`` (for
#: programs that use ``SIGUSR1`` themselves): ``#SBATCH --signal=USR2@120`` with
#: ``ANYDEVICE_REQUEUE_SIGNAL=USR2``.
REQUEUE_SIGNAL = "ANYDEVICE_REQUEUE_SIGNAL"


class Preemption:
    """The signals caught for an ``ad.distributed(on_preempt=fn)`` block, and the ranks'
    agreement on them. Made by :func:`watch`; ``d.check_preemption()`` calls :meth:`check`.
    """

    def __init__(
        self,
        on_preempt: Callable[[], object],
        signals: tuple[signal.Signals, ...],
        group: Any = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._fn = on_preempt
        self._signals = signals
        self._group = group  #: a CPU (gloo) group, or None for the default group
        self._environ = os.environ if environ is None else environ
        self._seen: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        """The signals caught."""
        return self._signals

    @property
    def received(self) -> signal.Signals | None:
        """The signal this rank received, if any (before the ranks agree)."""
        return self._seen

    def install(self) -> None:
        """Catch the signals; the previous handlers are kept for :meth:`restore`."""
        if threading.current_thread() is not threading.main_thread():
            raise DistributedError(
                "ad.distributed(on_preempt=...) must be entered on the main thread: Python "
                "delivers signals only there."
            )
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def check(self) -> None:
        """Agree with the other ranks whether a signal came; if one did, run ``on_preempt``
        on every rank and exit.

        Raises:
            SystemExit: with ``128 + signal`` after ``on_preempt`` ran.
        """
        mine = _RANK.get(self._seen, 0) if self._seen is not None else 0
        agreed = mine
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([mine], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            agreed = int(flag.item())
        if agreed == 0:
            return
        sig = next(s for s in self._signals if _RANK[s] == agreed)
        logger.warning("preemption: %s reached the job; saving and exiting", sig.name)
        self._fn()
        failures.record_preemption(sig, self._seen)  # for the launcher's report
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if _RANK[sig] == 1 and rank == 0:
            self._requeue()
        raise SystemExit(128 + int(sig))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self._seen is None or _RANK[sig] > _RANK[self._seen]:
            self._seen = sig

    def _requeue(self) -> None:
        command = requeue_command(self._environ)
        if command is None:
            return
        if shutil.which(command[0]) is None:
            logger.warning(
                "preemption: %s is not on PATH here (a container without SLURM's commands?), "
                "so the job is not requeued. Make scontrol and SLURM's configuration "
                "available in the job, or requeue it from outside: %s",
                command[0],
                " ".join(command),
            )
            return
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.warning("preemption: %s failed (%s); the job is not requeued", command, e)
            return
        if done.returncode != 0:
            logger.warning(
                "preemption: %s exited %d (%s); the job is not requeued (was it submitted "
                "with --no-requeue?)",
                " ".join(command),
                done.returncode,
                done.stderr.strip(),
            )
        else:
            logger.warning("preemption: requeued with %s", " ".join(command))


def requeue_command(environ: Mapping[str, str]) -> list[str] | None:
    """``scontrol requeue <job>`` for this SLURM job (``<array job>_<task>`` in an array),
    or ``None`` outside SLURM.

    >>> requeue_command({"SLURM_JOB_ID": "42"})
    ['scontrol', 'requeue', '42']
    >>> requeue_command({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40",
    ...                  "SLURM_ARRAY_TASK_ID": "3"})
    ['scontrol', 'requeue', '40_3']
    >>> requeue_command({}) is None
    True
    """
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        job = f"{array}_{task}"
    return ["scontrol", "requeue", job]


def requeue_signal(environ: Mapping[str, str]) -> signal.Signals:
    """The early-warning signal that saves and requeues under SLURM: ``SIGUSR1``, or what
    ``ANYDEVICE_REQUEUE_SIGNAL`` names (``USR1`` or ``USR2``).

    >>> requeue_signal({}).name
    'SIGUSR1'
    >>> requeue_signal({"ANYDEVICE_REQUEUE_SIGNAL": "sigusr2"}).name
    'SIGUSR2'

    Raises:
        ValueError: the variable names another signal.
    """
    text = environ.get(REQUEUE_SIGNAL, "").strip().upper()
    if not text:
        return signal.SIGUSR1
    name = text if text.startswith("SIG") else f"SIG{text}"
    if name not in ("SIGUSR1", "SIGUSR2"):
        raise ValueError(
            f"{REQUEUE_SIGNAL}={environ[REQUEUE_SIGNAL]!r}: the requeue signal is USR1 "
            "(default) or USR2; submit with the same one, e.g. #SBATCH --signal=USR2@120."
        )
    return signal.Signals[name]


@contextlib.contextmanager
def watch(on_preempt: Callable[[], object]) -> Iterator[Preemption]:
    """Catch the preemption signals for the block; yield what checks for them (the
    context's ``d.check_preemption()`` calls its :meth:`Preemption.check`).

    ``SIGTERM`` always; ``SIGUSR1`` too under SLURM (``SLURM_JOB_ID`` set), where it is the
    early warning (``SIGUSR2`` instead with ``ANYDEVICE_REQUEUE_SIGNAL=USR2``). In a world
    of several ranks whose group cannot reduce CPU tensors (NCCL), a gloo group is made for
    the agreement (a collective: every rank enters).
    """
    if not callable(on_preempt):
        raise TypeError(
            f"on_preempt={on_preempt!r}: pass a function of no arguments, e.g. "
            "lambda: ad.save_state(path, model=model, optimizer=opt, step=step)."
        )
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)
    if os.environ.get("SLURM_JOB_ID"):
        signals += (requeue_signal(os.environ),)
    group = None
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    host = backends.host().collective  # gloo
    if grouped and host not in backends.group_backends():
        group = dist.new_group(backend=host)
    watcher = Preemption(on_preempt, signals, group)
    watcher.install()
    try:
        yield watcher
    finally:
        watcher.restore()
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)
