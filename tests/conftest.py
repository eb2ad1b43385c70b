"""Test configuration: ``cuda`` tests run only where an NVIDIA GPU is really present, and
``xla`` tests only where torch_xla is installed and has a device.

The CUDA check reads NVML through anydevice's own inventory, so it neither initialises CUDA
in the pytest process nor fakes anything: on a machine without a GPU the tests are skipped.
torch_xla is looked for without importing it, and imported only where it is installed
(``scripts/xla-check.sh`` builds such an environment).
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def cuda_gpu_present() -> bool:
    from anydevice.backends.cuda import cuda_built
    from anydevice.inventory import inventory

    if not cuda_built():
        return False
    return bool(inventory(telemetry=False, kinds=("cuda", "cpu")).of_kind("cuda"))


@functools.cache
def xla_device_present() -> bool:
    from anydevice.backends.xla import installed

    if not installed():
        return False
    from anydevice.inventory import inventory

    return bool(inventory(telemetry=False, kinds=("xla", "cpu")).of_kind("xla"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs = {
        "cuda": (cuda_gpu_present, "needs an NVIDIA GPU (cuda marker); none here"),
        "xla": (
            xla_device_present,
            "needs torch_xla with a device (xla marker); scripts/xla-check.sh runs these",
        ),
    }
    for marker, (present, reason) in needs.items():
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        if marked and not present():
            for item in marked:
                item.add_marker(pytest.mark.skip(reason=reason))
