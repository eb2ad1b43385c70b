"""Device backends, one module per kind, chosen from a registry: the one place a kind is named.

Each backend implements :class:`~anydevice.hardware.backends.base.Backend` and declares its
kind's facts in one :class:`~anydevice.hardware.backends.kind.Kind` record (its spec
words, whether ``"gpu"`` may mean it, its collective backend, its precision policy, ...).
Everything outside this package asks the functions below and never names a kind: the
spec grammar (:func:`kinds`), ``"auto"``'s order (:func:`auto_order`), ``"gpu"``
(:func:`gpu_kinds`), the collective backend and device (:func:`collective_backend`,
:func:`collective_device`), torch's build (:func:`build_label`). A kind torch knows that
no backend claims (a ``privateuse1`` backend: ``npu``, ...) is served by the generic one
and has a record's defaults.

Modules load on first use, so ``import anydevice`` imports none of them; loading one
imports neither torch, nor NVML, nor ``torch_xla``.

Modules:

* :mod:`~anydevice.hardware.backends.kind` — :class:`Kind`, the record of a kind's facts.
* :mod:`~anydevice.hardware.backends.base` — :class:`Backend`: discovery and the run-time
  interface (streams, events, synchronisation, memory), written once on torch's
  device-generic API; a kind differs by flags and the few methods it overrides.
* :mod:`~anydevice.hardware.backends.cpu` — the CPU and the host's facts.
* :mod:`~anydevice.hardware.backends.cuda` — NVIDIA GPUs, read without CUDA;
  :mod:`~anydevice.hardware.backends.nvml` — NVML: physical GPUs, MIG, drivers.
* :mod:`~anydevice.hardware.backends.mps`, :mod:`~anydevice.hardware.backends.xpu`,
  :mod:`~anydevice.hardware.backends.xla` — Apple, Intel, XLA devices.
* :mod:`~anydevice.hardware.backends.generic` — any other accelerator torch knows.
* :mod:`~anydevice.hardware.backends.torch_private` — torch's private names, in one place.
* :mod:`~anydevice.hardware.backends.watch` — every accelerator read live for
  ``anydevice top``, each through its vendor's reader: NVML;
  :mod:`~anydevice.hardware.backends.amdsmi` (AMD's library);
  :mod:`~anydevice.hardware.backends.drm` (the kernel's DRM cards and fdinfo: AMD, Intel);
  :mod:`~anydevice.hardware.backends.xpusmi` (Intel's xpu-smi);
  :mod:`~anydevice.hardware.backends.ioreg` (Apple silicon's I/O Registry).

To add a kind: write ``backends/<kind>.py`` (its ``Backend`` with ``facts = Kind(...)``)
and name its class in :data:`_BUILT_IN`, where the order is ``"auto"``'s; or, from
outside the package, :func:`register` it.
"""

from __future__ import annotations

import importlib
import sys
from functools import cache
from typing import TYPE_CHECKING, Any

from anydevice.hardware.backends.base import Backend, Probe
from anydevice.hardware.backends.kind import Kind

if TYPE_CHECKING:
    import torch

    from anydevice.hardware.torchbuild import TorchBuild

__all__ = [
    "GENERIC",
    "Backend",
    "Kind",
    "Probe",
    "accelerators",
    "auto_order",
    "autocast_kinds",
    "build_label",
    "collective_backend",
    "collective_device",
    "facts",
    "generic_kinds",
    "get",
    "gpu_kinds",
    "group_backends",
    "host",
    "kinds",
    "probe_order",
    "register",
    "runtime",
    "stand_in",
]

#: The named kinds' backends, in the order ``"auto"`` prefers accelerators; the host and
#: the kinds discovery does not look for (``meta``) after them.
_BUILT_IN: tuple[str, ...] = (
    "anydevice.hardware.backends.cuda:CudaBackend",
    "anydevice.hardware.backends.xla:XlaBackend",
    "anydevice.hardware.backends.xpu:XpuBackend",
    "anydevice.hardware.backends.mps:MpsBackend",
    "anydevice.hardware.backends.cpu:CpuBackend",
    "anydevice.hardware.backends.base:Meta",
)

#: The registry's name for the backend of every other accelerator torch knows (the
#: privateuse1 backend's name, such as npu, and a current accelerator of another type).
GENERIC = "accelerator"
_GENERIC_BACKEND = "anydevice.hardware.backends.generic:GenericBackend"

#: Device types that are never a generic accelerator: torch internals.
_TORCH_INTERNAL = frozenset({"privateuseone", "lazy"})

_classes: dict[str, type[Backend]] = {}


def _registry() -> dict[str, type[Backend]]:
    """kind -> backend class, in the registry's order (the built-in ones loaded once)."""
    if not _classes:
        for target in _BUILT_IN:
            cls = _load(target)
            _classes[cls.kind] = cls
    return _classes


def _load(target: str) -> type[Backend]:
    module_name, _, class_name = target.partition(":")
    cls: type[Backend] = getattr(importlib.import_module(module_name), class_name)
    return cls


def register(backend: type[Backend]) -> None:
    """Add a device kind: ``backend`` with its ``facts``, after the accelerators already
    registered (so ``"auto"`` prefers those), before the host. From then on the spec
    grammar, ``"auto"``, ``"gpu"``, the inventory, precision and the collectives follow
    its record, with no other change.

    Raises:
        ValueError: ``backend`` declares no facts, or its kind is registered already.
    """
    record = getattr(backend, "facts", None)
    if not isinstance(record, Kind):
        raise ValueError(f"{backend.__name__} declares no facts: give it facts = Kind(...).")
    classes = _registry()
    if record.name in classes or record.name == GENERIC:
        raise ValueError(f"a backend for device kind {record.name!r} is registered already.")
    before = [k for k, c in classes.items() if c.facts.probed and not c.facts.host]
    after = [k for k in classes if k not in before]
    ordered = {k: classes[k] for k in before}
    ordered[record.name] = backend
    ordered.update((k, classes[k]) for k in after)
    classes.clear()
    classes.update(ordered)


# ----------------------------------------------------------------------------- the facts


def kinds() -> tuple[Kind, ...]:
    """Every named kind's facts, in the registry's order: the accelerators as ``"auto"``
    prefers them, the host, then the kinds with no devices to find (``meta``)."""
    return tuple(cls.facts for cls in _registry().values())


def facts(kind: str) -> Kind:
    """The facts of device type ``kind``: its backend's record; a type torch knows that
    no backend claims (``npu``, ``lazy``) has the defaults.

    >>> facts("cpu").host, facts("npu").gpu
    (True, False)
    """
    cls = _registry().get(kind)
    return cls.facts if cls is not None else Kind(kind)


def host() -> Kind:
    """The host's facts (the CPU)."""
    return next(k for k in kinds() if k.host)


def accelerators() -> tuple[str, ...]:
    """The named accelerator kinds, in the order ``"auto"`` prefers them."""
    return tuple(k.name for k in kinds() if k.probed and not k.host)


def gpu_kinds() -> tuple[str, ...]:
    """The kinds ``"gpu"`` may mean, in the order it looks for them."""
    return tuple(k.name for k in kinds() if k.gpu)


def autocast_kinds() -> tuple[str, ...]:
    """The kinds ``torch.amp.autocast`` runs on, whose autocast state torch reports."""
    return tuple(k.name for k in kinds() if k.autocast)


def auto_order() -> tuple[str, ...]:
    """Accelerator kinds in the order ``"auto"`` prefers them: the named, then the generic."""
    return (*accelerators(), *generic_kinds())


def probe_order() -> tuple[str, ...]:
    """The backends an inventory asks, in order: the named accelerators, the generic one
    (:data:`GENERIC`), the host."""
    return (*accelerators(), GENERIC, host().name)


def generic_kinds() -> tuple[str, ...]:
    """The accelerator device types torch knows in this process beyond the named kinds.

    The ``privateuse1`` backend's registered name (only when it was renamed, as every real
    one is), then torch's current accelerator when it is none of the named kinds. Looking
    imports nothing and initialises no device. Without torch imported: none (a backend that
    registers with torch loads with it).

    >>> "cuda" in generic_kinds()
    False
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    from anydevice.hardware.backends.torch_private import privateuse1_name

    named = {*_registry(), *_TORCH_INTERNAL}
    found: list[str] = []
    name = privateuse1_name()
    if name not in named:
        found.append(name)
    current = current_accelerator_type(torch)
    if current is not None and current not in named and current not in found:
        found.append(current)
    return tuple(found)


def current_accelerator_type(torch: Any) -> str | None:
    """torch's current accelerator type, or None; never asked of a build for a named kind's
    toolkit (CUDA, ROCm, XPU: :attr:`Kind.toolkits`), whose accelerator is that kind's.

    On a CUDA build the answer counts CUDA devices, which initialises the driver (and fixes
    ``CUDA_VISIBLE_DEVICES``).
    """
    version = getattr(torch, "version", None)
    if any(getattr(version, attr, None) for k in kinds() for attr, _ in k.toolkits):
        return None
    accelerator = getattr(torch, "accelerator", None)
    current = None if accelerator is None else accelerator.current_accelerator()
    return None if current is None else str(current.type)


def build_label(build: TorchBuild) -> str:
    """What a torch build is for: ``"CUDA 12.8"``, ``"ROCm 6.2"``, ``"XPU"``, or the host's
    label (``"CPU"``), from the toolkits the kinds declare (:attr:`Kind.toolkits`).

    >>> from anydevice.hardware.torchbuild import TorchBuild
    >>> build_label(TorchBuild("2.13.0")), build_label(TorchBuild("2.13.0", (("cuda", "13.0"),)))
    ('CPU', 'CUDA 13.0')
    """
    for kind in kinds():
        for attr, shown in kind.toolkits:
            value = build.toolkit(attr)
            if value:
                return shown.format(value)
    return _registry()[host().name].label


# ----------------------------------------------------------------------------- collectives


def collective_backend(kind: str) -> str:
    """The process-group backend for devices of ``kind``: its record's (NCCL for CUDA),
    else what torch maps it to (``torch.distributed.Backend.default_device_backend_map``:
    what a privateuse1 backend registered for its devices), else the host's (gloo). A
    backend this torch lacks gives the host's, unless the kind's record insists on its
    own (a CUDA job is told NCCL is missing rather than silently slowed).

    >>> collective_backend("cpu") == host().collective
    True
    """
    own = facts(kind)
    if own.collective is not None and not (own.collective_fallback and not _built(own.collective)):
        return own.collective
    import torch.distributed as dist

    mapped = dist.Backend.default_device_backend_map.get(kind)
    if mapped is not None and _built(str(mapped)):
        return str(mapped)
    return str(host().collective)


def _built(backend: str) -> bool:
    """Whether this torch has the collective ``backend``."""
    import torch.distributed as dist

    available = getattr(dist, "is_backend_available", None)
    if available is not None:
        return bool(available(backend))
    return bool(getattr(dist, f"is_{backend}_available", lambda: False)())


def collective_device(group_backend: str | None = None) -> torch.device:
    """Where a collective's tensors go on a process group whose backend is
    ``group_backend`` (default: the default group's, ``dist.get_backend()``): this rank's
    current device of the first kind, in ``"auto"``'s order, whose collective backend the
    group runs (NCCL: CUDA's, XCCL: XPU's, a privateuse1 backend's own: its devices), else
    the host (gloo). A group of several backends (``"cpu:gloo,cuda:nccl"``) takes the
    accelerator's.

    >>> str(collective_device("gloo"))
    'cpu'
    """
    import torch

    names = group_backends(group_backend)
    host_collective = host().collective
    for kind in auto_order():
        backend = collective_backend(kind)
        if backend != host_collective and backend in names:
            return _current_device(kind)
    return torch.device(host().name)


def group_backends(group_backend: str | None = None) -> frozenset[str]:
    """The collective backends a process group runs, from its backend's name
    (``"cpu:gloo,cuda:nccl"``: gloo and NCCL; default: the default group's).

    >>> sorted(group_backends("cpu:gloo,cuda:nccl"))
    ['gloo', 'nccl']
    """
    if group_backend is None:
        import torch.distributed as dist

        group_backend = str(dist.get_backend())
    return frozenset(part.rpartition(":")[2].strip() for part in group_backend.split(","))


def _current_device(kind: str) -> torch.device:
    """This process's current device of ``kind`` (its device module's, else torch's
    current accelerator's index)."""
    import torch

    from anydevice.hardware.backends.base import device_module

    current = getattr(device_module(kind), "current_device", None)
    index = current() if current is not None else torch.accelerator.current_device_index()
    return torch.device(kind, int(index))


# ----------------------------------------------------------------------------- backends


#: Backends that serve a kind in place of its own for a while (kind -> backend).
_STAND_INS: dict[str, Backend] = {}


def stand_in(kind: str, backend: Backend | None) -> Backend | None:
    """Serve ``kind`` with ``backend`` from now on (None: its own backend again), and
    return the stand-in this replaces. How ``anydevice.testing`` runs CUDA code on the
    simulated accelerator: its devices, presented as ``cuda``, answer through a backend
    of its own."""
    before = _STAND_INS.pop(kind, None)
    if backend is not None:
        _STAND_INS[kind] = backend
    return before


def get(kind: str) -> Backend:
    """The backend for ``kind`` (one instance per process; backends keep no device state).

    A device type torch knows beyond the named kinds (``npu``, ...) gets the generic one
    (as does :data:`GENERIC` itself).
    """
    if _STAND_INS and kind in _STAND_INS:
        return _STAND_INS[kind]
    cls = _registry().get(kind)
    if cls is None or not cls.facts.probed:
        if kind != GENERIC and kind not in generic_kinds():
            known = ", ".join((*probe_order(), *generic_kinds()))
            raise KeyError(f"no backend for device kind {kind!r}; known: {known}")
        return _instance(_load(_GENERIC_BACKEND))
    return _instance(cls)


@cache
def _instance(cls: type[Backend]) -> Backend:
    return cls()


def runtime(kind: str) -> Backend:
    """The backend that runs work on devices of ``kind``: :func:`get`'s, the registry's for
    a kind discovery does not look for (``meta``), and for a device type no backend claims
    (``lazy``) one with no streams, nothing to wait for and no memory counters
    (:class:`~anydevice.hardware.backends.base.Unclaimed`)."""
    try:
        return get(kind)
    except KeyError:
        cls = _registry().get(kind)
        if cls is not None:
            return _instance(cls)
        from anydevice.hardware.backends.base import Unclaimed

        return _instance(Unclaimed)
