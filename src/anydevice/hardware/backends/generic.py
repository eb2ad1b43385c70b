"""Any other accelerator torch knows, through its device-generic API.

Out-of-tree backends register under torch's ``privateuse1`` slot with a name of their own
(Ascend ``npu``, ...), and builds for other hardware make it torch's current accelerator.
This backend asks ``torch.accelerator`` and ``torch.get_device_module(name)`` what they
can tell (count, name, memory where the backend implements it), with no branch per
vendor. The named kinds keep their own backends (the registry's, in
:mod:`anydevice.hardware.backends`, which also tells which device types are generic).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from anydevice.hardware.backends import (
    GENERIC,
    accelerators,
    current_accelerator_type,
    generic_kinds,
)
from anydevice.hardware.backends.base import Backend, Probe, current_if_initialized, device_module
from anydevice.hardware.facts import DeviceInfo, HostInfo

if TYPE_CHECKING:
    import torch

__all__ = ["GenericBackend"]


class GenericBackend(Backend):
    kind = GENERIC
    label = "torch accelerator"
    has_streams = True

    def in_use(self) -> list[torch.device]:
        """The current device of each accelerator torch knows beyond the named kinds, once
        initialised (a module without ``is_initialized`` is not looked at)."""
        return [d for d in map(current_if_initialized, generic_kinds()) if d is not None]

    def probe_without_torch(self, *, telemetry: bool = True) -> Probe | None:
        """Only torch knows these devices: without it, nothing (the inventory says which
        device extensions were not probed); with torch already imported, ask it."""
        return Probe() if "torch" not in sys.modules else None

    def probe(self, *, telemetry: bool = True) -> Probe:
        import torch  # noqa: F401  (registers installed device extensions)

        devices: list[DeviceInfo] = []
        notes: list[str] = []
        for kind in generic_kinds():
            found, note = _devices(kind, telemetry=telemetry)
            devices.extend(found)
            notes.extend(note)
        return Probe(devices=tuple(devices), notes=tuple(notes))

    def unavailable_reason(self, host: HostInfo | None = None) -> str:
        import torch

        names = generic_kinds()
        if not names:
            *others, last = accelerators()
            named = f"{', '.join(others)} and {last}" if others else last
            return (
                f"torch {torch.__version__} has no accelerator beyond {named} here; a "
                "backend of another kind registers when its package is installed and "
                "imported (e.g. torch_npu for 'npu')."
            )
        return f"torch's {', '.join(names)} backend reports no device."


def module(kind: str) -> Any | None:
    """``torch.<kind>``, the device module a backend registered, or None."""
    return device_module(kind)


def _devices(kind: str, *, telemetry: bool) -> tuple[list[DeviceInfo], list[str]]:
    import torch

    mod = module(kind)
    is_current = _is_current(kind)
    if mod is None and not is_current:
        return [], [f"torch names a {kind!r} backend but registered no torch.{kind} module."]
    is_available = getattr(mod, "is_available", None)
    device_count = getattr(mod, "device_count", None) or torch.accelerator.device_count
    try:
        if not (is_current if is_available is None else bool(is_available())):
            return [], []
        count = int(device_count())
    except RuntimeError as e:
        return [], [f"torch's {kind} backend could not be asked for its devices: {e}"]
    devices = []
    for i in range(count):
        total, free = _memory(mod, kind, i, is_current) if telemetry else (None, None)
        unknown = "memory unknown (the backend does not report it); " if total is None else ""
        devices.append(
            DeviceInfo(
                kind=kind,
                index=i,
                name=_name(mod, kind, i),
                memory_total=total,
                memory_free=free,
                memory_used=None if total is None or free is None else total - free,
                notes=(f"{unknown}read through torch's device-generic API",),
            )
        )
    return devices, []


def _is_current(kind: str) -> bool:
    import torch

    return current_accelerator_type(torch) == kind


def _name(mod: Any, kind: str, index: int) -> str:
    get_name = getattr(mod, "get_device_name", None)
    if get_name is not None:
        try:
            return str(get_name(index))
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return f"{kind} device {index}"


def _memory(mod: Any, kind: str, index: int, is_current: bool) -> tuple[int | None, int | None]:
    """(total, free) bytes: the backend's ``mem_get_info``, else ``torch.accelerator``'s."""
    import torch

    readers = [getattr(mod, "mem_get_info", None)]
    if is_current:
        readers.append(torch.accelerator.get_memory_info)
    for read in readers:
        if read is None:
            continue
        try:
            free, total = (int(v) for v in read(index))
        except (RuntimeError, TypeError, NotImplementedError, AttributeError):
            continue
        return total, free
    return None, None
