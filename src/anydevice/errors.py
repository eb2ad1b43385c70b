"""Errors raised by anydevice.

Every error anydevice raises derives from :class:`AnydeviceError`, and also from the
built-in exception a caller would expect (``LookupError``, ``ValueError``,
``RuntimeError``), so ``except ValueError`` keeps working::

    AnydeviceError
    ├── DeviceNotFoundError (LookupError)   a spec names a device that is not here
    ├── DeviceSpecError (ValueError)        a device spec that cannot be parsed
    ├── VisibilityError (RuntimeError)      CUDA_VISIBLE_DEVICES can no longer change
    ├── DeviceMismatchError (RuntimeError)  tensors that must share a device do not
    ├── NoTensorError (ValueError)          device_of() was given an object with no tensor
    ├── ArgumentError (ValueError, TypeError)  an argument of the wrong type or value
    ├── MoveError (RuntimeError)            to() could not move a part of an object
    ├── CheckpointError (RuntimeError)      save() or load() failed; the file is named
    ├── PrecisionError (ValueError)         a precision mode unknown, or one the device cannot run
    ├── StepOrderError (RuntimeError)       backward / unscale_ / step called out of order
    ├── MeasurementError (RuntimeError)     a timing or memory reading cannot be made as asked
    ├── BatchSizeError (RuntimeError)       fit_batch_size found no batch size that fits
    ├── ExtensionError (RuntimeError)       load_extension cannot build: what is missing, the fix
    ├── WorkerImportError (RuntimeError)    spawned workers could not import what they are sent
    └── DistributedError (RuntimeError)     a process group cannot be formed or used
        ├── DistributedTimeoutError (TimeoutError)  peers did not join in time
        └── WorkerFailedError               a launched worker failed: rank, exit code, traceback

Messages say what happened, with the values, and what to do.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "AnydeviceError",
    "ArgumentError",
    "BatchSizeError",
    "CheckpointError",
    "DeviceMismatchError",
    "DeviceNotFoundError",
    "DeviceSpecError",
    "DistributedError",
    "DistributedTimeoutError",
    "ExtensionError",
    "MeasurementError",
    "MoveError",
    "NoTensorError",
    "PrecisionError",
    "StepOrderError",
    "VisibilityError",
    "WorkerFailedError",
    "WorkerImportError",
]


class AnydeviceError(Exception):
    """Base class of every error anydevice raises."""


class DeviceNotFoundError(AnydeviceError, LookupError):
    """A device spec is well formed but names a device that is not on this machine."""


class DeviceSpecError(AnydeviceError, ValueError):
    """A device spec that cannot be parsed (``"cuda:x"``, ``"gpu:-1"``, ``"cuda:0,1"``)."""


class PrecisionError(AnydeviceError, ValueError):
    """A precision mode that is unknown, or that the device cannot run natively (bf16 on a
    GPU before compute capability 8.0, fp16 on a TPU, ...)."""


class StepOrderError(AnydeviceError, RuntimeError):
    """``Precision.unscale_`` or ``Precision.step`` called out of order: twice in one step,
    or before any ``Precision.backward``. Caught on every device, so a loop that would break
    under fp16 gradient scaling breaks on the CPU too."""


class VisibilityError(AnydeviceError, RuntimeError):
    """The set of visible GPUs can no longer change in this process."""


class DeviceMismatchError(AnydeviceError, RuntimeError):
    """Tensors that must be on one device are on several.

    The message is a short report: parameter and buffer groups by module path, each input
    by its path, with its device. The same facts are attributes:

    Attributes:
        devices: each device and how many tensors are on it, most first.
        groups: ``(path, device, count)`` for each line of the report.
        suggested: the device to move everything to (the accelerator most tensors are on,
            else the CPU).
    """

    def __init__(
        self,
        message: str,
        *,
        devices: dict[torch.device, int] | None = None,
        groups: tuple[tuple[str, torch.device, int], ...] = (),
        suggested: torch.device | None = None,
    ) -> None:
        super().__init__(message)
        self.devices = dict(devices or {})
        self.groups = groups
        self.suggested = suggested


class NoTensorError(AnydeviceError, ValueError):
    """An object holds no tensor, so it has no device (``device_of(["a", 1])``)."""


class ArgumentError(AnydeviceError, ValueError, TypeError):
    """An argument anydevice cannot use: of the wrong type, out of range, or not what an
    earlier call returned (``accumulate(world_size=0)``, a corrupt loader state). The
    message names the argument, its value and what to pass. Both a ``ValueError`` and a
    ``TypeError``, so code that caught either keeps working."""


class MoveError(AnydeviceError, RuntimeError):
    """``to()`` could not move a part of an object: a custom ``.to`` raised (the original is
    the ``__cause__``), the structure refers back to itself, or an optimizer's parameters are
    elsewhere. ``path`` says where, as in ``batch['inputs'][2]``."""

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class CheckpointError(AnydeviceError, RuntimeError):
    """``save()`` or ``load()`` failed: an object that cannot be pickled, a full disk, a
    truncated or corrupt file. ``path`` is the checkpoint; the original is the ``__cause__``."""

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class MeasurementError(AnydeviceError, RuntimeError):
    """A timing or memory reading cannot be made as asked (a Timer read before it ran)."""


class BatchSizeError(AnydeviceError, RuntimeError):
    """:func:`~anydevice.measure.batch_size.fit_batch_size` found no batch size that fits.

    Either even the smallest batch (``low``) runs out of memory, or ``step`` never ran out
    of memory at all (it probably ignores its batch size), or another rank failed.
    """


class ExtensionError(AnydeviceError, RuntimeError):
    """:func:`~anydevice.extension.load_extension` cannot build or load an extension.

    The message names what is missing (a source, the compiler, ninja, an nvcc of torch's
    CUDA major version) and the fix; for a compile error, the compiler's first errors.
    ``log`` is the whole build output ("" when there was no build).
    """

    def __init__(self, message: str, *, log: str = "") -> None:
        super().__init__(message)
        self.log = log


class WorkerImportError(AnydeviceError, RuntimeError):
    """Worker processes started with ``spawn`` or ``forkserver`` could not import what they
    are sent: a class or function defined in an interactive ``__main__`` (a notebook cell,
    the REPL). Raised before any worker starts; the message names it and the ways out."""


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
