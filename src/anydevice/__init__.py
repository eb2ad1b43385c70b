"""anydevice: run PyTorch code on any device, fast and correctly.

>>> import anydevice as ad
>>> ad.device("cpu")
device(type='cpu')

The public API is what ``__all__`` lists; everything else is private.
"""

from __future__ import annotations

from anydevice._version import __version__
from anydevice.batch_size import fit_batch_size
from anydevice.errors import (
    AnydeviceError,
    BatchSizeError,
    DeviceNotFoundError,
    DeviceSpecError,
    MeasurementError,
    VisibilityError,
)
from anydevice.inventory import DeviceInfo, HostInfo, Inventory, ProcessInfo, inventory
from anydevice.memory import MemoryStats, MemoryUsage, free_memory, memory, track_memory
from anydevice.profiling import SyncReport, find_syncs, nvtx_range, profile
from anydevice.selection import (
    DeviceLike,
    describe,
    device,
    devices,
    restrict_visible,
    try_all_gpus,
    try_gpu,
)
from anydevice.timing import Measurement, Timer, timeit

__all__ = [
    "AnydeviceError",
    "BatchSizeError",
    "DeviceInfo",
    "DeviceLike",
    "DeviceNotFoundError",
    "DeviceSpecError",
    "HostInfo",
    "Inventory",
    "Measurement",
    "MeasurementError",
    "MemoryStats",
    "MemoryUsage",
    "ProcessInfo",
    "SyncReport",
    "Timer",
    "VisibilityError",
    "__version__",
    "describe",
    "device",
    "devices",
    "find_syncs",
    "fit_batch_size",
    "free_memory",
    "inventory",
    "memory",
    "nvtx_range",
    "profile",
    "restrict_visible",
    "timeit",
    "track_memory",
    "try_all_gpus",
    "try_gpu",
]
