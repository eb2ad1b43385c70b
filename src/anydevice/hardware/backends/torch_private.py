"""torch's private names anydevice relies on, in one place, each with what happens without it.

torch keeps these names out of its public API, so a release may rename or drop one. Each
is read here with ``getattr``, never at import time, and everything else in anydevice asks
through these functions. ``tests/hardware/test_torch_private.py`` checks every name in
:data:`NAMES` against the torch it runs on: present where that build should have it, and
the documented fallback where it does not (a CPU build has none of the CUDA ones).

Nothing here initialises a device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "NAMES",
    "cudnn_allow_tf32",
    "cudnn_binding",
    "default_device_context",
    "default_store",
    "engine_backward",
    "flight_record",
    "fp32_precision",
    "has_fp32_precision_tree",
    "host_empty_cache",
    "primary_context_query",
    "privateuse1_name",
    "process_groups",
    "record_memory_history",
    "set_fp32_precision",
    "snapshot_memory",
    "trace_plot",
]

#: Every private name used, where it lives, and which builds of torch have it.
NAMES: dict[str, tuple[str, str]] = {
    "_get_privateuse1_backend_name": ("torch._C", "all"),
    "_get_fp32_precision_getter": ("torch._C", "all"),  # torch >= 2.9
    "_set_fp32_precision_setter": ("torch._C", "all"),  # torch >= 2.9
    "_get_cudnn_allow_tf32": ("torch._C", "all"),
    "_cuda_hasPrimaryContext": ("torch._C", "cuda"),
    "_cudnn": ("torch._C", "cuda"),
    "_host_emptyCache": ("torch._C", "cuda"),  # before torch.accelerator.empty_host_cache
    "_record_memory_history": ("torch.cuda.memory", "all"),
    "_snapshot": ("torch.cuda.memory", "all"),
    "trace_plot": ("torch.cuda._memory_viz", "all"),
    "_world": ("torch.distributed.distributed_c10d", "all"),
    "_dump_fr_trace": ("torch._C._distributed_c10d", "all"),  # gloo records too: torch >= 2.10
    "_get_default_store": ("torch.distributed.distributed_c10d", "all"),
    "CURRENT_DEVICE": ("torch.utils._device", "all"),
    "_device_constructors": ("torch.utils._device", "all"),
    "_ImperativeEngine": ("torch._C", "all"),
}


def _C() -> Any:
    import torch

    return torch._C


def privateuse1_name() -> str:
    """The name torch's privateuse1 slot is registered under (``"privateuseone"`` until a
    backend renames it)."""
    return str(_C()._get_privateuse1_backend_name())


def primary_context_query() -> Callable[[int], bool] | None:
    """The driver's ``cuDevicePrimaryCtxGetState`` as torch binds it: whether this process
    has a context on a GPU, asked without creating one; None without that binding."""
    return getattr(_C(), "_cuda_hasPrimaryContext", None)


def cudnn_binding() -> Any | None:
    """torch's cuDNN binding (``getVersionInt``, ``is_cuda``), None on builds without it."""
    return getattr(_C(), "_cudnn", None)


def has_fp32_precision_tree() -> bool:
    """Whether this torch keeps the per-backend fp32 precision settings (torch >= 2.9)."""
    return hasattr(_C(), "_get_fp32_precision_getter")


def fp32_precision(backend: str, op: str) -> str:
    """What the fp32 precision node ``(backend, op)`` stores (``"none"``: it inherits).

    Read from ``torch._C``: ``torch.backends.mkldnn.fp32_precision``'s setter writes the
    generic value instead of mkldnn's (torch 2.13), so the public attributes cannot restore
    what they read.
    """
    return str(_C()._get_fp32_precision_getter(backend, op))


def set_fp32_precision(backend: str, op: str, value: str) -> None:
    """Store ``value`` at the fp32 precision node ``(backend, op)``."""
    _C()._set_fp32_precision_setter(backend, op, value)


def cudnn_allow_tf32() -> bool:
    """The legacy cuDNN TF32 flag; raises ``RuntimeError`` as torch does when the legacy and
    new settings disagree."""
    return bool(_C()._get_cudnn_allow_tf32())


def host_empty_cache() -> Callable[[], None] | None:
    """What gives the pinned host allocator's cached blocks back: the public
    ``torch.accelerator.empty_host_cache``, else torch's older private binding, else None."""
    import torch

    empty = getattr(torch.accelerator, "empty_host_cache", None)
    return empty if empty is not None else getattr(_C(), "_host_emptyCache", None)


def record_memory_history(**options: Any) -> None:
    """Start (or, with ``enabled=None``, stop) CUDA's allocator history."""
    import torch.cuda.memory

    torch.cuda.memory._record_memory_history(**options)


def snapshot_memory() -> Any:
    """CUDA's allocator snapshot, with the history recorded so far."""
    import torch.cuda.memory

    return torch.cuda.memory._snapshot()


def trace_plot(snapshot: Any) -> str:
    """torch's HTML timeline of an allocator snapshot."""
    from torch.cuda._memory_viz import trace_plot as plot

    return str(plot(snapshot))


def process_groups() -> list[Any]:
    """Every process group of this process, the default one first (torch's group
    registry, ``distributed_c10d._world.pg_map``); without that registry, the default
    group alone, where one exists."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", None) or ())
    default = dist.group.WORLD if dist.is_initialized() else None
    if default is not None and default not in groups:
        groups.insert(0, default)
    return groups


def flight_record(*, entries: bool) -> dict[str, Any] | None:
    """What torch's flight recorder holds for this process (``_dump_fr_trace``), or None
    where this torch has none, or it is off (``TORCH_FR_BUFFER_SIZE=0``).

    ``pg_status`` maps each process group's name to its ``last_enqueued_collective`` and
    ``last_completed_collective`` (torch's sequence numbers, the same on every rank of
    the group): a few microseconds to read. With ``entries``, also the last collectives
    recorded (``entries``: op as ``profiling_name``, ``collective_seq_id``,
    ``process_group``, ``input_sizes``, ``input_dtypes``, ``time_created_ns``, ...):
    tens of milliseconds for torch's default 2000. Never their stacks: torch symbolises
    them on the first such dump for seconds (8.7 s measured on torch 2.13), holding the
    GIL.
    """
    import pickle

    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:  # a torch built without distributed
        return None
    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    try:
        raw = dump(entries, False, not entries)
        found = pickle.loads(raw)  # torch's own pickle of plain values, made in this process
    except Exception:  # the recorder torn down while the process ends
        return None
    return found if isinstance(found, dict) else None


def default_store() -> Any | None:
    """The store of the default process group (``distributed_c10d._get_default_store``),
    where the ranks can meet outside a collective; None without a group or that name."""
    import torch.distributed as dist

    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None or not dist.is_initialized():
        return None
    try:
        return get()
    except (RuntimeError, ValueError):  # a group made without a store (a fake backend)
        return None


def default_device_context() -> tuple[Any, frozenset[Any]]:
    """The device ``torch.set_default_device`` / ``with torch.device(...)`` gives factory
    functions that name none (None when unset), and those factory functions
    (``torch.utils._device``'s ``CURRENT_DEVICE`` and ``_device_constructors()``); (None,
    nothing) without them."""
    import torch.utils._device as device_context

    constructors = getattr(device_context, "_device_constructors", None)
    return (
        getattr(device_context, "CURRENT_DEVICE", None),
        frozenset(constructors()) if constructors is not None else frozenset(),
    )


def engine_backward(output: Any) -> None:
    """Backpropagate from the scalar ``output`` through autograd's engine itself, without
    the context ``torch.autograd.backward`` keeps in the thread's state for the engine's
    threads (a Python object: freeing it needs the interpreter). Without that binding,
    ``output.backward()``."""
    import torch

    engine = getattr(_C(), "_ImperativeEngine", None)
    if engine is None:
        output.backward()
        return
    grad = torch.ones((), dtype=output.dtype, device=output.device)
    engine().run_backward((output,), (grad,), False, False, (), True, True)
