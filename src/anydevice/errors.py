"""Errors raised by anydevice.

Every error anydevice raises derives from :class:`AnydeviceError`, and also from the
built-in exception a caller would expect (``LookupError``, ``ValueError``,
``RuntimeError``), so ``except ValueError`` keeps working::

    AnydeviceError
    ├── DeviceNotFoundError (LookupError)   a spec names a device that is not here
    ├── DeviceSpecError (ValueError)        a device spec that cannot be parsed
    ├── VisibilityError (RuntimeError)      CUDA_VISIBLE_DEVICES can no longer change
    ├── MeasurementError (RuntimeError)     a timing or memory reading cannot be made as asked
    └── BatchSizeError (RuntimeError)       fit_batch_size found no batch size that fits

Messages say what happened, with the values, and what to do.
"""

from __future__ import annotations

__all__ = [
    "AnydeviceError",
    "BatchSizeError",
    "DeviceNotFoundError",
    "DeviceSpecError",
    "MeasurementError",
    "VisibilityError",
]


class AnydeviceError(Exception):
    """Base class of every error anydevice raises."""


class DeviceNotFoundError(AnydeviceError, LookupError):
    """A device spec is well formed but names a device that is not on this machine."""


class DeviceSpecError(AnydeviceError, ValueError):
    """A device spec that cannot be parsed (``"cuda:x"``, ``"gpu:-1"``, ``"cuda:0,1"``)."""


class VisibilityError(AnydeviceError, RuntimeError):
    """The set of visible GPUs can no longer change in this process."""


class MeasurementError(AnydeviceError, RuntimeError):
    """A timing or memory reading cannot be made as asked (a Timer read before it ran)."""


class BatchSizeError(AnydeviceError, RuntimeError):
    """:func:`~anydevice.batch_size.fit_batch_size` found no batch size that fits.

    Either even the smallest batch (``low``) runs out of memory, or ``step`` never ran out
    of memory at all (it probably ignores its batch size), or another rank failed.
    """
