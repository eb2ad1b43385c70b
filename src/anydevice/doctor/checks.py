"""Configuration checks: each reads an Inventory (and the environment) and gives a verdict.

A check is a pure function ``(Inventory, environ) -> Check``, so every verdict is tested
with hand-built machines. Statuses: ``ok``, ``info`` (worth knowing), ``warn`` (likely
costs speed or surprises), ``fail`` (torch cannot use the hardware as it is), ``skip``
(does not apply here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from anydevice.doctor.results import Check
from anydevice.doctor.toolchain import check_toolchain
from anydevice.hardware.facts import format_bytes
from anydevice.hardware.inventory import Inventory

__all__ = ["CHECKS", "run_checks"]


#: The pip line for torch's CPU-only build (the README's, for machines without a GPU).
CPU_WHEEL_COMMAND = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def check_torch_build(inv: Inventory, env: Mapping[str, str]) -> Check:
    """A CPU-only torch on a machine with NVIDIA GPUs wastes them."""
    from anydevice.hardware.backends.cuda import cuda_wheel_command

    h = inv.host
    title = "torch build fits the hardware"
    if h.torch_build == "CPU" and h.nvidia_gpus:
        return Check(
            "torch-build",
            title,
            "fail",
            f"torch {h.torch} is a CPU-only build, but this machine has {h.nvidia_gpus} "
            f"NVIDIA GPU(s) (driver {h.driver or '?'}, CUDA {h.driver_cuda or '?'}).",
            f"Install a CUDA build: {cuda_wheel_command(h.driver_cuda)}",
        )
    if h.torch_build.startswith("CUDA") and h.nvidia_gpus == 0:
        return Check(
            "torch-build",
            title,
            "info",
            f"torch {h.torch} is a {h.torch_build} build, but there is no NVIDIA GPU here; "
            "it runs on the CPU, and the CPU-only build is ~2 GB smaller.",
            f"For the CPU-only build: {CPU_WHEEL_COMMAND}",
        )
    gpus = f"{h.nvidia_gpus} NVIDIA GPU(s)" if h.nvidia_gpus else "no NVIDIA GPU"
    return Check("torch-build", title, "ok", f"torch {h.torch} ({h.torch_build}); {gpus}.")


def _version(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor.partition(".")[0] or 0)


def check_driver(inv: Inventory, env: Mapping[str, str]) -> Check:
    """The NVIDIA driver must support the CUDA runtime torch was built with."""
    h = inv.host
    title = "NVIDIA driver supports torch's CUDA"
    if not h.cuda_runtime or not h.nvidia_gpus:
        return Check("driver", title, "skip", "no CUDA runtime and GPU pair to check.")
    if not h.driver_cuda:
        return Check(
            "driver",
            title,
            "warn",
            f"torch uses CUDA {h.cuda_runtime}, but the driver's CUDA version is unknown "
            "(NVML unavailable).",
            "Run nvidia-smi: its header shows the driver's CUDA version.",
        )
    runtime, driver = _version(h.cuda_runtime), _version(h.driver_cuda)
    if driver[0] < runtime[0]:
        return Check(
            "driver",
            title,
            "fail",
            f"torch uses CUDA {h.cuda_runtime}, but driver {h.driver} supports at most CUDA "
            f"{h.driver_cuda}: CUDA {runtime[0]}.x needs a newer driver, so torch sees no GPU.",
            f"Upgrade the NVIDIA driver, or install a torch built for CUDA {driver[0]}.x.",
        )
    if driver < runtime:
        return Check(
            "driver",
            title,
            "warn",
            f"torch uses CUDA {h.cuda_runtime}; driver {h.driver} supports CUDA {h.driver_cuda}. "
            "Minor-version compatibility runs it, but kernels that need newer PTX JIT can fail.",
            "Upgrade the driver to one made for CUDA "
            f"{h.cuda_runtime} or later, or install a torch built for CUDA {h.driver_cuda}.",
        )
    return Check(
        "driver",
        title,
        "ok",
        f"driver {h.driver} (CUDA {h.driver_cuda}) runs torch's CUDA {h.cuda_runtime}.",
    )


def check_visibility(inv: Inventory, env: Mapping[str, str]) -> Check:
    """CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER surprises: hidden GPUs, shifted indices."""
    from anydevice.hardware.backends.cuda import CudaBackend  # nvidia-smi's numbering

    title = "GPU numbering (CUDA vs nvidia-smi)"
    cuda = inv.of_kind(CudaBackend.kind)
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if not inv.host.nvidia_gpus and not cuda:
        return Check("visibility", title, "skip", "no NVIDIA GPU.")
    if cvd is not None and not cvd.strip():
        return Check(
            "visibility",
            title,
            "warn",
            f"CUDA_VISIBLE_DEVICES is set but empty: torch sees none of the "
            f"{inv.host.nvidia_gpus} GPU(s).",
            "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use.",
        )
    if cvd is not None:
        entries = cvd.split(",")
        if len(cuda) < len(entries):
            notes = " ".join(n for n in inv.notes if "CUDA_VISIBLE_DEVICES" in n)
            return Check(
                "visibility",
                title,
                "warn",
                f"CUDA_VISIBLE_DEVICES={cvd!r} lists {len(entries)} entries but only "
                f"{len(cuda)} GPU(s) are visible. {notes}".strip(),
                "Fix the list (`anydevice info` shows each GPU's UUID), or unset it.",
            )
    guessed = [d for d in cuda if d.index_guessed]
    if guessed:
        return Check(
            "visibility",
            title,
            "warn",
            "GPUs of different models and CUDA_DEVICE_ORDER unset: CUDA numbers them fastest "
            "first, so cuda:N is not nvidia-smi's GPU N, and scripts that pick by index "
            "(or CUDA_VISIBLE_DEVICES=1) may get another GPU than you think.",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID (then cuda:N is nvidia-smi's GPU N), or "
            "select GPUs by UUID.",
        )
    shifted = [d for d in cuda if d.smi_index is not None and d.smi_index != d.index]
    mapping = ", ".join(f"{d.spec} is nvidia-smi GPU {d.smi_index}" for d in shifted)
    if shifted and cvd is not None:
        return Check(
            "visibility",
            title,
            "info",
            f"CUDA_VISIBLE_DEVICES={cvd!r}: {mapping}. nvidia-smi and torch number these "
            "GPUs differently.",
        )
    if shifted:
        return Check(
            "visibility",
            title,
            "warn",
            f"{mapping}, although CUDA_VISIBLE_DEVICES is unset.",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID so that both number GPUs alike.",
        )
    where = f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""
    return Check(
        "visibility",
        title,
        "ok",
        f"cuda:N is nvidia-smi's GPU N for all {len(cuda)} GPU(s){where}.",
    )


def check_nvml(inv: Inventory, env: Mapping[str, str]) -> Check:
    """Without NVML, anydevice (and nvidia-smi) cannot read GPUs without initialising CUDA.
    Where there is no NVIDIA GPU (a CUDA torch on a CPU machine) there is nothing to read."""
    from anydevice.hardware.backends.nvml import pci_gpus

    title = "NVML (GPU telemetry without a CUDA context)"
    nvml_notes = [n for n in inv.notes if "NVML" in n]
    if nvml_notes and inv.host.nvidia_gpus == 0:
        on_bus = pci_gpus()
        if on_bus:
            return Check(
                "nvml",
                title,
                "warn",
                f"{on_bus} NVIDIA GPU(s) on the PCI bus, but no NVIDIA driver is loaded: "
                "neither torch nor NVML can use them.",
                "Install the NVIDIA driver (it brings NVML), then reboot.",
            )
        return Check("nvml", title, "skip", "no NVIDIA GPU here: nothing for NVML to read.")
    if nvml_notes:
        return Check(
            "nvml",
            title,
            "warn",
            " ".join(nvml_notes),
            "Install the driver's NVML library (it ships with the driver) and nvidia-ml-py; "
            "after a driver upgrade, reboot.",
        )
    if not inv.host.nvidia_gpus:
        return Check("nvml", title, "skip", "no NVIDIA driver.")
    return Check("nvml", title, "ok", f"NVML reads {inv.host.nvidia_gpus} GPU(s).")


def check_device_env(inv: Inventory, env: Mapping[str, str]) -> Check:
    """``ANYDEVICE_DEVICE`` overrides ``ad.device()``: a value that names nothing here breaks
    every script that asks for ``"auto"``."""
    from anydevice.errors import AnydeviceError
    from anydevice.hardware.override import device_override, with_override
    from anydevice.hardware.selection import select
    from anydevice.hardware.spec import parse_spec

    title = "ANYDEVICE_DEVICE (the device ad.device() picks)"
    value = device_override(env)
    if value is None:
        return Check("device-env", title, "skip", "ANYDEVICE_DEVICE is not set.")
    try:
        d = select(with_override(parse_spec("auto"), env), inv, environ=env)
    except AnydeviceError as e:
        here = ", ".join(d.spec for d in inv.devices)
        return Check(
            "device-env",
            title,
            "fail",
            f"ad.device() fails in every script run here: {e}",
            f"unset ANYDEVICE_DEVICE, or set it to a device here ({here}; `anydevice info` "
            "lists them).",
        )
    return Check(
        "device-env", title, "ok", f"ANYDEVICE_DEVICE={value!r}: ad.device() picks {d.spec}."
    )


def check_free_memory(inv: Inventory, env: Mapping[str, str]) -> Check:
    """Low free memory on the device ``auto`` would pick is an OOM waiting to happen."""
    from anydevice.errors import AnydeviceError
    from anydevice.hardware.selection import select
    from anydevice.hardware.spec import Spec

    title = "free memory on the default device"
    try:
        d = select(Spec("auto"), inv, environ=env)
    except AnydeviceError as e:
        return Check("free-memory", title, "warn", str(e))
    if d.memory_free is None or d.memory_total is None:
        return Check("free-memory", title, "skip", f"free memory of {d.spec} is unknown.")
    share = d.memory_free / d.memory_total if d.memory_total else 0.0
    floor = 2**30 if d.is_accelerator else 2 * 2**30
    line = f"{d.spec}: {format_bytes(d.memory_free)} free of {format_bytes(d.memory_total)}"
    if share >= 0.10 and d.memory_free >= floor:
        return Check("free-memory", title, "ok", f"{line} ({share:.0%}).")
    holders = ""
    if d.processes:
        top = sorted(d.processes, key=lambda p: -(p.memory or 0))[:3]
        holders = " Held by: " + ", ".join(
            f"pid {p.pid} {p.name or '?'} ({format_bytes(p.memory)})" for p in top
        )
    fix = (
        "Free it (other processes, or ad.free_memory()), or pick another device: "
        "ad.device('free') takes the GPU with the most free memory."
        if d.is_accelerator
        else "Close other programs, or lower batch sizes."
    )
    return Check("free-memory", title, "warn", f"{line} ({share:.0%}).{holders}", fix)


def check_cores(inv: Inventory, env: Mapping[str, str]) -> Check:
    """A process limited to fewer cores than torch uses threads oversubscribes them."""
    h = inv.host
    title = "CPU cores usable by this process"
    limits = []
    if h.cpu_quota is not None:
        limits.append(f"cgroup quota {h.cpu_quota:g} cores")
    if h.cores_usable < h.cores_logical and h.cpu_quota is None:
        limits.append("CPU affinity")
    if h.torch_threads is not None and h.torch_threads > h.cores_usable:
        return Check(
            "cores",
            title,
            "warn",
            f"torch runs {h.torch_threads} threads, but this process may use only "
            f"{h.cores_usable} of {h.cores_logical} cores ({', '.join(limits) or 'limits'}): "
            "oversubscribed threads slow CPU work down.",
            f"torch.set_num_threads({h.cores_usable}) or OMP_NUM_THREADS={h.cores_usable}.",
        )
    if h.cores_usable < h.cores_logical:
        return Check(
            "cores",
            title,
            "info",
            f"this process may use {h.cores_usable} of {h.cores_logical} cores "
            f"({', '.join(limits)}); torch uses {h.torch_threads} threads.",
        )
    return Check(
        "cores",
        title,
        "ok",
        f"{h.cores_usable} cores usable ({h.cores_physical or '?'} physical); torch uses "
        f"{h.torch_threads} threads.",
    )


def check_mps_fallback(inv: Inventory, env: Mapping[str, str]) -> Check:
    """On a Mac, operators without an MPS kernel raise; the CPU fallback must be set before
    torch is imported."""
    from anydevice.hardware.backends.mps import MpsBackend  # Apple's variable

    title = "MPS fallback for operators MPS lacks"
    if not inv.of_kind(MpsBackend.kind):
        return Check("mps-fallback", title, "skip", "no MPS device.")
    if env.get("PYTORCH_ENABLE_MPS_FALLBACK", "").strip() == "1":
        return Check(
            "mps-fallback",
            title,
            "ok",
            "PYTORCH_ENABLE_MPS_FALLBACK=1: operators without an MPS kernel run on the CPU "
            "(slower), if it was set before torch was imported.",
        )
    return Check(
        "mps-fallback",
        title,
        "info",
        "operators without an MPS kernel raise NotImplementedError. "
        "PYTORCH_ENABLE_MPS_FALLBACK=1 runs them on the CPU, but torch reads it only when "
        "imported: setting os.environ after `import torch` does nothing.",
        "Set it when launching: PYTORCH_ENABLE_MPS_FALLBACK=1 python train.py",
    )


CHECKS: tuple[Callable[[Inventory, Mapping[str, str]], Check], ...] = (
    check_device_env,
    check_torch_build,
    check_driver,
    check_visibility,
    check_nvml,
    check_free_memory,
    check_cores,
    check_toolchain,
    check_mps_fallback,
)


def run_checks(inv: Inventory, environ: Mapping[str, str]) -> list[Check]:
    """Every configuration check, in order."""
    return [check(inv, environ) for check in CHECKS]
