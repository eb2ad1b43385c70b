"""``anydevice doctor``: what this machine has, what is off, what it does, and what to do.

:func:`examine` runs the configuration checks (:mod:`anydevice.doctor.checks`) and, when
asked, measures each device (:mod:`anydevice.doctor.measure`): throughput, bandwidth, what
each lever buys here, and a side-by-side table of the devices with advice.

Modules:

* :mod:`~anydevice.doctor.checks` — the configuration checks, each a verdict with its fix;
  :mod:`~anydevice.doctor.toolchain` — the compiler, ninja and nvcc check.
* :mod:`~anydevice.doctor.results` — what was found and measured, as frozen data.
* :mod:`~anydevice.doctor.workloads` — the plans (how long, how large) and what is timed.
* :mod:`~anydevice.doctor.measure` — the measurements; :mod:`~anydevice.doctor.levers` —
  what each lever buys, from interleaved A/B timings.
* :mod:`~anydevice.doctor.budget` — time budgets and self-sizing;
  :mod:`~anydevice.doctor.load` — whether other processes used the cores meanwhile.
* :mod:`~anydevice.doctor.render` — the report as rich tables;
  :mod:`~anydevice.doctor.plot` — as one picture (``--plot``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anydevice.doctor.checks import run_checks
from anydevice.doctor.results import Check, Interrupted
from anydevice.hardware.facts import DeviceInfo
from anydevice.hardware.inventory import Inventory, inventory

if TYPE_CHECKING:
    from collections.abc import Sequence

    from anydevice.doctor.results import Measurements
    from anydevice.doctor.workloads import Plan, Progress

__all__ = ["Check", "Report", "examine", "resolve_devices"]

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


def resolve_devices(
    inv: Inventory, specs: Sequence[str], environ: Mapping[str, str] | None = None
) -> list[DeviceInfo]:
    """The devices ``specs`` name in ``inv``, read as :func:`anydevice.device` reads them.

    Case-insensitive, with the same grammar and the same messages: ``"CPU"``, ``"0"``,
    ``"gpu:1"``, ``"free"``, ``"auto"`` (which honours ``ANYDEVICE_DEVICE``). Each device
    comes once, in the order first named.

    >>> from anydevice.hardware.inventory import inventory
    >>> [d.spec for d in resolve_devices(inventory(kinds=("cpu",)), ["CPU", "cpu:0"])]
    ['cpu']

    Raises:
        DeviceSpecError: a malformed spec.
        DeviceNotFoundError: a spec that names no device here; the message lists what is.
    """
    from anydevice.hardware.choice import DEVICE_VARIABLE, device_override
    from anydevice.hardware.selection import select
    from anydevice.hardware.spec import parse_spec

    env = os.environ if environ is None else environ
    override = device_override(env)
    found: dict[str, DeviceInfo] = {}
    for text in specs:
        spec = parse_spec(text)
        if spec.kind == "auto" and override:
            spec = parse_spec(override, source=DEVICE_VARIABLE)
        d = select(spec, inv, environ=env)
        found.setdefault(d.spec, d)
    return list(found.values())
