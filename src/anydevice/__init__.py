"""anydevice: run PyTorch code on any device, fast and correctly.

>>> import anydevice as ad
>>> ad.device("cpu")
device(type='cpu')

The public API is what ``__all__`` lists; everything else is private.
"""

from __future__ import annotations

from anydevice._version import __version__
from anydevice.errors import (
    AnydeviceError,
    DeviceNotFoundError,
    DeviceSpecError,
    PrecisionError,
    StepOrderError,
    VisibilityError,
)
from anydevice.inventory import DeviceInfo, HostInfo, Inventory, ProcessInfo, inventory
from anydevice.layout import channels_last
from anydevice.matmul import fast_matmul
from anydevice.precision import Precision, precision
from anydevice.selection import (
    DeviceLike,
    describe,
    device,
    devices,
    restrict_visible,
    try_all_gpus,
    try_gpu,
)

__all__ = [
    "AnydeviceError",
    "DeviceInfo",
    "DeviceLike",
    "DeviceNotFoundError",
    "DeviceSpecError",
    "HostInfo",
    "Inventory",
    "Precision",
    "PrecisionError",
    "ProcessInfo",
    "StepOrderError",
    "VisibilityError",
    "__version__",
    "channels_last",
    "describe",
    "device",
    "devices",
    "fast_matmul",
    "inventory",
    "precision",
    "restrict_visible",
    "try_all_gpus",
    "try_gpu",
]
