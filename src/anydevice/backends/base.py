"""The one small interface every device backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from anydevice.inventory import DeviceInfo, HostInfo

__all__ = ["Backend", "Probe"]


@dataclass(frozen=True)
class Probe:
    """What one backend found: its devices, host facts it knows, and notes on what it could not."""

    devices: tuple[DeviceInfo, ...] = ()
    host: Mapping[str, Any] = field(default_factory=dict)  #: HostInfo fields, by name
    notes: tuple[str, ...] = ()


class Backend(ABC):
    """A device kind (``cuda``, ``mps``, ...) as torch sees it.

    Backends are the only code that touches hardware. They must be cheap and safe to ask:
    no CUDA context, no import of optional packages that are not installed.
    """

    kind: ClassVar[str]
    #: Shown to users: "NVIDIA CUDA", "Apple MPS", ...
    label: ClassVar[str]
    #: Whether ``"gpu"`` may mean this kind.
    is_gpu: ClassVar[bool] = False

    @abstractmethod
    def probe(self, *, telemetry: bool = True) -> Probe:
        """Describe every device of this kind that torch can use in this process."""

    def probe_static(self) -> Probe:
        """Like ``probe(telemetry=False)``, where free memory may be left unknown: what
        resolving a spec needs. A backend that can answer it from facts read once per
        process overrides this (CUDA: no NVML session after the first)."""
        return self.probe(telemetry=False)

    def probe_without_torch(self, *, telemetry: bool = True) -> Probe | None:
        """Like :meth:`probe`, but without importing torch; None when this kind cannot tell
        without it (the default: a backend opts in by overriding this)."""
        return None

    def unavailable_reason(self, host: HostInfo | None = None) -> str:
        """Why this kind has no device here, in one sentence, with what to do."""
        return f"no {self.label} device is available to torch {_torch_version()}."


def _torch_version() -> str:
    from anydevice import torchbuild

    build = torchbuild.read()
    return build.version if build is not None else "(not installed)"
