"""Which device: the policies that turn a spec into a ``torch.device``, and the one resolver.

The grammar is :mod:`anydevice.hardware.spec`'s; what its words name here:

* ``auto``: the best accelerator (CUDA, then XLA, XPU, MPS, then any other torch knows: the
  registry's order, :func:`anydevice.hardware.backends.auto_order`), else the CPU. Under a
  launcher (``LOCAL_RANK`` set) it is this rank's GPU. ``ANYDEVICE_DEVICE=<spec>`` overrides it.
* ``gpu[:i]`` / an int: the i-th GPU of whatever kind this machine has (CUDA, XPU or MPS:
  the kinds whose facts say ``gpu``).
* ``cuda:i`` uses CUDA's index, the one torch uses, which is not always nvidia-smi's.
  Without an index, ``cuda``, ``gpu`` and ``auto`` name torch's current device once CUDA
  is initialised (as ``x.to("cuda")`` does), the first device before that.
* ``free``: the GPU with the most free memory (ties: lower utilisation, then lower index),
  read from NVML without creating a CUDA context.

The policies (:func:`select`, :func:`select_all`) are pure functions of an
:class:`~anydevice.hardware.inventory.Inventory`; :func:`device` and friends read this machine's
inventory and call them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import torch

from anydevice.errors import DeviceNotFoundError, DeviceSpecError, VisibilityError
from anydevice.hardware import backends
from anydevice.hardware.facts import DeviceInfo, format_bytes, parse_size
from anydevice.hardware.freest import free_key as _free_key
from anydevice.hardware.inventory import Inventory, inventory
from anydevice.hardware.override import with_override
from anydevice.hardware.spec import AUTO, FREE, GPU, DeviceLike, Spec, parse_spec, unindexed

__all__ = [
    "current_indices",
    "describe",
    "device",
    "devices",
    "resolve",
    "restrict_visible",
    "select",
    "select_all",
    "try_all_gpus",
    "try_gpu",
    "try_gpu_in",
]

logger = logging.getLogger("anydevice")


# ----------------------------------------------------------------------------- policies


def select(
    spec: Spec,
    inv: Inventory,
    *,
    need_memory: int | None = None,
    environ: Mapping[str, str] | None = None,
    current: Mapping[str, int] | None = None,
) -> DeviceInfo:
    """The one device ``spec`` names in ``inv`` (pure: reads nothing else but ``environ``).

    A spec without an index (``"cuda"``, ``"gpu"``, ``"auto"`` outside a launcher) names the
    *current* device of its kind, as ``x.to("cuda")`` does, when ``current`` gives one
    (``{"cuda": 1}`` after ``torch.cuda.set_device(1)``); otherwise the first one.

    >>> here = inventory(telemetry=False, kinds=("cpu",))
    >>> gpus = tuple(DeviceInfo(kind="cuda", index=i, name="GPU") for i in range(2))
    >>> inv = Inventory(here.host, (*gpus, here.cpu))
    >>> cuda = parse_spec("cuda")
    >>> select(cuda, inv).spec, select(cuda, inv, current={"cuda": 1}).spec
    ('cuda:0', 'cuda:1')

    Raises:
        DeviceNotFoundError: no such device here, or none with ``need_memory`` free.
    """
    env = os.environ if environ is None else environ
    kind = spec.kind
    if kind == "cpu":
        return _check_memory(inv.cpu, need_memory, inv, spec)
    if unindexed(kind):  # meta: no data, nothing here to look up; its backend names it
        return DeviceInfo(kind=kind, index=None, name=backends.runtime(kind).label)
    if kind == AUTO:
        return _auto(inv, need_memory, env, spec, current or {})
    if kind == FREE:
        return _freest(inv, need_memory, spec)
    target = _gpu_kind(inv) if kind == GPU else kind
    candidates = inv.of_kind(target) if target else ()
    if not candidates:
        raise DeviceNotFoundError(_missing_kind_message(spec, inv))
    if spec.index is None:
        ordered = _current_first(candidates, (current or {}).get(candidates[0].kind))
        if need_memory is None:
            return ordered[0]
        return _first_fitting(ordered, need_memory, inv, spec)
    if spec.index >= len(candidates):
        raise DeviceNotFoundError(_index_message(spec, candidates, inv, env))
    return _check_memory(candidates[spec.index], need_memory, inv, spec)


def select_all(spec: Spec, inv: Inventory) -> list[DeviceInfo]:
    """Every device ``spec`` covers: ``cuda`` gives all CUDA devices; ``gpu`` all GPUs or
    the CPU when there is none; ``auto`` all devices of the best accelerator, else the CPU;
    ``free`` all GPUs, most free memory first."""
    if spec.index is not None or unindexed(spec.kind):
        return [select(spec, inv)]
    if spec.kind == AUTO:
        for kind in backends.auto_order():
            if inv.of_kind(kind):
                return list(inv.of_kind(kind))
        return [inv.cpu]
    if spec.kind == GPU:
        gpus = _gpus(inv)
        return list(gpus) if gpus else [inv.cpu]
    if spec.kind == FREE:
        return sorted(_gpus(inv), key=_free_key) or [select(spec, inv)]
    found = inv.of_kind(spec.kind)
    if not found:
        raise DeviceNotFoundError(_missing_kind_message(spec, inv))
    return list(found)


def _gpu_kind(inv: Inventory) -> str | None:
    for kind in backends.gpu_kinds():
        if inv.of_kind(kind):
            return kind
    return None


def _gpus(inv: Inventory) -> tuple[DeviceInfo, ...]:
    kind = _gpu_kind(inv)
    return inv.of_kind(kind) if kind else ()


def _current_first(candidates: Sequence[DeviceInfo], current: int | None) -> Sequence[DeviceInfo]:
    """``candidates`` with the current device (by its ``cuda:N`` index) moved to the front."""
    if current is None:
        return candidates
    here = [d for d in candidates if d.index == current]
    return [*here, *(d for d in candidates if d.index != current)] if here else candidates


def _auto(
    inv: Inventory,
    need: int | None,
    env: Mapping[str, str],
    spec: Spec,
    current: Mapping[str, int],
) -> DeviceInfo:
    for kind in backends.auto_order():
        found = inv.of_kind(kind)
        if not found:
            continue
        if need is not None:
            return _first_fitting(_current_first(found, current.get(kind)), need, inv, spec)
        local_rank = env.get("LOCAL_RANK", "").strip()
        if local_rank.isdigit():
            rank = int(local_rank)
            if rank >= len(found):
                logger.warning(
                    "LOCAL_RANK=%d but only %d %s device(s) are visible: ranks share devices "
                    "(rank %d uses %s).",
                    rank,
                    len(found),
                    kind,
                    rank,
                    found[rank % len(found)].spec,
                )
            return found[rank % len(found)]
        return _current_first(found, current.get(kind))[0]
    return _check_memory(inv.cpu, need, inv, spec)


def _freest(inv: Inventory, need: int | None, spec: Spec) -> DeviceInfo:
    gpus = _gpus(inv)
    if not gpus:
        raise DeviceNotFoundError(_missing_kind_message(spec, inv))
    unknown = [d.spec for d in gpus if d.memory_free is None]
    if unknown:
        raise DeviceNotFoundError(
            f"'free' needs each GPU's free memory, but it is unknown for {', '.join(unknown)}"
            f"{_why_unknown(inv)}. Name a device instead, e.g. '{gpus[0].spec}'."
        )
    best = min(gpus, key=_free_key)
    return _check_memory(best, need, inv, spec)


def _first_fitting(
    candidates: Sequence[DeviceInfo], need: int, inv: Inventory, spec: Spec
) -> DeviceInfo:
    for d in candidates:
        if _fits(d, need, inv, spec):
            return d
    raise DeviceNotFoundError(_memory_message(candidates, need, spec))


def _check_memory(d: DeviceInfo, need: int | None, inv: Inventory, spec: Spec) -> DeviceInfo:
    if need is None or _fits(d, need, inv, spec):
        return d
    raise DeviceNotFoundError(_memory_message([d], need, spec))


def _fits(d: DeviceInfo, need: int, inv: Inventory, spec: Spec) -> bool:
    if d.memory_free is None:
        raise DeviceNotFoundError(
            f"Cannot check need_memory={format_bytes(need)} for {spec}: the free memory of "
            f"{d.spec} is unknown{_why_unknown(inv)}. Drop need_memory, or fix what hides it."
        )
    return d.memory_free >= need


def _why_unknown(inv: Inventory) -> str:
    nvml_notes = [n for n in inv.notes if "NVML" in n]
    return f" ({nvml_notes[0].rstrip('.')})" if nvml_notes else ""


# ----------------------------------------------------------------------------- messages


def _listing(inv: Inventory) -> str:
    accels = inv.accelerators
    if not accels:
        return "This machine has only the CPU."
    parts = []
    for d in accels:
        smi = f", nvidia-smi {d.smi_index}" if d.smi_index not in (None, d.index) else ""
        parts.append(f"{d.spec} {d.name!r}{smi}")
    return f"Here: {'; '.join(parts)}."


def _missing_kind_message(spec: Spec, inv: Inventory) -> str:
    origin = "" if spec.source == "argument" else f" (from {spec.source})"
    if spec.kind in (GPU, FREE):
        reason = _no_gpu_reason(inv)
        return (
            f"Requested {str(spec)!r}{origin}, but there is no GPU: {reason} "
            f"{_listing(inv)} Use 'auto' or ad.try_gpu() to fall back to the CPU."
        )
    reason = backends.get(spec.kind).unavailable_reason(inv.host)
    return f"Requested {str(spec)!r}{origin}, but {reason} {_listing(inv)}"


def _index_message(
    spec: Spec, candidates: Sequence[DeviceInfo], inv: Inventory, env: Mapping[str, str]
) -> str:
    kind = candidates[0].kind
    n = len(candidates)
    variable = backends.runtime(kind).visibility_variable
    shown = env.get(variable) if variable else None
    where = f" ({variable}={shown!r})" if shown is not None else ""
    names = [d.spec for d in candidates]
    options = names[0] if n == 1 else ", ".join(names[:-1]) + f" or {names[-1]}"
    origin = "" if spec.source == "argument" else f" (from {spec.source})"
    device_word = "device is" if n == 1 else "devices are"
    return (
        f"Requested {str(spec)!r}{origin}, but {n} {kind.upper()} {device_word} visible{where}. "
        f"Use {options}, or run `anydevice info` to see what is here."
    )


def _memory_message(candidates: Sequence[DeviceInfo], need: int, spec: Spec) -> str:
    free = ", ".join(
        f"{d.spec} {format_bytes(d.memory_free)} free of {format_bytes(d.memory_total)}"
        for d in candidates
    )
    return (
        f"No device for {str(spec)!r} has need_memory={format_bytes(need)} free: {free}. "
        "Free memory (other processes: `anydevice info`), lower the need, or pick another device."
    )


# ----------------------------------------------------------------------------- public API


def _resolve_auto(spec: DeviceLike) -> Spec:
    return with_override(parse_spec(spec))


def current_indices() -> dict[str, int]:
    """The current device of each kind whose torch runtime is initialised in this process.

    Before initialisation there is none: asking ``torch.cuda.current_device()`` then would
    initialise CUDA (and later create a context), which looking at devices must never do;
    and until then no ``set_device`` can have run, so the first device is the current one.

    >>> "cuda" in current_indices() or not torch.cuda.is_initialized()
    True
    """
    from anydevice.hardware.backends.base import current_if_initialized

    found: dict[str, int] = {}
    for kind in backends.accelerators():
        current = current_if_initialized(kind) if backends.facts(kind).indexed else None
        if current is not None and current.index is not None:
            found[kind] = current.index
    return found


def _inventory_for(spec: Spec, *, telemetry: bool = False, memory: bool = True) -> Inventory:
    """The inventory a spec is resolved on; without ``memory`` (and ``telemetry``), NVIDIA
    GPUs come from facts read once per process, with no NVML session."""
    if spec.kind == AUTO:
        kinds: tuple[str, ...] = (*backends.accelerators(), backends.GENERIC)
    else:
        kinds = backends.accelerators() if spec.kind in (GPU, FREE) else (spec.kind,)
    return inventory(telemetry=telemetry, kinds=(*kinds, backends.host().name), memory=memory)


def device(spec: DeviceLike = "auto", need_memory: int | str | None = None) -> torch.device:
    """The ``torch.device`` a spec names, checked against what this machine has.

    >>> device("cpu")
    device(type='cpu')
    >>> device().type in ("cpu", "cuda", "mps", "xpu", "xla")
    True

    Args:
        spec: see the module docstring for the grammar. ``"auto"`` honours
            ``ANYDEVICE_DEVICE`` and ``LOCAL_RANK``.
        need_memory: bytes, or text such as ``"8GiB"``: only a device with this much free.
            Without an index, the first device of the kind that has it.

    Raises:
        DeviceNotFoundError: no such device here; the message lists what exists.
        DeviceSpecError: malformed spec.
    """
    parsed = _resolve_auto(spec)
    try:
        need = None if need_memory is None else parse_size(need_memory)
    except (TypeError, DeviceSpecError) as e:
        raise type(e)(f"need_memory={need_memory!r}: {e}") from None
    if need is None and unindexed(parsed.kind):
        return torch.device(parsed.kind)  # nothing to look up
    # Free memory is read only for the policies that compare it.
    inv = _inventory_for(parsed, memory=need is not None or parsed.kind == FREE)
    return select(parsed, inv, need_memory=need, current=current_indices()).torch_device


def resolve(spec: DeviceLike) -> torch.device:
    """The ``torch.device`` a spec means here, with its index filled in: the one function
    every part of anydevice resolves a device with (``ad.to``, ``DeviceLoader``, the
    timers, the memory readers).

    A ``torch.device`` passes straight through (``cuda`` without an index becomes the
    current CUDA device, so that comparing it with a tensor's device works); anything else
    goes through :func:`device`, which checks it against this machine (a bare ``"cuda"``
    is torch's current CUDA device once CUDA is in use, as in torch).

    >>> resolve("cpu")
    device(type='cpu')
    >>> resolve(torch.device("meta"))
    device(type='meta')
    """
    if type(spec) is torch.device:
        if unindexed(spec.type):
            return spec
        if spec not in _CHECKED:
            _check_device(spec)
        if spec.index is not None:
            return spec
        return _with_current_index(spec)
    return device(spec)


#: ``torch.device`` objects already checked against this machine (devices do not vanish
#: from a process, so a check that passed once holds; one that failed is made again).
_CHECKED: set[torch.device] = set()


def forget_checked() -> None:
    """Check every ``torch.device`` again from now on: a backend stood in for a kind, or
    stopped standing in (``anydevice.hardware.backends.stand_in``), so devices of that kind
    came or went."""
    _CHECKED.clear()


def _check_device(dev: torch.device) -> None:
    """Refuse a ``torch.device`` this machine lacks as the same spec string would be
    refused (``DeviceNotFoundError``), instead of torch's raw error at the first copy
    (an ``AssertionError`` for CUDA on a CPU-only build). A type anydevice does not know
    is left for torch to judge."""
    try:
        device(dev)
    except DeviceNotFoundError:
        raise
    except DeviceSpecError:
        pass  # a type torch knows and anydevice does not: torch decides at the copy
    _CHECKED.add(dev)


def _with_current_index(dev: torch.device) -> torch.device:
    """``dev`` with the current device's index, as tensors made there report it (MPS's one
    device is ``mps:0``); unchanged for a type with no current device."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and accelerator.type == dev.type:
        return torch.device(dev.type, torch.accelerator.current_device_index())
    from anydevice.hardware.backends.base import device_module

    current = getattr(device_module(dev.type), "current_device", None)
    index = None if current is None else current()
    return torch.device(dev.type, index) if isinstance(index, int) else dev


def describe(spec: DeviceLike = "auto", *, telemetry: bool = True) -> DeviceInfo:
    """Everything known about the device a spec names, live readings included.

    >>> describe("cpu").kind
    'cpu'

    Args:
        spec: as for :func:`device`.
        telemetry: also read utilisation, temperature, power and processes. False is
            quicker (no sampling) and is what policies that need only the hardware use.
    """
    parsed = _resolve_auto(spec)
    inv = _inventory_for(parsed, telemetry=telemetry)
    return select(parsed, inv, current=current_indices())


def devices(spec: DeviceLike | Sequence[DeviceLike] = "auto") -> list[torch.device]:
    """Every device a spec covers, as ``torch.device`` objects.

    ``"gpu"`` gives all GPUs, or ``[cpu]`` when there is none; ``"cuda"`` all CUDA devices
    (an error when there is none); ``"cuda:0,2"`` or ``[0, 2]`` those two.

    >>> devices("cpu")
    [device(type='cpu')]
    """
    if isinstance(spec, str) and "," in spec:
        # "cuda:0,2" -> cuda:0, cuda:2: a bare index takes the kind written before it.
        kind = GPU
        items: list[DeviceLike] = []
        for part in (p.strip() for p in spec.split(",")):
            if part.isdigit():
                items.append(f"{kind}:{part}")
            else:
                kind = part.partition(":")[0] or kind
                items.append(part)
        spec = items
    if isinstance(spec, (list, tuple)):
        found = [device(s) for s in spec]
        return list(dict.fromkeys(found))
    parsed = _resolve_auto(spec)  # type: ignore[arg-type]  # None and other non-specs: TypeError
    if unindexed(parsed.kind):
        return [torch.device(parsed.kind)]
    inv = _inventory_for(parsed, memory=parsed.kind == FREE)
    return [d.torch_device for d in select_all(parsed, inv)]


def try_gpu(i: int = 0) -> torch.device:
    """GPU ``i`` if it exists, else the CPU (d2l's ``try_gpu``), saying why when it falls back.

    >>> try_gpu(10_000)
    device(type='cpu')
    """
    if isinstance(i, bool) or not isinstance(i, int):
        raise TypeError(
            f"try_gpu({i!r}): the GPU index is an int, not {type(i).__name__}. Use try_gpu(1), "
            "or ad.device('gpu:1') for a spec."
        )
    if i < 0:
        raise DeviceSpecError(f"try_gpu({i}): GPU indices start at 0.")
    return try_gpu_in(_gpu_inventory(), i).torch_device


def try_gpu_in(inv: Inventory, i: int = 0) -> DeviceInfo:
    """:func:`try_gpu`'s policy on a given inventory (pure, apart from one log record)."""
    gpus = _gpus(inv)
    if 0 <= i < len(gpus):
        return gpus[i]
    _log_fallback(f"try_gpu({i})", inv)
    return inv.cpu


def try_all_gpus() -> list[torch.device]:
    """Every GPU, or ``[cpu]`` when there is none (d2l's ``try_all_gpus``).

    >>> try_all_gpus()[0].type in ("cpu", "cuda", "mps", "xpu")
    True
    """
    inv = _gpu_inventory()
    gpus = _gpus(inv)
    if gpus:
        return [d.torch_device for d in gpus]
    _log_fallback("try_all_gpus()", inv)
    return [torch.device("cpu")]


def _gpu_inventory() -> Inventory:
    """The GPUs and the host, read from facts kept for the process (no telemetry, no NVML
    session)."""
    kinds = (*backends.gpu_kinds(), backends.host().name)
    return inventory(telemetry=False, kinds=kinds, memory=False)


def _no_gpu_reason(inv: Inventory) -> str:
    """Why there is no GPU here, as the first kind ``"gpu"`` looks for explains it (CUDA's:
    a CPU-only build beside NVIDIA GPUs, a hiding ``CUDA_VISIBLE_DEVICES``, ...)."""
    return backends.get(backends.gpu_kinds()[0]).unavailable_reason(inv.host)


def _log_fallback(call: str, inv: Inventory) -> None:
    gpus = _gpus(inv)
    if gpus:
        logger.warning(
            "%s: only %d GPU(s) here (%s); using the CPU.",
            call,
            len(gpus),
            ", ".join(f"{d.spec} {d.name!r}" for d in gpus),
        )
    elif inv.host.nvidia_gpus:
        # The hardware is there but torch cannot use it: that is worth a warning.
        logger.warning(
            "%s: using the CPU, although %d NVIDIA GPU(s) are in this machine: %s",
            call,
            inv.host.nvidia_gpus,
            _no_gpu_reason(inv),
        )
    else:
        logger.info("%s: no GPU on this machine; using the CPU.", call)


# ----------------------------------------------------------------------------- visibility


def restrict_visible(visible: str | int | DeviceInfo | Sequence[int | str | DeviceInfo]) -> str:
    """Show this process only some GPUs, by setting ``CUDA_VISIBLE_DEVICES``.

    Indices are the ``cuda:N`` indices visible now (not nvidia-smi's); UUIDs and UUID
    prefixes work too. The variable is written with UUIDs, so its meaning does not depend
    on ``CUDA_DEVICE_ORDER``. This deliberately changes process state; call it before
    anything touches CUDA.

    Returns:
        The new value of ``CUDA_VISIBLE_DEVICES``.

    Raises:
        VisibilityError: CUDA is already initialised in this process (``torch.cuda.is_available()``
            or any CUDA call does that), so the visible set is fixed.
        DeviceNotFoundError: an index or UUID that is not visible now.
    """
    from anydevice.hardware.backends import cuda
    from anydevice.hardware.visibility import visible_items, visible_value

    wanted = visible_items(visible)
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cuda.driver_initialized():
        raise VisibilityError(
            f"CUDA is already initialised in this process, so the visible GPUs are fixed "
            f"(CUDA_VISIBLE_DEVICES={current!r}); restrict_visible({visible!r}) would change "
            "nothing. Call it before any CUDA call (torch.cuda.is_available() counts), or set "
            "the variable when launching: CUDA_VISIBLE_DEVICES=0,2 python train.py"
        )
    nvidia = cuda.CudaBackend.kind  # the variable is CUDA's: the GPUs it hides are too
    inv = inventory(telemetry=False, kinds=(nvidia, backends.host().name), memory=False)
    value = visible_value(wanted, inv.of_kind(nvidia), current)
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    logger.info("CUDA_VISIBLE_DEVICES=%s", value)
    return value
