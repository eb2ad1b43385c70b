"""Which devices a doctor run measures: those named, read as ``ad.device`` reads them, or
else the CPU and one GPU of each model.

Torch-free at import: the command refuses a bad ``--device`` before anything is measured.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from anydevice.hardware.facts import DeviceInfo
from anydevice.hardware.override import with_override

if TYPE_CHECKING:
    from anydevice.doctor.workloads import Plan
    from anydevice.hardware.inventory import Inventory

__all__ = ["choose_devices", "resolve_devices"]


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
    from anydevice.hardware.selection import select
    from anydevice.hardware.spec import parse_spec

    env = os.environ if environ is None else environ
    found: dict[str, DeviceInfo] = {}
    for text in specs:
        d = select(with_override(parse_spec(text), env), inv, environ=env)
        found.setdefault(d.spec, d)
    return list(found.values())


def choose_devices(inv: Inventory, plan: Plan) -> list[DeviceInfo]:
    """What a run measures where no device is named: every device of ``inv``, one GPU of
    each model only (every GPU with ``plan.every_gpu``: the ``full`` plan)."""
    chosen, models = [], set()
    for d in inv.devices:
        if d.is_accelerator and not plan.every_gpu:
            if (d.kind, d.name) in models:
                continue  # identical to one already measured
            models.add((d.kind, d.name))
        chosen.append(d)
    return chosen
