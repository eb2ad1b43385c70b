"""Device backends, one module per kind, chosen from a registry.

Each backend implements :class:`~anydevice.hardware.backends.base.Backend`. Modules load on first
use, so ``import anydevice`` imports none of them (nor NVML, nor ``torch_xla``).

Modules:

* :mod:`~anydevice.hardware.backends.base` — :class:`Backend`: discovery and the run-time
  interface (streams, events, synchronisation, memory), written once on torch's
  device-generic API; a kind differs by flags and the few methods it overrides.
* :mod:`~anydevice.hardware.backends.cpu` — the CPU and the host's facts.
* :mod:`~anydevice.hardware.backends.cuda` — NVIDIA GPUs, read without CUDA;
  :mod:`~anydevice.hardware.backends.nvml` — NVML: physical GPUs, MIG, drivers.
* :mod:`~anydevice.hardware.backends.mps`, :mod:`~anydevice.hardware.backends.xpu`,
  :mod:`~anydevice.hardware.backends.xla` — Apple, Intel, XLA devices.
* :mod:`~anydevice.hardware.backends.generic` — any other accelerator torch knows.
* :mod:`~anydevice.hardware.backends.torch_private` — torch's private names, in one place.
* :mod:`~anydevice.hardware.backends.watch` — every accelerator read live for
  ``anydevice top``, each through its vendor's reader: NVML;
  :mod:`~anydevice.hardware.backends.amdsmi` (AMD's library);
  :mod:`~anydevice.hardware.backends.drm` (the kernel's DRM cards and fdinfo: AMD, Intel);
  :mod:`~anydevice.hardware.backends.xpusmi` (Intel's xpu-smi);
  :mod:`~anydevice.hardware.backends.ioreg` (Apple silicon's I/O Registry).
"""

from __future__ import annotations

import importlib
from functools import cache

from anydevice.hardware.backends.base import Backend, Probe

__all__ = ["KINDS", "Backend", "Probe", "get", "runtime", "stand_in"]

#: kind -> "module:class", in the order ``"auto"`` prefers accelerators, CPU last.
_REGISTRY: dict[str, str] = {
    "cuda": "anydevice.hardware.backends.cuda:CudaBackend",
    "xla": "anydevice.hardware.backends.xla:XlaBackend",
    "xpu": "anydevice.hardware.backends.xpu:XpuBackend",
    "mps": "anydevice.hardware.backends.mps:MpsBackend",
    # Every other accelerator torch knows (privateuse1 backends such as npu), by its name.
    "accelerator": "anydevice.hardware.backends.generic:GenericBackend",
    "cpu": "anydevice.hardware.backends.cpu:CpuBackend",
}

KINDS: tuple[str, ...] = tuple(_REGISTRY)

#: Backends that serve a kind in place of its own for a while (kind -> backend).
_STAND_INS: dict[str, Backend] = {}


def stand_in(kind: str, backend: Backend | None) -> Backend | None:
    """Serve ``kind`` with ``backend`` from now on (None: its own backend again), and
    return the stand-in this replaces. How ``anydevice.testing`` runs CUDA code on the
    simulated accelerator: its devices, presented as ``cuda``, answer through a backend
    of its own."""
    before = _STAND_INS.pop(kind, None)
    if backend is not None:
        _STAND_INS[kind] = backend
    return before


def get(kind: str) -> Backend:
    """The backend for ``kind`` (one instance per process; backends keep no device state).

    A device type torch knows beyond the named kinds (``npu``, ...) gets the generic one.
    """
    if _STAND_INS and kind in _STAND_INS:
        return _STAND_INS[kind]
    if kind not in _REGISTRY:
        from anydevice.hardware.backends.generic import kinds

        if kind not in kinds():
            known = ", ".join((*KINDS, *kinds()))
            raise KeyError(f"no backend for device kind {kind!r}; known: {known}")
        kind = "accelerator"
    return _get(kind)


@cache
def _get(kind: str) -> Backend:
    target = _REGISTRY[kind]
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    backend: Backend = cls()
    return backend


def runtime(kind: str) -> Backend:
    """The backend that runs work on devices of ``kind``: :func:`get`'s, and for a device
    type no backend claims (``meta``, ``lazy``) one with no streams, nothing to wait for
    and no memory counters (:class:`~anydevice.hardware.backends.base.Unclaimed`)."""
    try:
        return get(kind)
    except KeyError:
        return _meta() if kind == "meta" else _unclaimed()


@cache
def _meta() -> Backend:
    from anydevice.hardware.backends.base import Meta

    return Meta()


@cache
def _unclaimed() -> Backend:
    from anydevice.hardware.backends.base import Unclaimed

    return Unclaimed()
