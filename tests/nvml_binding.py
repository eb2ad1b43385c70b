"""A hand-built NVML binding: the calls ``anydevice.hardware.backends.nvml`` makes, answered from
chosen GPUs, with pynvml's real constants and real error classes.

It stands in for the driver, not for anydevice's NVML layer: that layer runs as it does on
a GPU machine, reading through the binding it is given. A GPU can be made to raise any
``pynvml.NVMLError_*`` from any call (a GPU that fell off the bus raises
``NVMLError_GpuIsLost`` from ``nvmlDeviceGetHandleByIndex``); a call the binding does not
implement raises ``NVMLError_NotSupported``, as a driver does for what a GPU lacks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

GiB = 2**30


@dataclass
class Gpu:
    """One physical GPU as the driver would answer for it."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    bus: str = "00000000:01:00.0"
    total: int = 80 * GiB
    free: int = 80 * GiB
    cc: tuple[int, int] = (9, 0)
    raises: dict[str, Exception] = field(default_factory=dict)  #: call name -> error
    processes: dict[int, int] | None = None  #: pid -> memory used (None: not supported)
    samples: list[tuple[int, int, int]] | None = None  #: (pid, SM %, time stamp)


class Binding:
    """The NVML calls anydevice makes, over ``gpus``; counts every call by name."""

    def __init__(self, gpus: list[Gpu], *, init_error: Exception | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        real = getattr(pynvml, name)
        if callable(real) and name.startswith(("nvmlDevice", "nvmlSystem")):
            return self._unsupported
        return real  # constants and error classes: pynvml's own

    @staticmethod
    def _unsupported(*args: Any, **kwargs: Any) -> Any:
        raise pynvml.NVMLError_NotSupported()

    def _gpu(self, call: str, handle: int) -> Gpu:
        self.calls[call] += 1
        gpu = self.gpus[handle]
        if call in gpu.raises:
            raise gpu.raises[call]
        return gpu

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.65.06"

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 13000

    def nvmlDeviceGetCount(self) -> int:
        self.calls["nvmlDeviceGetCount"] += 1
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self._gpu("nvmlDeviceGetHandleByIndex", i)
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._gpu("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._gpu("nvmlDeviceGetName", h).name

    def nvmlDeviceGetPciInfo_v3(self, h: int) -> Any:
        return SimpleNamespace(busId=self._gpu("nvmlDeviceGetPciInfo_v3", h).bus.encode())

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> Any:
        g = self._gpu("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(total=g.total, free=g.free, used=g.total - g.free)

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return self._gpu("nvmlDeviceGetCudaComputeCapability", h).cc

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        found = self._gpu("nvmlDeviceGetComputeRunningProcesses", h).processes
        if found is None:
            raise pynvml.NVMLError_NotSupported()
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in found.items()]

    def nvmlDeviceGetProcessUtilization(self, h: int, since: int) -> list[Any]:
        found = self._gpu("nvmlDeviceGetProcessUtilization", h).samples
        if found is None:
            raise pynvml.NVMLError_NotFound()
        return [
            SimpleNamespace(pid=p, smUtil=sm, memUtil=0, timeStamp=t)
            for p, sm, t in found
            if t > since
        ]


def gpus(n: int) -> list[Gpu]:
    """``n`` H100s on buses 1..n, UUIDs ``GPU-<i>...``."""
    return [
        Gpu(uuid=f"GPU-{i}{i}{i}{i}cccc-0000-0000-0000-{i:012d}", bus=f"00000000:{i + 1:02X}:00.0")
        for i in range(n)
    ]
