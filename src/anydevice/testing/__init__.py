"""Test GPU code without a GPU: a simulated asynchronous accelerator.

Most machines that test PyTorch code have no GPU, so the bugs only a GPU shows (a batch
read before its non-blocking copy finished, a copy to the host read before a sync, a side
stream that never waited) reach users first. :func:`enable` adds a device to torch that
behaves like a GPU where those bugs hide:

- its memory is its own, and starts poisoned (NaN for floating types): a read that comes
  before the write shows;
- every stream is a queue run by a worker thread; non-blocking copies from pinned memory
  return at once and land later; kernels wait for their stream, and for nothing else;
- copies cross a link with a speed (``bandwidth``), so overlap is a number;
- events record, wait and time on the workers' clock; pinned memory, allocator counters
  and a capacity that raises torch's out-of-memory error work through torch's API.

It is torch's ``privateuse1`` backend, built from C++ on first use (cached by content),
selected like any accelerator (``ad.device("sim")``, ``ANYDEVICE_DEVICE=sim``).

Modules:

- ``simulator``: :func:`enable`, :func:`busy` and the settings; builds and loads the
  backend (``sim.cpp``, shipped beside it).
- ``pytest_plugin``: the ``sim_device`` fixture (``pytest_plugins =
  ["anydevice.testing.pytest_plugin"]``).
"""

from __future__ import annotations

from anydevice.testing.simulator import (
    MIN_TORCH,
    SimulatorError,
    Span,
    bandwidth,
    busy,
    enable,
    enabled,
    parse_bandwidth,
    set_bandwidth,
    set_capacity,
    trace,
)

__all__ = [
    "MIN_TORCH",
    "SimulatorError",
    "Span",
    "bandwidth",
    "busy",
    "enable",
    "enabled",
    "parse_bandwidth",
    "set_bandwidth",
    "set_capacity",
    "trace",
]
