"""Device backends, one module per kind, chosen from a registry.

Each backend implements :class:`~anydevice.backends.base.Backend`. Modules load on first
use, so ``import anydevice`` imports none of them (nor NVML, nor ``torch_xla``).
"""

from __future__ import annotations

import importlib
from functools import cache

from anydevice.backends.base import Backend, Probe

__all__ = ["KINDS", "Backend", "Probe", "get"]

#: kind -> "module:class", in the order ``"auto"`` prefers accelerators, CPU last.
_REGISTRY: dict[str, str] = {
    "cuda": "anydevice.backends.cuda:CudaBackend",
    "xla": "anydevice.backends.xla:XlaBackend",
    "xpu": "anydevice.backends.xpu:XpuBackend",
    "mps": "anydevice.backends.mps:MpsBackend",
    "cpu": "anydevice.backends.cpu:CpuBackend",
}

KINDS: tuple[str, ...] = tuple(_REGISTRY)


@cache
def get(kind: str) -> Backend:
    """The backend for ``kind`` (one instance per process; backends keep no device state)."""
    try:
        target = _REGISTRY[kind]
    except KeyError:
        raise KeyError(f"no backend for device kind {kind!r}; known: {', '.join(KINDS)}") from None
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    backend: Backend = cls()
    return backend
