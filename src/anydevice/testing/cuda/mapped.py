"""torch's names beyond ``torch.cuda`` that take ``"cuda"``, mapped or refused for a run.

Mapped: checkpoints (``torch.load``'s ``map_location`` and a checkpoint's own CUDA
locations land on the simulated GPUs; a checkpoint saved in the run records ``cuda:k``, so
a GPU loads it), ``nn.Module.to`` (parameter objects kept, as for CUDA), autocast
(``torch.autocast("cuda")``, ``torch.cuda.amp.autocast``, the autocast state functions;
``GradScaler("cuda")`` then works as torch wrote it),
``torch.accelerator``'s and ``torch.Stream``'s / ``torch.Event``'s device arguments, and
``torch.cuda.comm`` (what ``nn.DataParallel`` moves tensors with: copies and sums).

Refused, at the first call, by name: NCCL process groups and collectives on simulated
tensors, ``DistributedDataParallel`` of a module on them, ``torch.compile``'s GPU backend
(inductor makes Triton kernels), and custom CUDA kernels (``cpp_extension`` with ``.cu``
sources or ``with_cuda=True``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from anydevice.testing.cuda.devices import is_cuda_name, to_cuda, to_sim
from anydevice.testing.cuda.refused import COLLECTIVES_NOT_SIMULATED, refusal, refuse
from anydevice.testing.device_module import alias

if TYPE_CHECKING:
    from anydevice.testing.cuda.module import Simulated

__all__ = ["install"]

Patch = Callable[[Any, str, Any], None]


def install(patch: Patch, run: Simulated) -> None:
    """Map or refuse, through ``patch(owner, name, value)``, every name this module covers."""
    sim = run.sim
    _checkpoints(patch, sim)
    _autocast(patch, sim)
    _accelerator(patch, sim)
    _generic_classes(patch, sim)
    _module_moves(patch)
    _comm(patch, run)
    _compile(patch)
    _extensions(patch)
    _distributed(patch, sim)


def _sim_type(device_type: Any, sim: str) -> Any:
    return sim if device_type == "cuda" else device_type


# ------------------------------------------------------------------ checkpoints
def _checkpoints(patch: Patch, sim: str) -> None:
    import torch.serialization as serialization

    restore: Any = serialization.default_restore_location
    tag: Any = serialization.location_tag

    @functools.wraps(restore)
    def default_restore_location(storage: Any, location: str) -> Any:
        return restore(storage, to_sim(location, sim))

    @functools.wraps(tag)
    def location_tag(storage: Any) -> str:
        location = str(tag(storage))
        if location == sim or location.startswith(sim + ":"):
            return "cuda" + location[len(sim) :]
        return location

    patch(serialization, "default_restore_location", default_restore_location)
    patch(serialization, "location_tag", location_tag)


# ------------------------------------------------------------------ autocast
def _autocast(patch: Patch, sim: str) -> None:
    from torch.amp import autocast_mode

    init = autocast_mode.autocast.__init__

    @functools.wraps(init)
    def __init__(
        self: Any,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        if device_type != "cuda":
            init(self, device_type, dtype, enabled, cache_enabled)
            return
        # CUDA's autocast takes any dtype (torch checks only that a GPU has bf16): nanoGPT's
        # dtype=float32 runs autocast("cuda", dtype=torch.float32). torch's check for a
        # privateuse1 backend allows the two the simulator lists, and warns of any other,
        # naming the simulator, and turns autocast off; so it is set up with one of those,
        # then given the dtype asked for, as on a GPU.
        wanted = dtype if dtype is not None else torch.get_autocast_dtype(sim)
        init(self, sim, torch.float16, enabled, cache_enabled)
        self.fast_dtype = wanted

    patch(autocast_mode.autocast, "__init__", __init__)

    def by_type(name: str) -> None:
        original = getattr(torch, name)

        @functools.wraps(original)
        def call(device_type: Any = "cuda", *args: Any, **kwargs: Any) -> Any:
            return original(_sim_type(device_type, sim), *args, **kwargs)

        patch(torch, name, call)

    # The device-type form; without an argument torch means CUDA.
    for name in ("is_autocast_enabled", "get_autocast_dtype"):
        by_type(name)
    for name in ("set_autocast_enabled", "set_autocast_dtype"):
        original = getattr(torch, name)

        def setter(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if len(args) == 2:  # (device_type, value)
                args = (_sim_type(args[0], sim), args[1])
            elif len(args) == 1 and not kwargs:  # (value): CUDA's, deprecated
                args = (sim, args[0])
            return _original(*args, **kwargs)

        patch(torch, name, functools.wraps(original)(setter))
    patch(torch, "get_autocast_gpu_dtype", lambda: torch.get_autocast_dtype(sim))
    patch(torch, "set_autocast_gpu_dtype", lambda dtype: torch.set_autocast_dtype(sim, dtype))


# ------------------------------------------------------------------ torch.accelerator
def _accelerator(patch: Patch, sim: str) -> None:
    from torch.accelerator import _utils

    index = _utils._get_device_index

    @functools.wraps(index)
    def _get_device_index(device: Any, optional: bool = False) -> int:
        return int(index(to_sim(device, sim), optional))

    for name in ("torch.accelerator", "torch.accelerator.memory", "torch.accelerator._utils"):
        module = importlib.import_module(name)
        if getattr(module, "_get_device_index", None) is index:
            patch(module, "_get_device_index", _get_device_index)


def _generic_classes(patch: Patch, sim: str) -> None:
    """``torch.Stream(device)`` and ``torch.Event(device)`` take a CUDA device too (a
    tensor's ``.device`` reads ``cuda`` in the run); ``isinstance`` still holds for the
    streams and events torch makes, and what they make is torch's own type."""
    for name in ("Stream", "Event"):
        base = getattr(torch, name)
        made: list[type] = []

        def __new__(
            cls: Any, *args: Any, _base: Any = base, _made: Any = made, **kwargs: Any
        ) -> Any:
            args = tuple(to_sim(a, sim) for a in args)
            if "device" in kwargs:
                kwargs["device"] = to_sim(kwargs["device"], sim)
            if cls is _made[0]:
                return _base(*args, **kwargs)
            return _base.__new__(cls, *args, **kwargs)  # a subclass made in the run

        made.append(alias(base, name, "torch", base.__doc__ or "", __new__=__new__))
        patch(torch, name, made[0])


# ------------------------------------------------------------------ nn.Module.to
def _module_moves(patch: Patch) -> None:
    """``nn.Module.to("cuda")`` keeps each parameter object, as it does for CUDA, so an
    optimizer made before the move trains the moved model. torch counts no privateuse1
    device as dense like the CPU, so between the CPU and the simulator it puts new
    parameters in the old ones' place; each is swapped back into the old object
    (``torch.utils.swap_tensors``), or, where torch refuses the swap (the old object is
    referenced from elsewhere), left as torch made it."""
    from torch import nn

    apply: Any = nn.Module._apply

    @functools.wraps(apply)
    def _apply(self: nn.Module, fn: Any, recurse: bool = True) -> Any:
        before = dict(self._parameters)
        result = apply(self, fn, recurse)
        for key, old in before.items():
            new = self._parameters.get(key)
            if old is None or new is None or new is old:
                continue
            try:
                torch.utils.swap_tensors(old, new)
            except RuntimeError:
                continue
            self._parameters[key] = old
        return result

    patch(nn.Module, "_apply", _apply)


# ------------------------------------------------------------------ torch.cuda.comm
def _comm(patch: Patch, run: Simulated) -> None:
    """What ``nn.DataParallel`` and ``torch.nn.parallel`` move tensors with, as copies
    between the simulated GPUs and sums (torch's own run C++ on CUDA devices)."""
    sim = run.sim

    def dev(device: Any) -> torch.device:
        if isinstance(device, int) and device == -1:
            return torch.device("cpu")
        if isinstance(device, torch.device) and device.type == "cpu":
            return device
        return torch.device(sim, run.index(device))

    def broadcast(tensor: torch.Tensor, devices: Any = None, *, out: Any = None) -> Any:
        if out is not None:
            for o in out:
                o.copy_(tensor)
            return tuple(out)
        return tuple(tensor.to(dev(d)) for d in devices)

    def broadcast_coalesced(tensors: Any, devices: Any, buffer_size: int = 10485760) -> Any:
        return [tuple(t.to(dev(d)) for t in tensors) for d in devices]

    def reduce_add(inputs: Any, destination: Any = None) -> Any:
        target = dev(destination)
        total = inputs[0].to(target, copy=True)
        for t in inputs[1:]:
            total += t.to(target)
        return total

    def reduce_add_coalesced(
        inputs: Any, destination: Any = None, buffer_size: int = 10485760
    ) -> Any:
        return tuple(reduce_add(list(group), destination) for group in zip(*inputs, strict=True))

    def scatter(
        tensor: torch.Tensor,
        devices: Any = None,
        chunk_sizes: Any = None,
        dim: int = 0,
        streams: Any = None,
        *,
        out: Any = None,
    ) -> Any:
        if out is not None:
            refuse("torch.cuda.comm.scatter(out=...)", "only the form with devices is simulated")
        targets = [dev(d) for d in devices]
        chunks = (
            tensor.split(list(chunk_sizes), dim)
            if chunk_sizes is not None
            else tensor.chunk(len(targets), dim)
        )
        moved = []
        for i, (chunk, target) in enumerate(zip(chunks, targets, strict=True)):
            stream = streams[i] if streams else None
            with run.mod.stream(stream):
                moved.append(chunk.to(target, non_blocking=True))
        return tuple(moved)

    def gather(tensors: Any, dim: int = 0, destination: Any = None, *, out: Any = None) -> Any:
        if out is not None:
            refuse("torch.cuda.comm.gather(out=...)", "only the form with devices is simulated")
        target = dev(destination)
        return torch.cat([t.to(target) for t in tensors], dim)

    functions = {
        "broadcast": broadcast,
        "broadcast_coalesced": broadcast_coalesced,
        "reduce_add": reduce_add,
        "reduce_add_coalesced": reduce_add_coalesced,
        "scatter": scatter,
        "gather": gather,
    }
    for name in ("torch.nn.parallel.comm", "torch.cuda.comm"):
        module = importlib.import_module(name)
        for key, value in functions.items():
            value.__module__ = name
            patch(module, key, value)


# ------------------------------------------------------------------ refused
def _compile(patch: Patch) -> None:
    original = torch.compile
    gpu_backends = ("inductor",)

    @functools.wraps(original)
    def compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", "inductor")
        if isinstance(backend, str) and backend in gpu_backends:
            refuse(
                f"torch.compile(backend={backend!r})",
                "inductor makes Triton kernels for the GPU, which the simulator cannot run",
                "Run the model without torch.compile under the simulator (most scripts have "
                "a switch, e.g. --compile=False), or pass backend='eager' or 'aot_eager' to "
                "check that it traces.",
            )
        compiled = original(model, *args, **kwargs)
        if model is None:  # used as @torch.compile(...): torch calls this again
            return compiled
        if isinstance(compiled, torch.nn.Module):
            compiled.forward = _unmapped(compiled.forward)
            return compiled
        return _unmapped(compiled)

    patch(torch, "compile", compile)


def _unmapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called with torch's function handling off: Dynamo cannot trace the mode that
    maps device names, so compiled code (eager and aot_eager backends) runs without it
    (tensors passed in are on the simulated GPUs already; ``"cuda"`` inside it is not
    mapped)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)

    return call


def _cuda_sources(sources: Iterable[Any]) -> list[str]:
    return [str(s) for s in sources if str(s).endswith((".cu", ".cuh"))]


def _extensions(patch: Patch) -> None:
    from torch.utils import cpp_extension

    why = "a custom CUDA kernel runs on a GPU only; the simulator runs torch's CPU kernels"
    instead = (
        "Build the operator's CPU kernel alone under the simulator (ad.load_extension "
        "builds the .cpp sources where torch has no CUDA), or run it where a GPU is."
    )
    load: Any = cpp_extension.load
    load_inline: Any = cpp_extension.load_inline

    @functools.wraps(load)
    def checked_load(name: str, sources: Any, *args: Any, **kwargs: Any) -> Any:
        listed = [sources] if isinstance(sources, str) else list(sources)
        cuda = _cuda_sources(listed)
        if cuda or kwargs.get("with_cuda"):
            refuse(f"torch.utils.cpp_extension.load({name!r}, {cuda or listed})", why, instead)
        return load(name, sources, *args, **kwargs)

    @functools.wraps(load_inline)
    def checked_inline(name: str, *args: Any, **kwargs: Any) -> Any:
        cuda_sources = kwargs.get("cuda_sources", args[1] if len(args) > 1 else None)
        if cuda_sources or kwargs.get("with_cuda"):
            refuse(
                f"torch.utils.cpp_extension.load_inline({name!r}, cuda_sources=...)", why, instead
            )
        return load_inline(name, *args, **kwargs)

    patch(cpp_extension, "load", checked_load)
    patch(cpp_extension, "load_inline", checked_inline)
    patch(
        cpp_extension,
        "CUDAExtension",
        refusal("torch.utils.cpp_extension.CUDAExtension", why, instead),
    )


_COLLECTIVES = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
)

_DISTRIBUTED_INSTEAD = (
    "Run the collective part on the CPU under the simulator (backend='gloo' with CPU "
    "tensors), or where GPUs are."
)


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def _distributed(patch: Patch, sim: str) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d as c10d

    why = COLLECTIVES_NOT_SIMULATED

    def named_nccl(backend: Any) -> bool:
        return backend is not None and "nccl" in str(backend).lower()

    def guarded_group(name: str) -> None:
        original = getattr(c10d, name)

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            backend = kwargs.get(
                "backend", args[0] if args and name == "init_process_group" else None
            )
            if named_nccl(backend):
                refuse(f"torch.distributed.{name}(backend={backend!r})", why, _DISTRIBUTED_INSTEAD)
            device_id = kwargs.get("device_id")
            if is_cuda_name(device_id) or (
                isinstance(device_id, torch.device) and device_id.type == sim
            ):
                refuse(
                    f"torch.distributed.{name}(device_id={device_id!r})",
                    why,
                    _DISTRIBUTED_INSTEAD,
                )
            return original(*args, **kwargs)

        for owner in (dist, c10d):
            if getattr(owner, name, None) is original:
                patch(owner, name, call)

    for name in ("init_process_group", "new_group"):
        guarded_group(name)

    def guarded_collective(name: str) -> None:
        original = getattr(c10d, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            for t in _tensors((*args, *kwargs.values())):
                if t.device.type in (sim, "cuda"):
                    refuse(
                        f"torch.distributed.{name} on {to_cuda(t.device, sim)}",
                        why,
                        _DISTRIBUTED_INSTEAD,
                    )
            return original(*args, **kwargs)

        for owner in (dist, c10d):
            if getattr(owner, name, None) is original:
                patch(owner, name, call)

    for name in _COLLECTIVES:
        guarded_collective(name)

    from torch.nn.parallel import DistributedDataParallel

    init: Any = DistributedDataParallel.__init__

    @functools.wraps(init)
    def ddp_init(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        for p in module.parameters():
            if p.device.type in (sim, "cuda"):
                refuse(
                    f"DistributedDataParallel of a module on {to_cuda(p.device, sim)}",
                    "its gradients are averaged with NCCL collectives, which are not simulated",
                    _DISTRIBUTED_INSTEAD,
                )
        init(self, module, *args, **kwargs)

    patch(DistributedDataParallel, "__init__", ddp_init)
