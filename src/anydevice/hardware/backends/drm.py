"""AMD and Intel GPUs as the Linux kernel shows them, without a vendor library: the DRM
cards in sysfs and each process's DRM clients in ``/proc/PID/fdinfo``.

The kernel's DRM drivers (amdgpu, i915, xe, and others) describe every open DRM file in
its ``fdinfo`` with the keys of the DRM client usage stats (the kernel's
``Documentation/gpu/drm-usage-stats.rst``): ``drm-driver``, ``drm-pdev`` (the PCI slot),
``drm-client-id`` (one per ``struct drm_file``: two descriptors of one client count once),
``drm-engine-<engine>: <ns> ns`` (time its work kept an engine busy),
``drm-engine-capacity-<engine>`` (engines of that class), ``drm-cycles-<engine>`` with
``drm-total-cycles-<engine>`` (xe: busy cycles against the GPU's timestamp), and memory per
region: ``drm-total-<region>``, ``drm-resident-<region>``, and the older
``drm-memory-<region>`` (an alias of ``drm-total-``), in bytes or with ``KiB``/``MiB``.
A region is the device's own memory when it is named ``vram*`` (amdgpu, xe) or ``local*``
(i915). An engine's busy share is the growth of its counter between two readings, over the
wall time (or the total cycles) between them, over its capacity.

The cards: ``/sys/class/drm/cardN/device`` gives the PCI vendor and device, the driver,
and for amdgpu the memory in use and in all (``mem_info_vram_used``/``_total``), the busy
share (``gpu_busy_percent``) and the hwmon sensors (temperature, power).

This module is the kernel's interface, vendor-neutral apart from naming which drivers
run compute accelerators (:data:`COMPUTE_DRIVERS`); it is read where neither amdsmi nor
xpu-smi is installed, and for per-process figures also where they are. Tested on outputs
recorded from the kernel's documentation and drivers; untested on AMD or Intel hardware.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "COMPUTE_DRIVERS",
    "DrmCard",
    "DrmClient",
    "busy_percent",
    "cards",
    "clients",
    "parse_fdinfo",
]

#: DRM drivers of GPUs that torch computes on (ROCm, XPU), and their vendors.
COMPUTE_DRIVERS: dict[str, str] = {"amdgpu": "AMD", "i915": "Intel", "xe": "Intel"}

_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_DEVICE_REGIONS = ("vram", "local")


@dataclass(frozen=True)
class DrmClient:
    """One DRM client (an open GPU file) of a process, as its fdinfo says."""

    pid: int
    driver: str
    pdev: str | None  #: PCI slot, e.g. ``0000:03:00.0``
    client_id: int | None
    engines: dict[str, int] = field(default_factory=dict)  #: ns busy, by engine
    cycles: dict[str, int] = field(default_factory=dict)  #: busy cycles, by engine
    total_cycles: dict[str, int] = field(default_factory=dict)  #: the GPU's cycles
    capacity: dict[str, int] = field(default_factory=dict)  #: engines of the class
    memory: dict[str, int] = field(default_factory=dict)  #: bytes by region (total)
    resident: dict[str, int] = field(default_factory=dict)  #: bytes by region, resident

    @property
    def device_memory(self) -> int:
        """Bytes in the device's own memory (resident where the driver says, else total)."""
        source = self.resident if any(_local(r) for r in self.resident) else self.memory
        return sum(v for r, v in source.items() if _local(r))


@dataclass(frozen=True)
class DrmCard:
    """One GPU card in ``/sys/class/drm``."""

    card: str  #: ``card0``
    pdev: str  #: PCI slot
    driver: str
    vendor: str  #: "AMD", "Intel"
    pci_id: str  #: ``1002:744c``
    name: str | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    utilization: float | None = None
    temperature: float | None = None
    power: float | None = None


def parse_fdinfo(text: str, pid: int = 0) -> DrmClient | None:
    """One fdinfo file's DRM keys; None where it is not a DRM client of a compute driver.

    >>> c = parse_fdinfo("drm-driver:\\tamdgpu\\ndrm-client-id:\\t7\\ndrm-memory-vram: 2048 KiB")
    >>> c.driver, c.client_id, c.device_memory
    ('amdgpu', 7, 2097152)
    """
    keys: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.startswith("drm-"):
            keys[key.strip()] = value.strip()
    driver = keys.get("drm-driver")
    if driver not in COMPUTE_DRIVERS:
        return None
    engines: dict[str, int] = {}
    cycles: dict[str, int] = {}
    total: dict[str, int] = {}
    capacity: dict[str, int] = {}
    memory: dict[str, int] = {}
    resident: dict[str, int] = {}
    for key, value in keys.items():
        name = key[4:]
        for prefix, into in (
            ("engine-capacity-", capacity),
            ("engine-", engines),
            ("total-cycles-", total),
            ("cycles-", cycles),
            ("resident-", resident),
            ("total-", memory),
            ("memory-", memory),
        ):
            if name.startswith(prefix):
                number = _number(value)
                if number is not None:
                    into.setdefault(name[len(prefix) :], number)
                break
    client = keys.get("drm-client-id", "")
    return DrmClient(
        pid=pid,
        driver=driver,
        pdev=keys.get("drm-pdev"),
        client_id=int(client) if client.isdigit() else None,
        engines=engines,
        cycles=cycles,
        total_cycles=total,
        capacity=capacity,
        memory=memory,
        resident=resident,
    )


def busy_percent(before: DrmClient, after: DrmClient, seconds: float) -> float | None:
    """The busiest engine's share of ``after``'s client since ``before``, in percent.

    A counter that went down is taken as unchanged (the kernel allows it for a while).

    >>> a = parse_fdinfo("drm-driver: amdgpu\\ndrm-engine-gfx: 1000000000 ns\\n")
    >>> b = parse_fdinfo("drm-driver: amdgpu\\ndrm-engine-gfx: 1500000000 ns\\n")
    >>> busy_percent(a, b, 1.0)
    50.0
    """
    shares = []
    for engine, ns in after.engines.items():
        grew = ns - before.engines.get(engine, ns)
        if seconds > 0 and grew >= 0:
            shares.append(grew / (seconds * 1e9) / max(1, after.capacity.get(engine, 1)))
    for engine, cyc in after.cycles.items():
        span = after.total_cycles.get(engine, 0) - before.total_cycles.get(engine, 0)
        grew = cyc - before.cycles.get(engine, cyc)
        if span > 0 and grew >= 0:
            shares.append(grew / span / max(1, after.capacity.get(engine, 1)))
    return min(100.0, 100.0 * max(shares)) if shares else None


def clients(pids: list[int] | None = None, proc: str = "/proc") -> list[DrmClient]:
    """The DRM clients of ``pids`` (default: every process), one per client and process:
    the descriptors pointing at ``/dev/dri/*``, their fdinfo read. Processes that cannot be
    read (another user's, unless root) or that end meanwhile are skipped."""
    found: list[DrmClient] = []
    if pids is None:
        try:
            pids = [int(n) for n in os.listdir(proc) if n.isdigit()]
        except OSError:
            return found
    for pid in pids:
        seen: set[tuple[str | None, int | None]] = set()
        try:
            fds = os.listdir(f"{proc}/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{proc}/{pid}/fd/{fd}")
                if not target.startswith("/dev/dri/"):
                    continue
                with open(f"{proc}/{pid}/fdinfo/{fd}") as f:
                    client = parse_fdinfo(f.read(), pid)
            except OSError:
                continue
            if client is None:
                continue
            if client.pdev is None:
                client = _with_pdev(client, target)
            key = (client.pdev, client.client_id)
            if client.client_id is not None and key in seen:
                continue  # a duplicated descriptor of a client already counted
            seen.add(key)
            found.append(client)
    return found


def cards(root: str = "/sys/class/drm") -> list[DrmCard]:
    """The cards of compute drivers under ``root``, in card order."""
    out: list[DrmCard] = []
    try:
        names = sorted(
            (n for n in os.listdir(root) if n.startswith("card") and n[4:].isdigit()),
            key=lambda n: int(n[4:]),
        )
    except OSError:
        return out
    for name in names:
        dev = Path(root) / name / "device"
        uevent = _keyvalues(_text(dev / "uevent") or "")
        driver = uevent.get("DRIVER", "")
        if driver not in COMPUTE_DRIVERS:
            continue
        vendor = (_text(dev / "vendor") or "").removeprefix("0x")
        device = (_text(dev / "device") or "").removeprefix("0x")
        pci_id = uevent.get("PCI_ID", f"{vendor}:{device}").lower()
        out.append(
            DrmCard(
                card=name,
                pdev=uevent.get("PCI_SLOT_NAME", ""),
                driver=driver,
                vendor=COMPUTE_DRIVERS[driver],
                pci_id=pci_id,
                name=_text(dev / "product_name") or pci_name(pci_id),
                memory_total=_int(dev / "mem_info_vram_total"),
                memory_used=_int(dev / "mem_info_vram_used"),
                utilization=_float(dev / "gpu_busy_percent"),
                temperature=_hwmon(dev, "temp1_input", 1e-3),
                power=_hwmon(dev, "power1_average", 1e-6) or _hwmon(dev, "power1_input", 1e-6),
            )
        )
    return out


def pci_name(pci_id: str, ids: str = "/usr/share/misc/pci.ids") -> str | None:
    """The device's name in the PCI ID database, where installed (``1002:744c`` ->
    ``Navi 31 [Radeon RX 7900 XT/7900 XTX]``)."""
    vendor, _, device = pci_id.partition(":")
    for path in (ids, "/usr/share/hwdata/pci.ids"):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                inside = False
                for line in f:
                    if not line.startswith("\t"):
                        inside = line.lower().startswith(vendor + " ")
                    elif inside and line.lower().startswith(f"\t{device} "):
                        return line.strip().split(" ", 1)[1].strip()
        except OSError:
            continue
    return None


def _local(region: str) -> bool:
    return region.startswith(_DEVICE_REGIONS)


def _number(value: str) -> int | None:
    number, _, unit = value.partition(" ")
    unit = unit.strip()
    if unit == "ns":
        unit = ""
    if not number.isdigit() or unit not in _UNITS:
        return None
    return int(number) * _UNITS[unit]


def _with_pdev(client: DrmClient, target: str) -> DrmClient:
    from dataclasses import replace

    link = Path("/sys/class/drm") / os.path.basename(target) / "device"
    try:
        return replace(client, pdev=os.path.basename(os.readlink(link)))
    except OSError:
        return client


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _int(path: Path) -> int | None:
    text = _text(path)
    return int(text) if text is not None and text.isdigit() else None


def _float(path: Path) -> float | None:
    value = _int(path)
    return None if value is None else float(value)


def _hwmon(dev: Path, name: str, scale: float) -> float | None:
    for sensor in sorted(dev.glob(f"hwmon/hwmon*/{name}")):
        value = _int(sensor)
        if value is not None:
            return value * scale
    return None


def _keyvalues(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
