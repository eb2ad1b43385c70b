"""anydevice: run PyTorch code on any device, fast and correctly.

>>> import anydevice as ad
>>> ad.device("cpu")
device(type='cpu')

The public API is what ``__all__`` lists; everything else is private.

Each public name loads on first use (PEP 562), so ``import anydevice`` alone imports
neither torch nor any of our modules: the ``anydevice`` command answers ``--help``,
``info`` and ``select`` without torch's seconds of start-up. To add a public name, add it
to ``__all__``, to ``_SOURCES`` (where it is defined) and to the ``TYPE_CHECKING`` imports
(what type checkers and editors see); ``tests/test_api.py`` checks that the three agree.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from anydevice._version import __version__

if TYPE_CHECKING:
    from anydevice.batch_size import fit_batch_size
    from anydevice.checkpoint import load, save
    from anydevice.distributed import (
        Distributed,
        all_gather,
        all_reduce,
        broadcast,
        distributed,
        gather_for_metrics,
        launch,
        load_state,
        prepare,
        save_state,
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
        WorkerImportError,
    )
    from anydevice.extension import load_extension
    from anydevice.flops import FlopCount, ModuleFlops, flops
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
    from anydevice.throughput import Peak, Throughput, ThroughputStats
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
    "FlopCount",
    "HostInfo",
    "Inventory",
    "LoaderStats",
    "Measurement",
    "MeasurementError",
    "MemoryStats",
    "MemoryUsage",
    "ModuleFlops",
    "MoveError",
    "NoTensorError",
    "Peak",
    "Precision",
    "PrecisionError",
    "ProcessInfo",
    "StepOrderError",
    "SyncReport",
    "Throughput",
    "ThroughputStats",
    "Timer",
    "VisibilityError",
    "WorkerFailedError",
    "WorkerImportError",
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
    "flops",
    "free_memory",
    "gather_for_metrics",
    "inventory",
    "launch",
    "load",
    "load_extension",
    "load_state",
    "memory",
    "nvtx_range",
    "precision",
    "prepare",
    "profile",
    "restrict_visible",
    "save",
    "save_state",
    "share",
    "side_stream",
    "timeit",
    "to",
    "track_memory",
    "try_all_gpus",
    "try_gpu",
    "unwrap",
]

#: Public name -> the module that defines it, loaded on first use.
_SOURCES: dict[str, str] = {
    "fit_batch_size": "anydevice.batch_size",
    "load": "anydevice.checkpoint",
    "load_extension": "anydevice.extension",
    "save": "anydevice.checkpoint",
    "Distributed": "anydevice.distributed",
    "all_gather": "anydevice.distributed",
    "all_reduce": "anydevice.distributed",
    "broadcast": "anydevice.distributed",
    "distributed": "anydevice.distributed",
    "gather_for_metrics": "anydevice.distributed",
    "launch": "anydevice.distributed",
    "load_state": "anydevice.distributed",
    "prepare": "anydevice.distributed",
    "save_state": "anydevice.distributed",
    "share": "anydevice.distributed",
    "unwrap": "anydevice.distributed",
    "AnydeviceError": "anydevice.errors",
    "BatchSizeError": "anydevice.errors",
    "CheckpointError": "anydevice.errors",
    "DeviceMismatchError": "anydevice.errors",
    "DeviceNotFoundError": "anydevice.errors",
    "DeviceSpecError": "anydevice.errors",
    "DistributedError": "anydevice.errors",
    "DistributedTimeoutError": "anydevice.errors",
    "ExtensionError": "anydevice.errors",
    "MeasurementError": "anydevice.errors",
    "MoveError": "anydevice.errors",
    "NoTensorError": "anydevice.errors",
    "PrecisionError": "anydevice.errors",
    "StepOrderError": "anydevice.errors",
    "VisibilityError": "anydevice.errors",
    "WorkerFailedError": "anydevice.errors",
    "WorkerImportError": "anydevice.errors",
    "DeviceInfo": "anydevice.inventory",
    "HostInfo": "anydevice.inventory",
    "Inventory": "anydevice.inventory",
    "ProcessInfo": "anydevice.inventory",
    "inventory": "anydevice.inventory",
    "channels_last": "anydevice.layout",
    "DeviceLoader": "anydevice.loader",
    "LoaderStats": "anydevice.loader",
    "fast_matmul": "anydevice.matmul",
    "MemoryStats": "anydevice.memory",
    "MemoryUsage": "anydevice.memory",
    "free_memory": "anydevice.memory",
    "memory": "anydevice.memory",
    "track_memory": "anydevice.memory",
    "check_devices": "anydevice.mismatch",
    "device_of": "anydevice.mismatch",
    "devices_of": "anydevice.mismatch",
    "diagnose": "anydevice.mismatch",
    "to": "anydevice.placement",
    "Precision": "anydevice.precision",
    "precision": "anydevice.precision",
    "SyncReport": "anydevice.profiling",
    "find_syncs": "anydevice.profiling",
    "nvtx_range": "anydevice.profiling",
    "profile": "anydevice.profiling",
    "DeviceLike": "anydevice.selection",
    "describe": "anydevice.selection",
    "device": "anydevice.selection",
    "devices": "anydevice.selection",
    "restrict_visible": "anydevice.selection",
    "try_all_gpus": "anydevice.selection",
    "try_gpu": "anydevice.selection",
    "side_stream": "anydevice.streams",
    "FlopCount": "anydevice.flops",
    "ModuleFlops": "anydevice.flops",
    "flops": "anydevice.flops",
    "Peak": "anydevice.throughput",
    "Throughput": "anydevice.throughput",
    "ThroughputStats": "anydevice.throughput",
    "Measurement": "anydevice.timing",
    "Timer": "anydevice.timing",
    "timeit": "anydevice.timing",
}


#: Modules whose names are plain definitions: their first use imports nothing more.
_SELF_CONTAINED = frozenset({"anydevice.errors"})


def __getattr__(name: str) -> Any:
    """Load a public name from its module on first use (PEP 562).

    The lookup also imports what the name's first call would (:func:`_load_device_finders`),
    so that ``ad.device()``, ``ad.DeviceLoader(...)``, ``ad.prepare(...)`` and ``ad.to(...)``
    pay no imports in step 1 of a timed loop: ``dev = ad.device`` or the first line that
    names it pays them, once.
    """
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module 'anydevice' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if module not in _SELF_CONTAINED:
        _load_device_finders()
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def _load_device_finders() -> None:
    """Import the device backends and psutil, which every device lookup uses.

    Each backend is a small module that imports neither torch nor a vendor library (NVML
    and ``torch_xla`` load only when a backend looks); instantiating one touches no device.
    psutil is what the CPU backend reads the host with.
    """
    from anydevice import backends

    for kind in backends.KINDS:
        backends.get(kind)
    import psutil  # noqa: F401


def __dir__() -> list[str]:
    """The public names, loaded or not, and what is already here."""
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """``anydevice`` itself: a public name is never replaced by a submodule of that name.

    ``ad.inventory``, ``ad.memory``, ``ad.precision`` and ``ad.distributed`` are functions
    that share their names with the modules defining them. Importing such a module (which
    our own code and a launched worker do) makes Python record it as an attribute of this
    package, which would hide the function; here the function stays, and the module is
    reached by a ``from`` import (``from anydevice.distributed.elastic import plan``).
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _SOURCES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
