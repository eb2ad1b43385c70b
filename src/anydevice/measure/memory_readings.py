"""How each device's memory is read, and how its cache is given back.

:mod:`anydevice.measure.memory` builds ``ad.memory``, ``track_memory`` and
``free_memory`` on these readings. Each is its device's backend's
(:class:`anydevice.hardware.backends.Backend`): the caching allocator's counters through
the device module or ``torch.accelerator`` for CUDA, XPU and any other accelerator that
keeps them, one implementation for all; MPS's two numbers, torch_xla's memory info and
the CPU's resident set where those kinds differ. And what "out of memory" looks like on each
(:func:`is_out_of_memory`), for the batch-size search and the history's snapshot on OOM.

>>> read_counters(torch.device("cpu")).allocated > 0
True
"""

from __future__ import annotations

import torch

from anydevice.errors import MeasurementError
from anydevice.hardware.backends import Backend, get
from anydevice.hardware.backends.base import Counters
from anydevice.hardware.backends.cpu import peak_rss, rss

__all__ = [
    "Counters",
    "counts_peaks",
    "device_free_total",
    "empty_cache",
    "initialized",
    "is_out_of_memory",
    "peak_rss",
    "read_counters",
    "reset_peak",
    "rss",
    "system_memory",
]


def _backend(device: torch.device) -> Backend:
    try:
        return get(device.type)
    except KeyError:
        from anydevice.hardware.backends import auto_order, host

        known = ", ".join((*auto_order(), host().name))
        raise MeasurementError(
            f"cannot read memory on {device}: torch knows no {device.type!r} accelerator in "
            f"this process (memory is read on {known})."
        ) from None


def read_counters(device: torch.device) -> Counters:
    """The counters of ``device`` now; ``MeasurementError`` where they cannot be read."""
    return _backend(device).memory(device)


def counts_peaks(device: torch.device) -> bool:
    """Whether ``device``'s allocator keeps a peak counter that can be restarted."""
    return _backend(device).counts_peaks


def reset_peak(device: torch.device) -> None:
    """Restart the allocator's peak counter of ``device`` (where it keeps one); nothing
    before the device is in use."""
    _backend(device).reset_peak(device)


def initialized(device: torch.device) -> bool:
    """Whether this process has started using ``device``'s kind."""
    return _backend(device).initialized(device)


def system_memory() -> tuple[int, int]:
    """The host's free and total bytes."""
    free, total, _ = get("cpu").free_total(torch.device("cpu"))
    return int(free or 0), int(total or 0)


def device_free_total(device: torch.device) -> tuple[int | None, int | None, list[str]]:
    """Free and total bytes of ``device``, and notes on what could not be read."""
    return _backend(device).free_total(device)


def empty_cache(device: torch.device) -> None:
    """Give ``device``'s cached memory back (the CPU: freed heap pages to the system)."""
    _backend(device).empty_cache(device)


#: Out-of-memory errors that torch raises as a plain RuntimeError (checked in its sources):
#: the CPU allocator, MPS (TORCH_CHECK, not OutOfMemoryError, as of torch 2.13), Intel's
#: older XPU extension, CUDA calls outside the caching allocator, the CUDA libraries'
#: own allocation failures (cuBLAS handle and workspace, cuDNN, cuFFT, cuSOLVER,
#: cuSPARSE), cuDNN finding no convolution algorithm whose workspace fits, and the text of
#: a CUDA OutOfMemoryError that was re-raised as another type.
_OOM_TEXTS = (
    "DefaultCPUAllocator: can't allocate memory",
    "MPS backend out of memory",
    "XPU out of memory",
    "CUDA error: out of memory",
    "CUDA out of memory",
    "HIP out of memory",
    "_STATUS_ALLOC_FAILED",  # CUBLAS_, CUDNN_, CUSOLVER_, CUSPARSE_, HIPBLAS_
    "CUFFT_ALLOC_FAILED",
    "Unable to find a valid cuDNN algorithm",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` means "out of memory", on any device torch supports.

    ``torch.OutOfMemoryError`` (CUDA, XPU, ROCm), Python's ``MemoryError``, and the
    RuntimeErrors torch raises for the others: its CPU allocator ("DefaultCPUAllocator:
    can't allocate memory"), MPS ("MPS backend out of memory"), Intel's older XPU
    extension, CUDA calls outside the caching allocator ("CUDA error: out of memory"), the
    CUDA libraries' allocation failures (``CUBLAS_STATUS_ALLOC_FAILED`` and the like), and
    cuDNN finding no algorithm whose workspace fits.

    >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    True
    >>> is_out_of_memory(RuntimeError("expected all tensors on the same device"))
    False

    An error raised *because of* one of those counts too: the chain of ``__cause__``
    (``raise ... from oom``, as ``torch._dynamo`` wraps backend failures) and
    ``__context__`` (an error raised while handling it) is followed, except where
    ``raise ... from None`` cut it.

    >>> try:
    ...     try:
    ...         raise torch.OutOfMemoryError("CUDA out of memory.")
    ...     except RuntimeError as oom:
    ...         raise ValueError("backend failed") from oom
    ... except ValueError as wrapped:
    ...     is_out_of_memory(wrapped)
    True
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(e, RuntimeError) and any(text in str(e) for text in _OOM_TEXTS):
            return True
        e = e.__cause__ if e.__cause__ is not None or e.__suppress_context__ else e.__context__
    return False
