"""How each device's memory is read, and how its cache is given back.

:mod:`anydevice.measure.memory` builds :func:`~anydevice.measure.memory`, ``track_memory`` and
``free_memory`` on these readings. Each is its device's backend's
(:class:`anydevice.hardware.backends.Backend`): the caching allocator's counters through the device
module or ``torch.accelerator`` for CUDA, XPU and any other accelerator that keeps them, one
implementation for all; MPS's two numbers, torch_xla's memory info and the CPU's resident
set where those kinds differ.

>>> read(torch.device("cpu")).allocated > 0
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
    "peak_rss",
    "read",
    "reset_peak",
    "rss",
    "system_memory",
]


def _backend(device: torch.device) -> Backend:
    try:
        return get(device.type)
    except KeyError:
        from anydevice.hardware.backends import KINDS
        from anydevice.hardware.backends.generic import kinds

        known = ", ".join(k for k in (*KINDS, *kinds()) if k != "accelerator")
        raise MeasurementError(
            f"cannot read memory on {device}: torch knows no {device.type!r} accelerator in "
            f"this process (memory is read on {known})."
        ) from None


def read(device: torch.device) -> Counters:
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
