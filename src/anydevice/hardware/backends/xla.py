"""TPUs (and other XLA devices) through ``torch_xla``, imported only when installed."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from anydevice.hardware.backends.base import Backend, Counters, Probe
from anydevice.hardware.backends.kind import Kind, PrecisionPolicy, who
from anydevice.hardware.facts import DeviceInfo, HostInfo

if TYPE_CHECKING:
    import torch

__all__ = ["XlaBackend", "installed", "step"]


def installed() -> bool:
    """Whether ``torch_xla`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("torch_xla") is not None


def _precision(info: DeviceInfo) -> PrecisionPolicy:
    refused = {
        "fp16": "torch.amp's gradient scaling does not run on XLA devices, and TPUs compute "
        "in bf16. Use 'bf16' or 'auto'."
    }
    if info.bf16:
        return PrecisionPolicy("bf16", f"{who(info)}: TPUs compute in bf16 natively", refused)
    if info.bf16 is False:
        refused["bf16"] = f"{who(info)} has no native bf16. Use 'fp32' or 'auto'."
    return PrecisionPolicy("fp32", f"{who(info)}: native bf16 not known, so fp32", refused)


class XlaBackend(Backend):
    #: "tpu" is torch_xla's device, unless torch has a backend of that name (a native TPU
    #: backend, which torch_xla's successor is planned to be: pytorch/xla#9684).
    facts = Kind("xla", words=("tpu",), precision=_precision)
    label = "XLA (TPU)"
    times_events = False
    lazy = True

    counts_peaks = False

    def collective_refusal(self, backend: str) -> str | None:
        if backend != "gloo":
            return None
        return (
            "XLA devices need torch_xla's own backend: pass backend='xla' and "
            "init_method='xla://' (after `import torch_xla.distributed.xla_backend`), or "
            "start the job with torch_xla's launcher."
        )

    def channels_last_pays(self, info: DeviceInfo) -> tuple[bool, str]:
        return False, f"{info.spec} ({info.name}): XLA chooses memory layouts itself"

    def end_step(self) -> None:
        step()

    def memory(self, device: torch.device) -> Counters:
        import torch_xla.core.xla_model as xm

        from anydevice.errors import MeasurementError

        try:
            info = xm.get_memory_info(device)
        except RuntimeError as e:  # the CPU PJRT client: "GetAllocatorStats is not supported"
            raise MeasurementError(
                f"cannot read memory on {device}: torch_xla's {_pjrt_type()} runtime keeps "
                f"no allocator statistics ({str(e).strip().splitlines()[-1][:200]}). On a "
                "TPU it does; ad.timeit and ad.DeviceLoader work without them."
            ) from e
        used = info.get("bytes_used", 1024 * (info.get("kb_total", 0) - info.get("kb_free", 0)))
        peak = info.get("peak_bytes_used")
        return Counters(allocated=int(used), peak=None if peak is None else int(peak))

    def in_use(self) -> list[torch.device]:
        return []  # asked of the device given (synchronize(device)), never looked for

    def synchronize(self, device: torch.device) -> None:
        """Run what is traced on XLA and wait for it: ``wait_device_ops`` alone waits only
        for graphs already sent, and ops since the last graph cut are not sent until one,
        so a timer around them would measure their tracing (a 4096³ matmul "took" 6 µs)."""
        import torch_xla.core.xla_model as xm

        step()
        xm.wait_device_ops()

    def probe_without_torch(self, *, telemetry: bool = True) -> Probe | None:
        """Nothing to find without torch_xla; with it, torch_xla (and torch) must be asked."""
        return Probe() if not installed() else None

    def probe(self, *, telemetry: bool = True) -> Probe:
        if not installed():
            return Probe()
        try:
            import torch_xla
            import torch_xla.core.xla_model as xm
            import torch_xla.runtime as xr
        except ImportError as e:  # installed but broken (mismatched torch, missing libtpu)
            return Probe(notes=(f"torch_xla is installed but does not import: {e}",))
        try:
            kind = str(xr.device_type())
            count = int(xr.global_runtime_device_count())
        except RuntimeError as e:  # PJRT found no device (no TPU, PJRT_DEVICE unset)
            return Probe(notes=(f"torch_xla found no device: {e}",))
        devices = []
        for i in range(count):
            total = free = None
            if telemetry:
                total, free = _memory(xm, torch_xla, i)
            devices.append(
                DeviceInfo(
                    kind="xla",
                    index=i,
                    name=f"XLA {kind}",
                    memory_total=total,
                    memory_free=free,
                    memory_used=None if total is None or free is None else total - free,
                    bf16=kind == "TPU" or None,
                    tf32=False,
                )
            )
        notes = () if count else ("torch_xla is installed but reports no device",)
        return Probe(devices=tuple(devices), notes=notes)

    def unavailable_reason(self, host: HostInfo | None = None) -> str:
        if not installed():
            return (
                "torch_xla is not installed. On a TPU VM: pip install 'torch_xla[tpu]' "
                "(its version must match torch's)."
            )
        return "torch_xla reports no device (is PJRT_DEVICE set, e.g. PJRT_DEVICE=TPU?)."


def _memory(xm: Any, torch_xla: Any, index: int) -> tuple[int | None, int | None]:
    try:
        info = xm.get_memory_info(torch_xla.device(index))
    except (RuntimeError, AttributeError, TypeError):
        return None, None
    limit, used = info.get("bytes_limit"), info.get("bytes_used")
    if limit is None:
        return None, None
    return int(limit), None if used is None else int(limit) - int(used)


def step() -> None:
    """Cut torch_xla's lazy graph here and run it: ``torch_xla.sync()`` (``mark_step``
    before torch_xla 2.6). What a training step on XLA ends with."""
    import torch_xla  # only where torch_xla is installed

    sync = getattr(torch_xla, "sync", None)
    if sync is not None:
        sync()
    else:  # torch_xla < 2.6
        import torch_xla.core.xla_model as xm

        xm.mark_step()


def _pjrt_type() -> str:
    import torch_xla.runtime as xr

    try:
        return str(xr.device_type())
    except RuntimeError:
        return "PJRT"
