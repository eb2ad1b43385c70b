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

``pytest --sim-cuda`` runs the tests marked ``cuda`` (tests written for a machine with
NVIDIA GPUs, skipped elsewhere) on the simulated GPUs instead, each inside
:func:`~anydevice.testing.simulate_cuda`, with the race detector on; ``--sim-devices N``
gives N simulated GPUs (1), ``--sim-capacity 4GiB`` each one's memory (the host's). The
skip of the ``cuda`` marker is the suite's own: it must let them run under ``--sim-cuda``
(``config.getoption("--sim-cuda", False)``). A test
that asserts what only a physical GPU gives (NVML, a child process that uses the GPU, a
GPU's speed) is marked ``@pytest.mark.real_gpu("why")`` and skipped there, saying why.
Tests without the ``cuda`` mark run as they do without the option.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from typing import Any

import pytest
import torch

__all__ = ["sim_cuda", "sim_device"]

#: The ``simulate_cuda`` block of a test run under ``--sim-cuda``.
_BLOCK = pytest.StashKey[contextlib.ExitStack]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--sim-races",
        choices=("raise", "warn", "off"),
        default="raise",
        help="anydevice's simulated accelerator: a stream race fails the test (raise, the "
        "default), is a warning (warn), or is not looked for (off)",
    )
    parser.addoption(
        "--sim-cuda",
        action="store_true",
        help="run the tests marked cuda on anydevice's simulated GPUs (each inside "
        "simulate_cuda, the race detector on); those marked real_gpu are skipped",
    )
    parser.addoption(
        "--sim-devices",
        type=int,
        default=1,
        metavar="N",
        help="how many simulated devices (GPUs under --sim-cuda) the simulator has (1)",
    )
    parser.addoption(
        "--sim-capacity",
        default=None,
        metavar="SIZE",
        help="memory per simulated device, e.g. 4GiB (default: the host's); a test that "
        "fills a GPU fills this",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "real_gpu(reason): a cuda test that asserts what only a physical GPU gives; "
        "skipped under --sim-cuda, saying why",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--sim-cuda"):
        return
    for item in items:
        mark = item.get_closest_marker("real_gpu")
        if mark is not None and item.get_closest_marker("cuda") is not None:
            why = mark.args[0] if mark.args else mark.kwargs.get("reason", "")
            item.add_marker(pytest.mark.skip(reason=f"needs a physical GPU: {why}"))


def _enable(config: pytest.Config) -> torch.device:
    """The simulator's device, enabled once for the session with the options' settings
    (where something enabled it first, as it is); skips the test saying why where it
    cannot be."""
    from anydevice.errors import ExtensionError
    from anydevice.testing import SimulatorError, enable, enabled

    name = enabled()
    if name is not None:
        return torch.device(name, 0)
    try:
        return enable(
            races=config.getoption("--sim-races"),
            devices=config.getoption("--sim-devices"),
            capacity=config.getoption("--sim-capacity"),
        )
    except (ExtensionError, SimulatorError) as e:
        pytest.skip(f"anydevice's simulated accelerator is not available here: {e}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``--sim-cuda``, a test marked ``cuda`` runs (fixtures included) inside
    ``simulate_cuda``."""
    if not item.config.getoption("--sim-cuda") or item.get_closest_marker("cuda") is None:
        return
    if any(m.name == "skip" for m in item.iter_markers()):
        return  # nothing to run: no simulator to build for it
    from anydevice.testing import simulate_cuda

    sim = _enable(item.config)
    block = contextlib.ExitStack()
    block.enter_context(simulate_cuda(torch.accelerator.device_count(), name=sim.type))
    item.stash[_BLOCK] = block


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    """Leave the test's ``simulate_cuda`` block once its fixtures are torn down."""
    try:
        return (yield)
    finally:
        block = item.stash.get(_BLOCK, None)
        if block is not None:
            del item.stash[_BLOCK]
            block.close()


@pytest.fixture(scope="session")
def sim_device(request: pytest.FixtureRequest) -> torch.device:
    """The simulated accelerator's device, enabled for the session (skips saying why
    where it cannot be)."""
    return _enable(request.config)


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
    from anydevice.testing.cuda import active

    if active() is not None:  # a cuda-marked test under --sim-cuda: its block is running
        yield torch.device("cuda", 0)
        return
    with simulate_cuda(torch.accelerator.device_count(), name=sim_device.type) as device:
        yield device
