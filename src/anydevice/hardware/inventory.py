"""What this machine has: :class:`HostInfo`, :class:`DeviceInfo` and :class:`Inventory`.

This module holds data. The backends (``anydevice.hardware.backends``) read the hardware and fill it
in; :func:`inventory` asks each of them. Looking never creates a CUDA context: NVIDIA GPUs
are read through NVML, so ``CUDA_VISIBLE_DEVICES`` can still change afterwards and ``fork``
stays safe.

The JSON form (``to_dict()``) is stable: keys are only ever added, memory is in bytes,
power in watts, temperature in degrees Celsius, utilisation in percent, and a field the
backend cannot tell is ``null``. ``Inventory.to_dict()["schema"]`` names the version.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anydevice.errors import DeviceSpecError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ACCELERATOR_KINDS",
    "DeviceInfo",
    "HostInfo",
    "Inventory",
    "ProcessInfo",
    "format_bytes",
    "inventory",
    "inventory_without_torch",
    "parse_size",
]

SCHEMA = "anydevice.hardware.inventory/1"

#: Accelerator kinds in the order ``"auto"`` prefers them.
ACCELERATOR_KINDS: tuple[str, ...] = ("cuda", "xla", "xpu", "mps")


def format_bytes(n: float | None) -> str:
    """Return ``n`` bytes in binary units, ``"?"`` when unknown.

    >>> format_bytes(80 * 2**30)
    '80.0 GiB'
    >>> format_bytes(512)
    '512 B'
    """
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip


def parse_size(value: int | float | str) -> int:
    """Bytes from ``8 * 2**30``, ``"8GiB"``, ``"8G"`` (binary) or ``"8GB"`` (decimal).

    >>> parse_size("8GiB") == parse_size("8G") == 8 * 2**30
    True
    >>> parse_size("1.5 GB")
    1500000000
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"a memory size is a number of bytes or text such as '8GiB', not "
            f"{type(value).__name__} ({value!r})"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise DeviceSpecError(
            f"a memory size must be a finite number of bytes, not {value!r}; write e.g. "
            "'8GiB' or 8 * 2**30"
        )
    if isinstance(value, (int, float)):
        if value < 0:
            raise DeviceSpecError(f"a memory size cannot be negative (got {value!r})")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise DeviceSpecError(
            f"cannot read {value!r} as a memory size; write e.g. '8GiB', '512MiB', '8GB' "
            "or a number of bytes"
        )
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class ProcessInfo:
    """A process that holds memory on a device (from NVML)."""

    pid: int
    name: str | None = None
    memory: int | None = None  #: bytes this process holds on the device


@dataclass(frozen=True, repr=False)
class DeviceInfo:
    """One device torch can use, with what its backend can tell about it.

    ``index`` is the torch index (``cuda:index``), which is not always nvidia-smi's index:
    ``smi_index`` is that one. Fields the backend cannot tell are ``None``; ``notes`` say why.

    >>> DeviceInfo(kind="cpu", index=None, name="Example CPU").spec
    'cpu'
    """

    kind: str  #: "cpu", "cuda", "mps", "xpu", "xla", or another accelerator's name ("npu")
    index: int | None  #: torch index; None for the CPU
    name: str
    uuid: str | None = None
    pci_bus_id: str | None = None
    smi_index: int | None = None  #: nvidia-smi's (NVML's) index of the physical GPU
    memory_total: int | None = None
    memory_free: int | None = None
    memory_used: int | None = None
    compute_capability: tuple[int, int] | None = None
    multiprocessors: int | None = None
    bf16: bool | None = None  #: native bfloat16 arithmetic (not emulation)
    tf32: bool | None = None  #: TensorFloat-32 matmul support
    utilization: float | None = None  #: percent busy, recent sample
    temperature: float | None = None  #: degrees Celsius
    power: float | None = None  #: watts drawn now
    power_limit: float | None = None  #: watts, enforced limit
    pcie_generation: int | None = None  #: highest PCIe generation the link supports
    pcie_width: int | None = None  #: highest PCIe lane count the link supports
    processes: tuple[ProcessInfo, ...] | None = None  #: None when unknown, () when none
    mig_parent: str | None = None  #: UUID of the physical GPU of a MIG device
    #: True when ``index`` is a guess: CUDA's unspecified FASTEST_FIRST order, or which of
    #: several visible MIG devices CUDA shows (``notes`` say which)
    index_guessed: bool = False
    notes: tuple[str, ...] = ()  #: what is unknown, and why

    @property
    def spec(self) -> str:
        """The torch device string: ``"cuda:0"``, ``"cpu"``."""
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        """This device as a :class:`torch.device`."""
        import torch

        return torch.device(self.spec)

    @property
    def is_accelerator(self) -> bool:
        """True for everything but the CPU."""
        return self.kind != "cpu"

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form: plain types, memory in bytes."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "processes" and value is not None:
                value = [dataclasses.asdict(p) for p in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        out["spec"] = self.spec
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceInfo:
        """Rebuild from :meth:`to_dict` output (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        if kwargs.get("compute_capability") is not None:
            kwargs["compute_capability"] = tuple(kwargs["compute_capability"])
        if kwargs.get("processes") is not None:
            kwargs["processes"] = tuple(ProcessInfo(**p) for p in kwargs["processes"])
        kwargs["notes"] = tuple(kwargs.get("notes") or ())
        return cls(**kwargs)

    def __repr__(self) -> str:
        parts = [self.spec, repr(self.name)]
        if self.memory_total is not None:
            parts.append(
                f"{format_bytes(self.memory_free)} free of {format_bytes(self.memory_total)}"
            )
        if self.compute_capability is not None:
            parts.append("cc {}.{}".format(*self.compute_capability))
        if self.smi_index is not None and self.smi_index != self.index:
            parts.append(f"nvidia-smi {self.smi_index}")
        if self.index_guessed:
            parts.append(
                "index guessed (MIG)" if self.mig_parent else "index guessed (FASTEST_FIRST)"
            )
        return f"DeviceInfo({', '.join(parts)})"


@dataclass(frozen=True, repr=False)
class HostInfo:
    """The machine around the devices: OS, Python, torch build, drivers, CPU and RAM."""

    hostname: str
    os: str
    python: str
    torch: str
    torch_build: str  #: "CPU", "CUDA 12.8", "ROCm 6.2", "MPS", "XPU"
    cpu_model: str
    cores_logical: int
    cores_physical: int | None
    cores_usable: int  #: what this process may use: affinity and cgroup quota
    memory_total: int
    memory_available: int
    torch_threads: int | None  #: torch.get_num_threads(); None when torch was not imported
    cpu_quota: float | None = None  #: cgroup CPU quota in cores; None when unlimited
    memory_limit: int | None = None  #: cgroup memory limit in bytes; None when unlimited
    cuda_runtime: str | None = None  #: torch.version.cuda
    cudnn: str | None = None
    nccl: str | None = None
    driver: str | None = None  #: NVIDIA driver version (NVML)
    driver_cuda: str | None = None  #: newest CUDA version the driver supports
    nvidia_gpus: int | None = None  #: physical NVIDIA GPUs, visible or not; None if unknown

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HostInfo:
        """Rebuild from :meth:`to_dict` output (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def __repr__(self) -> str:
        return (
            f"HostInfo({self.hostname!r}, {self.os}, Python {self.python}, "
            f"torch {self.torch} ({self.torch_build}), {self.cpu_model!r}, "
            f"{self.cores_usable}/{self.cores_logical} cores usable, "
            f"{format_bytes(self.memory_available)} of {format_bytes(self.memory_total)} RAM free)"
        )


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

        from anydevice.hardware.render import render_inventory

        out = io.StringIO()
        width = min(shutil.get_terminal_size((100, 24)).columns, 120)
        console = Console(file=out, width=width, color_system=None, force_jupyter=False)
        render_inventory(self, console)
        return out.getvalue().rstrip("\n")

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

    order = (*ACCELERATOR_KINDS, "accelerator", "cpu")  # "accelerator": any other torch knows
    wanted = tuple(kinds) if kinds is not None else order
    by_name = tuple(k for k in wanted if k not in order)  # device types by name ("npu")
    if by_name and "accelerator" not in wanted:
        wanted = (*wanted, "accelerator")
    host_fields: dict[str, Any] = {}
    devices: list[DeviceInfo] = []
    notes: list[str] = []
    imported_for: list[str] = []
    for kind in order:
        backend = backends.get(kind)
        # The CPU backend always runs: it knows the host. The CUDA backend always runs too,
        # for the driver facts and to notice GPUs a CPU-only torch cannot use.
        if kind not in wanted and kind not in ("cpu", "cuda"):
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
            devices.extend(d for d in probe.devices if kind != "accelerator" or _asked(d, by_name))
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
