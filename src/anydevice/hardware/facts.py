"""What a machine has, as data: :class:`HostInfo`, :class:`DeviceInfo`, :class:`ProcessInfo`;
and what its accelerators do now (:class:`DeviceReading`, :class:`DeviceUse`).

The backends (:mod:`anydevice.hardware.backends`) read the hardware and fill these in;
:mod:`anydevice.hardware.inventory` gathers them into an :class:`~anydevice.Inventory`.
Plain frozen data: the policies (choosing a device, a precision, a layout) are pure
functions of it, tested with hand-built values.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anydevice.errors import DeviceSpecError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DeviceInfo",
    "DeviceReading",
    "DeviceUse",
    "HostInfo",
    "ProcessInfo",
    "format_bytes",
    "parse_size",
]


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


@dataclass(frozen=True)
class DeviceUse:
    """What one process uses of one device now (None: not reported)."""

    pid: int
    memory: int | None = None  #: bytes
    utilization: float | None = None  #: percent of the device's compute


@dataclass(frozen=True)
class DeviceReading:
    """One accelerator now, as its vendor's tool or the kernel reports it (``anydevice
    top``). Fields the source does not report are None.

    >>> DeviceReading("nvml:GPU-1", "NVIDIA", "nvml", "NVIDIA H100", index=0).to_dict()["index"]
    0
    """

    key: str  #: unique within a reading: the source and the device's UUID or PCI slot
    vendor: str | None  #: "NVIDIA", "AMD", "Intel", "Apple"; None: known from heartbeats only
    source: str  #: what read it: nvml, amdsmi, drm, xpu-smi, ioreg, heartbeat
    name: str
    index: int | None = None  #: the vendor tool's index (nvidia-smi's, amd-smi's, the card's)
    torch_name: str | None = None  #: the torch device in this shell (e.g. ``cuda:0``)
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_used: int | None = None
    memory_total: int | None = None
    utilization: float | None = None  #: percent
    temperature: float | None = None  #: degrees Celsius
    power: float | None = None  #: watts
    power_limit: float | None = None
    mig_parent: str | None = None  #: the parent GPU's UUID, for a MIG device
    processes: tuple[DeviceUse, ...] | None = None  #: None when unknown, () when none
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain types, memory in bytes."""
        out = dataclasses.asdict(self)
        out["processes"] = (
            None if self.processes is None else [dataclasses.asdict(p) for p in self.processes]
        )
        out["notes"] = list(self.notes)
        return out


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
