"""Every public ``torch.cuda`` name, and what the simulated CUDA does with it.

:data:`TABLE` says, for each name in ``dir(torch.cuda)`` (torch 2.13, private names
aside): **mapped** (answered by the simulated GPUs: :mod:`anydevice.testing.cuda.module`),
**refused** (raises :class:`~anydevice.testing.cuda.refused.NotSimulatedError` at the first
call, saying why and what to do) or **not applicable** (left as torch has it: exception
types, constants, the modules ``torch.cuda`` imports for itself). A public name the table
does not know (a newer torch's) is refused saying so. :func:`install` applies the table;
``python -m anydevice.testing.cuda.names`` prints it as the Markdown table in
``docs/testing.md`` (a test keeps the two equal, and the table equal to ``dir(torch.cuda)``).
Of the private names one is mapped too, for the GPU tests that use it: ``_sleep(cycles)``
queues that many cycles of the simulated GPU's nominal clock on the current stream.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from anydevice.testing.cuda.module import Simulated, nvtx_members, profiler_members
from anydevice.testing.cuda.refused import refusal, refused_class

__all__ = ["MAPPED", "NOT_APPLICABLE", "REFUSED", "TABLE", "install", "markdown", "public_names"]

MAPPED, REFUSED, NOT_APPLICABLE = "mapped", "refused", "not applicable"

TABLE: dict[str, tuple[str, str]] = {}


def _rows(status: str, note: str, *names: str) -> None:
    for name in names:
        TABLE[name] = (status, note)


# --- devices
_rows(MAPPED, "True", "is_available", "is_initialized")
_rows(MAPPED, "the simulated GPUs' count (`--devices N`)", "device_count")
_rows(MAPPED, "nothing to start: the simulator is running", "init")
_rows(MAPPED, "the current simulated GPU, per thread", "current_device", "set_device")
_rows(MAPPED, "makes a simulated GPU current for a block", "device", "device_of")
_rows(MAPPED, "waits for the simulated GPU's streams", "synchronize")
_rows(MAPPED, '"anydevice simulated GPU"', "get_device_name")
_rows(MAPPED, "(8, 0) for every simulated GPU", "get_device_capability")
_rows(
    MAPPED,
    "a nominal compute capability 8.0 GPU with the simulator's memory",
    "get_device_properties",
)
_rows(MAPPED, "True for two different simulated GPUs", "can_device_access_peer")
_rows(MAPPED, "`['sm_80']` / its -gencode flag, as for capability 8.0", "get_arch_list")
_rows(MAPPED, "`-gencode compute=compute_80,code=sm_80`", "get_gencode_flags")
_rows(MAPPED, "True, as on capability 8.0 (the simulator computes in fp32)", "is_bf16_supported")
_rows(MAPPED, "True, as on capability 8.0", "is_tf32_supported")
_rows(MAPPED, "nothing to collect: no memory is shared between processes", "ipc_collect")
# --- streams and events
_rows(
    MAPPED,
    "the simulator's streams/events (torch.Stream/torch.Event subclasses); read back as cuda",
    "Stream",
    "Event",
)
_rows(
    MAPPED,
    "the simulator's current / default stream, as torch.cuda.Stream",
    "current_stream",
    "default_stream",
)
_rows(MAPPED, "makes a stream current (for a block)", "set_stream", "stream", "StreamContext")
_rows(MAPPED, "its functions, as the names above", "streams", "graphs", "memory", "random")
_rows(MAPPED, "through torch.amp, whose autocast takes 'cuda' as the simulated GPU", "amp")
_rows(MAPPED, "copies and sums between the simulated GPUs (nn.DataParallel's)", "comm")
# --- memory
_rows(
    MAPPED,
    "the simulator's caching allocator's counters (reserved includes its cached blocks)",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "memory_cached",
    "max_memory_cached",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_summary",
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
    "reset_max_memory_cached",
    "reset_accumulated_memory_stats",
)
_rows(MAPPED, "gives the simulator's cached free blocks back", "empty_cache")
_rows(MAPPED, "(free, total) of the simulated GPU (`--capacity`)", "mem_get_info")
_rows(
    MAPPED,
    "caps every simulated GPU (one capacity for all): beyond it, OutOfMemoryError",
    "set_per_process_memory_fraction",
    "get_per_process_memory_fraction",
)
_rows(
    REFUSED,
    "the simulator's allocator keeps no history or snapshot",
    "memory_snapshot",
)
_rows(
    MAPPED,
    "empty / no-ops: the simulator's pinned memory keeps no counters",
    "host_memory_stats",
    "host_memory_stats_as_nested_dict",
    "reset_accumulated_host_memory_stats",
    "reset_peak_host_memory_stats",
)
_rows(
    REFUSED,
    "CUDA's allocators and raw device pointers are not the simulator's",
    "caching_allocator_alloc",
    "caching_allocator_delete",
    "caching_allocator_enable",
    "caching_allocator_disabled",
    "change_current_allocator",
    "get_allocator_backend",
    "CUDAPluggableAllocator",
    "MemPool",
    "use_mem_pool",
)
# --- random numbers
_rows(
    MAPPED,
    "no-op: the simulated GPUs draw from the CPU's generator, which torch.manual_seed seeds",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
)
_rows(
    MAPPED,
    "the CPU generator's (the one the simulated GPUs draw from)",
    "initial_seed",
    "get_rng_state",
    "set_rng_state",
    "get_rng_state_all",
    "set_rng_state_all",
    "default_generators",
)
# --- debugging and profiling
_rows(MAPPED, "0 / accepts 0 only (no sync debug mode: use ad.find_syncs)", "get_sync_debug_mode")
_rows(MAPPED, "accepts 0 ('default'); other modes refused", "set_sync_debug_mode")
_rows(MAPPED, "no-ops: no profiler is attached to read the ranges", "nvtx")
_rows(MAPPED, "start/stop/profile are no-ops; cudart refused", "profiler")
# --- refused: what only a GPU runs
_rows(
    REFUSED,
    "CUDA graphs capture GPU kernels; the simulator runs CPU kernels",
    "CUDAGraph",
    "graph",
    "graph_pool_handle",
    "make_graphed_callables",
)
_rows(MAPPED, "False: nothing is being captured", "is_current_stream_capturing")
_rows(REFUSED, "NCCL collectives are not simulated", "nccl")
_rows(REFUSED, "jiterator compiles CUDA kernels at run time", "jiterator")
_rows(REFUSED, "TunableOp tunes GPU GEMM kernels", "tunable")
_rows(REFUSED, "GPUDirect Storage needs a GPU and its driver", "gds")
_rows(REFUSED, "green contexts partition a GPU's SMs", "GreenContext", "green_contexts")
_rows(
    REFUSED,
    "raw CUDA runtime handles and streams of other libraries",
    "cudart",
    "check_error",
    "current_blas_handle",
    "current_solver_handle",
    "ExternalStream",
    "get_stream_from_external",
)
_rows(
    REFUSED,
    "NVML telemetry of a physical GPU; the simulator has none",
    "utilization",
    "temperature",
    "power_draw",
    "clock_rate",
    "memory_usage",
    "device_memory_used",
    "list_gpu_processes",
)
_rows(
    REFUSED,
    "legacy tensor types: write torch.empty(..., dtype=..., device='cuda')",
    *(
        f"{t}Tensor"
        for t in ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long")
    ),
    "ShortTensor",
    "sparse",
)
_rows(
    REFUSED,
    "legacy storage types: write torch.UntypedStorage(n, device='cuda')",
    *(
        f"{t}Storage"
        for t in (
            "BFloat16",
            "Bool",
            "Byte",
            "Char",
            "ComplexDouble",
            "ComplexFloat",
            "Double",
            "Float",
            "Half",
            "Int",
            "Long",
            "Short",
        )
    ),
)
# --- left as torch has them
_rows(
    NOT_APPLICABLE,
    "torch's exception types: the simulator raises torch.OutOfMemoryError as a GPU does",
    "OutOfMemoryError",
    "AcceleratorError",
    "CudaError",
    "DeferredCudaCallError",
)
_rows(NOT_APPLICABLE, "CUDA's status codes (constants)", "cudaStatus")
_rows(NOT_APPLICABLE, "this torch build's facts (constants)", "has_half", "has_magma")
_rows(
    NOT_APPLICABLE,
    "not torch.cuda's API: a module or name it imports for itself",
    "Any",
    "Callable",
    "NewType",
    "Optional",
    "TYPE_CHECKING",
    "cast",
    "classproperty",
    "lru_cache",
    "importlib",
    "os",
    "platform",
    "threading",
    "traceback",
    "warnings",
    "torch",
    "pynvml",
    "Device",
    "DEVICE_REQUIREMENT",
    "PYTORCH_RELEASES_CODE_CC",
)


def public_names(module: ModuleType) -> list[str]:
    """The names ``dir(module)`` lists that do not start with an underscore."""
    return sorted(n for n in dir(module) if not n.startswith("_"))


Patch = Callable[[Any, str, Any], None]


def _mapped(run: Simulated) -> dict[str, Any]:
    """The replacement of each mapped name that is a function or class."""
    import torch

    mod = run.mod
    device = run.device_class()
    on = run.on_device
    count = torch.accelerator.device_count
    mapped: dict[str, Any] = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "device_count": lambda: int(count()),
        "current_device": lambda: int(torch.accelerator.current_device_index()),
        "set_device": run.set_device,
        "device": device,
        "device_of": run.device_of,
        "synchronize": run.synchronize,
        "get_device_name": run.get_device_name,
        "get_device_capability": run.get_device_capability,
        "get_device_properties": run.get_device_properties,
        "can_device_access_peer": run.can_device_access_peer,
        "get_arch_list": lambda: ["sm_80"],
        "get_gencode_flags": lambda: "-gencode compute=compute_80,code=sm_80",
        "is_bf16_supported": lambda including_emulation=True: True,
        "is_tf32_supported": lambda: True,
        "ipc_collect": lambda: None,
        "Stream": run.Stream,
        "Event": run.Event,
        "current_stream": run.current_stream,
        "default_stream": run.default_stream,
        "set_stream": mod.set_stream,
        "stream": mod.stream,
        "StreamContext": mod.StreamContext,
        "memory_stats_as_nested_dict": run.memory_stats_as_nested_dict,
        "empty_cache": mod.empty_cache,
        "mem_get_info": run.mem_get_info,
        "set_per_process_memory_fraction": run.set_per_process_memory_fraction,
        "get_per_process_memory_fraction": run.get_per_process_memory_fraction,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "seed": lambda: None,
        "seed_all": lambda: None,
        "initial_seed": torch.initial_seed,
        "get_rng_state": lambda device="cuda": mod.get_rng_state(run.index(device)),
        "set_rng_state": lambda new_state, device="cuda": mod.set_rng_state(
            new_state, run.index(device)
        ),
        "get_rng_state_all": mod.get_rng_state_all,
        "set_rng_state_all": mod.set_rng_state_all,
        "default_generators": tuple(torch.default_generator for _ in range(int(count()))),
        "host_memory_stats": dict,
        "host_memory_stats_as_nested_dict": dict,
        "reset_accumulated_host_memory_stats": lambda: None,
        "reset_peak_host_memory_stats": lambda: None,
        "get_sync_debug_mode": lambda: 0,
        "set_sync_debug_mode": run.set_sync_debug_mode,
        "is_current_stream_capturing": lambda: False,
    }
    aliases = {
        "memory_allocated": "memory_allocated",
        "max_memory_allocated": "max_memory_allocated",
        "memory_reserved": "memory_reserved",
        "max_memory_reserved": "max_memory_reserved",
        "memory_cached": "memory_reserved",
        "max_memory_cached": "max_memory_reserved",
        "memory_stats": "memory_stats",
        "reset_peak_memory_stats": "reset_peak_memory_stats",
        "reset_max_memory_allocated": "reset_peak_memory_stats",
        "reset_max_memory_cached": "reset_peak_memory_stats",
        "reset_accumulated_memory_stats": "reset_accumulated_memory_stats",
    }
    for name, target in aliases.items():
        mapped[name] = on(getattr(mod, target), name)
    return mapped


#: Mapped names that keep torch's own implementation, working on the mapped names above
#: (``comm``'s functions are :mod:`anydevice.testing.cuda.mapped`'s).
_KEPT = frozenset({"memory_summary", "amp", "comm", "streams", "graphs", "memory", "random"})


def install(patch: Patch, run: Simulated) -> None:
    """Apply :data:`TABLE` to ``torch.cuda`` (and its submodules) through
    ``patch(owner, name, value)``, which records what it replaces."""
    import torch

    cuda = torch.cuda
    mapped = _mapped(run)
    modules = [m for k, m in list(sys.modules.items()) if k.startswith("torch.cuda") and m]
    for name in public_names(cuda):
        original = getattr(cuda, name)
        status, note = TABLE.get(name, (None, ""))
        if status == NOT_APPLICABLE or name in _KEPT:
            continue
        what = f"torch.cuda.{name}"
        if status is None:
            value: Any = refusal(
                what,
                f"anydevice's simulated CUDA does not know this name of torch {torch.__version__}",
                "Tell the anydevice developers which call you need; until then, run that "
                "part where a GPU is.",
            )
        elif isinstance(original, ModuleType):
            _module(patch, original, status, note)
            continue
        elif status == MAPPED:
            value = mapped[name]
        elif isinstance(original, type):
            value = refused_class(what, note)
        else:
            value = refusal(what, note)
        for module in modules:
            if module.__dict__.get(name) is original:
                patch(module, name, value)
    patch(cuda, "_sleep", run.sleep)  # private, but how GPU tests keep a stream busy


def _module(patch: Patch, module: ModuleType, status: str, note: str) -> None:
    """A module-valued name: nvtx and profiler as no-ops, a refused module's own
    functions and classes refused."""
    short = module.__name__.rsplit(".", 1)[-1]
    if status == MAPPED:
        members = {"nvtx": nvtx_members, "profiler": profiler_members}[short]()
        for key, value in members.items():
            patch(module, key, value)
        if short == "profiler":
            for key in ("cudart", "check_error"):
                patch(module, key, refusal(f"{module.__name__}.{key}", "raw CUDA runtime"))
        return
    for key, value in list(vars(module).items()):
        if getattr(value, "__module__", None) != module.__name__ or key.startswith("__"):
            continue
        what = f"{module.__name__}.{key}"
        if isinstance(value, type):
            patch(module, key, refused_class(what, note))
        elif callable(value):
            patch(module, key, refusal(what, note))


def markdown() -> str:
    """:data:`TABLE` as the Markdown table ``docs/testing.md`` shows."""
    lines = ["| `torch.cuda.` name | under the simulated CUDA |", "|---|---|"]
    by_note: dict[tuple[str, str], list[str]] = {}
    for name, row in TABLE.items():
        by_note.setdefault(row, []).append(name)
    order = {MAPPED: 0, REFUSED: 1, NOT_APPLICABLE: 2}
    for (status, note), names in sorted(by_note.items(), key=lambda kv: order[kv[0][0]]):
        listed = ", ".join(f"`{n}`" for n in sorted(names, key=str.lower))
        lines.append(f"| {listed} | **{status}**: {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
