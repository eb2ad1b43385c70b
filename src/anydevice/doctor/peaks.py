"""What a device could do at best: vendor peaks of known GPUs and the PCIe link's limit.

The doctor sets each measurement against these, so "81 TFLOP/s" becomes "81 % of the
H100's dense bf16 peak". Peaks are the vendor's datasheet figures for dense math (no 2:4
sparsity) at boost clock; a GPU held to a lower power limit, or hot, reaches less. A GPU
not listed here has no peak, and the doctor says so rather than guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from anydevice.inventory import DeviceInfo

__all__ = ["GpuPeak", "gpu_peak", "pcie_peak"]


@dataclass(frozen=True)
class GpuPeak:
    """Datasheet peaks of one GPU model: dense TFLOP/s per dtype and memory bandwidth."""

    model: str
    tflops: dict[str, float]  #: "fp32", "tf32", "bf16", "fp16" -> dense TFLOP/s
    memory_gbps: float  #: device memory bandwidth, GB/s


# Dense TFLOP/s from the datasheets: fp32, tf32, bf16 and fp16 (bf16 and tf32 None where the
# GPU has none), and memory bandwidth in GB/s. Matched on the device name; the first match
# wins, so variants come before their family, and "GH200" (Grace Hopper: the H100's compute
# with 96 GB of HBM3 at 4.0 TB/s, or 144 GB of HBM3e at 4.9 TB/s) before "H200".
_ROWS: tuple[tuple[str, str, float, float | None, float | None, float, float], ...] = (
    # pattern        model        fp32   tf32   bf16   fp16   memory
    (r"GH200.*144G", "GH200 144GB", 67.0, 494.7, 989.4, 989.4, 4900.0),
    (r"GH200",       "GH200 480GB", 67.0,  494.7, 989.4, 989.4, 4000.0),
    (r"\bH200 NVL",  "H200 NVL",  60.0,  417.5, 835.5, 835.5, 4800.0),
    (r"\bH200",      "H200 SXM",  67.0,  494.7, 989.4, 989.4, 4800.0),
    (r"\bH100 NVL",  "H100 NVL",  60.0,  417.5, 835.5, 835.5, 3900.0),
    (r"\bH100 PCIe", "H100 PCIe", 51.2,  378.0, 756.0, 756.0, 2000.0),
    (r"\bH100",      "H100 SXM",  67.0,  494.7, 989.4, 989.4, 3350.0),
    (r"A100.*80GB",  "A100 80GB", 19.5,  156.0, 312.0, 312.0, 2039.0),
    (r"A100",        "A100 40GB", 19.5,  156.0, 312.0, 312.0, 1555.0),
    (r"L40S",        "L40S",      91.6,  183.0, 362.1, 362.1,  864.0),
    (r"\bL4\b",      "L4",        30.3,   60.0, 121.0, 121.0,  300.0),
    (r"\bA10\b",     "A10",       31.2,   62.5, 125.0, 125.0,  600.0),
    (r"\bT4\b",      "T4",         8.1,   None,  None,  65.0,  320.0),
    (r"V100.*PCIE",  "V100 PCIe", 14.0,   None,  None, 112.0,  900.0),
    (r"V100",        "V100 SXM2", 15.7,   None,  None, 125.0,  900.0),
)  # fmt: skip


def _peak(row: tuple[str, str, float, float | None, float | None, float, float]) -> GpuPeak:
    _, model, fp32, tf32, bf16, fp16, memory = row
    dtypes = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16}
    return GpuPeak(model, {k: v for k, v in dtypes.items() if v is not None}, memory)


def gpu_peak(info: DeviceInfo) -> GpuPeak | None:
    """The datasheet peaks of this GPU, or None for a GPU (or device) not in the table.

    >>> gpu_peak(DeviceInfo(kind="cuda", index=0, name="NVIDIA H100 80GB HBM3")).model
    'H100 SXM'
    >>> gpu_peak(DeviceInfo(kind="cpu", index=None, name="AMD EPYC")) is None
    True
    """
    if info.kind != "cuda" or info.mig_parent:  # a MIG slice has a fraction of the GPU
        return None
    for row in _ROWS:
        if re.search(row[0], info.name, re.IGNORECASE):
            return _peak(row)
    return None


# Transfer rate per lane (GT/s) and line-code efficiency, by PCIe generation.
_PCIE: dict[int, tuple[float, float]] = {
    1: (2.5, 8 / 10),
    2: (5.0, 8 / 10),
    3: (8.0, 128 / 130),
    4: (16.0, 128 / 130),
    5: (32.0, 128 / 130),
    6: (64.0, 242 / 256),  # PAM4, FLIT mode: 242 of every 256 bytes are not FEC/CRC
}


def pcie_peak(generation: int | None, width: int | None) -> float | None:
    """The theoretical one-way bandwidth of a PCIe link in GB/s, or None when unknown.

    Rate per lane x lanes x encoding efficiency / 8 bits. Copies reach ~75-85 % of it
    (packet headers and flow control take the rest).

    >>> round(pcie_peak(4, 16), 1), round(pcie_peak(5, 16), 1)
    (31.5, 63.0)
    """
    if generation is None or width is None or generation not in _PCIE or width < 1:
        return None
    rate, efficiency = _PCIE[generation]
    return rate * width * efficiency / 8
