"""torch's private names anydevice relies on, in one place, each with what happens without it.

torch keeps these names out of its public API, so a release may rename or drop one. Each
is read here with ``getattr``, never at import time, and everything else in anydevice asks
through these functions. Two tables list them, each entry with its fallback (what
anydevice does on a torch without it):

* :data:`NAMES` — functions and modules' names (``torch._C._cuda_hasPrimaryContext``, the
  flight recorder's ``_dump_fr_trace``, ...);
* :data:`MEMBERS` — members of torch's classes and objects: the elastic agent's and the
  rendezvous handler's private methods that anydevice *overrides* in a subclass, with the
  parameters it expects (:func:`missing_overrides` says at run time which this torch
  lacks), and the private attributes it reads or writes (the agent's worker processes and
  group, a process group's timeout, ``torch.compile``'s wrapped module, ...).

``tests/hardware/test_torch_private.py`` checks every entry against the torch it runs on:
present where that build should have it (an override's method with the parameters the
override takes), and the documented fallback where it does not (a CPU build has none of
the CUDA ones). An override whose method torch renamed would otherwise silently stop
being called.

Nothing here initialises a device.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datetime import timedelta

    from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "FALLBACKS",
    "MEMBERS",
    "NAMES",
    "Member",
    "TorchDispatchMode",
    "agent_processes",
    "agent_workers",
    "collective_timeout",
    "compiled_inner",
    "coo_parts",
    "cudnn_allow_tf32",
    "cudnn_binding",
    "default_device_context",
    "default_store",
    "engine_backward",
    "flight_record",
    "fp32_precision",
    "has_fp32_precision_tree",
    "host_empty_cache",
    "iterator_kept",
    "loader_workers",
    "lookup",
    "missing_overrides",
    "nvtx_binding",
    "overload_packet",
    "primary_context_query",
    "privateuse1_name",
    "process_groups",
    "random_sampler_size",
    "record_memory_history",
    "set_fp32_precision",
    "snapshot_memory",
    "stop_restarts",
    "trace_plot",
    "warn_missing_overrides",
]

#: Every private name used, where it lives, and which builds of torch have it.
NAMES: dict[str, tuple[str, str]] = {
    "_get_privateuse1_backend_name": ("torch._C", "all"),
    "_get_fp32_precision_getter": ("torch._C", "all"),  # torch >= 2.9
    "_set_fp32_precision_setter": ("torch._C", "all"),  # torch >= 2.9
    "_get_cudnn_allow_tf32": ("torch._C", "all"),
    "_cuda_hasPrimaryContext": ("torch._C", "cuda"),
    "_cudnn": ("torch._C", "cuda"),
    "_nvtx": ("torch._C", "cuda"),
    "_host_emptyCache": ("torch._C", "cuda"),  # before torch.accelerator.empty_host_cache
    "_record_memory_history": ("torch.cuda.memory", "all"),
    "_snapshot": ("torch.cuda.memory", "all"),
    "trace_plot": ("torch.cuda._memory_viz", "all"),
    "_world": ("torch.distributed.distributed_c10d", "all"),
    "_dump_fr_trace": ("torch._C._distributed_c10d", "all"),  # gloo records too: torch >= 2.10
    "_get_default_store": ("torch.distributed.distributed_c10d", "all"),
    "TorchDispatchMode": ("torch.utils._python_dispatch", "all"),
    # The simulated accelerator (anydevice.testing) registers its device module with it.
    "_register_device_module": ("torch", "all"),
    "CURRENT_DEVICE": ("torch.utils._device", "all"),
    "_device_constructors": ("torch.utils._device", "all"),
    "_ImperativeEngine": ("torch._C", "all"),
}

#: What anydevice does on a torch without each of :data:`NAMES`.
FALLBACKS: dict[str, str] = {
    "_get_privateuse1_backend_name": "none: the generic backend cannot name privateuse1",
    "_get_fp32_precision_getter": "fast_matmul reads and restores the legacy TF32 flags only",
    "_set_fp32_precision_setter": "fast_matmul reads and restores the legacy TF32 flags only",
    "_get_cudnn_allow_tf32": "none: fast_matmul cannot restore cuDNN's TF32 flag",
    "_cuda_hasPrimaryContext": "a GPU counts as not in use (its context is never waited on)",
    "_cudnn": "the cuDNN version is unknown (None)",
    "_nvtx": "nvtx_range marks nothing",
    "_host_emptyCache": "the pinned host cache is not given back (torch.accelerator's is used "
    "where it exists)",
    "_record_memory_history": "none: the allocator history cannot be recorded",
    "_snapshot": "none: the allocator history cannot be read",
    "trace_plot": "none: the allocator history has no HTML timeline",
    "_world": "process_groups() lists the default group alone",
    "_dump_fr_trace": "no collective is seen from a rank: the hang watch judges by steps only",
    "_get_default_store": "the ranks meet through a collective (no store): a rank that never "
    "comes is waited for until the group's timeout",
    "TorchDispatchMode": "none: ad.flops cannot count (it is torch's FlopCounterMode's base)",
    "_register_device_module": "none: the simulated accelerator cannot register its device",
    "CURRENT_DEVICE": "CUDA programs on the simulator: torch.set_default_device('cuda') is "
    "not mapped",
    "_device_constructors": "CUDA programs on the simulator: torch.set_default_device('cuda') "
    "is not mapped",
    "_ImperativeEngine": "output.backward() (a backward right before exit may abort there)",
}


@dataclass(frozen=True)
class Member:
    """A private member of a class of torch's that anydevice relies on."""

    where: str  #: the module of the class
    owner: str  #: the class
    name: str
    #: "override": a method anydevice's subclass overrides (``params``: its parameters
    #: after ``self`` as torch names them); "read" / "write": an attribute, or a method
    #: called, on torch's object
    use: str
    fallback: str  #: what anydevice does on a torch without it
    params: tuple[str, ...] = ()

    @property
    def dotted(self) -> str:
        return f"{self.where}.{self.owner}.{self.name}"


_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent"
_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"

#: Every private member of torch's classes used: overridden, read or written.
MEMBERS: tuple[Member, ...] = (
    Member(
        _AGENT,
        "LocalElasticAgent",
        "_rendezvous",
        "override",
        "the nodes' reach check and the hang watch's join do not run: workers that cannot "
        "reach each other wait out init_process_group's timeout",
        ("worker_group",),
    ),
    Member(
        _AGENT,
        "LocalElasticAgent",
        "_invoke_run",
        "override",
        "the hang watch does not start, and a signal to the launcher is not told apart from "
        "a failure",
        ("role",),
    ),
    Member(
        _AGENT,
        "LocalElasticAgent",
        "_monitor_workers",
        "override",
        "ranks calling different collectives are restarted (max_restarts) in vain",
        ("worker_group",),
    ),
    Member(
        _AGENT,
        "LocalElasticAgent",
        "_shutdown",
        "override",
        "workers get torch's shutdown_timeout after a signal, not grace",
        ("death_sig", "timeout"),
    ),
    Member(
        _AGENT,
        "LocalElasticAgent",
        "_pcontext",
        "read",
        "no worker's error file is read as it stops: a preemption reads as a failure, and a "
        "signal stops the workers without grace",
    ),
    Member(
        _AGENT,
        "LocalElasticAgent",
        "_worker_group",
        "read",
        "no worker's pid or global rank is known: the hang watch sees no process",
    ),
    Member(
        _AGENT,
        "LocalElasticAgent",
        "_remaining_restarts",
        "write",
        "ranks calling different collectives are restarted (max_restarts) in vain",
    ),
    Member(
        _RDZV,
        "DynamicRendezvousHandler",
        "_create_tcp_store_server",
        "override",
        "the workers' shared store listens on every interface, as torch's does",
        ("master_addr", "master_port"),
    ),
    Member(
        "torch.distributed",
        "ProcessGroup",
        "_get_backend",
        "read",
        "a checkpoint's collectives wait torch's default 30 minutes for a missing rank",
    ),
    Member(
        "torch.distributed",
        "ProcessGroupGloo.Options",
        "_timeout",
        "read",
        "a checkpoint's collectives wait torch's default 30 minutes for a missing rank",
    ),
    Member(
        "torch._dynamo.eval_frame",
        "OptimizedModule",
        "_orig_mod",
        "read",
        "a torch.compile'd model is not unwrapped: ad.unwrap returns it as it is, and "
        "d.accumulate cannot switch its gradient reduction off (one per micro-batch)",
    ),
    Member(
        "torch.utils.data",
        "RandomSampler",
        "_num_samples",
        "read",
        "a RandomSampler with num_samples is taken for a plain shuffle by ad.prepare",
    ),
    Member(
        "torch.utils.data.dataloader",
        "_MultiProcessingDataLoaderIter",
        "_shutdown_workers",
        "read",
        "a DeviceLoader left early leaves its workers to torch's garbage collection",
    ),
    Member(
        "torch.utils.data.dataloader",
        "_BaseDataLoaderIter",
        "_persistent_workers",
        "read",
        "persistent workers count as not persistent: they end with a pass left early",
    ),
    Member(
        "torch.utils.data",
        "DataLoader",
        "_iterator",
        "read",
        "a saved loader state between passes counts the persistent workers' order as fresh",
    ),
    Member(
        "torch._ops",
        "OpOverload",
        "_overloadpacket",
        "read",
        "no op's FLOPs are counted by ad.flops",
    ),
    Member(
        "torch",
        "Tensor",
        "_indices",
        "read",
        "none: a sparse COO tensor's buffers cannot be pinned or moved apart",
    ),
    Member(
        "torch",
        "Tensor",
        "_values",
        "read",
        "none: a sparse COO tensor's buffers cannot be pinned or moved apart",
    ),
)


def lookup(where: str, name: str) -> Any:
    """``where.name`` (a dotted ``name`` reaches into classes), or None where this torch
    has no such thing."""
    import importlib

    try:
        found: Any = importlib.import_module(where)
    except ImportError:
        return None
    for part in name.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


@functools.cache
def missing_overrides(base: type) -> tuple[Member, ...]:
    """The private methods of ``base`` that anydevice overrides (:data:`MEMBERS`) and this
    torch lacks, or defines with other parameters: each such override is never called."""
    gone = []
    for m in MEMBERS:
        if m.use != "override" or m.owner != base.__name__:
            continue
        method = getattr(base, m.name, None)
        if not callable(method) or _parameters(method) != m.params:
            gone.append(m)
    return tuple(gone)


@functools.cache
def warn_missing_overrides(base: type) -> None:
    """Say once per process, at WARNING, which of anydevice's overrides of ``base``'s
    private methods this torch would never call (:func:`missing_overrides`), and what
    anydevice does instead."""
    for m in missing_overrides(base):
        logging.getLogger("anydevice").warning(
            "anydevice: torch %s's %s has no %s(%s) for anydevice to override, so %s.",
            _torch_version(),
            m.owner,
            m.name,
            ", ".join(m.params),
            m.fallback,
        )


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _parameters(method: Callable[..., Any]) -> tuple[str, ...]:
    """The parameters of an unbound method, after ``self``."""
    try:
        names = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return ()
    return tuple(names[1:])


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


def agent_processes(agent: Any) -> Any | None:
    """The worker processes of torch's elastic agent (its ``PContext``: ``pids()``,
    ``error_files``), or None before they start or on a torch without ``_pcontext``."""
    return getattr(agent, "_pcontext", None)


def agent_workers(agent: Any) -> list[Any]:
    """The workers (``local_rank``, ``global_rank``, ``id``: the pid) of torch's elastic
    agent's group; none on a torch without ``_worker_group``."""
    group = getattr(agent, "_worker_group", None)
    return list(getattr(group, "workers", None) or [])


def stop_restarts(agent: Any) -> None:
    """Let torch's elastic agent restart the workers no more (``_remaining_restarts``)."""
    if hasattr(agent, "_remaining_restarts"):
        agent._remaining_restarts = 0


def collective_timeout(group: Any) -> timedelta | None:
    """The collectives' timeout of process group ``group`` (its backend's options), or
    None where the backend does not say."""
    import torch

    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # a backend without options, or no such names in this torch
        return None
    return timeout if timeout is not None else None


def compiled_inner(module: Any) -> Any | None:
    """The module ``torch.compile`` wrapped (an ``OptimizedModule``'s ``_orig_mod``), or
    None for a module it did not wrap."""
    return getattr(module, "_orig_mod", None)


def random_sampler_size(sampler: Any) -> int | None:
    """A ``RandomSampler``'s own ``num_samples`` argument (None: the dataset's length)."""
    return getattr(sampler, "_num_samples", None)


def loader_workers(iterator: Any) -> tuple[Callable[[], None] | None, bool]:
    """A DataLoader iterator's way to end its worker processes (None without workers) and
    whether they are persistent."""
    end = getattr(iterator, "_shutdown_workers", None)
    return (end if callable(end) else None), bool(getattr(iterator, "_persistent_workers", False))


def iterator_kept(loader: Any) -> bool:
    """Whether a DataLoader keeps its iterator between passes (its persistent workers)."""
    return getattr(loader, "_iterator", None) is not None


def overload_packet(func: Any) -> Any | None:
    """The overload packet of an ATen op (``aten.mm`` for ``aten.mm.default``): the key
    of torch's FLOP formulas."""
    return getattr(func, "_overloadpacket", None)


def nvtx_binding() -> Any | None:
    """torch's NVTX binding, None on builds without it."""
    return getattr(_C(), "_nvtx", None)


def coo_parts(t: Any) -> tuple[Any, Any]:
    """A sparse COO tensor's indices and values as stored (coalesced or not)."""
    return t._indices(), t._values()


def __getattr__(name: str) -> Any:
    """``TorchDispatchMode`` (``torch.utils._python_dispatch``), imported on first use."""
    if name == "TorchDispatchMode":
        from torch.utils._python_dispatch import TorchDispatchMode

        return TorchDispatchMode
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
