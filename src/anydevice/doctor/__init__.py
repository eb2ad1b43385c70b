"""``anydevice doctor``: what this machine has, what is off, what it does, and what to do.

:func:`examine` runs the configuration checks (:mod:`anydevice.doctor.checks`) and, when
asked, measures each device (:mod:`anydevice.doctor.measure`): throughput, bandwidth, what
each lever buys here, and a side-by-side table of the devices with advice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anydevice.doctor.checks import Check, run_checks
from anydevice.inventory import Inventory, inventory

if TYPE_CHECKING:
    from collections.abc import Sequence

    from anydevice.doctor.measure import Measurements, Plan, Progress

__all__ = ["Check", "Report", "examine"]

SCHEMA = "anydevice.doctor/1"


@dataclass(frozen=True)
class Report:
    """The doctor's findings: the inventory, each check's verdict, and the measurements."""

    inventory: Inventory
    checks: tuple[Check, ...] = field(default=())
    measurements: Measurements | None = None  #: None when nothing was measured

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed)."""
        return not any(c.status == "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "ok": self.ok,
            "checks": [c.to_dict() for c in self.checks],
            "measurements": self.measurements.to_dict() if self.measurements else None,
            "inventory": self.inventory.to_dict(),
        }


def examine(
    inv: Inventory | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    measure: str | Plan | None = None,
    devices: Sequence[str] | None = None,
    progress: Progress | None = None,
) -> Report:
    """Run every check on this machine (or on ``inv``, for tests), and measure if asked.

    Args:
        inv: the machine; default: :func:`~anydevice.inventory` of this one.
        environ: the environment the checks read (default: ``os.environ``).
        measure: None (checks only), or the plan of the measurements: ``"quick"``,
            ``"default"``, ``"full"``.
        devices: the devices to measure (default: the CPU and one GPU of each model).
        progress: called before each measurement with (done, total, title).
    """
    inv = inventory() if inv is None else inv
    env = os.environ if environ is None else environ
    checks = tuple(run_checks(inv, env))
    measured = None
    if measure is not None:
        from anydevice.doctor.measure import measure as run_measurements

        measured = run_measurements(inv, measure, devices, progress)
    return Report(inventory=inv, checks=checks, measurements=measured)
