"""Apple silicon GPUs through Metal Performance Shaders (``torch.backends.mps``)."""

from __future__ import annotations

import platform
import sys
from typing import TYPE_CHECKING, Any

from anydevice.hardware.backends.base import Backend, Counters, Probe
from anydevice.hardware.backends.kind import Kind, PrecisionPolicy, who
from anydevice.hardware.facts import DeviceInfo, HostInfo

if TYPE_CHECKING:
    import torch

__all__ = ["MpsBackend"]


def _precision(info: DeviceInfo) -> PrecisionPolicy:
    refused = {}
    if not info.bf16:
        refused["bf16"] = "bf16 on MPS needs macOS 14 (Sonoma) or later. Use 'fp16' or 'auto'."
    why = (
        f"{who(info)}: Apple GPUs compute fp16 natively (torch's default autocast dtype on "
        "MPS); fp16 with dynamic gradient scaling"
    )
    return PrecisionPolicy("fp16", why, refused)


class MpsBackend(Backend):
    facts = Kind("mps", gpu=True, autocast=True, precision=_precision)
    label = "Apple MPS"
    times_events = True  # on its one queue (no side streams: timeit synchronises instead)

    def channels_last_pays(self, info: DeviceInfo) -> tuple[bool, str]:
        return (
            False,
            f"{info.spec} ({info.name}): MPS convolves NCHW; channels_last adds conversions",
        )

    counts_peaks = False  # MPS keeps no peak counter: track_memory() samples it

    def memory(self, device: torch.device) -> Counters:
        import torch

        return Counters(
            allocated=int(torch.mps.current_allocated_memory()),
            reserved=int(torch.mps.driver_allocated_memory()),
        )

    def new_event(self, device: torch.device, *, timing: bool = False) -> Any:
        import torch

        return torch.mps.event.Event(enable_timing=timing)

    def in_use(self) -> list[torch.device]:
        import torch

        # MPS has no lazy initialisation to look at: the one device, where there is one
        return [torch.device("mps")] if torch.backends.mps.is_available() else []

    def synchronize(self, device: torch.device) -> None:
        import torch

        torch.accelerator.synchronize(device)

    def probe_without_torch(self, *, telemetry: bool = True) -> Probe | None:
        """Nothing to find off macOS; on a Mac only torch can tell (None)."""
        return Probe() if sys.platform != "darwin" else None

    def probe(self, *, telemetry: bool = True) -> Probe:
        import torch

        if not torch.backends.mps.is_available():
            return Probe()
        import psutil

        from anydevice.hardware.backends.cpu import cpu_model

        vm = psutil.virtual_memory()
        # Unified memory: the GPU may use up to Metal's recommended working set.
        total = int(torch.mps.recommended_max_memory()) or vm.total
        used = int(torch.mps.driver_allocated_memory())
        bf16 = torch.backends.mps.is_macos_or_newer(14, 0)
        device = DeviceInfo(
            kind="mps",
            index=0,
            name=f"{cpu_model()} GPU",
            memory_total=total,
            memory_free=min(vm.available, total - used),
            memory_used=used,
            bf16=bf16,
            tf32=False,
            notes=("unified memory shared with the CPU; utilisation and temperature unknown",),
        )
        return Probe(devices=(device,))

    def unavailable_reason(self, host: HostInfo | None = None) -> str:
        if sys.platform != "darwin":
            return f"MPS exists only on Apple silicon Macs; this is {platform.system()}."
        import torch

        if not torch.backends.mps.is_built():
            return f"this torch ({torch.__version__}) was built without MPS support."
        return "MPS needs macOS 12.3 or later on an Apple silicon (M-series) Mac."
