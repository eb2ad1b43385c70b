"""pytest fixtures for the simulated accelerator: ``sim_device`` and ``sim_cuda``.

In ``conftest.py``::

    pytest_plugins = ["anydevice.testing.pytest_plugin"]

then in a test::

    def test_loader_feeds_the_model(sim_device):
        batch = next(iter(ad.DeviceLoader(data, sim_device)))
        ...

    def test_my_cuda_code(sim_cuda):           # code written for CUDA, unchanged
        assert torch.cuda.is_available()
        model = MyModel().cuda()
        ...

``sim_device`` enables the simulator once per test session (``anydevice.testing.enable()``,
default settings: ``"sim"``, a 2 GB/s link, one device, the stream race detector raising;
where a session fixture of yours enabled it first, with its settings) and returns its
device. ``sim_cuda`` runs its test inside :func:`anydevice.testing.simulate_cuda`, as many
CUDA GPUs as the simulator has devices, and returns ``torch.device("cuda", 0)``;
everything it mapped is restored after the test. For N GPUs, enable the simulator with
``devices=N`` in a session fixture. A test in which a stream race is reported fails, with
the report, also when the test caught the :class:`~anydevice.testing.StreamRaceError` (a
test that shows a race on purpose wraps it in ``anydevice.testing.expect_races()``);
``--sim-races=warn`` makes races warnings, ``--sim-races=off`` turns the detector off.
Where the simulator cannot be enabled (no C++ compiler or ninja, another privateuse1
backend in the process, a torch older than :data:`anydevice.testing.MIN_TORCH`) the tests
that use them are skipped, with the reason. torch holds one privateuse1 backend per
process: run tests that load another one (an NPU's, torch's OpenReg) in a separate pytest
run.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import pytest
import torch

__all__ = ["sim_cuda", "sim_device"]


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
    from anydevice.testing import SimulatorError, enable, enabled

    name = enabled()
    if name is not None:  # enabled already (a session fixture chose its settings): as is
        return torch.device(name, 0)
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


@pytest.fixture
def sim_cuda(sim_device: torch.device) -> Iterator[torch.device]:
    """``torch.device("cuda", 0)``, with CUDA simulated for the test (restored after it)."""
    from anydevice.testing import simulate_cuda

    with simulate_cuda(torch.accelerator.device_count(), name=sim_device.type) as device:
        yield device
