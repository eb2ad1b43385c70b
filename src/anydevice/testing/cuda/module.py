"""``torch.cuda`` answered by the simulated devices: what each mapped name does instead.

Streams and events are the simulator's own (subclasses of ``torch.sim.Stream`` and
``torch.sim.Event``, themselves ``torch.Stream`` and ``torch.Event``), so every record and
wait reaches its workers, and whatever watches those sees CUDA code's streams; they read
back CUDA's device names. Memory counters, synchronisation and the current device are the
simulator's, through ``torch.accelerator``. Device facts are those of a nominal GPU of
compute capability :data:`CAPABILITY` (code takes the paths of a current GPU: bf16, TF32)
with the simulator's memory; the name says what it is.

Random numbers on the simulated devices come from the CPU's generator (kernels are the
CPU's): ``torch.manual_seed`` seeds them; ``torch.cuda.manual_seed`` and its siblings seed
nothing of their own, so a program gives the numbers it gives on the CPU, and the RNG
state functions read and write the CPU generator's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from anydevice.testing.cuda.devices import CUDA
from anydevice.testing.cuda.refused import refuse
from anydevice.testing.device_module import alias

__all__ = ["CAPABILITY", "CLOCK_KHZ", "NAME", "DeviceProperties", "Simulated", "index"]

#: The compute capability the simulated GPUs report.
CAPABILITY = (8, 0)
#: What ``torch.cuda.get_device_name`` says.
NAME = "anydevice simulated GPU"
#: The simulated GPUs' nominal clock, kHz (``get_device_properties().clock_rate``, as
#: CUDA reports it): what ``torch.cuda._sleep(cycles)`` counts its cycles in.
CLOCK_KHZ = 1_410_000


@dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` reports for a simulated GPU: its memory,
    and nominal values of a GPU of compute capability 8.0 for the rest (they describe no
    hardware; the simulator runs kernels on the host)."""

    name: str
    total_memory: int
    major: int = CAPABILITY[0]
    minor: int = CAPABILITY[1]
    multi_processor_count: int = 108
    max_threads_per_multi_processor: int = 2048
    regs_per_multiprocessor: int = 65536
    warp_size: int = 32
    L2_cache_size: int = 40 * 2**20
    clock_rate: int = CLOCK_KHZ
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    uuid: str = ""
    pci_bus_id: int = 0
    pci_device_id: int = 0
    pci_domain_id: int = 0

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
            f"minor={self.minor}, total_memory={self.total_memory // 2**20}MB, "
            f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
            f"L2_cache_size={self.L2_cache_size // 2**20}MB)"
        )


def index(device: Any, sim: str) -> int:
    """The device index a ``torch.cuda`` function's ``device`` argument names: None or a
    negative int is the current device; an int, ``"cuda:k"``, ``torch.device("cuda", k)``
    (or the simulator's own name for it).

    Raises:
        ValueError: a device of another type, as ``torch.cuda`` does.
    """
    if device is None:
        return int(torch.accelerator.current_device_index())
    if isinstance(device, int) and not isinstance(device, bool):
        return int(torch.accelerator.current_device_index()) if device < 0 else device
    dev = torch.device(device) if isinstance(device, str) else device
    if not isinstance(dev, torch.device) or dev.type not in (CUDA, sim):
        raise ValueError(f"Expected a cuda device, but got: {device}")
    return int(torch.accelerator.current_device_index()) if dev.index is None else dev.index


class Simulated:
    """The mapped ``torch.cuda`` names of one run, on the simulator registered as ``sim``
    (its device module ``torch.<sim>``)."""

    def __init__(self, sim: str) -> None:
        self.sim = sim
        self.mod: ModuleType = torch.get_device_module(sim)
        #: Each device's memory when the run began: what a memory fraction is of.
        self.total = int(torch.accelerator.get_memory_info(0)[1])
        self.Stream, self.Event = self._classes()

    def index(self, device: Any) -> int:
        """See :func:`index`."""
        return index(device, self.sim)

    # ------------------------------------------------------------------ streams, events
    def _classes(self) -> tuple[type, type]:
        sim_stream: Any = self.mod.Stream
        torch_event: Any = self.mod.Event.__bases__[0]  # torch.Event itself
        run = self

        class Stream(sim_stream):  # type: ignore[misc]
            """A CUDA stream of the simulated GPU: a queue run in order by a worker."""

            def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Any:
                if "stream_id" in kwargs or "stream_ptr" in kwargs:
                    if "stream_ptr" in kwargs:
                        refuse(
                            "torch.cuda.ExternalStream",
                            "it wraps a stream another library made on a real GPU",
                        )
                    return super().__new__(cls, **kwargs)
                return super().__new__(cls, run.index(device), priority)

            @property
            def device(self) -> torch.device:
                return torch.device(CUDA, self.device_index)

            @property
            def cuda_stream(self) -> int:
                """The simulator's stream id (a handle, not a ``cudaStream_t``)."""
                return int(self.stream_id)

            def record_event(self, event: Any = None) -> Any:
                event = Event() if event is None else event
                event.record(self)
                return event

            def __repr__(self) -> str:
                return f"<torch.cuda.Stream device={self.device} cuda_stream={self.cuda_stream:#x}>"

        def new_event(
            cls: type,
            enable_timing: bool = False,
            blocking: bool = False,
            interprocess: bool = False,
            external: bool = False,
        ) -> Any:
            if interprocess:
                refuse(
                    "torch.cuda.Event(interprocess=True)",
                    "the simulated GPUs belong to one process: there is no IPC",
                )
            return torch_event(enable_timing=enable_timing, blocking=blocking)

        def from_ipc_handle(cls: type, device: Any, handle: Any) -> Any:
            refuse("torch.cuda.Event.from_ipc_handle", "there is no IPC between processes")

        Event = alias(
            torch_event,
            "Event",
            "torch.cuda",
            doc="""A CUDA event of the simulated GPU: torch's ``torch.Event`` itself (its
            ``elapsed_time`` times only that very type), recorded, waited for and timed on
            the simulator's workers; ``event.device`` says the simulator's name.""",
            __new__=new_event,
            from_ipc_handle=classmethod(from_ipc_handle),
        )

        Stream.__module__ = "torch.cuda"
        return Stream, Event

    def _wrap(self, stream: torch.Stream) -> Any:
        return self.Stream(
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )

    def current_stream(self, device: Any = None) -> Any:
        """The stream current on ``device`` for the calling thread."""
        return self._wrap(torch.accelerator.current_stream(self.index(device)))

    def default_stream(self, device: Any = None) -> Any:
        """The default stream of ``device``."""
        return self._wrap(self.mod.default_stream(self.index(device)))

    # ------------------------------------------------------------------ devices
    def set_device(self, device: Any) -> None:
        """Make ``device`` current (a negative index or None: nothing changes)."""
        if device is None or (isinstance(device, int) and device < 0):
            return
        torch.accelerator.set_device_index(self.index(device))

    def device_class(self) -> type:
        """``torch.cuda.device``: a context manager that makes a device current."""
        run = self

        class device:
            """Make a device current inside a ``with`` block (None or a negative index:
            nothing changes)."""

            def __init__(self, device: Any) -> None:
                none = device is None or (isinstance(device, int) and device < 0)
                self.idx = -1 if none else run.index(device)
                self.prev_idx = -1

            def __enter__(self) -> None:
                self.prev_idx = int(torch.accelerator.current_device_index())
                if self.idx >= 0:
                    torch.accelerator.set_device_index(self.idx)

            def __exit__(self, *exc: object) -> None:
                if self.idx >= 0:
                    torch.accelerator.set_device_index(self.prev_idx)

        class device_of(device):
            """``device`` of a tensor or storage on a simulated GPU; a no-op for others."""

            def __init__(self, obj: Any) -> None:
                on = obj.device.type in (CUDA, run.sim)
                super().__init__(obj.get_device() if on else -1)

        for cls in (device, device_of):
            cls.__module__ = "torch.cuda"
        self.device_of = device_of
        return device

    def get_device_properties(self, device: Any = None) -> DeviceProperties:
        """A nominal GPU's facts with the simulator's memory (see :class:`DeviceProperties`)."""
        i = self.index(device)
        self._check(i)
        _, total = torch.accelerator.get_memory_info(i)
        return DeviceProperties(name=NAME, total_memory=int(total), uuid=f"GPU-simulated-{i}")

    def get_device_name(self, device: Any = None) -> str:
        """The simulated GPU's name."""
        self._check(self.index(device))
        return NAME

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        """:data:`CAPABILITY`, for every simulated GPU."""
        self._check(self.index(device))
        return CAPABILITY

    def can_device_access_peer(self, device: Any, peer_device: Any) -> bool:
        """Whether ``device`` reads ``peer_device``'s memory directly: True for two
        different simulated GPUs (the simulator copies between them)."""
        a, b = self.index(device), self.index(peer_device)
        self._check(a)
        self._check(b)
        return a != b

    def _check(self, i: int) -> None:
        count = torch.accelerator.device_count()
        if not 0 <= i < count:
            raise AssertionError(f"Invalid device id: {i} ({count} simulated GPU(s))")

    def synchronize(self, device: Any = None) -> None:
        """Wait for the work queued on ``device``'s streams."""
        torch.accelerator.synchronize(self.index(device))

    # ------------------------------------------------------------------ memory
    def on_device(self, read: Callable[[int], Any], name: str) -> Callable[..., Any]:
        """``torch.cuda.<name>(device=None)`` reading the simulator's allocator."""

        def call(device: Any = None) -> Any:
            return read(self.index(device))

        call.__name__ = call.__qualname__ = name
        call.__doc__ = f"torch.cuda.{name}, read from the simulated GPU's allocator."
        return call

    def memory_stats_as_nested_dict(self, device: Any = None) -> dict[str, Any]:
        """``memory_stats`` with its dotted keys as nested dictionaries."""
        nested: dict[str, Any] = {}
        for key, value in self.mod.memory_stats(self.index(device)).items():
            *path, last = key.split(".")
            node = nested
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        return nested

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """(free, total) bytes of the simulated GPU."""
        free, total = torch.accelerator.get_memory_info(self.index(device))
        return int(free), int(total)

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        """Cap every simulated GPU at ``fraction`` of its memory (the simulator has one
        capacity for all of its devices): an allocation beyond raises
        ``torch.OutOfMemoryError``."""
        from anydevice.testing.simulator import set_capacity

        if not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.index(device)
        set_capacity(max(1, int(fraction * self.total)))

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        """The share of a simulated GPU's memory this process may allocate."""
        _, total = self.mem_get_info(device)
        return total / self.total

    # ------------------------------------------------------------------ debugging
    def sleep(self, cycles: int) -> None:
        """``torch.cuda._sleep(cycles)``: a kernel that spins the current GPU for
        ``cycles`` clock cycles, queued on the current stream (GPU tests use it to keep a
        stream busy): that long of :func:`anydevice.testing.busy` at :data:`CLOCK_KHZ`."""
        from anydevice.testing.simulator import busy

        if isinstance(cycles, bool) or not isinstance(cycles, int) or cycles < 0:
            raise TypeError(f"torch.cuda._sleep(cycles={cycles!r}): cycles is a count >= 0")
        busy(cycles / (CLOCK_KHZ * 1e3))

    def set_sync_debug_mode(self, debug_mode: int | str) -> None:
        """Accept the default mode only: the simulator has no sync debug mode."""
        if debug_mode not in (0, "default"):
            refuse(
                f"torch.cuda.set_sync_debug_mode({debug_mode!r})",
                "the simulator does not flag synchronising calls",
                "To find them, run ad.find_syncs(fn, *args) where a GPU is (it takes CUDA's "
                "own sync debug mode).",
            )


@contextlib.contextmanager
def _nothing(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield


def nvtx_members() -> dict[str, Any]:
    """``torch.cuda.nvtx``'s functions as no-ops (no profiler is attached to read them);
    ``range_push`` returns the depth it would have, ``range_start`` an id."""
    depth = [0]

    def range_push(msg: str) -> int:
        depth[0] += 1
        return depth[0] - 1

    def range_pop() -> int:
        depth[0] = max(0, depth[0] - 1)
        return depth[0]

    def range_start(msg: str) -> int:
        return 0

    def range_end(range_id: int) -> None:
        return None

    def mark(msg: str) -> None:
        return None

    return {
        "range_push": range_push,
        "range_pop": range_pop,
        "range_start": range_start,
        "range_end": range_end,
        "mark": mark,
        "range": _nothing,
    }


def profiler_members() -> dict[str, Any]:
    """``torch.cuda.profiler``: ``start``, ``stop`` and ``profile`` as no-ops (no CUDA
    profiler is attached); ``cudart`` and ``check_error`` refuse (raw CUDA runtime)."""
    return {"start": lambda: None, "stop": lambda: None, "profile": _nothing}
