"""anydevice: run PyTorch code on any device, fast and correctly.

>>> import anydevice as ad
>>> ad.device("cpu")
device(type='cpu')

The public API is what ``__all__`` lists; everything else is private.
"""

from __future__ import annotations

from anydevice._version import __version__

# ``ad.distributed`` is the function, which shadows the package of the same name as an
# attribute of ``anydevice``: reach the package's modules with ``from
# anydevice.distributed.elastic import plan`` (``import anydevice.distributed.elastic as m``
# would look the name up on the function).
from anydevice.distributed import (
    Distributed,
    all_gather,
    all_reduce,
    broadcast,
    distributed,
    gather_for_metrics,
    launch,
    prepare,
    share,
    unwrap,
)
from anydevice.errors import (
    AnydeviceError,
    DeviceNotFoundError,
    DeviceSpecError,
    DistributedError,
    DistributedTimeoutError,
    VisibilityError,
    WorkerFailedError,
)
from anydevice.inventory import DeviceInfo, HostInfo, Inventory, ProcessInfo, inventory
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
    "Distributed",
    "DistributedError",
    "DistributedTimeoutError",
    "HostInfo",
    "Inventory",
    "ProcessInfo",
    "VisibilityError",
    "WorkerFailedError",
    "__version__",
    "all_gather",
    "all_reduce",
    "broadcast",
    "describe",
    "device",
    "devices",
    "distributed",
    "gather_for_metrics",
    "inventory",
    "launch",
    "prepare",
    "restrict_visible",
    "share",
    "try_all_gpus",
    "try_gpu",
    "unwrap",
]
