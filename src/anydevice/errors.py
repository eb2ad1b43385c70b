"""Errors raised by anydevice.

Every error anydevice raises derives from :class:`AnydeviceError`, and also from the
built-in exception a caller would expect (``LookupError``, ``ValueError``,
``RuntimeError``), so ``except ValueError`` keeps working::

    AnydeviceError
    ├── DeviceNotFoundError (LookupError)   a spec names a device that is not here
    ├── DeviceSpecError (ValueError)        a device spec that cannot be parsed
    ├── PrecisionError (ValueError)         a precision mode unknown, or one the device cannot run
    ├── StepOrderError (RuntimeError)       backward / unscale_ / step called out of order
    └── VisibilityError (RuntimeError)      CUDA_VISIBLE_DEVICES can no longer change

Messages say what happened, with the values, and what to do.
"""

from __future__ import annotations

__all__ = [
    "AnydeviceError",
    "DeviceNotFoundError",
    "DeviceSpecError",
    "PrecisionError",
    "StepOrderError",
    "VisibilityError",
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
