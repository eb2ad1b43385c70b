"""Intel GPUs through ``torch.xpu``."""

from __future__ import annotations

from anydevice.hardware import torchbuild
from anydevice.hardware.backends.base import Backend, Probe
from anydevice.hardware.backends.kind import Kind, PrecisionPolicy, who
from anydevice.hardware.facts import DeviceInfo, HostInfo

__all__ = ["XpuBackend"]


def _precision(info: DeviceInfo) -> PrecisionPolicy:
    if info.bf16:
        return PrecisionPolicy(
            "bf16", f"{who(info)} has native bf16 (Intel XMX); no gradient scaling"
        )
    refused = {}
    if info.bf16 is False:
        refused["bf16"] = f"torch reports no native bf16 on {who(info)}. Use 'fp16' or 'auto'."
    why = f"{who(info)}: no native bf16 known; fp16 with gradient scaling"
    return PrecisionPolicy("fp16", why, refused)


class XpuBackend(Backend):
    facts = Kind(
        "xpu",
        gpu=True,
        collective="xccl",
        collective_fallback=True,  # XCCL is in XPU builds from torch 2.8 on
        autocast=True,
        profiler="XPU",
        toolkits=(("xpu", "XPU"),),
        precision=_precision,
    )
    label = "Intel XPU"
    has_streams = True
    ddp_device_ids = True
    visibility_variable = "ZE_AFFINITY_MASK"

    def channels_last_pays(self, info: DeviceInfo) -> tuple[bool, str]:
        return True, f"{info.spec} ({info.name}): oneDNN convolutions are fastest in NHWC"

    def probe_without_torch(self, *, telemetry: bool = True) -> Probe | None:
        """Nothing to find when torch was built without XPU; otherwise only torch can tell."""
        build = torchbuild.read()
        built = build is not None and any(build.toolkit(t) for t, _ in self.facts.toolkits)
        return None if built else Probe()

    def probe(self, *, telemetry: bool = True) -> Probe:
        import torch

        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            return Probe()
        devices = []
        for i in range(xpu.device_count()):
            p = xpu.get_device_properties(i)
            free = total = None
            try:
                free, total = (int(v) for v in xpu.mem_get_info(i))
            except (RuntimeError, AttributeError):
                total = int(getattr(p, "total_memory", 0)) or None
            uuid = getattr(p, "uuid", None)
            devices.append(
                DeviceInfo(
                    kind="xpu",
                    index=i,
                    name=str(p.name),
                    uuid=None if uuid is None else str(uuid),
                    memory_total=total,
                    memory_free=free,
                    memory_used=None if free is None or total is None else total - free,
                    multiprocessors=getattr(p, "gpu_subslice_count", None),
                    bf16=_native_bf16(p),
                    tf32=bool(getattr(p, "has_fp32_dpas", False)) or None,
                    notes=("utilisation, temperature and power unknown (no telemetry library)",),
                )
            )
        return Probe(devices=tuple(devices))

    def unavailable_reason(self, host: HostInfo | None = None) -> str:
        import torch

        if not getattr(getattr(torch, "xpu", None), "_is_compiled", lambda: False)():
            return (
                f"this torch ({torch.__version__}) was built without XPU support; install an "
                "XPU build: pip install torch --index-url https://download.pytorch.org/whl/xpu"
            )
        return "no Intel GPU is visible to torch (driver or oneAPI runtime missing?)."


def _native_bf16(props: object) -> bool | None:
    """Native bf16 on one XPU, as torch itself judges it without emulation.

    ``torch.xpu.is_bf16_supported()`` counts emulation by default (True on every XPU) and
    asks only the current device; the device property is what its
    ``including_emulation=False`` form reads.
    """
    value = getattr(props, "has_bfloat16_conversions", None)
    return None if value is None else bool(value)
