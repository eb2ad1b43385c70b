"""A pytest fixture for the simulated accelerator: ``sim_device``.

In ``conftest.py``::

    pytest_plugins = ["anydevice.testing.pytest_plugin"]

then in a test::

    def test_loader_feeds_the_model(sim_device):
        batch = next(iter(ad.DeviceLoader(data, sim_device)))
        ...

The fixture enables the simulator once per test session (``anydevice.testing.enable()``,
default settings: ``"sim"``, a 2 GB/s link, the stream race detector raising) and
returns its device. A test in which a stream race is reported fails, with the report,
also when the test caught the :class:`~anydevice.testing.StreamRaceError` (a test that
shows a race on purpose wraps it in ``anydevice.testing.expect_races()``);
``--sim-races=warn`` makes races warnings, ``--sim-races=off`` turns the detector off.
Where the simulator cannot be enabled (no C++ compiler or ninja, another privateuse1
backend in the process, a torch older than :data:`anydevice.testing.MIN_TORCH`) the tests
that use it are skipped, with the reason. torch holds one privateuse1 backend per process:
run tests that load another one (an NPU's, torch's OpenReg) in a separate pytest run.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import torch

__all__ = ["sim_device"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--sim-races",
        choices=("raise", "warn", "off"),
        default="raise",
        help="anydevice's simulated accelerator: a stream race fails the test (raise, the "
        "default), is a warning (warn), or is not looked for (off)",
    )


@pytest.fixture(scope="session")
def sim_device(request: pytest.FixtureRequest) -> torch.device:
    """The simulated accelerator's device, enabled for the session (skips saying why
    where it cannot be)."""
    from anydevice.errors import ExtensionError
    from anydevice.testing import SimulatorError, enable

    try:
        return enable(races=request.config.getoption("--sim-races"))
    except (ExtensionError, SimulatorError) as e:
        pytest.skip(f"anydevice's simulated accelerator is not available here: {e}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    """Fail a test in which a stream race was reported, though the test caught it."""
    from anydevice.testing import StreamRaceError
    from anydevice.testing.races import forget_reported, race_mode, uncaught

    forget_reported()  # each test reports its own races, though an earlier one had them
    before = len(uncaught())
    result = yield
    found = uncaught()[before:]
    if found and race_mode() == "raise":
        raise StreamRaceError(found[0])
    return result
