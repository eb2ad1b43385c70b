"""What the simulator's device module (``torch.sim``) offers beyond what torch asks of a
backend: streams, events, the current and default stream, and the allocator's counters.

These are the names CUDA code finds in ``torch.cuda`` (``Stream``, ``Event``,
``current_stream``, ``default_stream``, ``set_stream``, ``stream``, ``memory_allocated``,
...), so ``torch.get_device_module("sim")`` answers as ``torch.cuda`` does, and the
simulated CUDA (:mod:`anydevice.testing.cuda`) is this module with CUDA's device names.
Each is written on torch's device-generic API (``torch.Stream``, ``torch.Event``,
``torch.accelerator``): the streams and events are the simulator's own, so waits and
records reach its workers.

>>> "Stream" in NAMES and "memory_allocated" in NAMES
True
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["NAMES", "alias", "extend", "index_of"]

#: The names :func:`extend` adds to the device module.
NAMES = (
    "Event",
    "Stream",
    "current_stream",
    "default_stream",
    "empty_cache",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_stream",
    "stream",
    "StreamContext",
    "get_rng_state",
    "get_rng_state_all",
    "initial_seed",
    "seed",
    "seed_all",
    "set_rng_state",
    "set_rng_state_all",
)


def index_of(device: Any, kind: str) -> int:
    """The device index ``device`` names on a device type ``kind``: None or a negative
    number is the current device; an int, ``"kind:i"``, or a ``torch.device`` of that type.

    Raises:
        ValueError: a device of another type (as torch's ``torch.cuda`` functions do).
    """
    import torch

    if device is None:
        return int(torch.accelerator.current_device_index())
    if isinstance(device, int) and not isinstance(device, bool):
        return int(torch.accelerator.current_device_index()) if device < 0 else device
    dev = torch.device(device) if isinstance(device, str) else device
    if not isinstance(dev, torch.device) or dev.type != kind:
        raise ValueError(f"Expected a {kind} device, but got: {device!r}")
    return int(torch.accelerator.current_device_index()) if dev.index is None else dev.index


def alias(base: type, name: str, module: str, doc: str, **members: Any) -> type:
    """A class named ``module.name`` whose construction (its ``__new__``, in ``members``)
    gives objects of torch's ``base`` itself, and for which ``isinstance`` holds for every
    ``base`` object: what torch's C code checks by exact type (``torch.Event``) can then
    have a device module's name.
    """

    class Alias(type(base)):  # type: ignore[misc]
        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, base)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, base)

    made = Alias(name, (base,), {**members, "__doc__": doc, "__module__": module})
    made.__qualname__ = name
    return made


def extend(mod: ModuleType, name: str) -> None:
    """Add :data:`NAMES` to ``mod``, the device module of the simulator registered as
    ``name``."""
    for key, value in _members(name).items():
        setattr(mod, key, value)


def _members(name: str) -> dict[str, Any]:
    import torch

    def index(device: Any) -> int:
        return index_of(device, name)

    class Stream(torch.Stream):
        """A stream of the simulator: a queue run in order by a worker thread.

        ``Stream(device=None, priority=0)``: a new stream on ``device`` (default: the
        current one), from a pool of 31 handed out round-robin, as CUDA's is.
        """

        def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Any:
            if "stream_id" in kwargs:  # wrap an existing stream
                return super().__new__(cls, **kwargs)
            return super().__new__(cls, torch.device(name, index(device)), priority=priority)

    def new_event(
        cls: type, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> torch.Event:
        if interprocess:
            raise NotImplementedError(
                f"interprocess events are not simulated: {name!r} devices belong to one "
                "process. Pass interprocess=False."
            )
        return torch.Event(enable_timing=enable_timing, blocking=blocking)

    Event = alias(
        torch.Event,
        "Event",
        f"torch.{name}",
        __new__=new_event,
        doc="""An event of the simulator, bound to a device where it is first recorded.

        ``Event(enable_timing=False, blocking=False)`` gives torch's ``torch.Event``
        itself: torch times only two ``torch.Event`` objects of that very type
        (``elapsed_time`` refuses subclasses). ``interprocess`` events are not simulated.
        """,
    )

    def wrap(stream: torch.Stream) -> Any:
        return Stream(
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )

    def current_stream(device: Any = None) -> Any:
        """The stream current on ``device`` for the calling thread."""
        return wrap(torch.accelerator.current_stream(index(device)))

    def default_stream(device: Any = None) -> Any:
        """The default stream (stream 0) of ``device``."""
        current = torch.accelerator.current_stream(index(device))
        return Stream(
            stream_id=0, device_index=current.device_index, device_type=current.device_type
        )

    def set_stream(stream: torch.Stream) -> None:
        """Make ``stream`` current (and its device the current device)."""
        torch.accelerator.set_stream(stream)

    class StreamContext:
        """``with stream(s):`` makes ``s`` current for the block; the stream and device
        current before come back after it (``None``: nothing changes). Each block keeps
        what it restores, so one stream may be entered by several threads."""

        def __init__(self, stream: torch.Stream | None) -> None:
            self.stream = stream
            self._saved: list[tuple[int, torch.Stream]] = []

        def __enter__(self) -> torch.Stream | None:
            if self.stream is None:
                return None
            device = int(torch.accelerator.current_device_index())
            before = torch.accelerator.current_stream(self.stream.device_index)
            self._saved.append((device, before))
            torch.accelerator.set_stream(self.stream)
            return self.stream

        def __exit__(self, *exc: object) -> None:
            if self.stream is None:
                return
            device, before = self._saved.pop()
            torch.accelerator.set_stream(before)
            torch.accelerator.set_device_index(device)

    def stream(stream: torch.Stream | None) -> StreamContext:
        """A context manager that makes ``stream`` current for a block."""
        return StreamContext(stream)

    # Random numbers: kernels run on the host and draw from the CPU's generator, which
    # torch.manual_seed seeds (the module's manual_seed, seed and seed_all do nothing).
    def get_rng_state(device: Any = name) -> torch.Tensor:
        """The state of the generator the devices draw from: the CPU's."""
        index(device)
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = name) -> None:
        """Set the state of the generator the devices draw from: the CPU's."""
        index(device)
        torch.set_rng_state(new_state)

    def get_rng_state_all() -> list[torch.Tensor]:
        """:func:`get_rng_state` once per device (they share the CPU's generator)."""
        return [torch.get_rng_state() for _ in range(torch.accelerator.device_count())]

    def set_rng_state_all(new_states: Any) -> None:
        """Set the CPU generator's state from the first of ``new_states``."""
        states = list(new_states)
        if states:
            torch.set_rng_state(states[0])

    memory = torch.accelerator.memory

    def on_device(read: Callable[[int], Any], doc: str) -> Callable[..., Any]:
        def call(device: Any = None) -> Any:
            return read(index(device))

        call.__doc__ = doc
        return call

    members: dict[str, Any] = {
        "Stream": Stream,
        "Event": Event,
        "StreamContext": StreamContext,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "set_stream": set_stream,
        "stream": stream,
        "empty_cache": memory.empty_cache,
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "get_rng_state_all": get_rng_state_all,
        "set_rng_state_all": set_rng_state_all,
        "initial_seed": torch.initial_seed,
        "seed": lambda: None,
        "seed_all": lambda: None,
    }
    for key in (
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "max_memory_reserved",
        "memory_stats",
        "reset_peak_memory_stats",
        "reset_accumulated_memory_stats",
    ):
        members[key] = on_device(getattr(memory, key), getattr(memory, key).__doc__ or "")
    for key, value in members.items():
        if callable(value) and hasattr(value, "__qualname__"):
            value.__qualname__ = key
            value.__module__ = f"torch.{name}"
    return members
