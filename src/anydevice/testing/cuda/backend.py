"""anydevice's own view of the simulated CUDA: the simulated devices as ``cuda`` devices.

In a run, ``ad.device()`` picks ``cuda:0``, ``ad.inventory()`` lists the simulated GPUs as
CUDA devices (and not a second time under the simulator's name), and every anydevice
feature that asks a backend (streams, events, memory, synchronisation) gets this one for
``cuda``: torch's device-generic API on the simulator, as for any accelerator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anydevice.hardware.backends.base import Probe, current_if_initialized
from anydevice.hardware.backends.generic import GenericBackend
from anydevice.hardware.facts import DeviceInfo, HostInfo
from anydevice.testing.cuda.devices import CUDA
from anydevice.testing.cuda.module import CAPABILITY, NAME
from anydevice.testing.cuda.refused import COLLECTIVES_NOT_SIMULATED

if TYPE_CHECKING:
    import torch

__all__ = ["SimulatedCuda", "WithoutSimulator"]


class SimulatedCuda(GenericBackend):
    """The ``cuda`` kind in a run: the simulator's devices, with CUDA's name."""

    kind = CUDA
    label = "CUDA (anydevice's simulated GPU)"
    is_gpu = True
    has_streams = True
    times_events = True
    tf32 = True
    math_backend = "cuda"
    data_parallel = True
    policies_need_facts = True
    visibility_variable = "CUDA_VISIBLE_DEVICES"

    def __init__(self, sim: str) -> None:
        self.sim = sim

    def probe(self, *, telemetry: bool = True) -> Probe:
        import torch

        devices = []
        for i in range(torch.accelerator.device_count()):
            free, total = (int(v) for v in torch.accelerator.get_memory_info(i))
            devices.append(
                DeviceInfo(
                    kind=CUDA,
                    index=i,
                    name=NAME,
                    memory_total=total,
                    memory_free=free,
                    memory_used=total - free,
                    compute_capability=CAPABILITY,
                    bf16=True,
                    tf32=True,
                    notes=(f"anydevice's simulated accelerator ({self.sim}:{i}), shown as CUDA",),
                )
            )
        return Probe(devices=tuple(devices))

    def unavailable_reason(self, host: HostInfo | None = None) -> str:
        return "the simulated CUDA has no device (enable the simulator with devices >= 1)."

    def collective_refusal(self, backend: str) -> str | None:
        """Every process group on the simulated GPUs: NCCL is not simulated, nor are
        collectives on their tensors (refused before the group forms, not at its first
        collective)."""
        return (
            f"a process group (backend={backend!r}) on the simulated GPUs cannot run: "
            f"{COLLECTIVES_NOT_SIMULATED}. Run the collective part on the CPU under the "
            "simulator (ad.distributed(device='cpu'): gloo with CPU tensors), or where GPUs are."
        )

    def stream_device(self, device: torch.device) -> torch.device | None:
        import torch

        index = torch.accelerator.current_device_index() if device.index is None else device.index
        return torch.device(CUDA, index)

    def in_use(self) -> list[torch.device]:
        """Every simulated GPU, as ``cuda:k``, the current one first: the simulator runs
        them all (a GPU's backend says which have a context; waiting for a simulated GPU
        with nothing queued costs nothing)."""
        import torch

        current = current_if_initialized(self.sim)
        if current is None:
            return []
        others = [i for i in range(torch.accelerator.device_count()) if i != current.index]
        return [torch.device(CUDA, i) for i in (current.index, *others)]


class WithoutSimulator(GenericBackend):
    """The other accelerators torch knows, less the simulator (listed as CUDA instead)."""

    def __init__(self, sim: str) -> None:
        self.sim = sim

    def probe(self, *, telemetry: bool = True) -> Probe:
        found = super().probe(telemetry=telemetry)
        return Probe(
            devices=tuple(d for d in found.devices if d.kind != self.sim),
            host=found.host,
            notes=found.notes,
        )

    def in_use(self) -> list[torch.device]:
        return [d for d in super().in_use() if d.type != self.sim]  # in use as CUDA
