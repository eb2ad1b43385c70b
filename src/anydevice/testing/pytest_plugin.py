"""A pytest fixture for the simulated accelerator: ``sim_device``.

In ``conftest.py``::

    pytest_plugins = ["anydevice.testing.pytest_plugin"]

then in a test::

    def test_loader_feeds_the_model(sim_device):
        batch = next(iter(ad.DeviceLoader(data, sim_device)))
        ...

The fixture enables the simulator once per test session (``anydevice.testing.enable()``,
default settings: ``"sim"``, a 2 GB/s link) and returns its device. Where it cannot be
enabled (no C++ compiler or ninja, another privateuse1 backend in the process, a torch
older than :data:`anydevice.testing.MIN_TORCH`) the tests that use it are skipped, with
the reason. torch holds one privateuse1 backend per process: run tests that load another
one (an NPU's, torch's OpenReg) in a separate pytest run.
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["sim_device"]


@pytest.fixture(scope="session")
def sim_device() -> torch.device:
    """The simulated accelerator's device, enabled for the session (skips saying why
    where it cannot be)."""
    from anydevice.errors import ExtensionError
    from anydevice.testing import SimulatorError, enable

    try:
        return enable()
    except (ExtensionError, SimulatorError) as e:
        pytest.skip(f"anydevice's simulated accelerator is not available here: {e}")
