"""Which GPUs to show this process: the pure half of :func:`anydevice.restrict_visible`.

:func:`visible_items` reads what the caller asked for; :func:`visible_value` turns it into
the ``CUDA_VISIBLE_DEVICES`` value that shows exactly those GPUs, given the ones visible
now. Both are pure; :func:`anydevice.hardware.selection.restrict_visible` reads the machine and
writes the variable.
"""

from __future__ import annotations

from collections.abc import Sequence

from anydevice.errors import DeviceNotFoundError, DeviceSpecError
from anydevice.hardware.facts import DeviceInfo
from anydevice.hardware.spec import parse_spec

__all__ = ["visible_items", "visible_value"]


def visible_items(visible: object) -> list[int | str]:
    """The GPU indices and UUIDs named by ``"0,2"``, ``[0, "GPU-8932f9"]`` or DeviceInfos.

    >>> visible_items("0, 2")
    [0, 2]
    """
    if isinstance(visible, DeviceInfo):
        visible = [visible]
    if isinstance(visible, (int, str)) and not isinstance(visible, bool):
        visible = [s.strip() for s in str(visible).split(",") if s.strip()]
    if not isinstance(visible, (list, tuple)) or not visible:
        raise DeviceSpecError(f"restrict_visible needs GPU indices or UUIDs, got {visible!r}.")
    items: list[int | str] = []
    for v in visible:
        if isinstance(v, DeviceInfo):
            v = v.uuid if v.uuid else v.index if v.index is not None else v.spec
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        elif isinstance(v, str) and v.lower().startswith("cuda:"):
            v = int(parse_spec(v).index or 0)
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise DeviceSpecError(f"restrict_visible: {v!r} is not a GPU index or UUID.")
        items.append(v)
    return items


def visible_value(
    wanted: Sequence[int | str], visible: Sequence[DeviceInfo], current: str | None
) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows exactly ``wanted`` (pure).

    Indices refer to ``visible`` (today's ``cuda:N``). With UUIDs known the value is made of
    UUIDs; without them, of today's entries of ``current``.
    """
    if not visible:
        raise DeviceNotFoundError(
            f"restrict_visible({list(wanted)!r}): no CUDA device is visible to restrict to "
            f"(CUDA_VISIBLE_DEVICES={current!r})."
        )
    chosen: list[DeviceInfo] = []
    for w in wanted:
        if isinstance(w, int):
            if not 0 <= w < len(visible):
                raise DeviceNotFoundError(
                    f"restrict_visible: cuda:{w} is not visible; {len(visible)} CUDA device(s) "
                    f"are (cuda:0..cuda:{len(visible) - 1}, CUDA_VISIBLE_DEVICES={current!r})."
                )
            chosen.append(visible[w])
        else:
            matches = [d for d in visible if d.uuid and d.uuid.lower().startswith(w.lower())]
            if len(matches) != 1:
                what = "matches no" if not matches else "matches more than one"
                raise DeviceNotFoundError(
                    f"restrict_visible: {w!r} {what} visible GPU UUID; visible: "
                    f"{', '.join(f'{d.spec} {d.uuid}' for d in visible)}."
                )
            chosen.append(matches[0])
    if len({d.index for d in chosen}) != len(chosen):
        raise DeviceSpecError(
            f"restrict_visible: {list(wanted)!r} names a GPU twice; CUDA would then show none."
        )
    if all(d.uuid for d in chosen):
        return ",".join(str(d.uuid) for d in chosen)
    entries = [e.strip() for e in current.split(",")] if current else None
    return ",".join(entries[d.index or 0] if entries else str(d.index) for d in chosen)
