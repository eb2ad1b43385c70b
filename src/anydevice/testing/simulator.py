"""The simulated accelerator: build, register, configure.

:func:`enable` builds ``sim.cpp`` with :func:`anydevice.load_extension` (once per
source, compiler and torch: later calls, in any process, load the cached library), then
registers it as torch's ``privateuse1`` backend under the name given, with a device module
(``torch.<name>``) and the tensor methods torch generates for such backends
(``tensor.sim()``, ``tensor.is_sim``).

What it models, and why each rule holds (the C++ source says the same beside the code):

- **Memory.** Allocations come from the simulator's allocator, filled with 0xFF bytes:
  NaN for every IEEE float type (float16, bfloat16, float32, float64, complex), -1 for
  signed integers, the maximum for unsigned ones; bool tensors start ``True``. A read
  that comes before the write shows.
- **Streams.** Each stream is a queue run in order by a worker thread. A copy from pinned
  host memory with ``non_blocking=True`` (and a device-to-host copy into pinned memory,
  and any device-to-device copy) is queued and returns at once; any other copy waits for
  its own completion, as CUDA's do (pageable memory goes through a staging buffer).
- **Kernels** are torch's CPU kernels, run by the host on device memory. Before one runs,
  the host waits for the current stream of each device it touches: a kernel comes after
  everything queued on its stream, and after nothing on other streams, which is what a
  GPU guarantees and all it guarantees.
- **The link.** Host-device copies take ``bytes / bandwidth`` (one link per direction
  and device, shared by the streams that copy that way, like a GPU's copy engines); the
  bytes land at the end of that time.
- **Events** are reached when their stream's worker gets to them and take the worker's
  clock then; ``wait_event`` / ``wait_stream`` queue a wait on the worker.

What it does not model: kernels do not run concurrently with each other (compute is
ordered on the host), there are no Tensor Cores or reduced-precision matmul modes, no
NCCL, and the allocator does not cache (a freed block is never handed to another stream).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

from anydevice.errors import AnydeviceError, DeviceSpecError

if TYPE_CHECKING:
    import torch

__all__ = [
    "MIN_TORCH",
    "SimulatorError",
    "Span",
    "bandwidth",
    "busy",
    "enable",
    "enabled",
    "parse_bandwidth",
    "set_bandwidth",
    "set_capacity",
    "trace",
]

logger = logging.getLogger("anydevice")

#: The oldest torch the simulator is built and tested against. It needs
#: ``c10::DeviceAllocator`` with ``getMemoryInfo`` and ``torch.accelerator.memory``.
MIN_TORCH = (2, 13)
SOURCE = Path(__file__).with_name("sim.cpp")
_EXTENSION = "anydevice_sim"
_UNSET = "privateuseone"  # torch's name for the slot before a backend renames it

_lib: Any = None  # the loaded extension module
_name: str | None = None  # the name the simulator was enabled under


class SimulatorError(AnydeviceError, RuntimeError):
    """The simulator cannot be enabled here (another privateuse1 backend, an old torch),
    or was asked for something it cannot do after it started."""


def parse_bandwidth(value: float | str | None) -> float:
    """Bytes per second from ``"2GB/s"``, ``"500 MiB/s"``, a number, or None / ``"inf"``
    for a link that takes no time (returned as ``math.inf``).

    >>> parse_bandwidth("2GB/s")
    2000000000.0
    >>> parse_bandwidth("16 GiB/s") == 16 * 2**30
    True
    >>> parse_bandwidth(None)
    inf
    """
    from anydevice.hardware.facts import parse_size

    if value is None:
        return math.inf
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "inf":
            return math.inf
        if not text.lower().endswith("/s"):
            raise DeviceSpecError(
                f"bandwidth={value!r} has no '/s'; write bytes per second, e.g. '2GB/s', "
                "'500MiB/s', a number of bytes per second, or None for a link without delay"
            )
        try:
            per_second = float(parse_size(text[:-2]))
        except DeviceSpecError:
            raise DeviceSpecError(
                f"cannot read bandwidth={value!r}; write e.g. '2GB/s', '500MiB/s', a number "
                "of bytes per second, or None for a link without delay"
            ) from None
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DeviceSpecError(
            f"bandwidth must be text such as '2GB/s', a number or None, not "
            f"{type(value).__name__} ({value!r})"
        )
    else:
        per_second = float(value)
    if not per_second > 0:
        raise DeviceSpecError(
            f"bandwidth={value!r} must be positive; use None for a link without delay"
        )
    return per_second


def _capacity_bytes(capacity: int | str | None) -> int:
    from anydevice.hardware.facts import parse_size

    if capacity is None:
        return -1
    try:
        size = parse_size(capacity)
    except (DeviceSpecError, TypeError) as e:
        raise DeviceSpecError(
            f"capacity={capacity!r}: {e}; write e.g. '1GiB', a number of bytes, or None for "
            "the host's memory"
        ) from None
    if size <= 0:
        raise DeviceSpecError(f"capacity={capacity!r} must be positive, or None")
    return size


def _check_torch() -> None:
    import torch

    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        raise SimulatorError(
            f"The simulated accelerator needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} "
            f"(its device allocator API and torch.accelerator.memory); this is torch "
            f"{torch.__version__}. Upgrade torch to use it."
        )


def _check_slot(name: str) -> None:
    """Raise when torch's one privateuse1 slot holds another backend."""

    from anydevice.hardware.backends.torch_private import privateuse1_name

    current = privateuse1_name()
    if current in (_UNSET, name) and (current == _UNSET or _name == name):
        return
    if _name is not None and current == _name:
        raise SimulatorError(
            f"The simulator is already enabled as {_name!r} in this process; torch names a "
            f"backend once. Use {_name!r}, or name={name!r} in a fresh process."
        )
    raise SimulatorError(
        f"torch's privateuse1 backend is already {current!r} in this process, and torch "
        f"holds one such backend per process: the simulator stays off rather than replace "
        f"it. Run the simulated tests in a process that does not load {current!r} (e.g. a "
        "separate pytest run)."
    )


def _built_library(started: float) -> bool:
    """Whether a build of the simulator finished after ``started`` (so this call built)."""
    from anydevice.extension import cache_root

    return any(p.stat().st_mtime >= started for p in cache_root().glob(f"{_EXTENSION}-*/*.so"))


def _load() -> Any:
    global _lib
    if _lib is None:
        from anydevice.extension import load_extension

        started = time.time()
        t0 = time.perf_counter()
        _lib = load_extension(_EXTENSION, [SOURCE], extra_cflags=["-O2"])
        seconds = time.perf_counter() - t0
        how = "built" if _built_library(started) else "loaded from the build cache"
        logger.info("anydevice.testing: the simulated accelerator %s in %.1f s", how, seconds)
    return _lib


def _device_module(name: str, lib: Any) -> ModuleType:
    """``torch.<name>``: what torch and anydevice ask of a backend's module."""
    import torch

    mod = ModuleType(f"torch.{name}", f"The simulated accelerator {name!r} (anydevice).")

    def device_count() -> int:
        return int(lib.device_count())

    def _index(device: Any) -> int:
        if device is None:
            return int(torch.accelerator.current_device_index())
        if isinstance(device, int):
            return device
        d = torch.device(device)
        return int(torch.accelerator.current_device_index() if d.index is None else d.index)

    def synchronize(device: Any = None) -> None:
        torch.accelerator.synchronize(_index(device))

    def get_device_name(device: Any = None) -> str:
        return "anydevice simulated accelerator"

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        free, total = torch.accelerator.get_memory_info(_index(device))
        return int(free), int(total)

    class device:  # torch.<backend>.device(i), a context manager, by torch's name
        """Make a device the current one inside a ``with`` block."""

        def __init__(self, device: Any) -> None:
            self.index = _index(device)
            self.previous = 0

        def __enter__(self) -> None:
            self.previous = int(torch.accelerator.current_device_index())
            torch.accelerator.set_device_index(self.index)

        def __exit__(self, *exc: object) -> None:
            torch.accelerator.set_device_index(self.previous)

    attrs: dict[str, Any] = {
        "device": device,
        "is_available": lambda: True,
        "device_count": device_count,
        "current_device": torch.accelerator.current_device_index,
        "set_device": torch.accelerator.set_device_index,
        "synchronize": synchronize,
        "get_device_name": get_device_name,
        "mem_get_info": mem_get_info,
        "is_initialized": lambda: True,
        # torch.autocast asks this of a privateuse1 module; the host's kernels take both.
        "get_amp_supported_dtype": lambda: [torch.float16, torch.bfloat16],
        # torch.manual_seed asks these of a privateuse1 module. Kernels run on the host
        # with the CPU's generator, which torch.manual_seed already seeds.
        "_is_in_bad_fork": lambda: False,
        "manual_seed_all": lambda seed: None,
        "manual_seed": lambda seed: None,
    }
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def enabled() -> str | None:
    """The name the simulator is enabled under in this process, or None."""
    return _name


def enable(
    name: str = "sim",
    *,
    bandwidth: float | str | None = "2GB/s",
    capacity: int | str | None = None,
    devices: int = 1,
) -> torch.device:
    """Add the simulated accelerator to torch in this process, and return its device.

    The first call builds the backend from C++ (about a minute; cached by content, so
    later calls and processes load it in a fraction of a second; the time is logged at
    INFO on logger ``anydevice``). Calling again with the same name changes the settings.

    Args:
        name: the device type (``torch.device(name)``; ``ad.device(name)``); a lowercase
            identifier that torch does not use already.
        bandwidth: the host-device link's speed in each direction (``"2GB/s"``, bytes per
            second, or None for copies that take no time).
        capacity: the memory of each device (``"1GiB"``, bytes, or None for the host's
            memory); an allocation beyond it raises ``torch.OutOfMemoryError``.
        devices: how many devices (1 to 16); fixed once the device is used.

    Returns:
        ``torch.device(name, 0)``.

    Raises:
        SimulatorError: another privateuse1 backend holds torch's slot in this process
            (torch holds one), the simulator is enabled under another name, or torch is
            older than :data:`MIN_TORCH`.
        ExtensionError: no C++ compiler or ninja here, or the build failed.
        DeviceSpecError: a bad name, bandwidth, capacity or device count.
    """
    global _name
    import torch

    if not (isinstance(name, str) and name.isidentifier() and name.islower()):
        raise DeviceSpecError(
            f"name={name!r} must be a lowercase identifier, e.g. 'sim', to become a device type"
        )
    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= 16:
        raise DeviceSpecError(f"devices={devices!r} must be a whole number from 1 to 16")
    per_second = parse_bandwidth(bandwidth)
    limit = _capacity_bytes(capacity)
    _check_torch()
    _check_slot(name)
    if _name is None:
        try:
            torch.device(name)
        except RuntimeError:
            pass
        else:
            raise DeviceSpecError(
                f"name={name!r} is a device type torch has already; pick another, e.g. 'sim'"
            )
    lib = _load()
    try:
        lib.set_device_count(devices)
    except RuntimeError as e:
        raise SimulatorError(str(e)) from None
    lib.set_bandwidth(0.0 if math.isinf(per_second) else per_second)
    lib.set_capacity(limit)
    if _name is None:
        from torch.utils.backend_registration import (
            generate_methods_for_privateuse1_backend,
            rename_privateuse1_backend,
        )

        lib.register_hooks()
        rename_privateuse1_backend(name)
        torch._register_device_module(name, _device_module(name, lib))
        generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
        # torch skips synchronising a device type it has not initialised yet: work queued
        # with busy() before any tensor or stream was made would be waited for by nobody.
        torch.accelerator.current_stream(torch.device(name, 0))
        _name = name
        logger.info(
            "anydevice.testing: %r enabled (%d device(s), link %s, capacity %s)",
            name,
            devices,
            "without delay" if math.isinf(per_second) else f"{per_second / 1e9:g} GB/s",
            "the host's memory" if limit < 0 else f"{limit} bytes",
        )
    return torch.device(name, 0)


def _library() -> Any:
    if _lib is None or _name is None:
        raise SimulatorError(
            "The simulated accelerator is not enabled in this process: call "
            "anydevice.testing.enable() first."
        )
    return _lib


def set_bandwidth(value: float | str | None) -> None:
    """Change the link's speed (``"2GB/s"``, bytes per second, None: no delay)."""
    per_second = parse_bandwidth(value)
    _library().set_bandwidth(0.0 if math.isinf(per_second) else per_second)


def bandwidth() -> float:
    """The link's speed in bytes per second (``math.inf``: copies take no time)."""
    value = float(_library().bandwidth())
    return math.inf if value <= 0 else value


def set_capacity(value: int | str | None) -> None:
    """Change each device's memory (``"1GiB"``, bytes, None: the host's memory)."""
    _library().set_capacity(_capacity_bytes(value))


def busy(seconds: float, device: Any = None) -> None:
    """Queue ``seconds`` of simulated device work on the current stream, and return at
    once, as a kernel launch does on a GPU: the stream's later work, its events and any
    wait for it come after it.

    Args:
        seconds: how long the device is busy.
        device: the device: an index, ``"sim:1"``, a ``torch.device`` (default, or
            without an index: the current device).
    """
    if not (isinstance(seconds, (int, float)) and 0 <= seconds < math.inf):
        raise DeviceSpecError(f"seconds={seconds!r} must be a finite number >= 0")
    _library().busy(float(seconds), _index(device))


def _index(device: Any) -> int:
    """The device index ``device`` names (-1: the current device)."""
    import torch

    if device is None:
        return -1
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise DeviceSpecError(
            f"device={device!r} is not a device: pass an index, 'NAME:i' or a torch.device"
        ) from e
    return -1 if dev.index is None else dev.index


class Span(NamedTuple):
    """A piece of work a stream's worker did: a copy over the link or busy time."""

    what: str  #: "h2d" (host to device), "d2h" (device to host) or "busy"
    device: int
    stream: int  #: the stream's id (0: the device's default stream)
    bytes: int  #: copied (0 for busy time)
    start: float  #: seconds on the monotonic clock (``time.monotonic()``)
    end: float


@contextmanager
def trace() -> Iterator[list[Span]]:
    """Record the copies and busy time the workers run during the block.

    The list yielded is filled when the block ends, in the order the work finished;
    synchronise before the end to include work still queued. For ordering facts (the copy
    of batch k+1 started before the compute of batch k ended) on the simulator's own
    clock, not on wall-clock thresholds.
    """
    lib = _library()
    lib.take_trace()
    lib.set_tracing(True)
    spans: list[Span] = []
    try:
        yield spans
    finally:
        lib.set_tracing(False)
        spans.extend(Span(*s) for s in lib.take_trace())
