"""Test configuration: ``cuda`` tests run only where an NVIDIA GPU is really present.

The check reads NVML through anydevice's own inventory, so it neither initialises CUDA in
the pytest process nor fakes anything: on a machine without a GPU the tests are skipped.
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_gpu_present():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (cuda marker); none here")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
