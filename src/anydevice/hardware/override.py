"""``ANYDEVICE_DEVICE``: the spec that overrides what ``"auto"`` picks, read in one place.

Torch-free, so the launcher checks it before torch is imported (``anydevice launch``), as
``ad.device()``, the doctor and the launched ranks read it.

>>> device_override({"ANYDEVICE_DEVICE": " cpu "})
'cpu'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from anydevice.hardware.spec import Spec

__all__ = ["DEVICE_VARIABLE", "device_override", "with_override"]

#: The variable that overrides what ``"auto"`` picks.
DEVICE_VARIABLE = "ANYDEVICE_DEVICE"


def device_override(environ: Mapping[str, str] | None = None) -> str | None:
    """The spec ``ANYDEVICE_DEVICE`` gives ``"auto"`` (None when unset or blank); the one
    place it is read."""
    value = (os.environ if environ is None else environ).get(DEVICE_VARIABLE, "").strip()
    return value or None


def with_override(spec: Spec, environ: Mapping[str, str] | None = None) -> Spec:
    """``spec``, or for ``"auto"`` the spec ``ANYDEVICE_DEVICE`` gives where it is set: the
    rule ``ad.device()``, the doctor and ``anydevice launch`` follow (errors in its value
    name the variable).

    >>> from anydevice.hardware.spec import parse_spec
    >>> with_override(parse_spec("auto"), {"ANYDEVICE_DEVICE": "cpu"}).kind
    'cpu'
    >>> with_override(parse_spec("cuda:1"), {"ANYDEVICE_DEVICE": "cpu"}).text
    'cuda:1'
    """
    from anydevice.hardware.spec import AUTO, parse_spec  # imports torch: not at load

    if spec.kind != AUTO:
        return spec
    override = device_override(environ)
    if override is None:
        return spec
    return parse_spec(override, source=DEVICE_VARIABLE)
