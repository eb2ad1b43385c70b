"""The device spec grammar, read without looking at the hardware: :func:`parse_spec`.

Grammar (case-insensitive)::

    auto | cpu | gpu[:i] | cuda[:i] | mps | xpu[:i] | xla[:i] | tpu[:i] | free | int | torch.device
    | <name>[:i]   (any other accelerator torch knows: the privateuse1 backend's name, e.g. npu)

What each names on this machine is :mod:`anydevice.hardware.selection`'s to say.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

import torch

from anydevice.errors import DeviceSpecError

__all__ = ["NO_INDEX", "DeviceLike", "Spec", "generic_kinds", "parse_spec"]

#: Device types that take no index: one host, and ``meta``.
NO_INDEX = frozenset({"cpu", "meta"})


#: What every function that takes a device accepts.
DeviceLike = torch.device | str | int


_KINDS = ("auto", "cpu", "gpu", "cuda", "mps", "xpu", "xla", "free", "meta")


#: "tpu" is torch_xla's device, unless torch has a backend of that name (a native TPU
#: backend, which torch_xla's successor is planned to be: pytorch/xla#9684).
_ALIASES = {"tpu": "xla"}


_INDEXED = ("gpu", "cuda", "xpu", "xla", "mps")


@dataclass(frozen=True)
class Spec:
    """A parsed device spec: ``Spec("cuda", 1)`` for ``"cuda:1"``."""

    kind: str  #: auto, cpu, gpu, cuda, mps, xpu, xla, free, meta, or an accelerator's name
    index: int | None = None
    text: str = ""  #: as the caller wrote it, for messages
    source: str = "argument"  #: or "ANYDEVICE_DEVICE"

    def __str__(self) -> str:
        return self.text or (self.kind if self.index is None else f"{self.kind}:{self.index}")


def parse_spec(spec: DeviceLike, *, source: str = "argument") -> Spec:
    """Parse a device spec without looking at the hardware.

    >>> parse_spec("CUDA:1")
    Spec(kind='cuda', index=1, text='CUDA:1', source='argument')
    >>> parse_spec(2).kind, parse_spec("tpu").kind
    ('gpu', 'xla')

    Raises:
        DeviceSpecError: malformed text (``"cuda:x"``, ``"gpu:-1"``, ``"cuda:0,1"``).
        TypeError: not a str, int or torch.device.
    """
    if isinstance(spec, torch.device):
        return Spec(_check_kind(spec.type, str(spec), source), spec.index, str(spec), source)
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise TypeError(
            f"a device spec is a str, int or torch.device, not {type(spec).__name__} "
            f"({spec!r}). Pass e.g. 'auto', 'cpu', 'cuda:0' or 1."
        )
    if isinstance(spec, int):
        if spec < 0:
            raise DeviceSpecError(f"GPU index {spec} is negative; indices start at 0.")
        return Spec("gpu", spec, str(spec), source)
    text = spec.strip().lower()
    origin = "" if source == "argument" else f" (from {source})"
    if "," in text:
        raise DeviceSpecError(
            f"{spec!r}{origin} names several devices, but one is wanted here. Use "
            f"ad.devices({spec!r}) for a list, or ad.restrict_visible({spec!r}) to hide the rest."
        )
    if text.isdigit():
        return Spec("gpu", int(text), spec, source)
    kind, sep, index_text = text.partition(":")
    if kind in _ALIASES and kind not in generic_kinds():  # a backend named "tpu" is itself
        kind = _ALIASES[kind]
    kind = _check_kind(kind, spec, source)
    if not sep:
        return Spec(kind, None, spec, source)
    if not re.fullmatch(r"[+-]?\d+", index_text.strip()):
        raise DeviceSpecError(
            f"{spec!r}{origin}: the index after ':' must be a whole number, as in '{kind}:0'."
        )
    index = int(index_text)
    if index < 0:
        raise DeviceSpecError(f"{spec!r}{origin}: device index {index} is negative; use {kind}:0.")
    if kind == "cpu":
        if index != 0:
            raise DeviceSpecError(f"{spec!r}{origin}: there is one CPU device; use 'cpu'.")
        return Spec("cpu", None, spec, source)
    if kind not in _INDEXED and kind not in generic_kinds():
        raise DeviceSpecError(f"{spec!r}{origin}: '{kind}' takes no index; use '{kind}'.")
    return Spec(kind, index, spec, source)


def _check_kind(kind: str, spec: object, source: str) -> str:
    if kind in _KINDS:
        return kind
    generic = generic_kinds()
    if kind in generic:
        return kind
    close = difflib.get_close_matches(kind, [*_KINDS, "tpu", *generic], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    origin = "" if source == "argument" else f" (from {source})"
    registered = (
        "".join(f"{g}[:i], " for g in generic)
        if generic
        else "<name>[:i] (the name an accelerator's backend registers with torch), "
    )
    tpu = "" if "tpu" in generic else "tpu[:i], "  # a backend named tpu is listed as such
    raise DeviceSpecError(
        f"Unknown device {spec!r}{origin}.{hint} Use one of: auto, cpu, gpu[:i], cuda[:i], "
        f"mps, xpu[:i], xla[:i], {tpu}{registered}free, meta, an int, or a torch.device."
    )


def generic_kinds() -> tuple[str, ...]:
    """Accelerator device types torch knows beyond the named kinds (``npu``, ...)."""
    from anydevice.hardware.backends.generic import kinds

    return kinds()
