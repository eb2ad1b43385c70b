"""The doctor's one run: :func:`examine` runs the checks and, when asked, the
measurements, into one :class:`~anydevice.doctor.results.Report`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from anydevice.doctor.checks import run_checks
from anydevice.doctor.results import Interrupted, Report
from anydevice.doctor.targets import resolve_devices
from anydevice.hardware.inventory import Inventory, inventory

if TYPE_CHECKING:
    from anydevice.doctor.workloads import Plan, Progress

__all__ = ["examine"]


def examine(
    inv: Inventory | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    measure: str | Plan | None = None,
    devices: Sequence[str] | None = None,
    progress: Progress | None = None,
    budget: float | None = None,
) -> Report:
    """Run every check on this machine (or on ``inv``, for tests), and measure if asked.

    Args:
        inv: the machine; default: :func:`~anydevice.hardware.inventory` of this one.
        environ: the environment the checks read (default: ``os.environ``).
        measure: None (checks only), or the plan of the measurements: ``"quick"``,
            ``"default"``, ``"full"``.
        devices: the devices to measure, in :func:`anydevice.device`'s grammar (default:
            the CPU and one GPU of each model).
        progress: called before each step with (done, total, title, seconds left).
        budget: seconds of measuring, instead of the plan's.

    Raises:
        DeviceSpecError: a malformed spec in ``devices``.
        DeviceNotFoundError: a spec in ``devices`` that names no device here.
        Interrupted: Ctrl-C while measuring (a ``KeyboardInterrupt``); its ``report`` holds
            the checks and what was measured before it.
    """
    inv = inventory() if inv is None else inv
    env = os.environ if environ is None else environ
    if devices is not None:
        resolve_devices(inv, devices, env)  # bad input is refused before any work
    checks = tuple(run_checks(inv, env))
    measured = None
    if measure is not None:
        from anydevice.doctor.measure import measure as run_measurements

        try:
            measured = run_measurements(inv, measure, devices, progress, budget=budget)
        except KeyboardInterrupt as e:  # Ctrl-C: the interrupt goes on, with the report so far
            so_far = e.measurements if isinstance(e, Interrupted) else None
            raise Interrupted(so_far, Report(inv, checks, so_far)) from None
    return Report(inventory=inv, checks=checks, measurements=measured)
