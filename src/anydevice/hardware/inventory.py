"""What this machine has: :class:`Inventory`, and :func:`inventory`, which gathers it.

The data of each part is :mod:`anydevice.hardware.facts`'s; the backends
(:mod:`anydevice.hardware.backends`) read the hardware and fill it in;
:func:`inventory` asks each of them. Looking never creates a CUDA context: NVIDIA GPUs
are read through NVML, so ``CUDA_VISIBLE_DEVICES`` can still change afterwards and ``fork``
stays safe.

The JSON form (``to_dict()``) is stable: keys are only ever added, memory is in bytes,
power in watts, temperature in degrees Celsius, utilisation in percent, and a field the
backend cannot tell is ``null``. ``Inventory.to_dict()["schema"]`` names the version.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from anydevice.hardware.facts import (
    DeviceInfo,
    HostInfo,
)

__all__ = ["Inventory", "inventory", "inventory_without_torch"]

SCHEMA = "anydevice.inventory/1"


@dataclass(frozen=True, repr=False)
class Inventory:
    """Everything on this machine torch can run on: the host and each device, CPU included.

    >>> inv = inventory()
    >>> inv.devices[-1].kind
    'cpu'
    """

    host: HostInfo
    devices: tuple[DeviceInfo, ...]
    notes: tuple[str, ...] = field(default=())  #: what could not be read, and why

    def of_kind(self, kind: str) -> tuple[DeviceInfo, ...]:
        """The devices of one kind, in torch index order."""
        return tuple(d for d in self.devices if d.kind == kind)

    @property
    def accelerators(self) -> tuple[DeviceInfo, ...]:
        """Every device but the CPU."""
        return tuple(d for d in self.devices if d.is_accelerator)

    @property
    def cpu(self) -> DeviceInfo:
        """The CPU device."""
        return self.of_kind("cpu")[0]

    def find(self, kind: str, index: int | None) -> DeviceInfo | None:
        """The device ``kind:index``, or None."""
        for d in self.devices:
            if d.kind == kind and d.index == index:
                return d
        return None

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form: ``{"schema", "host", "devices", "notes"}``."""
        return {
            "schema": SCHEMA,
            "host": self.host.to_dict(),
            "devices": [d.to_dict() for d in self.devices],
            "notes": list(self.notes),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Inventory:
        """Rebuild from :meth:`to_dict` output."""
        return cls(
            host=HostInfo.from_dict(data["host"]),
            devices=tuple(DeviceInfo.from_dict(d) for d in data["devices"]),
            notes=tuple(data.get("notes") or ()),
        )

    def __repr__(self) -> str:
        devices = ", ".join(d.spec for d in self.devices)
        return f"Inventory({self.host.hostname!r}: {devices})"

    def __str__(self) -> str:
        """The tables ``anydevice info`` shows, as plain text: what ``print(inv)`` prints.

        The rendering is the CLI's (rich), loaded here rather than at ``import anydevice``.
        """
        import io
        import shutil

        from rich.console import Console

        out = io.StringIO()
        width = min(shutil.get_terminal_size((100, 24)).columns, 120)
        console = Console(file=out, width=width, color_system=None, force_jupyter=False)
        console.print(self)
        return out.getvalue().rstrip("\n")

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        """The host's panel, each device's, then the notes: how ``console.print(inv)``
        (rich) and ``anydevice info`` show an inventory."""
        from rich.text import Text

        from anydevice.hardware.render import device_table, host_panel

        yield host_panel(self.host)
        for d in self.devices:
            yield device_table(d)
        for note in self.notes:
            yield Text(f"note: {note}", style="yellow")

    def _repr_html_(self) -> str:
        """The same tables as HTML, which notebooks show for an inventory."""
        from html import escape

        from rich.text import Text

        from anydevice.hardware.render import device_table, host_table

        def plain(cell: object) -> str:
            return cell.plain if isinstance(cell, Text) else str(cell)

        def table(title: str, rows: Any) -> str:  # a rich Table of (label, value) rows
            labels, values = (list(column.cells) for column in rows.columns)
            body = "".join(
                f"<tr><th style='text-align:left'>{escape(plain(k))}</th>"
                f"<td style='text-align:left'>{escape(plain(v))}</td></tr>"
                for k, v in zip(labels, values, strict=True)
            )
            caption = f"<caption style='text-align:left'><b>{escape(title)}</b></caption>"
            return f"<table>{caption}{body}</table>"

        parts = [table("host", host_table(self.host))]
        for d in self.devices:
            panel = device_table(d)
            parts.append(table(Text.from_markup(str(panel.title)).plain, panel.renderable))
        parts += [f"<p>note: {escape(note)}</p>" for note in self.notes]
        return "<div>" + "".join(parts) + "</div>"


def inventory(
    *, telemetry: bool = True, kinds: Iterable[str] | None = None, memory: bool = True
) -> Inventory:
    """Describe this machine: the host and every device torch can use, CPU last.

    Never creates a CUDA context and never initialises CUDA when NVML works; never imports
    ``torch_xla`` unless it is installed.

    Args:
        telemetry: also read utilisation, temperature, power and the processes on each
            device (a few milliseconds per GPU). Selection passes False.
        kinds: only ask these backends (default: all of them).
        memory: read each device's free and used memory now. With ``memory=False`` and
            ``telemetry=False`` a backend may leave them unknown and answer from facts read
            once per process: NVIDIA GPUs are then listed without an NVML session after
            the first (what resolving ``"cuda:0"`` needs).

    Returns:
        An :class:`Inventory`; ``notes`` says what could not be read and why.
    """
    return _collect(telemetry, kinds, with_torch=True, memory=memory)


def inventory_without_torch(
    *, telemetry: bool = True, kinds: Iterable[str] | None = None
) -> Inventory:
    """:func:`inventory`, read without importing torch wherever the hardware allows.

    NVML gives the NVIDIA GPUs, psutil and ``/proc`` the host, torch's own files its
    version and build. torch is imported only for a kind that cannot be seen otherwise (MPS
    on a Mac, an XPU build, torch_xla, CUDA without NVML); ``notes`` say which, and what
    was not asked. This is what ``anydevice info`` shows in a fraction of a second.

    >>> inventory_without_torch(telemetry=False).devices[-1].kind
    'cpu'
    """
    return _collect(telemetry, kinds, with_torch=False)


def _collect(
    telemetry: bool, kinds: Iterable[str] | None, *, with_torch: bool, memory: bool = True
) -> Inventory:
    from anydevice.hardware import backends

    order = backends.probe_order()  # the named accelerators, the generic one, the host
    wanted = tuple(kinds) if kinds is not None else order
    by_name = tuple(k for k in wanted if k not in order)  # device types by name ("npu")
    if by_name and backends.GENERIC not in wanted:
        wanted = (*wanted, backends.GENERIC)
    host_fields: dict[str, Any] = {}
    devices: list[DeviceInfo] = []
    notes: list[str] = []
    imported_for: list[str] = []
    for kind in order:
        backend = backends.get(kind)
        # The CPU backend always runs: it knows the host. The CUDA backend always runs too,
        # for the driver facts and to notice GPUs a CPU-only torch cannot use.
        if kind not in wanted and not backend.always_probed:
            continue
        live = telemetry and kind in wanted
        probe = None
        if not with_torch:
            before = "torch" in sys.modules
            probe = backend.probe_without_torch(telemetry=live)
            if probe is None:
                imported_for.append(backend.label)
            elif not before and "torch" in sys.modules:
                imported_for.append(backend.label)  # the backend had to (torch_xla does)
        if probe is None:
            probe = backend.probe(telemetry=live) if live or memory else backend.probe_static()
        host_fields.update(probe.host)
        if kind in wanted:
            devices.extend(
                d for d in probe.devices if kind != backends.GENERIC or _asked(d, by_name)
            )
        notes.extend(probe.notes)
    if imported_for:
        notes.append(f"torch was imported to look for {', '.join(imported_for)} devices.")
    if not with_torch:
        notes.extend(_unprobed_extensions())
    return Inventory(host=HostInfo(**host_fields), devices=tuple(devices), notes=tuple(notes))


def _asked(device: DeviceInfo, by_name: tuple[str, ...]) -> bool:
    """Whether a generic accelerator's device was asked for: all of them, or its kind by name."""
    return not by_name or device.kind in by_name


def _unprobed_extensions() -> list[str]:
    from anydevice.hardware import torchbuild

    names = torchbuild.device_extensions()
    if not names or "torch" in sys.modules:
        return []
    return [
        f"device extensions that load with torch ({', '.join(names)}) were not probed: "
        "torch was not imported (anydevice info --torch)."
    ]
