"""What anydevice knows about a device kind, as data: :class:`Kind`, one frozen record each.

Every fact that code outside ``hardware/backends/`` needs about a kind (which words name it
in a spec, whether ``"gpu"`` may mean it, its collective backend, its precision policy,
...) is a field here, declared once beside the kind's backend (``backends/<kind>.py``:
``facts = Kind(...)`` on its :class:`~anydevice.hardware.backends.base.Backend`). The
rest of the package asks the registry (:mod:`anydevice.hardware.backends`) and never
names a kind. A kind torch knows that no backend claims (a ``privateuse1`` backend such
as ``npu``) has the defaults.

Reading a record imports nothing: no torch, no vendor library.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from anydevice.hardware.facts import DeviceInfo

__all__ = ["Kind", "PrecisionPolicy", "who"]


@dataclass(frozen=True)
class PrecisionPolicy:
    """What one device does: the ``auto`` precision mode and why, the modes it refuses
    (and why, with what to do), and caveats of the others when forced."""

    auto: Literal["bf16", "fp16", "fp32"]
    why: str
    refused: Mapping[str, str] = field(default_factory=dict)  #: mode -> why not, what to do
    caveats: Mapping[str, str] = field(default_factory=dict)  #: mode -> note when forced


def who(info: DeviceInfo) -> str:
    """A device as the precision policies name it: ``"cuda:0 (NVIDIA A100)"``."""
    return f"{info.spec} ({info.name})"


@dataclass(frozen=True)
class Kind:
    """One device kind's facts, as the rest of anydevice asks for them.

    >>> Kind("quark", gpu=True).indexed, Kind("quark").collective
    (True, None)
    """

    #: torch's device type, and the spec word for it (``"cuda"``).
    name: str
    #: Other spec words that name it (``("tpu",)`` for XLA), unless torch has a backend
    #: of that name.
    words: tuple[str, ...] = ()
    #: ``"<name>:i"`` names one of several devices; False: there is one (the CPU) or none
    #: to number (``meta``).
    indexed: bool = True
    #: The host itself: the CPU, where ``"auto"`` and ``"gpu"`` fall back to.
    host: bool = False
    #: Discovery finds devices of it (False: ``meta``, which holds no data).
    probed: bool = True
    #: ``"gpu"`` may mean it; the first such kind present is what ``"gpu"`` and ``"free"``
    #: pick from, in the registry's order.
    gpu: bool = False
    #: The process-group backend its collectives run on (``"nccl"``); None: what torch's
    #: ``Backend.default_device_backend_map`` says, else the host's.
    collective: str | None = None
    #: Where this torch lacks :attr:`collective`, the host's serves instead; False: the
    #: job is told it is missing rather than silently slowed.
    collective_fallback: bool = False
    #: Why ranks of one machine cannot share a device under :attr:`collective`, or None
    #: where they can.
    one_rank_per_device: str | None = None
    #: ``torch.amp.autocast`` runs here and ``torch.is_autocast_enabled(name)`` answers.
    autocast: bool = False
    #: The ``torch.profiler.ProfilerActivity`` that records its kernels (``"CUDA"``).
    profiler: str | None = None
    #: torch's sync debug mode (``set_sync_debug_mode``) warns at implicit
    #: synchronisations here: what ``ad.find_syncs`` watches with.
    sync_debug: bool = False
    #: The ``torch.backends`` name whose ``fp32_precision`` settings govern its fp32 math
    #: (``"cuda"``, ``"mkldnn"``); None: the generic setting alone.
    math: str | None = None
    #: fp32 matmuls and convolutions may run as TF32 here (where the math settings allow);
    #: its :attr:`math` node's conv and RNN settings are the legacy cuDNN flag's.
    tf32: bool = False
    #: The ``torch.version`` attributes that name the toolkit a torch build for this kind
    #: was made with, each with how to show it (``{}``: the version).
    toolkits: tuple[tuple[str, str], ...] = ()
    #: The mixed-precision policy for one of its devices; None: fp32 only.
    precision: Callable[[DeviceInfo], PrecisionPolicy] | None = None
