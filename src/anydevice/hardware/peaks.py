"""What a device could do at best: vendor peaks of known GPUs and the PCIe link's limit.

The doctor sets each measurement against these, so "81 TFLOP/s" becomes "81 % of the
H100's dense bf16 peak". Peaks are the vendor's datasheet figures for dense math (no 2:4
sparsity) at boost clock; a GPU held to a lower power limit, or hot, reaches less. A GPU
not listed here has no peak, and the doctor says so rather than guess.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from anydevice.hardware.backends.cuda import CudaBackend  # the table lists NVIDIA's GPUs
from anydevice.hardware.facts import DeviceInfo

__all__ = ["GpuPeak", "Peak", "gpu_peak", "pcie_peak"]


@dataclass(frozen=True)
class Peak:
    """The best dense TFLOP/s of a device in one dtype, and where that number comes from.

    >>> Peak(989.4, "bf16", "H100 SXM datasheet, dense bf16")
    Peak(tflops=989.4, dtype='bf16', source='H100 SXM datasheet, dense bf16')
    """

    tflops: float
    dtype: str  #: "fp32", "tf32", "bf16", "fp16", ...
    source: str  #: the datasheet, or the matmul measured here

    @property
    def measured(self) -> bool:
        """True when measured on this machine rather than read from a datasheet."""
        return self.source.startswith("measured")

    def share(self, tflops: float) -> tuple[float | None, str | None]:
        """``tflops`` as a share of this peak (an MFU), or None and why it is not one.

        A rate above the peak is no utilisation: the peak and the rate were not measured
        alike, and the reason names the likely cause for where the peak came from.

        >>> Peak(100.0, "bf16", "given").share(40.0)
        (0.4, None)
        >>> mfu, why = Peak(10.0, "fp32", "measured: fp32 matmul 2048^3 on cpu").share(14.1)
        >>> mfu, why.split(":")[0]
        (None, 'the rate is 1.41x the peak')
        """
        if not self.tflops > 0:
            return None, f"the peak is {self.tflops} TFLOP/s, which no rate can be a share of"
        ratio = tflops / self.tflops
        if ratio <= 1.0 + 1e-9:  # a rate equal to the peak, up to rounding, is 100 %
            return min(ratio, 1.0), None
        rate = f"{ratio:.3g}x" if math.isfinite(ratio) else "infinitely many times"
        head = f"the rate is {rate} the peak: {tflops:.4g} against {self.tflops:.4g} TFLOP/s"
        if self.measured:
            why = (
                f"({self.source}). The peak was measured under other conditions than the "
                "step (other processes busy, fewer threads, lower clocks): measure both on a "
                "quiet machine, close in time"
            )
        elif self.source == "given":
            why = "given: give the device's real peak in the dtype the step's math runs in"
        else:
            why = (
                f"({self.source}). The math ran in a faster dtype than {self.dtype} (TF32 or "
                "bf16 counted as fp32?), or the FLOPs were counted too high: pass the dtype "
                "the step runs in, or count with ad.flops(step)"
            )
        return None, f"{head} {why}."


@dataclass(frozen=True)
class GpuPeak:
    """Datasheet peaks of one GPU model: dense TFLOP/s per dtype and memory bandwidth."""

    model: str
    #: "fp32", "tf32", "bf16", "fp16", "fp8", "fp64" -> dense TFLOP/s; a dtype the
    #: datasheet gives no figure for is absent
    tflops: dict[str, float]
    memory_gbps: float  #: device memory bandwidth, GB/s


_Row = tuple[str, str, float, float | None, float | None, float, float | None, float | None, float]

# Dense TFLOP/s from NVIDIA's datasheets (the sparse figures halved), and memory bandwidth
# in GB/s; None where the GPU has no such unit or its datasheet gives no figure.
# * fp32: CUDA cores (no Tensor Cores). tf32, bf16, fp16, fp8: Tensor Cores.
# * fp64: the "FP64 Tensor Core" figure where the GPU has them (A100, H100, H200, GH200:
#   what cuBLAS's DGEMM reaches), the plain FP64 figure on V100; none for the L40S, L4,
#   A10 and T4, whose datasheets give none (their fp64 is 1/32 or 1/64 of fp32).
# * The Hopper datasheets rate Tensor Cores at a lower clock than fp32 and fp64 (H100 SXM:
#   1830 against 1980 MHz), so tf32..fp8 are ~8 % under SMs x clock x rate.
# Matched on the device name; the first match wins, so variants come before their family:
# "GH200" (Grace Hopper: the H100's compute with 96 GB of HBM3 at 4.0 TB/s, or 144 GB of
# HBM3e at 4.9 TB/s) before "H200", and the A100 80GB PCIe (HBM2e at 1935 GB/s) before
# the SXM4 80GB (2039 GB/s).
_ROWS: tuple[_Row, ...] = (
    # pattern             model            fp32   tf32   bf16   fp16    fp8     fp64  memory
    (r"GH200.*144G",      "GH200 144GB",   67.0, 494.7, 989.4, 989.4, 1978.9,  67.0, 4900.0),
    (r"GH200",            "GH200 480GB",   67.0, 494.7, 989.4, 989.4, 1978.9,  67.0, 4000.0),
    (r"\bH200 NVL",       "H200 NVL",      60.0, 417.5, 835.5, 835.5, 1670.5,  60.0, 4800.0),
    (r"\bH200",           "H200 SXM",      67.0, 494.7, 989.4, 989.4, 1978.9,  67.0, 4800.0),
    (r"\bH100 NVL",       "H100 NVL",      60.0, 417.5, 835.5, 835.5, 1670.5,  60.0, 3900.0),
    (r"\bH100 PCIe",      "H100 PCIe",     51.2, 378.0, 756.0, 756.0, 1513.0,  51.2, 2000.0),
    (r"\bH100",           "H100 SXM",      67.0, 494.7, 989.4, 989.4, 1978.9,  67.0, 3350.0),
    (r"A100.*80GB.*PCIe", "A100 80GB PCIe", 19.5, 156.0, 312.0, 312.0,   None,  19.5, 1935.0),
    (r"A100.*80GB",       "A100 80GB",     19.5, 156.0, 312.0, 312.0,   None,  19.5, 2039.0),
    (r"A100",             "A100 40GB",     19.5, 156.0, 312.0, 312.0,   None,  19.5, 1555.0),
    (r"L40S",             "L40S",          91.6, 183.0, 362.1, 362.1,  733.0,  None,  864.0),
    (r"\bL4\b",           "L4",            30.3,  60.0, 121.0, 121.0,  242.5,  None,  300.0),
    (r"\bA10\b",          "A10",           31.2,  62.5, 125.0, 125.0,   None,  None,  600.0),
    (r"\bT4\b",           "T4",             8.1,  None,  None,  65.0,   None,  None,  320.0),
    (r"V100.*PCIE",       "V100 PCIe",     14.0,  None,  None, 112.0,   None,   7.0,  900.0),
    (r"V100",             "V100 SXM2",     15.7,  None,  None, 125.0,   None,   7.8,  900.0),
)  # fmt: skip
_COLUMNS = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp64")


def _peak(row: _Row) -> GpuPeak:
    _, model, *values, memory = row
    dtypes = dict(zip(_COLUMNS, values, strict=True))
    return GpuPeak(model, {k: v for k, v in dtypes.items() if v is not None}, memory)


def gpu_peak(info: DeviceInfo) -> GpuPeak | None:
    """The datasheet peaks of this GPU, or None for a GPU (or device) not in the table.

    >>> gpu_peak(DeviceInfo(kind="cuda", index=0, name="NVIDIA H100 80GB HBM3")).model
    'H100 SXM'
    >>> gpu_peak(DeviceInfo(kind="cpu", index=None, name="AMD EPYC")) is None
    True
    """
    if info.kind != CudaBackend.kind or info.mig_parent:  # a MIG slice has a fraction of one
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
