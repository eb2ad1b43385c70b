"""The device spec grammar, read without looking at the hardware: :func:`parse_spec`.

Grammar (case-insensitive)::

    auto | gpu[:i] | free | int | torch.device
    | <kind>[:i]   each device kind the registry knows, by its name or another word for it
                   (cpu, cuda[:i], xla[:i], tpu[:i], xpu[:i], mps, meta: its backend's
                   facts, :mod:`anydevice.hardware.backends`)
    | <name>[:i]   (any other accelerator torch knows: the privateuse1 backend's name, e.g. npu)

``auto``, ``gpu`` and ``free`` are the grammar's own words; what each names on this machine
is :mod:`anydevice.hardware.selection`'s to say.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

import torch

from anydevice.errors import DeviceSpecError
from anydevice.hardware import backends

__all__ = ["DeviceLike", "Spec", "generic_kinds", "parse_spec", "unindexed"]


#: What every function that takes a device accepts.
DeviceLike = torch.device | str | int

#: The grammar's own words, which name no kind: the best device, a GPU, the freest GPU.
AUTO, GPU, FREE = "auto", "gpu", "free"


@dataclass(frozen=True)
class Spec:
    """A parsed device spec: ``Spec("cuda", 1)`` for ``"cuda:1"``."""

    kind: str  #: auto, gpu, free, a device kind's name (cpu, cuda, ...), or an accelerator's
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
        return Spec(GPU, spec, str(spec), source)
    text = spec.strip().lower()
    origin = "" if source == "argument" else f" (from {source})"
    if "," in text:
        raise DeviceSpecError(
            f"{spec!r}{origin} names several devices, but one is wanted here. Use "
            f"ad.devices({spec!r}) for a list, or ad.restrict_visible({spec!r}) to hide the rest."
        )
    if text.isdigit():
        return Spec(GPU, int(text), spec, source)
    kind, sep, index_text = text.partition(":")
    if kind not in generic_kinds():  # a backend named like another word ("tpu") is itself
        kind = _kind_named(kind) or kind
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
    if kind == backends.host().name:
        if index != 0:
            raise DeviceSpecError(f"{spec!r}{origin}: there is one CPU device; use '{kind}'.")
        return Spec(kind, None, spec, source)
    if kind in (AUTO, FREE) or unindexed(kind):
        raise DeviceSpecError(f"{spec!r}{origin}: '{kind}' takes no index; use '{kind}'.")
    return Spec(kind, index, spec, source)


def _kind_named(word: str) -> str | None:
    """The registry's kind ``word`` names (its name, or another word for it), or None."""
    for kind in backends.kinds():
        if word == kind.name or word in kind.words:
            return kind.name
    return None


def unindexed(kind: str) -> bool:
    """Whether ``kind`` is a device type that takes no index, as its facts say: the host
    (one CPU) and ``meta`` (no devices to number); ``torch.device(kind)`` is all of it.

    >>> unindexed("cpu"), unindexed("cuda"), unindexed("auto")
    (True, False, False)
    """
    return kind not in (AUTO, GPU, FREE) and not backends.facts(kind).indexed


def _check_kind(kind: str, spec: object, source: str) -> str:
    if kind in (AUTO, GPU, FREE) or _kind_named(kind) == kind:
        return kind
    generic = generic_kinds()
    if kind in generic:
        return kind
    spellings = _spellings(generic)
    words = [w.partition("[")[0] for w in spellings if not w.startswith("<")]
    close = difflib.get_close_matches(kind, words, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    origin = "" if source == "argument" else f" (from {source})"
    raise DeviceSpecError(
        f"Unknown device {spec!r}{origin}.{hint} Use one of: {', '.join(spellings)}, an int, "
        "or a torch.device."
    )


def _spellings(generic: tuple[str, ...]) -> list[str]:
    """Every way to write a spec, as the error for an unknown one lists them: the grammar's
    words, each kind and its other words (``tpu`` is listed where no backend of that name
    is: such a backend is listed as itself), and the accelerators torch knows by name."""

    def written(kind: backends.Kind) -> list[str]:
        words = [w for w in (kind.name, *kind.words) if w == kind.name or w not in generic]
        return [f"{w}[:i]" if kind.indexed else w for w in words]

    named = backends.kinds()
    return [
        AUTO,
        *(w for k in named if k.host for w in written(k)),
        f"{GPU}[:i]",
        *(w for k in named if k.probed and not k.host for w in written(k)),
        *(
            [f"{g}[:i]" for g in generic]
            or ["<name>[:i] (the name an accelerator's backend registers with torch)"]
        ),
        FREE,
        *(w for k in named if not k.probed for w in written(k)),
    ]


def generic_kinds() -> tuple[str, ...]:
    """Accelerator device types torch knows beyond the named kinds (``npu``, ...)."""
    return backends.generic_kinds()
