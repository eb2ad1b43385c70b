"""anydevice: run PyTorch code on any device, fast and correctly.

>>> import anydevice as ad
>>> ad.device("cpu")
device(type='cpu')

The public API is what ``__all__`` lists; everything else is private.
"""

from __future__ import annotations

from anydevice._version import __version__
from anydevice.batch_size import fit_batch_size
from anydevice.checkpoint import load, save

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
    BatchSizeError,
    CheckpointError,
    DeviceMismatchError,
    DeviceNotFoundError,
    DeviceSpecError,
    DistributedError,
    DistributedTimeoutError,
    ExtensionError,
    MeasurementError,
    MoveError,
    NoTensorError,
    PrecisionError,
    StepOrderError,
    VisibilityError,
    WorkerFailedError,
)
from anydevice.extension import load_extension
from anydevice.inventory import DeviceInfo, HostInfo, Inventory, ProcessInfo, inventory
from anydevice.layout import channels_last
from anydevice.loader import DeviceLoader, LoaderStats
from anydevice.matmul import fast_matmul
from anydevice.memory import MemoryStats, MemoryUsage, free_memory, memory, track_memory
from anydevice.mismatch import check_devices, device_of, devices_of, diagnose
from anydevice.placement import to
from anydevice.precision import Precision, precision
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
from anydevice.streams import side_stream
from anydevice.timing import Measurement, Timer, timeit

__all__ = [
    "AnydeviceError",
    "BatchSizeError",
    "CheckpointError",
    "DeviceInfo",
    "DeviceLike",
    "DeviceLoader",
    "DeviceMismatchError",
    "DeviceNotFoundError",
    "DeviceSpecError",
    "Distributed",
    "DistributedError",
    "DistributedTimeoutError",
    "ExtensionError",
    "HostInfo",
    "Inventory",
    "LoaderStats",
    "Measurement",
    "MeasurementError",
    "MemoryStats",
    "MemoryUsage",
    "MoveError",
    "NoTensorError",
    "Precision",
    "PrecisionError",
    "ProcessInfo",
    "StepOrderError",
    "SyncReport",
    "Timer",
    "VisibilityError",
    "WorkerFailedError",
    "__version__",
    "all_gather",
    "all_reduce",
    "broadcast",
    "channels_last",
    "check_devices",
    "describe",
    "device",
    "device_of",
    "devices",
    "devices_of",
    "diagnose",
    "distributed",
    "fast_matmul",
    "find_syncs",
    "fit_batch_size",
    "free_memory",
    "gather_for_metrics",
    "inventory",
    "launch",
    "load",
    "load_extension",
    "memory",
    "nvtx_range",
    "precision",
    "prepare",
    "profile",
    "restrict_visible",
    "save",
    "share",
    "side_stream",
    "timeit",
    "to",
    "track_memory",
    "try_all_gpus",
    "try_gpu",
    "unwrap",
]
