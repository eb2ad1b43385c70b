"""The simulated accelerator: build, register, configure.

:func:`enable` builds the C++ sources beside this file (``device.cpp``, ``memory.cpp``,
``pinned.cpp``, ``kernels.cpp``, ``recurrent_cells.cpp``, ``races.cpp``, ``watch.cpp``,
``module.cpp``, in two files built in parallel: ``sim_operators.cpp`` and
``sim_runtime.cpp``) with
:func:`anydevice.load_extension` (once per source, compiler and torch: later calls, in
any process, load the cached library), then registers it as torch's ``privateuse1``
backend under the name given, with a device module (``torch.<name>``) and the tensor
methods torch generates for such backends (``tensor.sim()``, ``tensor.is_sim``), and
starts the stream race detector (:mod:`anydevice.testing.races`) on it.

What it models, and why each rule holds (the C++ sources say the same beside the code):

- **Memory.** A caching allocator with CUDA's rules: blocks rounded to 512 bytes, cut
  from 2 MiB or 20 MiB segments, cached after a free (reserved memory exceeds allocated
  memory), reused at once by the stream that allocated them and by another stream only
  after the work ``record_stream`` recorded is done. Every allocation is filled with 0xFF
  bytes on its stream: NaN for every IEEE float type, -1 for signed integers, the maximum
  for unsigned ones; bool tensors start ``True``. A read that comes before the write shows.
- **Streams.** Each stream is a queue run in order by a worker thread.
- **Kernels** are torch's CPU kernels, run asynchronously by the stream's worker on the
  device memory: the host returns at once (the meta kernel gives the outputs' shapes), so
  it runs ahead of the device, and a kernel on a stream that did not wait reads whatever
  is there when it runs. The host waits where a GPU's does: ``.item()``, ``nonzero``,
  boolean indexing, a blocking copy. Random operators run on the host after their stream,
  so they draw from the CPU's generator in program order.
- **Copies.** From pinned host memory with ``non_blocking=True``, into pinned memory with
  ``non_blocking=True``, and between devices: queued, the host goes on. From pageable
  memory with ``non_blocking=True``: the host waits for the stream, stages the bytes and
  goes on (as CUDA's driver does); any other copy waits for its own completion.
- **The link.** Host-device copies take ``bytes / bandwidth`` (one link per direction
  and device, shared by the streams that copy that way, like a GPU's copy engines); the
  bytes land at the end of that time.
- **Events** are reached when their stream's worker gets to them and take the worker's
  clock then; ``wait_event`` / ``wait_stream`` queue a wait on the worker.
- **Failures.** A kernel that fails on the worker (an index out of range) is reported at
  the host's next wait for its stream or next launch on it, as a GPU reports a failed
  kernel at a later call.

What it does not model: Tensor Cores or reduced-precision matmul modes, collectives,
CUDA graphs, ``torch.compile``.
"""

from __future__ import annotations

import atexit
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

from anydevice.errors import AnydeviceError, DeviceSpecError
from anydevice.testing import device_module
from anydevice.testing.autograd_threads import release_autograd_threads
from anydevice.testing.races import RaceMode, check_mode, start as start_races

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_BANDWIDTH",
    "MAX_BUSY",
    "MAX_CAPACITY",
    "MIN_BANDWIDTH",
    "MIN_TORCH",
    "SimulatorError",
    "Span",
    "bandwidth",
    "busy",
    "detect_races",
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
#: The simulator's C++ sources, shipped beside this file: two files that include the
#: others, so the heavy headers are read twice and the two build in parallel.
SOURCES = (
    Path(__file__).with_name("sim_operators.cpp"),
    Path(__file__).with_name("sim_runtime.cpp"),
)
#: What they include: part of the build cache's key.
DEPENDS = tuple(
    Path(__file__).with_name(name)
    for name in (
        "kernels.cpp",
        "recurrent_cells.cpp",
        "watch.cpp",
        "device.cpp",
        "memory.cpp",
        "pinned.cpp",
        "races.cpp",
        "module.cpp",
        "sim.h",
        "races.h",
        "boxed.h",
    )
)
#: The range of a link's speed, bytes per second (beyond it, pass None: no delay).
MIN_BANDWIDTH = 1e3
MAX_BANDWIDTH = 1e15
#: The most device memory a simulated device may have, in bytes (1 EiB).
MAX_CAPACITY = 2**60
#: The longest ``busy()`` call, in seconds.
MAX_BUSY = 3600.0
#: The compiler's flags, each of which makes the build cheaper (bench_races.py --build):
#: -O1 builds faster than -O2 and runs torch's kernels (compiled in torch) just as fast;
#: the simulator's own code is a small part of the time. NDEBUG, as torch itself is built:
#: its headers' debug-only checks (code generated in every operator call the simulator
#: makes) are left out, and their structures match the library's (at::RecordFunction has a
#: field only without it). AT_PER_OPERATOR_HEADERS: torch's headers include the headers of
#: the operators they use (ATen/ops/*.h), not those of every operator (ATen/Functions.h).
_CFLAGS = ("-O1", "-DNDEBUG", "-DAT_PER_OPERATOR_HEADERS")
#: What the first build takes (measured: benchmarks/bench_races.py --build; docs/testing.md).
_BUILD_SECONDS = "15 s on two idle cores, 40 s on two busy ones"
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
            f"bandwidth={value!r} must be text such as '2GB/s', a number or None, not "
            f"{type(value).__name__}"
        )
    else:
        per_second = float(value)
    if math.isinf(per_second) and per_second > 0:
        return math.inf
    if not MIN_BANDWIDTH <= per_second <= MAX_BANDWIDTH:
        raise DeviceSpecError(
            f"bandwidth={value!r} is out of range: a link's speed is {MIN_BANDWIDTH:g} to "
            f"{MAX_BANDWIDTH:g} bytes per second (e.g. '2GB/s'); use None for a link "
            "without delay"
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
    if not 0 < size <= MAX_CAPACITY:
        raise DeviceSpecError(
            f"capacity={capacity!r} is out of range: a device's memory is 1 byte to "
            f"{MAX_CAPACITY} bytes (1 EiB), e.g. '16GiB'; or None for the host's memory"
        )
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


def load() -> Any:
    """The simulator's extension module: built on first use (said before, with the time
    it takes, and after, at WARNING, which Python shows by default), then loaded from the
    build cache. Loading it registers nothing with torch."""
    global _lib
    if _lib is None:
        from anydevice.extension import is_built, load_extension

        building = not is_built(_EXTENSION, SOURCES, extra_cflags=_CFLAGS, depends=DEPENDS)
        if building:
            logger.warning(
                "anydevice.testing: building the simulated accelerator from C++, once for this "
                "torch and compiler (%s; cached in %s)",
                _BUILD_SECONDS,
                _cache(),
            )
        t0 = time.perf_counter()
        _lib = load_extension(_EXTENSION, SOURCES, extra_cflags=_CFLAGS, depends=DEPENDS)
        seconds = time.perf_counter() - t0
        if building:
            logger.warning("anydevice.testing: built the simulated accelerator in %.0f s", seconds)
        else:
            logger.info("anydevice.testing: loaded the simulated accelerator in %.2f s", seconds)
    return _lib


def _cache() -> str:
    from anydevice.extension import cache_root

    return str(cache_root())


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
    device_module.extend(mod, name)  # streams, events, memory: as torch.cuda has them
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
    races: RaceMode = "raise",
) -> torch.device:
    """Add the simulated accelerator to torch in this process, and return its device.

    The first call builds the backend from C++ (15 s on two idle cores, 40 s on two busy
    ones; said before and after on logger ``anydevice`` at WARNING; cached by content,
    so later calls and processes load it in a fraction of a second). Calling again with the
    same name changes the settings.

    The stream race detector (:mod:`anydevice.testing.races`) watches it from the start:
    two accesses to a tensor's memory that nothing orders (a missing ``wait_stream``, a
    non-blocking copy read before a synchronisation, a tensor freed without
    ``record_stream`` while another stream reads it, ``elapsed_time`` before the event is
    known complete) raise :class:`~anydevice.testing.StreamRaceError` at the second one,
    naming both lines of the user's code and the fix.

    Args:
        name: the device type (``torch.device(name)``; ``ad.device(name)``); a lowercase
            identifier that torch does not use already.
        bandwidth: the host-device link's speed in each direction (``"2GB/s"``, bytes per
            second, or None for copies that take no time).
        capacity: the memory of each device (``"1GiB"``, bytes, or None for the host's
            memory); an allocation beyond it raises ``torch.OutOfMemoryError``.
        devices: how many devices (1 to 16); fixed once the device is used.
        races: what a stream race does: ``"raise"`` (:class:`StreamRaceError` at the
            racing call), ``"warn"`` (a :class:`StreamRaceWarning`, and the program goes
            on) or ``"off"`` (the detector costs nothing then).

    Returns:
        ``torch.device(name, 0)``.

    Raises:
        SimulatorError: another privateuse1 backend holds torch's slot in this process
            (torch holds one), the simulator is enabled under another name, or torch is
            older than :data:`MIN_TORCH`.
        ExtensionError: no C++ compiler or ninja here, or the build failed.
        DeviceSpecError: a bad name, bandwidth, capacity, device count or races mode.
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
    check_mode(races)
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
    lib = load()
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

        lib.register_device()
        rename_privateuse1_backend(name)
        torch._register_device_module(name, _device_module(name, lib))
        generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
        # torch skips synchronising a device type it has not initialised yet: work queued
        # with busy() before any tensor or stream was made would be waited for by nobody.
        torch.accelerator.current_stream(torch.device(name, 0))
        atexit.register(release_autograd_threads, name)  # or exiting may abort
        _name = name
        start_races(lib, name, simulated=True, mode=races)
        logger.info(
            "anydevice.testing: %r enabled (%d device(s), link %s, capacity %s)",
            name,
            devices,
            "without delay" if math.isinf(per_second) else f"{per_second / 1e9:g} GB/s",
            "the host's memory" if limit < 0 else f"{limit} bytes",
        )
    else:
        start_races(lib, name, simulated=True, mode=races)
    return torch.device(name, 0)


def detect_races(mode: RaceMode = "raise") -> None:
    """Watch torch's current accelerator for stream races in this process, from now on.

    On the simulated accelerator it is on already (``enable(races=...)``); on a real one
    (CUDA, XPU, a privateuse1 backend) this turns it on, through torch's device-generic
    API: streams, events and waits made with ``torch.Stream``, ``torch.Event`` and
    ``torch.accelerator`` are seen (those made with a device's own module, such as
    ``torch.cuda.Stream``, are not: the detector then takes their waits for missing).
    Start it before the streams and events the program makes. It needs the simulator's
    extension (built from C++ on first use, 15 s to a minute, then cached). Calling it
    again changes the mode.

    Args:
        mode: ``"raise"``: :class:`StreamRaceError` at the second access of a race;
            ``"warn"``: a :class:`StreamRaceWarning`, and the program goes on; ``"off"``.

    Raises:
        DeviceSpecError: ``mode`` is not one of them.
        AnydeviceError: torch has no accelerator here.
        ExtensionError: the extension cannot be built (no compiler or ninja).
    """
    check_mode(mode)
    import torch

    from anydevice.testing import races

    if races._lib is not None:
        races._set_mode(mode)
        return
    if mode == "off":
        return
    current = torch.accelerator.current_accelerator()
    if current is None:
        raise AnydeviceError(
            "detect_races(): torch has no accelerator in this process, so there are no "
            "streams to race; on a machine without one, run on the simulator "
            "(anydevice.testing.enable(), where the detector is on by default)"
        )
    start_races(load(), current.type, simulated=current.type == enabled(), mode=mode)


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
    limit = _capacity_bytes(value)
    _library().set_capacity(limit)


def busy(seconds: float, device: Any = None) -> None:
    """Queue ``seconds`` of simulated device work on the current stream, and return at
    once, as a kernel launch does on a GPU: the stream's later work, its events and any
    wait for it come after it.

    Args:
        seconds: how long the device is busy.
        device: the device: an index, ``"sim:1"``, a ``torch.device`` (default, or
            without an index: the current device).
    """
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not 0 <= seconds <= MAX_BUSY
    ):
        raise DeviceSpecError(
            f"seconds={seconds!r} is out of range: busy() takes a number of seconds from 0 to "
            f"{MAX_BUSY:g}"
        )
    lib = _library()
    lib.busy(float(seconds), _index(device, int(lib.device_count())))


def _index(device: Any, count: int) -> int:
    """The device index ``device`` names (-1: the current device)."""
    import torch

    if device is None:
        return -1
    if isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        try:
            dev = torch.device(device)
        except (TypeError, RuntimeError) as e:
            raise DeviceSpecError(
                f"device={device!r} is not a device: pass an index, '{_name}:i' or a torch.device"
            ) from e
        if dev.type != _name:
            raise DeviceSpecError(
                f"device={device!r} is not the simulated accelerator; pass an index or '{_name}:i'"
            )
        if dev.index is None:
            return -1
        index = dev.index
    if not 0 <= index < count:
        raise DeviceSpecError(
            f"device={device!r} is out of range: the simulator has {count} device(s) "
            f"(indices 0 to {count - 1}); enable(devices=N) sets how many"
        )
    return index


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
