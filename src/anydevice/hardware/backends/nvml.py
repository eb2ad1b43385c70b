"""NVIDIA GPUs as NVML sees them: physical GPUs in nvidia-smi order, MIG devices, drivers.

NVML is the NVIDIA management library behind nvidia-smi. Reading it creates no CUDA context
and does not initialise CUDA, so it is safe before ``fork`` and before
``CUDA_VISIBLE_DEVICES`` is set. Everything here is plain data: which of these GPUs CUDA
shows, and under which index, is decided in :mod:`anydevice.hardware.backends.cuda`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from anydevice.hardware.facts import ProcessInfo

__all__ = ["DriverInfo", "GpuRecord", "NvmlReader", "NvmlUnavailable", "read", "reader", "static"]

T = TypeVar("T")

# CUDA cores per multiprocessor by compute capability, to turn NVML's core count into SMs.
_CORES_PER_SM = {(6, 0): 64, (7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64}  # others: 128


class NvmlUnavailable(Exception):
    """NVML could not be loaded or initialised; the message says why, for the user."""


@dataclass(frozen=True)
class GpuRecord:
    """One physical GPU or MIG device, as NVML reports it."""

    smi_index: int  #: nvidia-smi index of the (parent) physical GPU
    uuid: str
    name: str
    pci_bus_id: str | None = None
    memory_total: int | None = None
    memory_free: int | None = None
    memory_used: int | None = None
    compute_capability: tuple[int, int] | None = None
    multiprocessors: int | None = None
    utilization: float | None = None
    temperature: float | None = None
    power: float | None = None
    power_limit: float | None = None
    pcie_generation: int | None = None
    pcie_width: int | None = None
    processes: tuple[ProcessInfo, ...] | None = None
    #: pid -> SM utilisation in percent over NVML's last samples (None: not supported)
    process_utilization: dict[int, float] | None = None
    mig_enabled: bool = False
    mig_devices: tuple[GpuRecord, ...] = ()  #: for a MIG-enabled GPU, its MIG devices
    mig_parent: str | None = None  #: for a MIG device, the parent GPU's UUID
    mig_gi: int | None = None  #: GPU instance id of a MIG device
    mig_ci: int | None = None  #: compute instance id of a MIG device
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class DriverInfo:
    """Driver-level facts: versions, and the GPUs NVML sees."""

    driver: str | None
    driver_cuda: str | None  #: e.g. "12.4": the newest CUDA this driver supports
    gpus: tuple[GpuRecord, ...] = field(default=())
    notes: tuple[str, ...] = ()  #: GPUs NVML would not read, and why
    unreadable: tuple[int, ...] = ()  #: nvidia-smi indices of the GPUs left out


class NvmlReader:
    """Reads NVML: what does not change once per process, the rest each time it is asked.

    The name, UUID, PCI bus, compute capability, total memory and MIG layout of a GPU do
    not change while a process runs; free memory, utilisation, temperature, power and
    processes do. :meth:`static` answers from the first reading without asking the driver
    again, so resolving ``"cuda:0"`` in a loop costs no NVML session; :meth:`read` opens
    one (``nvmlInit`` ... ``nvmlShutdown``) and refreshes the static facts on the way.

    A GPU NVML cannot read (``GpuIsLost``, ``NoPermission``, ``Unknown``, ...) is left out
    with a note in :attr:`DriverInfo.notes`, never raised.

    Args:
        library: the NVML binding to call (pynvml's module, imported when None).
    """

    def __init__(self, library: Any | None = None) -> None:
        self._library = library
        self._static: DriverInfo | None = None
        self._unavailable: NvmlUnavailable | None = None

    @property
    def library(self) -> Any | None:
        """The NVML binding this reader was given; None: pynvml, imported on first read."""
        return self._library

    def read(self, *, telemetry: bool = True) -> DriverInfo:
        """Read every GPU NVML sees now, in nvidia-smi order.

        Raises:
            NvmlUnavailable: no NVML library, no driver, a driver/library version mismatch,
                or NVML cannot even count the GPUs.
        """
        try:
            info = _read(self._library, telemetry)
        except NvmlUnavailable as e:
            if self._static is None:  # GPUs once read stay what they were
                self._unavailable = e
            raise
        self._unavailable, self._static = None, _static_part(info)
        return info

    def static(self) -> DriverInfo:
        """The GPUs' facts that do not change, read once per process (memory, utilisation
        and the other live readings are None).

        Raises:
            NvmlUnavailable: as for :meth:`read`, remembered from the first attempt.
        """
        if self._static is not None:
            return self._static
        if self._unavailable is not None:
            raise self._unavailable
        return _static_part(self.read(telemetry=False))

    def forget(self) -> None:
        """Drop what was read: the next :meth:`static` asks the driver again (after a GPU
        was reconfigured, e.g. new MIG instances)."""
        self._static = None
        self._unavailable = None


_reader = NvmlReader()


def reader() -> NvmlReader:
    """This process's :class:`NvmlReader`, shared by every caller."""
    return _reader


def read(*, telemetry: bool = True) -> DriverInfo:
    """Read every GPU NVML sees now, in nvidia-smi order (:meth:`NvmlReader.read`).

    Raises:
        NvmlUnavailable: no NVML library, no driver, or a driver/library version mismatch.
    """
    return _reader.read(telemetry=telemetry)


def static() -> DriverInfo:
    """The GPUs' unchanging facts, read once per process (:meth:`NvmlReader.static`)."""
    return _reader.static()


def _read(library: Any | None, telemetry: bool) -> DriverInfo:
    nv = _init(library)
    try:
        driver = _maybe(lambda: _text(nv.nvmlSystemGetDriverVersion()))
        cuda_v = _maybe(nv.nvmlSystemGetCudaDriverVersion_v2)
        driver_cuda = None if cuda_v is None else f"{cuda_v // 1000}.{(cuda_v % 1000) // 10}"
        try:
            count = int(nv.nvmlDeviceGetCount())
        except _errors() as e:
            raise NvmlUnavailable(f"NVML cannot count the GPUs ({_error_text(e)})") from e
        gpus: list[GpuRecord] = []
        notes: list[str] = []
        unreadable: list[int] = []
        for i in range(count):
            try:
                gpus.append(_read_gpu(nv, i, telemetry, notes))
            except _errors() as e:
                unreadable.append(i)
                notes.append(_unreadable(e, f"nvidia-smi GPU {i}", i))
        return DriverInfo(
            driver=driver,
            driver_cuda=driver_cuda,
            gpus=tuple(gpus),
            notes=tuple(notes),
            unreadable=tuple(unreadable),
        )
    finally:
        _maybe(nv.nvmlShutdown)


#: The readings that change while a process runs: left out of the static facts.
_LIVE: dict[str, Any] = {
    "memory_free": None,
    "memory_used": None,
    "utilization": None,
    "temperature": None,
    "power": None,
    "power_limit": None,
    "processes": None,
    "process_utilization": None,
}


def _static_part(info: DriverInfo) -> DriverInfo:
    """``info`` without the readings that change while a process runs."""

    def still(g: GpuRecord) -> GpuRecord:
        return replace(g, mig_devices=tuple(still(m) for m in g.mig_devices), **_LIVE)

    return replace(info, gpus=tuple(still(g) for g in info.gpus))


def _errors() -> type[Exception]:
    """NVML's error base class (every ``NVMLError_*`` derives from it)."""
    import pynvml

    return pynvml.NVMLError  # type: ignore[no-any-return]


def _error_text(e: Exception) -> str:
    return f"{type(e).__name__.removeprefix('NVMLError_')}: {e}"


def _unreadable(e: Exception, what: str, smi_index: int) -> str:
    """The note for a GPU (or MIG device) NVML would not read: what, why, what to do."""
    import pynvml

    if isinstance(e, getattr(pynvml, "NVMLError_GpuIsLost", ())):
        advice = (
            "it fell off the bus: see the kernel log (dmesg, Xid 79) and nvidia-smi; a GPU "
            "reset or a reboot brings it back"
        )
    elif isinstance(e, getattr(pynvml, "NVMLError_NoPermission", ())):
        advice = (
            "this process may not open it: check the /dev/nvidia* permissions and the "
            "devices the container was given"
        )
    else:
        advice = f"`nvidia-smi -i {smi_index} -q` shows what the driver reports"
    return (
        f"{what} could not be read ({_error_text(e)}) and is left out; {advice}. cuda:N "
        "indices are counted over the GPUs that answer."
    )


def driver_present() -> bool:
    """Whether an NVIDIA kernel driver is loaded (without NVML): ``/proc/driver/nvidia``."""
    return Path("/proc/driver/nvidia/gpus").is_dir()


def pci_gpus(root: str | os.PathLike[str] = "/sys/bus/pci/devices") -> int | None:
    """NVIDIA GPUs on the PCI bus, driver loaded or not: functions of vendor ``0x10de``
    whose class is a display or 3D controller (``0x0300``/``0x0302``). None where the bus
    cannot be read (not Linux, no sysfs)."""
    folder = Path(root)
    if not folder.is_dir():
        return None
    count = 0
    for dev in folder.iterdir():
        try:
            vendor = (dev / "vendor").read_text().strip().lower()
            cls = (dev / "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor == "0x10de" and cls.startswith(("0x0300", "0x0302")):
            count += 1
    return count


def _init(library: Any | None) -> Any:
    nv: Any = library
    if nv is None:
        try:
            import pynvml
        except ImportError as e:
            raise NvmlUnavailable(
                f"the nvidia-ml-py package is not installed ({e}); pip install nvidia-ml-py"
            ) from e
        nv = pynvml
    try:
        nv.nvmlInit()
    except _errors() as e:
        raise NvmlUnavailable(_explain_init_error(nv, e)) from e
    return nv


def _explain_init_error(nv: Any, e: Exception) -> str:
    text = str(e)
    if isinstance(e, getattr(nv, "NVMLError_LibraryNotFound", ())):
        where = "no NVIDIA driver here" if not driver_present() else "libnvidia-ml.so.1 not found"
        return f"NVML library not found ({where})"
    if isinstance(e, getattr(nv, "NVMLError_DriverNotLoaded", ())):
        return "NVML: the NVIDIA kernel driver is not loaded"
    if isinstance(e, getattr(nv, "NVMLError_LibRmVersionMismatch", ())):
        return (
            "NVML: Driver/library version mismatch (the driver was upgraded but the old "
            "kernel module is still loaded; reboot, or reload the nvidia kernel modules)"
        )
    if isinstance(e, getattr(nv, "NVMLError_NoPermission", ())):
        return "NVML: no permission to read the GPUs (check /dev/nvidia* permissions)"
    return f"NVML failed to initialise: {text}"


def _read_gpu(nv: Any, i: int, telemetry: bool, notes: list[str]) -> GpuRecord:
    h = nv.nvmlDeviceGetHandleByIndex(i)
    mig_mode = _maybe(lambda: nv.nvmlDeviceGetMigMode(h))
    mig_enabled = bool(mig_mode and mig_mode[0] == nv.NVML_DEVICE_MIG_ENABLE)
    record = _read_common(nv, h, i, telemetry)
    uuid = record["uuid"]
    migs: tuple[GpuRecord, ...] = ()
    if mig_enabled:
        migs = tuple(_read_migs(nv, h, i, uuid, record, telemetry, notes))
    return GpuRecord(mig_enabled=mig_enabled, mig_devices=migs, **record)


def _read_common(nv: Any, h: Any, smi_index: int, telemetry: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "smi_index": smi_index,
        "uuid": _text(nv.nvmlDeviceGetUUID(h)),
        "name": _text(_maybe(lambda: nv.nvmlDeviceGetName(h)) or "NVIDIA GPU"),
    }
    pci = _maybe(lambda: nv.nvmlDeviceGetPciInfo_v3(h)) or _maybe(
        lambda: nv.nvmlDeviceGetPciInfo(h)
    )
    out["pci_bus_id"] = _text(pci.busId) if pci is not None else None
    mem = _maybe(lambda: nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2))
    if mem is None:
        mem = _maybe(lambda: nv.nvmlDeviceGetMemoryInfo(h))
    if mem is not None:
        out.update(
            memory_total=int(mem.total), memory_free=int(mem.free), memory_used=int(mem.used)
        )
    cc = _maybe(lambda: nv.nvmlDeviceGetCudaComputeCapability(h))
    out["compute_capability"] = (int(cc[0]), int(cc[1])) if cc else None
    cores = _maybe(lambda: nv.nvmlDeviceGetNumGpuCores(h))
    if cores and out["compute_capability"]:
        per_sm = _CORES_PER_SM.get(out["compute_capability"], 128)
        out["multiprocessors"] = int(cores) // per_sm
    if telemetry:
        util = _maybe(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        out["utilization"] = float(util.gpu) if util is not None else None
        temp = _maybe(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        out["temperature"] = float(temp) if temp is not None else None
        power = _maybe(lambda: nv.nvmlDeviceGetPowerUsage(h))
        out["power"] = power / 1000.0 if power is not None else None
        limit = _maybe(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))
        out["power_limit"] = limit / 1000.0 if limit is not None else None
        out["processes"] = _processes(nv, h)
        out["process_utilization"] = _process_utilization(nv, h)
    out["pcie_generation"] = _maybe(lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(h))
    out["pcie_width"] = _maybe(lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(h))
    return out


def _read_migs(
    nv: Any,
    h: Any,
    smi_index: int,
    parent_uuid: str,
    parent: dict[str, Any],
    telemetry: bool,
    notes: list[str],
) -> list[GpuRecord]:
    migs = []
    count = _maybe(lambda: nv.nvmlDeviceGetMaxMigDeviceCount(h)) or 0
    for j in range(count):
        mh = _maybe(partial(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, j))
        if mh is None:
            continue  # an empty slot: fewer MIG devices exist than could
        try:
            info = _read_common(nv, mh, smi_index, telemetry)
        except _errors() as e:
            notes.append(_unreadable(e, f"MIG device {j} of nvidia-smi GPU {smi_index}", smi_index))
            continue
        attrs = _maybe(partial(nv.nvmlDeviceGetAttributes, mh))
        if attrs is not None:
            info["multiprocessors"] = int(attrs.multiprocessorCount)
        info["compute_capability"] = info["compute_capability"] or parent["compute_capability"]
        info["pci_bus_id"] = parent["pci_bus_id"]
        info["name"] = f"{parent['name']} MIG {_mig_profile(info, attrs)}"
        migs.append(
            GpuRecord(
                mig_parent=parent_uuid,
                mig_gi=_maybe(partial(nv.nvmlDeviceGetGpuInstanceId, mh)),
                mig_ci=_maybe(partial(nv.nvmlDeviceGetComputeInstanceId, mh)),
                **info,
            )
        )
    return migs


def _mig_profile(info: dict[str, Any], attrs: Any) -> str:
    gib = (info.get("memory_total") or 0) / 2**30
    slices = getattr(attrs, "gpuInstanceSliceCount", None)
    return f"{slices}g.{round(gib)}gb" if slices else f"{round(gib)}gb"


def _processes(nv: Any, h: Any) -> tuple[ProcessInfo, ...] | None:
    seen: dict[int, ProcessInfo] = {}
    readers = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")
    any_ok = False
    for reader in readers:
        fn = getattr(nv, reader, None)
        procs = _maybe(partial(fn, h)) if fn is not None else None
        if procs is None:
            continue
        any_ok = True
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            memory = int(used) if isinstance(used, int) and used < 2**63 else None
            seen.setdefault(int(p.pid), ProcessInfo(int(p.pid), _process_name(int(p.pid)), memory))
    return tuple(seen.values()) if any_ok else None


def _process_utilization(nv: Any, h: Any) -> dict[int, float] | None:
    """Each process's SM utilisation in NVML's newest sample of it (what nvitop's %SM
    column shows); None where the GPU or driver does not keep the samples."""
    samples = _maybe(lambda: nv.nvmlDeviceGetProcessUtilization(h, 0))
    if samples is None:
        return None
    newest: dict[int, tuple[int, float]] = {}
    for p in samples:
        pid, stamp, sm = int(p.pid), int(getattr(p, "timeStamp", 0)), float(p.smUtil)
        if pid not in newest or stamp >= newest[pid][0]:
            newest[pid] = (stamp, sm)
    return {pid: min(100.0, sm) for pid, (_, sm) in newest.items()}


def _process_name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None if pid != os.getpid() else "python"


def _maybe(fn: Callable[[], T]) -> T | None:
    """Call one NVML getter; None when this GPU or driver does not support it."""
    import pynvml as nv

    try:
        return fn()
    except nv.NVMLError:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
