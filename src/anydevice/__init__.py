"""anydevice: run PyTorch code on any device, fast and correctly.

>>> import anydevice as ad
>>> ad.device("cpu")
device(type='cpu')

The public API is what ``__all__`` lists; everything else is private. The package is laid
out by concern, each layer importing only from those below it (``docs/design.md``):

* :mod:`anydevice.errors` — the error tree; :mod:`anydevice.heartbeat` — what a process
  is doing, published for ``anydevice top`` and the launcher; ``anydevice._version``.
* :mod:`anydevice.hardware` — what devices are here and which to use; the backends.
* :mod:`anydevice.placement` — where tensors are, moving them, checkpoints;
  :mod:`anydevice.numerics` — precision, matmul math, memory layout;
  :mod:`anydevice.extension` — custom C++/CUDA operators.
* :mod:`anydevice.feeding` — batches onto the device; :mod:`anydevice.measure` — time,
  work, rates and memory.
* :mod:`anydevice.launching` — one process per device, on one machine or many;
  :mod:`anydevice.checkpoints` — a training run's saved state, on any world size.
* :mod:`anydevice.training` — inside each rank: the process group, prepare, collectives.
* :mod:`anydevice.doctor` — the machine examined; :mod:`anydevice.testing` — a simulated
  accelerator for tests.
* :mod:`anydevice.cli` — the ``anydevice`` command (``anydevice.__main__``).

Each public name loads on first use (PEP 562), so ``import anydevice`` alone imports
neither torch nor any of our modules: the ``anydevice`` command answers ``--help``,
``info`` and ``select`` without torch's seconds of start-up. To add a public name, add it
to ``_SOURCES`` (where it is defined; ``__all__`` is made from it) and to the
``TYPE_CHECKING`` imports (what type checkers and editors see); ``tests/test_api.py``
checks that the two agree.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from anydevice._version import __version__

if TYPE_CHECKING:  # `X as X`: re-exported for type checkers (PEP 484)
    from anydevice.checkpoints.state import (
        load_state as load_state,
        save_state as save_state,
        wait_for_saves as wait_for_saves,
    )
    from anydevice.errors import (
        AnydeviceError as AnydeviceError,
        ArgumentError as ArgumentError,
        BatchSizeError as BatchSizeError,
        CheckpointError as CheckpointError,
        DeviceMismatchError as DeviceMismatchError,
        DeviceNotFoundError as DeviceNotFoundError,
        DeviceSpecError as DeviceSpecError,
        DistributedError as DistributedError,
        DistributedTimeoutError as DistributedTimeoutError,
        ExtensionError as ExtensionError,
        MeasurementError as MeasurementError,
        MoveError as MoveError,
        NoTensorError as NoTensorError,
        PrecisionError as PrecisionError,
        StepOrderError as StepOrderError,
        VisibilityError as VisibilityError,
        WorkerFailedError as WorkerFailedError,
        WorkerImportError as WorkerImportError,
    )
    from anydevice.extension import (
        load_extension as load_extension,
    )
    from anydevice.feeding.loader import (
        DeviceLoader as DeviceLoader,
        LoaderStats as LoaderStats,
    )
    from anydevice.feeding.streams import (
        side_stream as side_stream,
    )
    from anydevice.hardware.facts import (
        DeviceInfo as DeviceInfo,
        HostInfo as HostInfo,
        ProcessInfo as ProcessInfo,
    )
    from anydevice.hardware.inventory import Inventory as Inventory, inventory as inventory
    from anydevice.hardware.peaks import Peak as Peak
    from anydevice.hardware.selection import (
        describe as describe,
        device as device,
        devices as devices,
        restrict_visible as restrict_visible,
        try_all_gpus as try_all_gpus,
        try_gpu as try_gpu,
    )
    from anydevice.hardware.spec import DeviceLike as DeviceLike
    from anydevice.launching.elastic import (
        launch as launch,
    )
    from anydevice.measure.batch_size import (
        fit_batch_size as fit_batch_size,
    )
    from anydevice.measure.flops import (
        FlopCount as FlopCount,
        ModuleFlops as ModuleFlops,
        flops as flops,
    )
    from anydevice.measure.memory import (
        MemoryStats as MemoryStats,
        MemoryUsage as MemoryUsage,
        free_memory as free_memory,
        memory as memory,
        track_memory as track_memory,
    )
    from anydevice.measure.profiling import (
        SyncReport as SyncReport,
        find_syncs as find_syncs,
        nvtx_range as nvtx_range,
        profile as profile,
    )
    from anydevice.measure.samples import (
        Measurement as Measurement,
    )
    from anydevice.measure.throughput import (
        Throughput as Throughput,
        ThroughputStats as ThroughputStats,
    )
    from anydevice.measure.timing import (
        Timer as Timer,
        timeit as timeit,
    )
    from anydevice.numerics.layout import (
        channels_last as channels_last,
    )
    from anydevice.numerics.matmul import (
        fast_matmul as fast_matmul,
    )
    from anydevice.numerics.precision import (
        Precision as Precision,
        precision as precision,
    )
    from anydevice.placement.checkpoint import (
        load as load,
        save as save,
    )
    from anydevice.placement.mismatch import (
        check_devices as check_devices,
        device_of as device_of,
        devices_of as devices_of,
        diagnose as diagnose,
    )
    from anydevice.placement.move import (
        to as to,
    )
    from anydevice.training.collectives import (
        all_gather as all_gather,
        all_reduce as all_reduce,
        broadcast as broadcast,
        gather_for_metrics as gather_for_metrics,
    )
    from anydevice.training.context import (
        Distributed as Distributed,
        distributed as distributed,
    )
    from anydevice.training.parallel import (
        prepare as prepare,
        unwrap as unwrap,
    )
    from anydevice.training.sharing import (
        share as share,
    )


#: Public name -> the module that defines it, loaded on first use.
_SOURCES: dict[str, str] = {
    "fit_batch_size": "anydevice.measure.batch_size",
    "load": "anydevice.placement.checkpoint",
    "load_extension": "anydevice.extension",
    "save": "anydevice.placement.checkpoint",
    "Distributed": "anydevice.training.context",
    "all_gather": "anydevice.training.collectives",
    "all_reduce": "anydevice.training.collectives",
    "broadcast": "anydevice.training.collectives",
    "distributed": "anydevice.training.context",
    "gather_for_metrics": "anydevice.training.collectives",
    "launch": "anydevice.launching.elastic",
    "load_state": "anydevice.checkpoints.state",
    "prepare": "anydevice.training.parallel",
    "save_state": "anydevice.checkpoints.state",
    "wait_for_saves": "anydevice.checkpoints.state",
    "share": "anydevice.training.sharing",
    "unwrap": "anydevice.training.parallel",
    "AnydeviceError": "anydevice.errors",
    "ArgumentError": "anydevice.errors",
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
    "DeviceInfo": "anydevice.hardware.facts",
    "HostInfo": "anydevice.hardware.facts",
    "Inventory": "anydevice.hardware.inventory",
    "ProcessInfo": "anydevice.hardware.facts",
    "inventory": "anydevice.hardware.inventory",
    "channels_last": "anydevice.numerics.layout",
    "DeviceLoader": "anydevice.feeding.loader",
    "LoaderStats": "anydevice.feeding.loader",
    "fast_matmul": "anydevice.numerics.matmul",
    "MemoryStats": "anydevice.measure.memory",
    "MemoryUsage": "anydevice.measure.memory",
    "free_memory": "anydevice.measure.memory",
    "memory": "anydevice.measure.memory",
    "track_memory": "anydevice.measure.memory",
    "check_devices": "anydevice.placement.mismatch",
    "device_of": "anydevice.placement.mismatch",
    "devices_of": "anydevice.placement.mismatch",
    "diagnose": "anydevice.placement.mismatch",
    "to": "anydevice.placement.move",
    "Precision": "anydevice.numerics.precision",
    "precision": "anydevice.numerics.precision",
    "SyncReport": "anydevice.measure.profiling",
    "find_syncs": "anydevice.measure.profiling",
    "nvtx_range": "anydevice.measure.profiling",
    "profile": "anydevice.measure.profiling",
    "DeviceLike": "anydevice.hardware.spec",
    "describe": "anydevice.hardware.selection",
    "device": "anydevice.hardware.selection",
    "devices": "anydevice.hardware.selection",
    "restrict_visible": "anydevice.hardware.selection",
    "try_all_gpus": "anydevice.hardware.selection",
    "try_gpu": "anydevice.hardware.selection",
    "side_stream": "anydevice.feeding.streams",
    "FlopCount": "anydevice.measure.flops",
    "ModuleFlops": "anydevice.measure.flops",
    "flops": "anydevice.measure.flops",
    "Peak": "anydevice.hardware.peaks",
    "Throughput": "anydevice.measure.throughput",
    "ThroughputStats": "anydevice.measure.throughput",
    "Measurement": "anydevice.measure.samples",
    "Timer": "anydevice.measure.timing",
    "timeit": "anydevice.measure.timing",
}

#: The public API: every lazily loaded name, and the version.
__all__ = ["__version__", *sorted(_SOURCES)]


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
    from anydevice.hardware import backends

    for kind in backends.probe_order():
        backends.get(kind)
    import psutil  # noqa: F401


def __dir__() -> list[str]:
    """The public names, loaded or not, and what is already here."""
    return sorted({*globals(), *__all__})
