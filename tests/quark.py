"""A device kind anydevice has never heard of, added from this one module: ``quark``.

Everything a kind is to anydevice is here: torch's side (its python ``privateuse1``
backend under the name ``quark``, so that ``torch.device("quark", 1)`` exists), the
backend that finds two quark devices, and the kind's facts (a GPU, its collective
backend ``quarkcc``, bf16 by its own precision policy). :func:`register` hands it to the
registry; ``tests/test_new_kind.py`` then finds the spec grammar, ``ad.device``, the
``"gpu"`` and ``"auto"`` rules, the precision policy and the collective device following
it, with no other edit anywhere. Nothing is registered when this file is imported (torch
keeps one ``privateuse1`` backend per process, for good: the test registers it in a child).
"""

from __future__ import annotations

from anydevice.hardware.backends import Backend, Kind, Probe, register
from anydevice.hardware.backends.kind import PrecisionPolicy, who
from anydevice.hardware.facts import DeviceInfo

NAME = "quark"
COLLECTIVE = "quarkcc"
COUNT = 2


def _precision(info: DeviceInfo) -> PrecisionPolicy:
    return PrecisionPolicy("bf16", f"{who(info)}: quarks compute in bf16", {"fp16": "no fp16"})


class QuarkBackend(Backend):
    facts = Kind(NAME, gpu=True, collective=COLLECTIVE, precision=_precision)
    label = "Quark"

    def probe(self, *, telemetry: bool = True) -> Probe:
        devices = tuple(
            DeviceInfo(NAME, i, f"Quark {i}", memory_total=2**30, memory_free=2**29 - i)
            for i in range(COUNT)
        )
        return Probe(devices=devices)


class _Module:
    """``torch.quark``: what torch asks of a device module (one is current: index 0)."""

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return COUNT

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        return None


def register_kind() -> None:
    """Make ``quark`` a device type torch knows, and a kind anydevice knows."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(NAME, backend_module=_Module())
    register(QuarkBackend)
