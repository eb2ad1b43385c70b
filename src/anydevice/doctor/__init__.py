"""``anydevice doctor``: what this machine has, what is off, and what to do about it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from anydevice.doctor.checks import Check, run_checks
from anydevice.inventory import Inventory, inventory

__all__ = ["Check", "Report", "examine"]

SCHEMA = "anydevice.doctor/1"


@dataclass(frozen=True)
class Report:
    """The doctor's findings: the inventory and each check's verdict."""

    inventory: Inventory
    checks: tuple[Check, ...] = field(default=())

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
            "inventory": self.inventory.to_dict(),
        }


def examine(inv: Inventory | None = None, environ: Mapping[str, str] | None = None) -> Report:
    """Run every check on this machine (or on ``inv``, for tests)."""
    inv = inventory() if inv is None else inv
    env = os.environ if environ is None else environ
    return Report(inventory=inv, checks=tuple(run_checks(inv, env)))
