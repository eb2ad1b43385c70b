"""The freest GPUs: the rule behind ``ad.device("free")`` and ``anydevice select``.

Most free memory first; on a tie, the less busy; then the lower index. The rule works on
:class:`~anydevice.hardware.facts.DeviceInfo` data alone (no torch, no hardware), so it is
tested with hand-built inventories and shared by the library and the command line, which
asks it before torch is imported (:func:`select_visible`: NVML only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from anydevice.errors import DeviceNotFoundError, VisibilityError
from anydevice.hardware.facts import DeviceInfo, format_bytes

if TYPE_CHECKING:
    from anydevice.hardware.backends.nvml import GpuRecord

__all__ = [
    "Choice",
    "choose_free",
    "cuda_indices",
    "free_key",
    "select_visible",
]


def free_key(d: DeviceInfo) -> tuple[float, float, int]:
    """Sort key of the "free" rule: more free memory, then lower utilisation, then index.

    >>> a = DeviceInfo("cuda", 0, "A", memory_free=2**30, utilization=90.0)
    >>> b = DeviceInfo("cuda", 1, "B", memory_free=2**30, utilization=10.0)
    >>> [d.index for d in sorted([a, b], key=free_key)]
    [1, 0]
    """
    free = d.memory_free if d.memory_free is not None else -1
    util = d.utilization if d.utilization is not None else 0.0
    return (-free, util, d.index or 0)


@dataclass(frozen=True)
class Choice:
    """The GPUs picked, best first, and each one left out with the reason."""

    picked: tuple[DeviceInfo, ...]
    rejected: tuple[tuple[DeviceInfo, str], ...] = ()
    wanted: int = 1

    @property
    def ok(self) -> bool:
        """Whether as many GPUs as wanted qualified."""
        return len(self.picked) == self.wanted

    def explain(self) -> str:
        """Why fewer than ``wanted`` qualified: each GPU and what it lacks, in one line each."""
        lines = [f"{self.wanted} GPU(s) wanted, {len(self.picked)} qualify:"]
        lines += [f"  {d.spec} {d.name}: qualifies" for d in self.picked]
        lines += [f"  {d.spec} {d.name}: {reason}" for d, reason in self.rejected]
        return "\n".join(lines)


def choose_free(
    gpus: Sequence[DeviceInfo],
    n: int = 1,
    *,
    min_free: int | None = None,
    max_util: float | None = None,
) -> Choice:
    """The ``n`` freest of ``gpus`` by :func:`free_key`, among those that qualify.

    A GPU qualifies when its free memory is known (and at least ``min_free``) and, with
    ``max_util``, its utilisation is known and at most ``max_util`` percent. When fewer than
    ``n`` qualify, :attr:`Choice.picked` holds those that do and ``ok`` is False.

    >>> gpus = [DeviceInfo("cuda", i, "G", memory_free=f * 2**30) for i, f in enumerate([4, 9, 7])]
    >>> [d.index for d in choose_free(gpus, 2).picked]
    [1, 2]
    >>> choose_free(gpus, 2, min_free=8 * 2**30).ok
    False
    """
    if n < 1:
        raise ValueError(f"n={n}: ask for at least one GPU")
    rejected: list[tuple[DeviceInfo, str]] = []
    fit: list[DeviceInfo] = []
    for d in gpus:
        reason = _shortfall(d, min_free, max_util)
        if reason:
            rejected.append((d, reason))
        else:
            fit.append(d)
    fit.sort(key=free_key)
    # Qualifying GPUs beyond the n picked are not rejected; they are simply not needed.
    return Choice(picked=tuple(fit[:n]), rejected=tuple(rejected), wanted=n)


def _shortfall(d: DeviceInfo, min_free: int | None, max_util: float | None) -> str:
    if d.memory_free is None:
        return "free memory unknown"
    if min_free is not None and d.memory_free < min_free:
        return f"{format_bytes(d.memory_free)} free < {format_bytes(min_free)}"
    if max_util is not None:
        if d.utilization is None:
            return "utilisation unknown"
        if d.utilization > max_util:
            return f"{d.utilization:.0f}% busy > {max_util:g}%"
    return ""


def select_visible(
    n: int = 1,
    min_free: int | None = None,
    max_util: float | None = None,
    form: str = "uuid",
    environ: Mapping[str, str] | None = None,
) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value for this machine's ``n`` freest CUDA GPUs.

    Reads NVML (no torch, no CUDA context); candidates are the GPUs this process sees.

    Args:
        n, min_free, max_util: as for :func:`choose_free`.
        form: ``"uuid"`` (right whatever ``CUDA_DEVICE_ORDER`` says) or ``"index"``
            (CUDA's index among all GPUs, as a new ``CUDA_VISIBLE_DEVICES`` reads it).
        environ: where ``CUDA_DEVICE_ORDER`` is read (default: this process's).

    Raises:
        DeviceNotFoundError: no CUDA GPU here, or fewer than ``n`` qualify; says why.
        VisibilityError: ``form="index"`` where CUDA's order cannot be known without CUDA.
    """
    from anydevice.hardware import backends
    from anydevice.hardware.backends.cuda import CudaBackend  # CUDA_VISIBLE_DEVICES is CUDA's
    from anydevice.hardware.inventory import inventory_without_torch

    env = os.environ if environ is None else environ
    inv = inventory_without_torch(kinds=(CudaBackend.kind,))
    gpus = inv.of_kind(CudaBackend.kind)
    if not gpus:
        reason = backends.get(CudaBackend.kind).unavailable_reason(inv.host)
        raise DeviceNotFoundError(f"no CUDA GPU to select: {reason}")
    choice = choose_free(gpus, n, min_free=min_free, max_util=max_util)
    if not choice.ok:
        raise DeviceNotFoundError(choice.explain())
    if form == "uuid":
        return ",".join(str(d.uuid) for d in choice.picked)
    from anydevice.hardware.backends import nvml

    gpus_here = nvml.static().gpus
    return ",".join(
        str(i) for i in cuda_indices(choice.picked, gpus_here, env.get("CUDA_DEVICE_ORDER"))
    )


def cuda_indices(
    picked: Sequence[DeviceInfo], gpus: Sequence[GpuRecord], device_order: str | None
) -> list[int]:
    """Each picked GPU's index in CUDA's order of all of NVML's ``gpus`` (pure).

    That is how a new ``CUDA_VISIBLE_DEVICES`` reads an index, whatever the current one
    hides.

    Raises:
        VisibilityError: a MIG device (named by UUID only), or GPUs of different models
            without ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, whose CUDA order is CUDA's own guess.
    """
    from anydevice.hardware.backends.cuda import visible_devices

    migs = [d.spec for d in picked if d.mig_parent is not None]
    if migs:
        raise VisibilityError(
            f"{', '.join(migs)}: MIG devices are named by UUID only in CUDA_VISIBLE_DEVICES; "
            "use --format uuid."
        )
    every = visible_devices(gpus, None, device_order)
    if every.guessed:
        raise VisibilityError(
            "the GPUs here differ and CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA numbers "
            "them by its own unspecified heuristic and an index could name another GPU. Use "
            "--format uuid, or set CUDA_DEVICE_ORDER=PCI_BUS_ID."
        )
    order = [r.uuid for r in every.devices]
    return [order.index(str(d.uuid)) for d in picked]
