"""NVIDIA GPUs: which ones CUDA shows this process, under which index, read without CUDA.

CUDA numbers GPUs differently from nvidia-smi. nvidia-smi (NVML) lists them in PCI bus
order; CUDA lists them in ``CUDA_DEVICE_ORDER`` order (``FASTEST_FIRST`` unless set to
``PCI_BUS_ID``), then keeps those ``CUDA_VISIBLE_DEVICES`` names, in the order it names them.
:func:`visible_devices` applies those rules to NVML's records, so ``cuda:N`` is known
before CUDA is initialised. When CUDA is already initialised, torch's own UUIDs confirm
the mapping.

Rules applied (CUDA's documented behaviour, as torch's own NVML-based count reads it):

* An entry is an index (into CUDA's order), a UUID or a unique UUID prefix (``GPU-8932f9``),
  or a MIG device (``MIG-<uuid>``, or the older ``MIG-GPU-<uuid>/<gi>/<ci>``).
* The first invalid entry (``-1``, an index past the end, an unknown or ambiguous UUID)
  hides it and every entry after it.
* A repeated entry makes no GPU visible.
* A GPU in MIG mode is not a CUDA device itself; its MIG devices are, and one CUDA process
  enumerates a single MIG device. Which one, when several are visible, CUDA does not
  document: the first in NVML's order is taken and marked as guessed
  (``DeviceInfo.index_guessed``) until torch, once CUDA is initialised, names it.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anydevice.hardware import torchbuild
from anydevice.hardware.backends import nvml
from anydevice.hardware.backends.base import Backend, Probe
from anydevice.hardware.backends.kind import Kind, PrecisionPolicy, who
from anydevice.hardware.backends.nvml import GpuRecord, NvmlUnavailable
from anydevice.hardware.backends.torch_private import cudnn_binding, primary_context_query
from anydevice.hardware.facts import DeviceInfo, HostInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "CudaBackend",
    "Visibility",
    "confirm_order",
    "cuda_built",
    "cuda_wheel_command",
    "cudnn_version_number",
    "driver_initialized",
    "has_primary_context",
    "nvtx",
    "visible_devices",
]

_CUDA_ERROR_NOT_INITIALIZED = 3


@dataclass(frozen=True)
class Visibility:
    """The GPUs CUDA shows this process, in ``cuda:N`` order, and how sure that order is."""

    devices: tuple[GpuRecord, ...]
    guessed: bool = False  #: the order is CUDA's unspecified FASTEST_FIRST heuristic
    ignored: tuple[str, ...] = ()  #: CUDA_VISIBLE_DEVICES entries CUDA ignores
    notes: tuple[str, ...] = ()
    #: With several MIG devices visible, all of them: CUDA shows one, and which one it
    #: does not document, so the one in :attr:`devices` is a guess (NVML's first) until
    #: torch's own UUIDs confirm it. Empty when there was no choice to make.
    mig_candidates: tuple[GpuRecord, ...] = ()

    def index_guessed(self, record: GpuRecord) -> bool:
        """Whether ``record``'s ``cuda:N`` (or its being shown at all) is a guess."""
        return self.guessed or any(record is m for m in self.mig_candidates)


def cuda_built() -> bool:
    """Whether this torch was built with CUDA (or ROCm, which torch also calls ``cuda``).

    Read from torch's files when torch is not imported yet, so asking does not import it.
    """
    build = torchbuild.read()
    return build is not None and any(build.toolkit(t) for t, _ in CudaBackend.facts.toolkits)


def nvtx() -> Any | None:
    """torch's NVTX binding (``torch.cuda.nvtx``: ``range_push``, ``range_pop``) where this
    torch was built with NVTX, else None. NVTX needs no GPU and no CUDA context, so asking
    never runs ``cuInit``: only the build is looked at."""
    if not cuda_built():
        return None
    import torch

    from anydevice.hardware.backends.torch_private import nvtx_binding

    return torch.cuda.nvtx if nvtx_binding() is not None else None


def _torch_cuda_initialized() -> bool:
    """torch's own flag, without importing torch: a torch not imported has not initialised."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    return cuda is not None and bool(cuda.is_initialized())


def driver_initialized() -> bool:
    """Whether this process has already initialised the CUDA driver (``cuInit``).

    ``torch.cuda.is_initialized()`` is not enough: ``torch.cuda.is_available()`` runs
    ``cuInit`` without initialising torch's CUDA state, and from then on
    ``CUDA_VISIBLE_DEVICES`` is fixed and ``fork`` is unsafe. The driver answers
    ``cuDeviceGetCount`` with ``CUDA_ERROR_NOT_INITIALIZED`` until ``cuInit`` ran; asking
    initialises nothing.
    """
    if not cuda_built():
        return False
    if _torch_cuda_initialized():
        return True
    if not sys.platform.startswith("linux"):
        return False  # without /proc/self/maps, trust torch's own flag
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    if "libcuda.so" not in maps:
        return False  # the driver library is not even loaded
    lib = ctypes.CDLL("libcuda.so.1")
    count = ctypes.c_int(0)
    return int(lib.cuDeviceGetCount(ctypes.byref(count))) != _CUDA_ERROR_NOT_INITIALIZED


def visible_devices(
    gpus: Sequence[GpuRecord], cuda_visible: str | None, device_order: str | None = None
) -> Visibility:
    """Which of NVML's ``gpus`` CUDA shows, in ``cuda:N`` order.

    Args:
        gpus: physical GPUs as NVML lists them (nvidia-smi order), MIG devices inside.
        cuda_visible: the value of ``CUDA_VISIBLE_DEVICES``, None when unset.
        device_order: the value of ``CUDA_DEVICE_ORDER``, None when unset.

    >>> a = GpuRecord(smi_index=0, uuid="GPU-aaaa", name="A", pci_bus_id="0000:01:00.0")
    >>> b = GpuRecord(smi_index=1, uuid="GPU-bbbb", name="A", pci_bus_id="0000:02:00.0")
    >>> [g.smi_index for g in visible_devices([a, b], "1,0").devices]
    [1, 0]
    """
    notes: list[str] = []
    physical, guessed = _cuda_order(gpus, device_order, notes)
    if cuda_visible is None:
        chosen = [d for g in physical for d in _expand(g, notes)]
        ignored: list[str] = []
    else:
        chosen, ignored, by_uuid = _apply_visible(physical, cuda_visible, notes)
        if by_uuid:
            guessed = False  # UUIDs fix the order whatever CUDA_DEVICE_ORDER says
    chosen, candidates = _one_mig_device(chosen, notes)
    return Visibility(tuple(chosen), guessed, tuple(ignored), tuple(notes), tuple(candidates))


def _pci_key(g: GpuRecord) -> tuple[str, int]:
    return ((g.pci_bus_id or "").lower(), g.smi_index)


def _cuda_order(
    gpus: Sequence[GpuRecord], device_order: str | None, notes: list[str]
) -> tuple[list[GpuRecord], bool]:
    by_pci = sorted(gpus, key=_pci_key)
    order = (device_order or "FASTEST_FIRST").strip().upper()
    if order not in ("FASTEST_FIRST", "PCI_BUS_ID"):
        notes.append(
            f"CUDA_DEVICE_ORDER={device_order!r} is not FASTEST_FIRST or PCI_BUS_ID; "
            "CUDA uses FASTEST_FIRST."
        )
        order = "FASTEST_FIRST"
    if order == "PCI_BUS_ID" or len({g.name for g in gpus}) <= 1:
        return by_pci, False
    # FASTEST_FIRST with different models: CUDA puts the one it guesses fastest first and
    # leaves the rest unspecified. Guess by compute capability, then size.
    fastest = sorted(
        by_pci,
        key=lambda g: (g.compute_capability or (0, 0), g.multiprocessors or 0, g.memory_total or 0),
        reverse=True,
    )
    # sorted() is stable with reverse=True as well: equal keys keep PCI order.
    names = ", ".join(sorted({g.name for g in gpus}))
    notes.append(
        f"CUDA_DEVICE_ORDER is {order} and the GPUs differ ({names}): CUDA numbers them "
        "fastest first by its own heuristic, so cuda:N may not be nvidia-smi's GPU N. "
        "Set CUDA_DEVICE_ORDER=PCI_BUS_ID to make the two agree."
    )
    return fastest, True


def _expand(g: GpuRecord, notes: list[str]) -> list[GpuRecord]:
    if not g.mig_enabled:
        return [g]
    if not g.mig_devices:
        notes.append(
            f"GPU {g.smi_index} ({g.name}) is in MIG mode but has no MIG devices: CUDA cannot "
            "use it. Create instances (nvidia-smi mig -cgi ... -C) or disable MIG mode."
        )
    return list(g.mig_devices)


def _strtoul(text: str) -> int | None:
    """The integer ``text`` starts with, as CUDA reads it (``"1gpu"`` is 1); None if none."""
    digits = ""
    for i, c in enumerate(text):
        if c.isdigit() or (i == 0 and c in "+-"):
            digits += c
        else:
            break
    if digits in ("", "+", "-"):
        return None
    return int(digits)


def _apply_visible(
    physical: list[GpuRecord], cuda_visible: str, notes: list[str]
) -> tuple[list[GpuRecord], list[str], bool]:
    entries = cuda_visible.split(",")
    chosen: list[GpuRecord] = []
    seen: set[str] = set()
    by_uuid = True
    for pos, raw in enumerate(entries):
        entry = raw.strip()
        found = _lookup(physical, entry)
        if isinstance(found, str):
            rest = entries[pos:]
            notes.append(
                f"CUDA_VISIBLE_DEVICES={cuda_visible!r}: entry {entry!r} {found}, so CUDA "
                f"ignores it and everything after it ({','.join(rest)!r})."
            )
            return chosen, rest, by_uuid and bool(chosen)
        records, is_uuid = found
        by_uuid = by_uuid and is_uuid
        for rec in records:
            if rec.uuid in seen:
                notes.append(
                    f"CUDA_VISIBLE_DEVICES={cuda_visible!r} names {rec.uuid} twice: CUDA then "
                    "shows no GPU at all. List each GPU once."
                )
                return [], entries, False
            seen.add(rec.uuid)
        chosen.extend(_expand_all(records, notes))
    return chosen, [], by_uuid


def _expand_all(records: list[GpuRecord], notes: list[str]) -> list[GpuRecord]:
    return [d for r in records for d in _expand(r, notes)]


def _lookup(physical: list[GpuRecord], entry: str) -> tuple[list[GpuRecord], bool] | str:
    """The records one CUDA_VISIBLE_DEVICES entry names, or why it names none."""
    low = entry.lower()
    if low.startswith("mig-gpu-"):  # MIG-GPU-<parent uuid>/<gi>/<ci>
        parent, _, rest = entry[4:].partition("/")
        gi, _, ci = rest.partition("/")
        for g in _prefix_matches(physical, parent):
            for m in g.mig_devices:
                if str(m.mig_gi) == gi and str(m.mig_ci) == ci:
                    return [m], True
        return "matches no MIG device here"
    if low.startswith("mig-"):
        migs = [m for g in physical for m in g.mig_devices]
        matches = _prefix_matches(migs, entry)
        if len(matches) == 1:
            return matches, True
        return "matches no MIG device here" if not matches else "is an ambiguous UUID prefix"
    if low.startswith("gpu-"):
        matches = _prefix_matches(physical, entry)
        if len(matches) == 1:
            return matches, True
        return "matches no GPU here" if not matches else "is an ambiguous UUID prefix"
    index = _strtoul(entry)
    if index is None:
        return "is not an index or a UUID"
    if index < 0:
        return "is negative"
    if index >= len(physical):
        return f"is past the last GPU (there are {len(physical)})"
    return [physical[index]], False


def _prefix_matches(records: Sequence[GpuRecord], prefix: str) -> list[GpuRecord]:
    p = prefix.lower()
    return [r for r in records if r.uuid.lower().startswith(p)]


def _one_mig_device(
    chosen: list[GpuRecord], notes: list[str]
) -> tuple[list[GpuRecord], list[GpuRecord]]:
    """``chosen`` with one MIG device kept, and the MIG devices it was guessed among."""
    migs = [d for d in chosen if d.mig_parent is not None]
    if len(migs) <= 1:
        return chosen, []
    keep = migs[0]
    notes.append(
        f"{len(migs)} MIG devices are visible, but a CUDA process enumerates only one, and "
        f"CUDA does not say which: {keep.uuid} (NVML's first) is a guess until torch "
        "confirms it once CUDA is initialised. Give each process its own with "
        "CUDA_VISIBLE_DEVICES=MIG-<uuid>."
    )
    return [d for d in chosen if d.mig_parent is None or d is keep], migs


def _uuid_key(uuid: str) -> str:
    u = uuid.lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            u = u[len(prefix) :]
    return u


def _confirm_with_torch(vis: Visibility) -> Visibility:
    """Once torch has initialised CUDA anyway, read the true order from its UUIDs."""
    import torch

    try:
        torch_uuids = [
            str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
        ]
    except (RuntimeError, AttributeError):
        return vis
    return confirm_order(vis, torch_uuids)


def confirm_order(vis: Visibility, torch_uuids: Sequence[str]) -> Visibility:
    """``vis`` in the order of the UUIDs torch reports for ``cuda:0``, ``cuda:1``, ... (pure).

    Nothing is guessed any more where every UUID is known: the order, and which MIG device
    CUDA shows. UUIDs that name devices NVML did not list leave ``vis`` as it was.
    """
    theirs = [_uuid_key(u) for u in torch_uuids]
    records = {_uuid_key(d.uuid): d for d in (*vis.mig_candidates, *vis.devices)}
    if [_uuid_key(d.uuid) for d in vis.devices] == theirs:
        return Visibility(vis.devices, False, vis.ignored, vis.notes)
    if not all(u in records for u in theirs):
        return vis
    notes = [*vis.notes, "CUDA's order differs from the one read from NVML; using CUDA's."]
    shown = {_uuid_key(d.uuid) for d in vis.devices}
    for u in theirs:
        if u not in shown:
            notes.append(f"CUDA shows MIG device {records[u].uuid}: the guess is corrected.")
    return Visibility(tuple(records[u] for u in theirs), False, vis.ignored, tuple(notes))


def _info(index: int, r: GpuRecord, vis: Visibility) -> DeviceInfo:
    modern = None if r.compute_capability is None else r.compute_capability >= (8, 0)
    notes = r.notes
    if any(r is m for m in vis.mig_candidates):
        notes = (
            *notes,
            f"which of the {len(vis.mig_candidates)} visible MIG devices CUDA shows is a "
            "guess (NVML's first) until torch confirms it once CUDA is initialised",
        )
    return DeviceInfo(
        kind="cuda",
        index=index,
        name=r.name,
        uuid=r.uuid,
        pci_bus_id=r.pci_bus_id,
        smi_index=r.smi_index,
        memory_total=r.memory_total,
        memory_free=r.memory_free,
        memory_used=r.memory_used,
        compute_capability=r.compute_capability,
        multiprocessors=r.multiprocessors,
        bf16=modern,
        tf32=modern,
        utilization=r.utilization,
        temperature=r.temperature,
        power=r.power,
        power_limit=r.power_limit,
        pcie_generation=r.pcie_generation,
        pcie_width=r.pcie_width,
        processes=r.processes,
        mig_parent=r.mig_parent,
        index_guessed=vis.index_guessed(r),
        notes=notes,
    )


def _precision(info: DeviceInfo) -> PrecisionPolicy:
    """By compute capability: bf16 from 8.0, fp16 with gradient scaling from 7.0 (Tensor
    Cores), fp32 before; never by ``torch.cuda.is_bf16_supported()``, which counts
    emulation."""
    name = who(info)
    cc = info.compute_capability
    if cc is None:
        if info.bf16:
            return PrecisionPolicy("bf16", f"{name} has native bf16 (compute capability unknown)")
        return PrecisionPolicy(
            "fp32",
            f"{name}: compute capability unknown, so fp32; force 'bf16' (compute capability "
            ">= 8.0) or 'fp16' (>= 7.0) if the GPU has them",
        )
    ccs = f"{cc[0]}.{cc[1]}"
    refused: dict[str, str] = {}
    caveats: dict[str, str] = {}
    # The flag can only veto: ROCm's backend reports bf16=False, since AMD's architecture
    # numbers say nothing about bf16. Forcing bf16 there stays allowed.
    native_bf16 = cc >= (8, 0) and info.bf16 is not False
    if cc < (8, 0):
        refused["bf16"] = (
            f"bf16 needs compute capability 8.0 or later (Ampere, Ada, Hopper, Blackwell) and "
            f"{name} has {ccs}: it would be emulated, slower than fp32. Use mode='fp16' "
            "(gradient scaling is automatic) or 'auto'."
        )
    elif not native_bf16:
        caveats["bf16"] = "the backend does not report native bf16 for this GPU"
    if cc < (5, 3):
        refused["fp16"] = (
            f"{name} (compute capability {ccs}) has no fp16 arithmetic; it starts at 5.3. "
            "Use mode='fp32' or 'auto'."
        )
    elif cc < (7, 0):
        caveats["fp16"] = "no Tensor Cores: fp16 saves memory here but is rarely faster"
    if native_bf16:
        why = (
            f"{name} has compute capability {ccs} >= 8.0: native bf16 Tensor Cores; bf16 keeps "
            "fp32's range, so no gradient scaling"
        )
        return PrecisionPolicy("bf16", why, refused, caveats)
    if cc >= (7, 0):
        why = (
            f"{name} has compute capability {ccs}: fp16 Tensor Cores but no native bf16 (8.0+); "
            "fp16 with dynamic gradient scaling"
        )
        return PrecisionPolicy("fp16", why, refused, caveats)
    why = f"{name} has compute capability {ccs}: no Tensor Cores (they start at 7.0), so fp32"
    return PrecisionPolicy("fp32", why, refused, caveats)


class CudaBackend(Backend):
    facts = Kind(
        "cuda",
        gpu=True,
        collective="nccl",
        one_rank_per_device="NCCL refuses two ranks on one GPU ('Duplicate GPU detected')",
        autocast=True,
        profiler="CUDA",
        sync_debug=True,
        math="cuda",  # cuBLAS and cuDNN
        tf32=True,
        toolkits=(("cuda", "CUDA {}"), ("hip", "ROCm {}")),  # ROCm builds are torch's cuda too
        precision=_precision,
    )
    label = "CUDA"
    has_streams = True
    records_streams = True
    reuses_events = True
    pins_surely = True
    times_events = True
    always_probed = True
    keeps_history = True
    data_parallel = True
    ddp_device_ids = True
    visibility_variable = "CUDA_VISIBLE_DEVICES"

    policies_need_facts = True

    def channels_last_pays(self, info: DeviceInfo) -> tuple[bool, str]:
        who = f"{info.spec} ({info.name})"
        cc = info.compute_capability
        if cc is None:
            return False, f"{who}: compute capability unknown, so Tensor Cores are not assumed"
        ccs = f"{cc[0]}.{cc[1]}"
        if cc >= (7, 0):
            amp = "fp16 autocast" if cc < (8, 0) else "TF32, bf16 or fp16"
            return True, f"{who}: Tensor Cores (compute capability {ccs}) convolve NHWC with {amp}"
        return False, f"{who}: no Tensor Cores (compute capability {ccs} < 7.0)"

    def in_use(self) -> list[torch.device]:
        """Each GPU this process has a context on, torch's current device first, read from
        the driver without creating one (work is queued only through a context)."""
        import torch

        if not torch.cuda.is_initialized():
            return []
        current = torch.cuda.current_device()
        others = [i for i in range(torch.cuda.device_count()) if i != current]
        return [torch.device("cuda", i) for i in (current, *others) if has_primary_context(i)]

    def synchronize(self, device: torch.device) -> None:
        """Wait for ``device`` only where this process has a context on it: else nothing
        was queued there, and waiting would create one (~500 MB) on that GPU."""
        import torch

        if not torch.cuda.is_initialized():
            return
        index = torch.cuda.current_device() if device.index is None else device.index
        if has_primary_context(index):
            torch.accelerator.synchronize(index)

    def free_total(self, device: torch.device) -> tuple[int | None, int | None, list[str]]:
        """From NVML; without it, from CUDA where this process has a context there (asking
        elsewhere would create one)."""
        free, total, notes = super().free_total(device)
        if free is not None:
            return free, total, notes
        import torch

        index = device.index if device.index is not None else 0
        if has_primary_context(index):
            free, total = (int(v) for v in torch.cuda.mem_get_info(index))
            return free, total, ["free and total read from CUDA (NVML unavailable)"]
        return (
            None,
            total,
            [
                "free memory unknown: NVML is unavailable, and asking CUDA would create a "
                f"context (~500 MB) on cuda:{index}; it is read once this process uses the "
                "device"
            ],
        )

    def cache_bytes(self, device: torch.device) -> int:
        """The L2 size from the device properties (as torch inductor's benchmarker reads it)."""
        import torch

        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)

    def sync_debug_unavailable(self) -> str | None:
        """Why CUDA's sync debug mode cannot watch this process, or None (asking whether a
        GPU is visible runs ``cuInit``, as any CUDA work would next)."""
        import torch

        if not cuda_built():
            return (
                f"this torch ({torch.__version__}) is a CPU-only build; finding implicit "
                "synchronisations takes CUDA's sync debug mode, so a CUDA build of torch and "
                "an NVIDIA GPU"
            )
        if getattr(torch.version, "hip", None):
            return "no CUDA: torch's sync debug mode is not supported on ROCm"
        if not torch.cuda.is_available():
            return "no CUDA device is visible to this process, so there is nothing to synchronise"
        return None

    @contextmanager
    def sync_debug(self) -> Iterator[None]:
        import torch

        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def __init__(
        self, environ: Mapping[str, str] | None = None, nvml_reader: nvml.NvmlReader | None = None
    ) -> None:
        self._environ = environ
        self._nvml = nvml_reader

    @property
    def environ(self) -> Mapping[str, str]:
        return os.environ if self._environ is None else self._environ

    @property
    def nvml_reader(self) -> nvml.NvmlReader:
        """Where NVML is read: this process's shared reader unless one was given."""
        return nvml.reader() if self._nvml is None else self._nvml

    def probe(self, *, telemetry: bool = True) -> Probe:
        probe = self._probe(telemetry, with_torch=True)
        assert probe is not None  # with torch, every case has an answer
        return probe

    def probe_static(self) -> Probe:
        """The GPUs from NVML's facts read once per process: no NVML session after the
        first, free memory and the live readings unknown."""
        probe = self._probe(False, with_torch=True, live=False)
        assert probe is not None
        return probe

    def probe_without_torch(self, *, telemetry: bool = True) -> Probe | None:
        """NVML's GPUs and torch's build from its files; None when NVML cannot be read and
        a CUDA torch would have to be asked instead."""
        return self._probe(telemetry, with_torch="torch" in sys.modules)

    def _probe(self, telemetry: bool, *, with_torch: bool, live: bool = True) -> Probe | None:
        host: dict[str, Any] = {}
        notes: list[str] = []
        driver: nvml.DriverInfo | None = None
        try:
            reader = self.nvml_reader
            driver = reader.read(telemetry=telemetry) if live else reader.static()
            notes.extend(driver.notes)
        except NvmlUnavailable as e:
            reason = str(e)
            if cuda_built() or nvml.driver_present():
                notes.append(f"{reason}.")
        if driver is not None:
            host.update(
                driver=driver.driver,
                driver_cuda=driver.driver_cuda,
                nvidia_gpus=len(driver.gpus) + len(driver.unreadable),
            )
        elif nvml.driver_present():
            host["nvidia_gpus"] = len(list(Path("/proc/driver/nvidia/gpus").iterdir()))
        else:
            host["nvidia_gpus"] = 0 if sys.platform.startswith("linux") else None
        if not cuda_built():
            return Probe(host=host, notes=tuple(notes))
        if telemetry:
            host.update(_library_versions() if with_torch else _installed_library_versions())
            if not with_torch and host["cudnn"] is None:
                notes.append(
                    "cuDNN and NCCL: no nvidia-cudnn/nvidia-nccl package beside torch, and torch "
                    "was not imported to ask it (anydevice info --torch)."
                )
        if driver is None:
            if not with_torch:
                return None
            devices, more = self._probe_with_torch()
            return Probe(devices=devices, host=host, notes=(*notes, *more))
        vis = visible_devices(
            driver.gpus,
            self.environ.get("CUDA_VISIBLE_DEVICES"),
            self.environ.get("CUDA_DEVICE_ORDER"),
        )
        if _torch_cuda_initialized():
            vis = _confirm_with_torch(vis)
        devices = tuple(_info(i, r, vis) for i, r in enumerate(vis.devices))
        return Probe(devices=devices, host=host, notes=(*notes, *vis.notes))

    def _probe_with_torch(self) -> tuple[tuple[DeviceInfo, ...], list[str]]:
        """Without NVML, ask torch. This initialises CUDA in this process; the notes say so."""
        import torch

        already = driver_initialized()
        count = torch.cuda.device_count()
        devices = []
        for i in range(count):
            p = torch.cuda.get_device_properties(i)
            cc = (int(p.major), int(p.minor))
            modern = cc >= (8, 0) and not getattr(torch.version, "hip", None)
            devices.append(
                DeviceInfo(
                    kind="cuda",
                    index=i,
                    name=str(p.name),
                    uuid=_torch_uuid(p),
                    memory_total=int(p.total_memory),
                    compute_capability=cc,
                    multiprocessors=int(p.multi_processor_count),
                    bf16=modern,
                    tf32=modern,
                    notes=(
                        "free memory, utilisation, temperature, power and processes "
                        "unknown without NVML",
                    ),
                )
            )
        notes = [
            "Devices were read from torch instead of NVML: free memory and telemetry are "
            "unknown, and nvidia-smi indices cannot be matched."
        ]
        if not already and count:
            notes.append(
                "Reading them initialised CUDA in this process: CUDA_VISIBLE_DEVICES can no "
                "longer change here, and fork() is no longer safe."
            )
        return tuple(devices), notes

    def unavailable_reason(self, host: HostInfo | None = None) -> str:
        build = torchbuild.read()
        version = build.version if build is not None else "(not installed)"
        env = self.environ
        if not cuda_built():
            if host is not None and host.nvidia_gpus:
                return (
                    f"this torch ({version}) is a CPU-only build, although "
                    f"{host.nvidia_gpus} NVIDIA GPU(s) are in this machine. Install a CUDA build: "
                    f"{cuda_wheel_command(host.driver_cuda)}"
                )
            return f"there is no NVIDIA GPU here (and torch {version} is CPU-only)."
        cvd = env.get("CUDA_VISIBLE_DEVICES")
        if cvd is not None and not cvd.strip():
            return "CUDA_VISIBLE_DEVICES is set to '' and hides every GPU; unset it."
        if cvd is not None:
            return f"CUDA_VISIBLE_DEVICES={cvd!r} leaves no GPU visible; run `anydevice info`."
        return "no NVIDIA GPU is visible (no driver, or no GPU in this machine or container)."


#: CUDA variants of the official torch wheels, newest last.
_WHEEL_CUDA = ((11, 8), (12, 1), (12, 4), (12, 6), (12, 8), (12, 9), (13, 0))


def cuda_wheel_command(driver_cuda: str | None) -> str:
    """The pip command for the newest official CUDA wheel this driver can run.

    >>> cuda_wheel_command("12.4")
    'pip install torch --index-url https://download.pytorch.org/whl/cu124'
    """
    best = _WHEEL_CUDA[-2]
    if driver_cuda:
        major, _, minor = driver_cuda.partition(".")
        have = (int(major), int(minor or 0))
        fitting = [v for v in _WHEEL_CUDA if v <= have]
        best = fitting[-1] if fitting else _WHEEL_CUDA[0]
    return f"pip install torch --index-url https://download.pytorch.org/whl/cu{best[0]}{best[1]}"


def _torch_uuid(props: Any) -> str | None:
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.upper().startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _cudnn_text(v: int) -> str:
    """cuDNN 9 encodes 9.1.0 as 90100; cuDNN 8 encoded 8.9.2 as 8902."""
    if v >= 90000:
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"


def _installed_library_versions() -> dict[str, Any]:
    """cuDNN and NCCL as installed beside torch's CUDA wheels, read without importing torch."""
    return {
        "cudnn": torchbuild.library_version(
            "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cudnn-cu11"
        ),
        "nccl": torchbuild.library_version(
            "nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"
        ),
    }


def _library_versions() -> dict[str, Any]:
    """cuDNN's and NCCL's versions from the libraries torch loaded, asking no device.

    ``torch.backends.cudnn.version()`` is not used: it checks every GPU's compute
    capability first (torch 2.11), which initialises CUDA in this process.
    """
    import torch

    installed = _installed_library_versions()
    out: dict[str, Any] = {}
    try:
        v = cudnn_version_number()
        out["cudnn"] = installed["cudnn"] if v is None else _cudnn_text(v)
    except (RuntimeError, OSError):
        out["cudnn"] = installed["cudnn"]
    try:
        nccl = torch.cuda.nccl.version()  # ncclGetVersion: the library's own number
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except (RuntimeError, AttributeError, OSError):
        out["nccl"] = installed["nccl"]
    return out


# ----------------------------------------------------------------- torch's private names
# Each is read in one function, with a test of its own; a torch without the name gets the
# fallback the function documents.


def cudnn_version_number() -> int | None:
    """cuDNN's version number as the loaded library reports it (``cudnnGetVersion``).

    Read through torch's binding ``torch._C._cudnn.getVersionInt``, which asks the library
    alone: no device, no CUDA initialisation. None without cuDNN (a CPU build, or ROCm,
    whose binding reports MIOpen's version instead).
    """

    binding = cudnn_binding()
    get = getattr(binding, "getVersionInt", None)
    if get is None or not getattr(binding, "is_cuda", False):
        return None
    return int(get())


def has_primary_context(index: int) -> bool:
    """Whether this process has a CUDA context on GPU ``index``, asked without creating one.

    Through ``torch._C._cuda_hasPrimaryContext`` (the driver's ``cuDevicePrimaryCtxGetState``);
    without that name, whether torch's allocator holds memory there. False before torch
    has initialised CUDA: no context can exist yet, and asking would initialise it.
    """
    import torch

    if not torch.cuda.is_initialized():
        return False
    has = primary_context_query()
    if has is not None:
        return bool(has(index))
    return int(torch.cuda.memory_reserved(index)) > 0
