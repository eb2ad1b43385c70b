"""The one small interface every device backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from anydevice.hardware.backends.kind import Kind
from anydevice.hardware.facts import DeviceInfo, HostInfo

if TYPE_CHECKING:
    import torch

__all__ = ["META", "Backend", "Counters", "Probe", "device_module"]


@dataclass(frozen=True)
class Counters:
    """One reading of a device's memory counters, in bytes."""

    allocated: int
    reserved: int | None = None
    peak: int | None = None
    peak_reserved: int | None = None
    retries: int | None = None
    ooms: int | None = None


@dataclass(frozen=True)
class Probe:
    """What one backend found: its devices, host facts it knows, and notes on what it could not."""

    devices: tuple[DeviceInfo, ...] = ()
    host: Mapping[str, Any] = field(default_factory=dict)  #: HostInfo fields, by name
    notes: tuple[str, ...] = ()


class Backend(ABC):
    """A device kind (``cuda``, ``mps``, ...) as torch sees it.

    Backends are the only code that touches hardware. They must be cheap and safe to ask:
    no CUDA context, no import of optional packages that are not installed.

    Two halves. *Discovery* (:meth:`probe` and friends) describes the devices without using
    them. The *run time* (:meth:`stream_device`, :meth:`new_stream`, :meth:`use_stream`,
    :meth:`new_event`, ...) is what feature code asks of a device it works on; it is written
    once here on torch's device-generic API (``torch.accelerator``, ``torch.Stream``,
    ``torch.Event``), which covers CUDA, XPU and privateuse1 backends alike, so the code a
    test runs on the simulated accelerator is the code a GPU runs. A kind states what it
    adds or lacks with the flags below; feature code never asks which kind it is on.

    What the rest of the package needs to know about the kind without running anything
    (its spec words, whether it is a GPU, its collective backend, its precision policy)
    is its :attr:`facts`, one :class:`~anydevice.hardware.backends.kind.Kind` record.
    """

    #: The kind's facts; :attr:`kind` is its name.
    facts: ClassVar[Kind]
    kind: ClassVar[str]
    #: Shown to users: "NVIDIA CUDA", "Apple MPS", ...
    label: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "facts" in cls.__dict__:
            cls.kind = cls.facts.name

    #: The device is the host itself (the CPU): its memory is the process's resident set,
    #: nothing is copied to reach it, and nothing is queued.
    is_host: ClassVar[bool] = False
    #: Work runs on eager streams, ordered through ``torch.Stream``/``torch.Event`` (when
    #: the kind is torch's current accelerator). False: MPS (one queue), XLA (a graph),
    #: the CPU; their side streams are no-ops and their copies synchronous.
    has_streams: ClassVar[bool] = False
    #: ``Tensor.record_stream`` works: a tensor read on another stream keeps its block until
    #: that stream is past the free (CUDA). Without it, that stream joins the ones later
    #: allocations wait for.
    records_streams: ClassVar[bool] = False
    #: An event may be recorded again once its waits are issued (CUDA). Without it, a new
    #: event per use: a backend may read an event only when the waiting stream reaches it.
    reuses_events: ClassVar[bool] = False
    #: Pinned host memory is part of the kind: a failure to pin is an error, not a backend
    #: without pinned memory.
    pins_surely: ClassVar[bool] = False
    #: The allocator keeps a peak counter that can be restarted (CUDA's caching allocator
    #: and the backends that share its API). Without one, ``track_memory`` samples.
    counts_peaks: ClassVar[bool] = True
    #: Ops are traced into a lazy graph that runs only where it is cut (XLA): a step ends
    #: with :meth:`end_step`, and a call's result is kept until the cut after it.
    lazy: ClassVar[bool] = False
    #: Timing events (``torch.Event(enable_timing=True)``) time work here: True, False, or
    #: None where only trying tells (a backend without ``elapsedTime``).
    times_events: ClassVar[bool | None] = None
    #: Its tensors hold data (everything but ``meta``): memory to read, peaks to reach.
    holds_data: ClassVar[bool] = True
    #: Probed even when not asked for: the CPU (the host's facts) and CUDA (the driver's
    #: facts, and GPUs a CPU-only torch cannot use).
    always_probed: ClassVar[bool] = False
    #: The caching allocator records a history torch can snapshot
    #: (``torch.cuda.memory._record_memory_history``: CUDA and ROCm).
    keeps_history: ClassVar[bool] = False
    #: ``nn.DataParallel`` drives several of these devices from one process (CUDA only).
    data_parallel: ClassVar[bool] = False
    #: ``DistributedDataParallel`` takes ``device_ids=[i]`` for a module on one device.
    ddp_device_ids: ClassVar[bool] = False
    #: The variable that chooses which devices of this kind a process sees, for messages.
    visibility_variable: ClassVar[str | None] = None

    @abstractmethod
    def probe(self, *, telemetry: bool = True) -> Probe:
        """Describe every device of this kind that torch can use in this process."""

    def probe_static(self) -> Probe:
        """Like ``probe(telemetry=False)``, where free memory may be left unknown: what
        resolving a spec needs. A backend that can answer it from facts read once per
        process overrides this (CUDA: no NVML session after the first)."""
        return self.probe(telemetry=False)

    def probe_without_torch(self, *, telemetry: bool = True) -> Probe | None:
        """Like :meth:`probe`, but without importing torch; None when this kind cannot tell
        without it (the default: a backend opts in by overriding this)."""
        return None

    def unavailable_reason(self, host: HostInfo | None = None) -> str:
        """Why this kind has no device here, in one sentence, with what to do."""
        return f"no {self.label} device is available to torch {_torch_version()}."

    # The run time: torch's device-generic API, for every kind with streams.
    def in_use(self) -> list[torch.device]:
        """The devices of this kind this process may have queued work on: the current one,
        once the kind is initialised (asking initialises nothing)."""
        current = current_if_initialized(self.kind)
        return [] if current is None else [current]

    def synchronize(self, device: torch.device) -> None:
        """Wait until the work queued on ``device`` is done. A kind not yet initialised has
        nothing queued (and waiting would create a context); a backend that cannot wait
        gets a warning: times then cover only what ran before each call returned."""
        import warnings

        import torch

        mod = device_module(device.type)
        initialized = getattr(mod, "is_initialized", None)
        if initialized is not None and not initialized():
            return
        wait = getattr(mod, "synchronize", None) or torch.accelerator.synchronize
        try:
            wait(device)
        except (RuntimeError, ValueError) as e:
            warnings.warn(
                f"cannot wait for {device}: its torch backend does not synchronise ({e}). "
                "Times include only the work that finished before each call returned.",
                RuntimeWarning,
                stacklevel=4,
            )

    # Memory: the caching allocator's API (CUDA's counter names), through the device's
    # module, then torch.accelerator (which speaks for torch's current accelerator only).
    def _allocators(self, device: torch.device) -> list[Any]:
        import torch

        found = [m for m in (device_module(device.type),) if m is not None]
        current = torch.accelerator.current_accelerator()
        if current is not None and current.type == device.type:
            found.append(getattr(torch.accelerator, "memory", torch.accelerator))
        return found

    def memory(self, device: torch.device) -> Counters:
        """The allocator's counters of ``device`` now (zero before the process used it: no
        initialisation); :class:`~anydevice.errors.MeasurementError` where the backend
        keeps none."""
        reasons = []
        for source in self._allocators(device):
            stats = getattr(source, "memory_stats", None)
            if stats is None:
                continue
            try:
                s = stats(device)
            except UNSUPPORTED as e:
                reasons.append(str(e).strip().splitlines()[-1][:200])
                continue
            return Counters(
                allocated=int(s.get("allocated_bytes.all.current", 0)),
                reserved=int(s.get("reserved_bytes.all.current", 0)),
                peak=int(s.get("allocated_bytes.all.peak", 0)),
                peak_reserved=int(s.get("reserved_bytes.all.peak", 0)),
                retries=s.get("num_alloc_retries"),
                ooms=s.get("num_ooms"),
            )
        from anydevice.errors import MeasurementError

        why = f" ({reasons[0]})" if reasons else ""
        raise MeasurementError(
            f"cannot read memory on {device}: torch's {device.type} backend keeps no "
            f"allocator statistics{why}. Its free and total memory, where the backend "
            "reports them, are in ad.inventory(); ad.timeit and ad.DeviceLoader work without "
            "them."
        )

    def reset_peak(self, device: torch.device) -> None:
        """Restart the allocator's peak counter of ``device``; nothing before it is in use."""
        if not self.initialized(device):
            return
        for source in self._allocators(device):
            reset = getattr(source, "reset_peak_memory_stats", None)
            if reset is not None:
                reset(device)
                return

    def empty_cache(self, device: torch.device) -> None:
        """Give the allocator's cached blocks back (a no-op before first use)."""
        for source in self._allocators(device):
            try:
                source.empty_cache()
                return
            except UNSUPPORTED:  # no cache to give back through this module
                continue

    def initialized(self, device: torch.device) -> bool:
        """Whether this process has started using ``device``'s kind (True where the kind
        has no lazy initialisation to look at)."""
        initialized = getattr(device_module(device.type), "is_initialized", None)
        return True if initialized is None else bool(initialized())

    def rng_state(self, device: torch.device) -> torch.Tensor | None:
        """The state of ``device``'s default random generator (what dropout and
        ``torch.rand`` on it draw from), or None where the kind keeps none of its own
        (the CPU's is torch's global one) or its module cannot say. Asks nothing of a kind
        not yet initialised: its generator has drawn nothing."""
        get = getattr(device_module(device.type), "get_rng_state", None)
        if get is None or self.is_host or not self.initialized(device):
            return None
        import torch

        try:
            state = get(device)
        except UNSUPPORTED:
            return None
        return state if isinstance(state, torch.Tensor) else None

    def set_rng_state(self, device: torch.device, state: torch.Tensor) -> bool:
        """Give ``device``'s default random generator ``state`` (from :meth:`rng_state`);
        False where the kind cannot take one."""
        put = getattr(device_module(device.type), "set_rng_state", None)
        if put is None or self.is_host:
            return False
        try:
            put(state, device)
        except UNSUPPORTED:
            return False
        return True

    def free_total(self, device: torch.device) -> tuple[int | None, int | None, list[str]]:
        """Free and total bytes of ``device`` as discovery reads them, and notes."""
        probe = self.probe(telemetry=False)
        index = device.index if device.index is not None else 0
        info = next((d for d in probe.devices if d.kind == device.type and d.index == index), None)
        if info is None:
            return None, None, []
        return info.memory_free, info.memory_total, []

    # Policies that depend on the kind's hardware, asked with the device's facts.
    #: The policies below need the device's facts (compute capability) beyond its kind.
    policies_need_facts: ClassVar[bool] = False

    def channels_last_pays(self, info: DeviceInfo) -> tuple[bool, str]:
        """Whether channels_last convolutions pay on this device, and why (pure)."""
        return False, f"{info.spec} ({info.name}): no known gain from channels_last"

    def end_step(self) -> None:
        """Cut and run a lazy graph here (:attr:`lazy` kinds); nothing elsewhere."""
        return

    def cache_bytes(self, device: torch.device) -> int:
        """The size of ``device``'s last-level cache in bytes, 0 where unknown."""
        return 0

    def stream_device(self, device: torch.device) -> torch.device | None:
        """``device`` with its index when its work runs on streams here, else None.

        Only torch's current accelerator has streams through ``torch.accelerator``; asking
        initialises nothing beyond what ``torch.accelerator.is_available()`` does.
        """
        if not self.has_streams:
            return None
        import torch

        current = torch.accelerator.current_accelerator()
        if current is None or current.type != device.type or not torch.accelerator.is_available():
            return None
        if device.index is not None:
            return device
        return torch.device(device.type, torch.accelerator.current_device_index())

    def new_stream(self, device: torch.device, priority: int = 0) -> torch.Stream:
        """A new stream on ``device`` (with its index)."""
        import torch

        return torch.Stream(device, priority=priority)

    def current_stream(self, device: torch.device) -> torch.Stream:
        """The stream current on ``device`` for the calling thread."""
        import torch

        return torch.accelerator.current_stream(device.index)

    @contextmanager
    def use_stream(self, stream: torch.Stream) -> Iterator[torch.Stream]:
        """Make ``stream`` current for a block; the device and stream current before come
        back after it. Each block keeps its own state (``with stream:`` keeps it on the
        stream, so two threads in one cached stream would restore each other's)."""
        import torch

        index = torch.accelerator.current_device_index()
        before = torch.accelerator.current_stream(stream.device_index)
        torch.accelerator.set_stream(stream)
        try:
            yield stream
        finally:
            torch.accelerator.set_stream(before)  # also makes its device current
            if index != stream.device_index:
                torch.accelerator.set_device_index(index)

    def new_event(self, device: torch.device, *, timing: bool = False) -> torch.Event:
        """A new event on ``device``; ``timing``: one ``elapsed_time`` can read."""
        import torch

        return torch.Event(device, enable_timing=timing)

    def event_timing(self, device: torch.device) -> bool:
        """Whether timing events time work on ``device`` (with its index, as
        :meth:`stream_device` gives it): :attr:`times_events` where the kind says, else a
        pair of events recorded, waited for and read there tells, once per device. A backend
        without event timing (torch's python privateuse1 backend) gets the host clock."""
        if self.times_events is not None:
            return self.times_events
        if not self.has_streams:
            return False
        tried = self.__dict__.setdefault("_event_timing", {})
        known = tried.get(device)
        if known is None:
            try:
                stream = self.current_stream(device)
                start = self.new_event(device, timing=True)
                end = self.new_event(device, timing=True)
                start.record(stream)
                end.record(stream)
                end.synchronize()
                start.elapsed_time(end)
                known = True
            except (RuntimeError, NotImplementedError, ValueError):
                known = False
            tried[device] = known
        return bool(known)

    def collective_refusal(self, backend: str) -> str | None:
        """Why the process-group backend ``backend`` cannot serve this kind, with what to
        do; None where it can (XLA refuses gloo)."""
        return None

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` current on the calling thread (pinning then makes no context on
        device 0 of a GPU machine)."""
        import torch

        torch.accelerator.set_device_index(device.index)

    def host_memory_stats(self) -> Mapping[str, Any] | None:
        """The counters of the pinned host memory this kind's host allocator holds
        (``torch.<kind>.host_memory_stats``), or None: none kept, or the kind not in use
        yet (no pinned memory can exist then, and asking initialises nothing)."""
        mod = device_module(self.kind)
        stats = getattr(mod, "host_memory_stats", None)
        initialized = getattr(mod, "is_initialized", None)
        if stats is None or initialized is None or not initialized():
            return None
        found = stats()
        return found if isinstance(found, Mapping) else None

    def sync_debug_unavailable(self) -> str | None:
        """Why torch's sync debug mode cannot watch this kind here, with what it needs;
        None where it can (:meth:`sync_debug`)."""
        return f"torch has no sync debug mode for {self.label}"

    @contextmanager
    def sync_debug(self) -> Iterator[None]:
        """Inside the block, each implicit host-device synchronisation warns (torch's sync
        debug mode at ``"warn"``); the mode before comes back after it. Only where
        :meth:`sync_debug_unavailable` is None."""
        raise NotImplementedError(self.sync_debug_unavailable())
        yield  # pragma: no cover


#: What a backend raises for a call it does not implement (an allocator counter, a stream
#: on a backend that names streams but cannot make them).
UNSUPPORTED = (RuntimeError, NotImplementedError, AttributeError)


class Unclaimed(Backend):
    """The run time of a device type no backend claims (``lazy``): no streams, nothing
    queued to wait for, no memory counters; discovery finds nothing."""

    kind = "unclaimed"
    label = "device"
    counts_peaks = False

    def probe(self, *, telemetry: bool = True) -> Probe:
        return Probe()

    def in_use(self) -> list[torch.device]:
        return []

    def synchronize(self, device: torch.device) -> None:
        return None


#: ``meta``: torch's device of shapes and dtypes without data, where nothing runs.
META = Kind("meta", indexed=False, probed=False)


class Meta(Unclaimed):
    """``meta``: tensors with shapes and dtypes but no data (FLOP counting, planning)."""

    facts = META
    label = "meta (no data)"
    holds_data = False


def current_if_initialized(kind: str) -> torch.device | None:
    """The current device of ``kind`` once its device module is initialised, else None;
    asking initialises nothing (a module without ``is_initialized`` is not looked at)."""
    import torch

    mod = device_module(kind)
    initialized = getattr(mod, "is_initialized", None)
    current = getattr(mod, "current_device", None)
    if initialized is None or current is None or not initialized():
        return None
    return torch.device(kind, int(current()))


def device_module(kind: str) -> Any | None:
    """``torch.<kind>``, the device module torch or a backend registered, or None."""
    import torch

    try:
        return torch.get_device_module(kind)
    except (RuntimeError, AttributeError, ValueError):
        return None


def _torch_version() -> str:
    from anydevice.hardware import torchbuild

    build = torchbuild.read()
    return build.version if build is not None else "(not installed)"
