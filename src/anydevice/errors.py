"""Errors raised by anydevice.

Every error anydevice raises derives from :class:`AnydeviceError`, and also from the
built-in exception a caller would expect (``LookupError``, ``ValueError``,
``RuntimeError``), so ``except ValueError`` keeps working::

    AnydeviceError
    ├── DeviceNotFoundError (LookupError)   a spec names a device that is not here
    ├── DeviceSpecError (ValueError)        a device spec that cannot be parsed
    ├── VisibilityError (RuntimeError)      CUDA_VISIBLE_DEVICES can no longer change
    └── DistributedError (RuntimeError)     a process group cannot be formed or used
        ├── DistributedTimeoutError (TimeoutError)  peers did not join in time
        └── WorkerFailedError               a launched worker failed: rank, exit code, traceback

Messages say what happened, with the values, and what to do.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = [
    "AnydeviceError",
    "DeviceNotFoundError",
    "DeviceSpecError",
    "DistributedError",
    "DistributedTimeoutError",
    "VisibilityError",
    "WorkerFailedError",
]


class AnydeviceError(Exception):
    """Base class of every error anydevice raises."""


class DeviceNotFoundError(AnydeviceError, LookupError):
    """A device spec is well formed but names a device that is not on this machine."""


class DeviceSpecError(AnydeviceError, ValueError):
    """A device spec that cannot be parsed (``"cuda:x"``, ``"gpu:-1"``, ``"cuda:0,1"``)."""


class VisibilityError(AnydeviceError, RuntimeError):
    """The set of visible GPUs can no longer change in this process."""


class DistributedError(AnydeviceError, RuntimeError):
    """A process group cannot be formed or used as asked.

    Raised, among others, when the environment says ``WORLD_SIZE > 1`` but no process group
    exists, so that the ranks would silently train independent copies.
    """


class DistributedTimeoutError(DistributedError, TimeoutError):
    """Peers did not join within the configured time (a missing node or rank)."""


class WorkerFailedError(DistributedError):
    """A launched worker failed. The message names the rank and carries its traceback.

    Attributes:
        rank: the global rank whose failure came first (the root cause).
        exitcode: that worker's exit code; negative for a signal (``-9``: SIGKILL).
        traceback: the worker's Python traceback, or ``""`` when it left none (it was killed,
            or it called ``sys.exit``).
        failures: every failed rank, mapped to its exit code.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exitcode: int,
        traceback: str = "",
        failures: dict[int, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.traceback = traceback
        self.failures = dict(failures) if failures else {rank: exitcode}

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Keyword-only fields do not survive Exception's default pickling.
        fields: dict[str, Any] = {
            "rank": self.rank,
            "exitcode": self.exitcode,
            "traceback": self.traceback,
            "failures": self.failures,
        }
        return functools.partial(type(self), **fields), (str(self.args[0]),)
