"""The datasheet peaks: each GPU's row found by its name, fp8 and fp64 columns, and the
table checked against torch's own calculator of a GPU's limits where torch has one."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from anydevice.hardware.facts import DeviceInfo
from anydevice.hardware.peaks import GpuPeak, gpu_peak


def peak_of(name: str) -> GpuPeak:
    peak = gpu_peak(DeviceInfo(kind="cuda", index=0, name=name))
    assert peak is not None, name
    return peak


def test_an_a100_80gb_pcie_is_not_taken_for_the_sxm4():
    pcie = peak_of("NVIDIA A100 80GB PCIe")
    assert (pcie.model, pcie.memory_gbps) == ("A100 80GB PCIe", 1935.0)
    sxm = peak_of("NVIDIA A100-SXM4-80GB")
    assert (sxm.model, sxm.memory_gbps) == ("A100 80GB", 2039.0)
    assert peak_of("NVIDIA A100-PCIE-40GB").memory_gbps == 1555.0
    assert pcie.tflops == sxm.tflops  # the same chip and clocks; only the memory differs


@pytest.mark.parametrize(
    ("name", "fp8", "fp64"),
    [
        ("NVIDIA H100 80GB HBM3", 1978.9, 67.0),
        ("NVIDIA H100 PCIe", 1513.0, 51.2),
        ("NVIDIA H100 NVL", 1670.5, 60.0),
        ("NVIDIA H200", 1978.9, 67.0),
        ("NVIDIA GH200 480GB", 1978.9, 67.0),
        ("NVIDIA L40S", 733.0, None),
        ("NVIDIA L4", 242.5, None),
        ("NVIDIA A100-SXM4-80GB", None, 19.5),  # Ampere has no fp8 units
        ("Tesla V100-SXM2-16GB", None, 7.8),
    ],
)
def test_fp8_and_fp64_peaks(name, fp8, fp64):
    tflops = peak_of(name).tflops
    assert tflops.get("fp8") == fp8
    assert tflops.get("fp64") == fp64


def test_fp8_is_twice_fp16_wherever_a_gpu_has_it():
    # The datasheets round, and the L40S's fp8 (733) is 1.2 % above twice its 362.05.
    from anydevice.hardware.peaks import _ROWS, _peak

    with_fp8 = [_peak(row) for row in _ROWS if "fp8" in _peak(row).tflops]
    assert len(with_fp8) == 9
    for peak in with_fp8:
        assert peak.tflops["fp8"] == pytest.approx(2 * peak.tflops["fp16"], rel=0.02), peak.model


# ----------------------------------------------------------------------------- torch's own

#: torch's private calculator of an NVIDIA GPU's limits (torch >= 2.9): SMs x clock x
#: FMAs per clock, and bus width x memory clock. Only the tests read it.
HAS_LIMITS = importlib.util.find_spec("torch.cuda._device_limits") is not None
needs_limits = pytest.mark.skipif(
    not HAS_LIMITS, reason="torch.cuda._device_limits (private, torch >= 2.9) is not here"
)

#: What cudaGetDeviceProperties reports for GPUs torch's calculator knows (sm_80, sm_90):
#: SMs, compute capability, the maximum SM clock and the memory clock (kHz), the memory
#: bus width (bits).
PROPERTIES = {
    "NVIDIA A100-SXM4-80GB": (108, (8, 0), 1_410_000, 1_593_000, 5120),
    "NVIDIA A100-SXM4-40GB": (108, (8, 0), 1_410_000, 1_215_000, 5120),
    "NVIDIA A100 80GB PCIe": (108, (8, 0), 1_410_000, 1_512_000, 5120),
    "NVIDIA H100 80GB HBM3": (132, (9, 0), 1_980_000, 2_619_000, 5120),
}
#: Our column -> (torch dtype, on Tensor Cores) as torch's calculator takes them.
COLUMNS = {
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
    "bf16": (torch.bfloat16, True),
    "fp16": (torch.float16, True),
    "fp64": (torch.float64, True),
}
#: The Hopper datasheets rate Tensor Cores at 1830 MHz, torch multiplies by the 1980 MHz
#: maximum clock: there the table reads 1830/1980 of torch's figure for Tensor Core math.
HOPPER_TENSOR_CLOCK = 1830 / 1980


def torchs_limits(properties: object, capability: tuple[int, int]) -> object:
    """torch's GPULimits for these properties: what its constructor builds from
    ``torch.cuda.get_device_properties``, built from the numbers above instead."""
    from torch.cuda._device_limits import GPULimits

    limits = GPULimits.__new__(GPULimits)
    limits.device_properties = properties
    limits.compute_capability = int(f"{capability[0]}{capability[1]}")
    return limits


def expected_share(model: str, column: str, tensor_cores: bool) -> float:
    hopper = model.startswith(("H100", "H200", "GH200"))
    return HOPPER_TENSOR_CLOCK if hopper and tensor_cores and column != "fp64" else 1.0


def check_against_torch(peak: GpuPeak, limits: object, *, exact: bool = True) -> None:
    """Every column torch can compute, and the memory bandwidth: equal up to the Hopper
    Tensor Core clock where ``exact``; else (a GPU's own properties, whatever its model)
    between 85 % and 101 % of torch's figure, memory within 3 %."""
    for column, (dtype, tensor_cores) in COLUMNS.items():
        if column not in peak.tflops:
            continue
        theirs = limits.get_tflops_per_second(dtype, use_tensor_cores=tensor_cores)  # type: ignore[attr-defined]
        ours = peak.tflops[column]
        if exact:
            share = expected_share(peak.model, column, tensor_cores)
            assert ours == pytest.approx(share * theirs, rel=0.01), (column, theirs)
        else:
            assert 0.85 * theirs <= ours <= 1.01 * theirs, (column, ours, theirs)
    bandwidth = limits.get_memory_bandwidth_Bps() / 1e9  # type: ignore[attr-defined]
    assert peak.memory_gbps == pytest.approx(bandwidth, rel=0.01 if exact else 0.03), bandwidth


@needs_limits
@pytest.mark.parametrize("name", PROPERTIES)
def test_the_table_agrees_with_torchs_own_calculator(name):
    sms, capability, clock, memory_clock, bus = PROPERTIES[name]
    properties = SimpleNamespace(
        multi_processor_count=sms,
        major=capability[0],
        minor=capability[1],
        clock_rate=clock,
        memory_clock_rate=memory_clock,
        memory_bus_width=bus,
    )
    check_against_torch(peak_of(name), torchs_limits(properties, capability))


@pytest.mark.cuda
@needs_limits
def test_the_table_agrees_with_torchs_calculator_on_this_gpu():
    from torch.cuda._device_limits import GPULimits

    from anydevice.hardware.selection import describe

    info = describe("cuda:0", telemetry=False)
    peak = gpu_peak(info)
    if peak is None:
        pytest.skip(f"{info.name} is not in the peaks table")
    limits = GPULimits(torch.device("cuda", 0))
    if limits.compute_capability not in (80, 90):
        pytest.skip(f"torch's calculator has no rates for sm_{limits.compute_capability}")
    props = limits.device_properties
    if not getattr(props, "clock_rate", 0) or not getattr(props, "memory_clock_rate", 0):
        # CUDA 13 dropped the clocks from cudaDeviceProp; torch may report them as 0
        pytest.skip("this torch build reports no SM or memory clock")
    check_against_torch(peak, limits, exact=False)
