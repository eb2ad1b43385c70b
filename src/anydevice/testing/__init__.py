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
- every stream is a queue run by a worker thread; kernels run there, asynchronously, so
  the host runs ahead; non-blocking copies from pinned memory return at once and land
  later; a kernel waits for its stream, and for nothing else;
- copies cross a link with a speed (``bandwidth``), so overlap is a number;
- a caching allocator with CUDA's stream rules (``record_stream``, reserved and
  allocated memory, ``empty_cache``), events that record, wait and time on the workers'
  clock, pinned memory, and a capacity that raises torch's out-of-memory error;
- a stream race detector, on by default: two accesses to a tensor's memory that nothing
  orders raise :class:`StreamRaceError` at the second, naming both lines and the fix,
  whatever the timing (:func:`detect_races` turns it on for a real accelerator too).

It is torch's ``privateuse1`` backend, built from C++ on first use (cached by content),
selected like any accelerator (``ad.device("sim")``, ``ANYDEVICE_DEVICE=sim``). Code
written for CUDA runs on it unchanged inside :func:`simulate_cuda` (``python -m
anydevice.testing train.py`` does that by default).

Modules:

- ``simulator``: :func:`enable`, :func:`busy` and the settings; builds and loads the
  backend (the C++ sources shipped beside it).
- ``races``: the stream race detector's reports and modes (:func:`detect_races`,
  :func:`expect_races`, :class:`RaceReport`).
- ``device_module``: what ``torch.sim`` offers as ``torch.cuda`` does (streams, events,
  the current and default stream, memory counters).
- ``autograd_threads``: what a process with the simulator does at exit (autograd's device
  threads let go of their last backward pass, or the process may abort).
- ``cuda``: :func:`simulate_cuda`, CUDA programs on the simulated devices (a subpackage).
- ``pytest_plugin``: the ``sim_device`` and ``sim_cuda`` fixtures (``pytest_plugins =
  ["anydevice.testing.pytest_plugin"]``); a test with a stream race fails.
"""

from __future__ import annotations

from anydevice.testing.cuda import NotSimulatedError, simulate_cuda
from anydevice.testing.races import (
    RaceReport,
    StreamRaceError,
    StreamRaceWarning,
    expect_races,
    race_mode,
    race_reports,
)
from anydevice.testing.simulator import (
    MIN_TORCH,
    SimulatorError,
    Span,
    bandwidth,
    busy,
    detect_races,
    enable,
    enabled,
    parse_bandwidth,
    set_bandwidth,
    set_capacity,
    trace,
)

__all__ = [
    "MIN_TORCH",
    "NotSimulatedError",
    "RaceReport",
    "SimulatorError",
    "Span",
    "StreamRaceError",
    "StreamRaceWarning",
    "bandwidth",
    "busy",
    "detect_races",
    "enable",
    "enabled",
    "expect_races",
    "parse_bandwidth",
    "race_mode",
    "race_reports",
    "set_bandwidth",
    "set_capacity",
    "simulate_cuda",
    "trace",
]
