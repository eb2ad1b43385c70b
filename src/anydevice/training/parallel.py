"""Data parallelism — ``ad.prepare(model, loader, optimizer)``: place, wrap, shard.

The model and optimizer come back as torch's own objects, never wrappers of ours: the model
on this rank's device — inside torch's ``DistributedDataParallel`` when the world has more
than one rank, inside ``nn.DataParallel`` for ``strategy="dp"``, sharded in place by torch's
``fully_shard`` for ``strategy="fsdp"`` (:mod:`~anydevice.training.sharding`), as it is
in a world of one — and the same optimizer with its state moved along. ``ad.unwrap(model)``
gives the user's module back. The loader is torch's ``DataLoader`` rebuilt around a
``DistributedSampler`` (every setting of the original kept), inside a
:class:`~anydevice.DeviceLoader` that delivers its batches on the rank's device and keeps the
sampler's epoch: yours where you set it, advanced by one after each complete pass where you
never do.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any, cast, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from anydevice.errors import DistributedError
from anydevice.feeding.loader import DeviceLoader
from anydevice.hardware import selection
from anydevice.hardware.backends import collective_device, runtime, torch_private
from anydevice.hardware.spec import DeviceLike
from anydevice.launching import environment
from anydevice.training import sharding
from anydevice.training.context import rank_device

__all__ = [
    "device_loader",
    "distributed_loader",
    "prepare",
    "unwrap",
]

logger = logging.getLogger("anydevice")

_STRATEGIES = ("auto", "ddp", "dp", "fsdp", "none")
#: An optimizer, or a function that makes one from the prepared model's parameters.
OptimizerLike = torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@overload
def prepare(
    model: nn.Module, *, strategy: str = ..., device: DeviceLike | None = ..., **kwargs: Any
) -> nn.Module: ...
@overload
def prepare(
    model: nn.Module,
    loader: DataLoader[Any] | DeviceLoader[Any],
    *,
    strategy: str = ...,
    device: DeviceLike | None = ...,
    **kwargs: Any,
) -> tuple[nn.Module, DeviceLoader[Any]]: ...
@overload
def prepare(
    model: nn.Module,
    loader: DataLoader[Any] | DeviceLoader[Any],
    optimizer: OptimizerLike,
    *,
    strategy: str = ...,
    device: DeviceLike | None = ...,
    **kwargs: Any,
) -> tuple[nn.Module, DeviceLoader[Any], torch.optim.Optimizer]: ...
@overload
def prepare(
    model: nn.Module,
    loader: None = ...,
    *,
    optimizer: OptimizerLike,
    strategy: str = ...,
    device: DeviceLike | None = ...,
    **kwargs: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]: ...
def prepare(
    model: nn.Module,
    loader: DataLoader[Any] | DeviceLoader[Any] | None = None,
    optimizer: OptimizerLike | None = None,
    *,
    strategy: str = "auto",
    device: DeviceLike | None = None,
    **kwargs: Any,
) -> Any:
    """Put the model on this rank's device, wrap it for data parallelism, shard the loader.

    >>> import anydevice as ad
    >>> net = torch.nn.Linear(4, 2)
    >>> with ad.distributed() as d:          # a world of one here
    ...     model = ad.prepare(net)
    >>> model is net                         # nothing to wrap in a world of one
    True

    Under a launcher with ``N`` ranks the same lines give a ``DistributedDataParallel``
    (``device_ids=[i]`` on GPU ``i``; ``None`` on the CPU, where torch refuses ids) and a
    loader whose sampler gives each rank ``ceil(len(dataset) / N)`` samples. The batch
    size stays per process, so the global batch is ``N`` times larger. The sampler pads
    the dataset by repeating its first samples so every rank gets as many batches (ranks
    with fewer batches would hang in DDP); use ``ad.gather_for_metrics`` to drop the
    repeats when evaluating. If your own data is uneven across ranks, train inside
    ``with model.join():`` (torch's ``DDP.join``).

    Args:
        model: the user's module.
        loader: a ``DataLoader`` to shard. Its dataset, batch size, shuffle, workers,
            collate_fn, pin_memory, drop_last, timeout, worker_init_fn, generator,
            prefetch_factor, persistent_workers and multiprocessing context are kept.
            It comes back inside a :class:`~anydevice.DeviceLoader`: batches arrive on the
            rank's device (prefetched; on CUDA, pinned and copied on a side stream), and
            the sampler's epoch is yours where you set it (``loader.set_epoch(e)`` or
            ``loader.sampler.set_epoch(e)``), else advanced after each complete pass. A
            ``DeviceLoader`` may be passed too: its source is sharded and its
            ``transform``, ``prefetch`` and ``depth`` are kept.
        optimizer: its state (momentum, Adam moments) moves to the model's device. Or a
            function that makes the optimizer from the prepared model's parameters
            (``functools.partial(torch.optim.AdamW, lr=1e-3)``); it is called after
            wrapping or sharding.
        strategy: ``"auto"`` (DDP when the world has several ranks, else nothing);
            ``"ddp"`` (DDP whenever a process group exists, even of one rank);
            ``"fsdp"`` (torch's FSDP2 ``fully_shard`` on each block, then the root, over
            a ``DeviceMesh`` of the world; nothing in a world of one — see below);
            ``"dp"`` (``nn.DataParallel`` over every visible GPU in this one process —
            slower than DDP: one Python thread drives all GPUs and the module is
            replicated on every step; on the CPU torch's DataParallel silently just calls
            the module, so anydevice warns and returns the model unwrapped);
            ``"none"`` (place only).
        device: the device to use (default: this rank's, as ``ad.distributed`` picks it).
        kwargs: passed to torch's wrapper, e.g. ``find_unused_parameters=True`` for DDP,
            ``reshard_after_forward=False`` or ``mp_policy=`` for ``fully_shard``. With
            ``"fsdp"`` three more are anydevice's: ``shard=`` (a module class, a tuple of
            them, or a predicate naming the blocks; default the children of the model's
            largest ``nn.ModuleList``/``nn.Sequential``), ``precision=`` (``"auto"``, a
            mode or an ``ad.precision`` object: bf16/fp16 gathers parameters in that
            dtype and reduces gradients in fp32; ``"auto"`` chooses by hardware, so fp32
            on a CPU without native bf16) and ``cpu_offload=True`` (parameters, gradients
            and optimizer state live in host memory between uses).

    With ``"fsdp"`` the parameters become sharded ``DTensor``\\ s, so an optimizer made
    before ``prepare`` is pointed at them: the same optimizer object, its param groups in
    the same order with the same hyper-parameters (an LR scheduler made on it keeps
    working). One that has already stepped is refused — its state has the full shapes;
    restore state after ``prepare`` with :func:`~anydevice.load_state`.

    Returns:
        The arguments given, in order: ``model``; ``(model, loader)``;
        ``(model, loader, optimizer)``; or ``(model, optimizer)``. The model and optimizer
        are torch's objects; the loader is a ``DeviceLoader`` whose ``.loader`` is torch's
        ``DataLoader`` (its ``dataset``, ``sampler`` and ``batch_size`` read through).

    Raises:
        DistributedError: ``WORLD_SIZE > 1`` but no process group (call it inside ``with
            ad.distributed():``); a loader that cannot be sharded (an ``IterableDataset``,
            a custom sampler or batch sampler); ``"dp"`` with several processes; an
            optimizer that holds parameters the model does not have; with ``"fsdp"``,
            an optimizer that has already stepped.
        ValueError: an unknown strategy.
        TypeError: an optimizer (or a function making one) in the ``loader`` place, as in
            ``ad.prepare(model, opt)``: pass it by name, ``optimizer=opt``.
    """
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: use one of {', '.join(_STRATEGIES)}.")
    _check_loader_argument(loader)
    rank, size, dev = _where(device)
    # fully_shard moves each block to the device as it shards it: moving the whole model
    # first would need room for all of it (and for a model made on "meta", fail).
    module = model if strategy == "fsdp" and size > 1 else _place(model, dev)
    given = factory = None
    if isinstance(optimizer, torch.optim.Optimizer):
        given = optimizer
        _move_optimizer(given, model)
    elif optimizer is not None:
        factory = optimizer
    if strategy == "fsdp":
        wrapped = _fully_shard(module, given, size, dev, kwargs)
    else:
        wrapped = _wrap(module, strategy, size, dev, kwargs)
    out: list[Any] = [wrapped]
    if loader is not None:
        out.append(device_loader(loader, size, rank, dev))
    if given is not None:
        out.append(given)
    elif factory is not None:
        out.append(sharding.build_optimizer(factory, wrapped))
    return out[0] if len(out) == 1 else tuple(out)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside torch's wrappers (DDP, DataParallel, ``torch.compile``).

    >>> net = torch.nn.Linear(2, 2)
    >>> unwrap(torch.nn.DataParallel(net)) is net
    True
    """
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
            continue
        inner = torch_private.compiled_inner(model)  # torch.compile's OptimizedModule
        if isinstance(inner, nn.Module):
            model = inner
            continue
        return model


def distributed_loader(
    loader: DataLoader[Any], num_replicas: int, rank: int, *, seed: int = 0
) -> DataLoader[Any]:
    """``loader`` rebuilt to give this rank its share, or ``loader`` itself when there is
    nothing to share (one replica, or already sharded this way).

    >>> from torch.utils.data import DataLoader
    >>> shard = distributed_loader(DataLoader(range(10), batch_size=2, shuffle=True), 4, 1)
    >>> type(shard.sampler).__name__, shard.sampler.shuffle, len(shard.sampler)
    ('DistributedSampler', True, 3)

    The sampler is torch's own: on its own it deals the same order every epoch unless
    ``set_epoch`` is called; inside a :class:`~anydevice.DeviceLoader` (as ``ad.prepare``
    returns it) the epoch advances after each complete pass where you never set it.

    Raises:
        DistributedError: the loader cannot be sharded by a ``DistributedSampler``.
    """
    if num_replicas == 1:
        return loader
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        if sampler.num_replicas == num_replicas and sampler.rank == rank:
            return loader
        raise DistributedError(
            f"The loader's DistributedSampler is for rank {sampler.rank} of "
            f"{sampler.num_replicas}, but this is rank {rank} of {num_replicas}. Pass the "
            "loader with its original sampler and let ad.prepare shard it."
        )
    if isinstance(loader.dataset, IterableDataset):
        raise DistributedError(
            f"The loader reads an IterableDataset ({type(loader.dataset).__name__}), which a "
            "sampler cannot split. Shard it inside the dataset: skip items by d.rank and "
            "d.world_size (and by torch.utils.data.get_worker_info() for workers)."
        )
    if loader.batch_size is None and loader.batch_sampler is not None:
        raise DistributedError(
            f"The loader uses its own batch_sampler ({type(loader.batch_sampler).__name__}), "
            "which ad.prepare cannot split without changing its batches. Make it take "
            "num_replicas and rank, or build the loader with batch_size and shuffle."
        )
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or torch_private.random_sampler_size(sampler) is not None:
            raise DistributedError(
                "The loader's RandomSampler draws with replacement or a fixed num_samples, "
                "which DistributedSampler cannot reproduce. Build the loader with "
                "shuffle=True instead, or shard the dataset yourself."
            )
        shuffle = True
    elif isinstance(sampler, SequentialSampler):
        shuffle = False
    else:
        raise DistributedError(
            f"The loader's sampler is a {type(sampler).__name__}; ad.prepare can only shard "
            "shuffle=True / shuffle=False loaders. Write a sampler that takes num_replicas "
            "and rank (for weighted sampling, draw with a generator seeded the same on "
            "every rank and keep every num_replicas-th index)."
        )
    new_sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
    )
    options = _loader_options(loader)
    try:
        return type(loader)(loader.dataset, sampler=new_sampler, **options)
    except TypeError as e:
        raise DistributedError(
            f"Cannot rebuild {type(loader).__name__} with a DistributedSampler: {e}. Pass a "
            "torch.utils.data.DataLoader, or give it a DistributedSampler yourself."
        ) from e


def device_loader(
    loader: DataLoader[Any] | DeviceLoader[Any], size: int, rank: int, device: torch.device
) -> DeviceLoader[Any]:
    """``loader`` sharded for this rank and delivering its batches on ``device``.

    A ``DeviceLoader`` given here keeps its ``transform``, ``prefetch`` and ``depth``; its
    source is what gets sharded.

    >>> from torch.utils.data import DataLoader
    >>> dl = device_loader(DataLoader(range(8), batch_size=2), 2, 1, torch.device("cpu"))
    >>> [b.tolist() for b in dl], dl.sampler.rank
    ([[1, 3], [5, 7]], 1)
    """
    if isinstance(loader, DeviceLoader):
        inner = loader.loader
        if not isinstance(inner, DataLoader):
            if size > 1:
                raise DistributedError(
                    f"The DeviceLoader wraps a {type(inner).__name__}, not a DataLoader, so "
                    f"ad.prepare cannot split it over {size} ranks. Wrap a DataLoader, or "
                    "shard the data yourself by d.rank and d.world_size."
                )
            inner = cast("DataLoader[Any]", inner)
        source = distributed_loader(inner, size, rank)
        if source is loader.loader and loader.device == device:
            return loader
        return DeviceLoader(source, device, loader.transform, loader.prefetch, depth=loader.depth)
    return DeviceLoader(distributed_loader(loader, size, rank), device)


# ----------------------------------------------------------------------------- internals


def _check_loader_argument(loader: object) -> None:
    """Refuse an optimizer given where the loader goes (the second positional argument)."""
    if isinstance(loader, (DataLoader, DeviceLoader)) or loader is None:
        return
    if isinstance(loader, torch.optim.Optimizer):
        what = f"a {type(loader).__name__} optimizer"
    elif callable(loader) and not isinstance(loader, Iterable):
        what = f"{getattr(loader, '__qualname__', type(loader).__name__)!r}, a function"
    else:
        return  # another iterable of batches: a DeviceLoader delivers it in a world of one
    raise TypeError(
        f"ad.prepare(model, {what}): the second argument is the loader. Pass the optimizer "
        "by name, ad.prepare(model, optimizer=opt), or after the loader, "
        "ad.prepare(model, loader, opt)."
    )


def _where(device: DeviceLike | None) -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process."""
    if dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
        if device is not None:
            return rank, size, selection.device(device)
        where = collective_device()  # NCCL's: this rank's GPU
        if not runtime(where.type).is_host:
            return rank, size, where
        world = environment.detect()
        local = world.local_rank if world.world_size == size else 0
        return rank, size, rank_device("auto", local)
    world = environment.detect()
    if world.world_size > 1:
        raise DistributedError(
            f"ad.prepare: this process is {world.describe()}, but no process group exists, "
            "so each rank would train its own copy. Call it inside `with ad.distributed():`."
        )
    return 0, 1, rank_device(device if device is not None else "auto", 0)


def _place(model: nn.Module, dev: torch.device) -> nn.Module:
    inner = unwrap(model)
    placed = {t.device for t in (*inner.parameters(), *inner.buffers())}
    if len(placed) > 1:
        spans = sorted(map(str, placed))
        logger.info("prepare: the model spans %s; leaving its placement alone", spans)
        return model
    return model.to(dev)


def _wrap(
    model: nn.Module, strategy: str, size: int, dev: torch.device, kwargs: dict[str, Any]
) -> nn.Module:
    if isinstance(model, (DistributedDataParallel, DataParallel)) or strategy == "none":
        return model
    if strategy == "dp":
        return _data_parallel(model, size, dev, kwargs)
    grouped = dist.is_available() and dist.is_initialized()
    if size == 1 and not (strategy == "ddp" and grouped):
        return model
    devices = {p.device for p in model.parameters()}
    single_gpu = len(devices) == 1 and runtime(dev.type).ddp_device_ids
    ids = [_index(dev)] if single_gpu else None  # torch refuses device_ids for CPU modules
    return DistributedDataParallel(model, device_ids=ids, **kwargs)


def _fully_shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    size: int,
    dev: torch.device,
    kwargs: dict[str, Any],
) -> nn.Module:
    options = dict(kwargs)
    shard = options.pop("shard", None)
    mode = options.pop("precision", "auto")
    offload = bool(options.pop("cpu_offload", False))
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        raise DistributedError(
            f"strategy='fsdp' got a model already wrapped in {type(model).__name__}. Pass "
            "the module itself (ad.unwrap(model))."
        )
    if size == 1:
        return model  # nothing to shard: the same script runs unchanged in a world of one
    names = sharding.parameter_names(model)
    sharded = sharding.fully_shard_model(
        model, dev, size, shard=shard, mode=mode, cpu_offload=offload, **options
    )
    if optimizer is not None:
        sharding.swap_parameters(optimizer, names, sharded)
    return sharded


def _data_parallel(
    model: nn.Module, size: int, dev: torch.device, kwargs: dict[str, Any]
) -> nn.Module:
    if size > 1:
        raise DistributedError(
            f"strategy='dp' runs one process that drives every GPU, but this is one of {size} "
            "processes. Use strategy='auto' (DistributedDataParallel) under a launcher."
        )
    if not runtime(dev.type).data_parallel:
        warnings.warn(
            f"strategy='dp': nn.DataParallel needs CUDA GPUs, and the model is on {dev}. "
            "torch's DataParallel would silently just call the module there (no "
            "parallelism, and a 'module.' prefix in state_dict), so the model is returned "
            "unwrapped.",
            RuntimeWarning,
            stacklevel=3,
        )
        return model
    ids = [i for i in (d.index for d in selection.devices(dev.type)) if i is not None]
    first = _index(dev)
    ids = [first, *(i for i in ids if i != first)]
    return DataParallel(model, device_ids=ids, output_device=first, **kwargs)


def _move_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    owned = {id(p) for p in model.parameters()}
    foreign = [
        tuple(p.shape)
        for group in optimizer.param_groups
        for p in group["params"]
        if id(p) not in owned
    ]
    if foreign:
        raise DistributedError(
            f"The optimizer holds {len(foreign)} parameter(s) the model does not have "
            f"(shapes {foreign[:4]}{'...' if len(foreign) > 4 else ''}): it was made for "
            "another model, so training would not update this one. Create it from "
            "model.parameters() of the model passed to ad.prepare."
        )
    for group in optimizer.param_groups:
        keep_step = not (group.get("capturable") or group.get("fused"))
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and not (key == "step" and keep_step):
                    state[key] = value.to(p.device)


def _loader_options(loader: DataLoader[Any]) -> dict[str, Any]:
    accepted = set(inspect.signature(DataLoader.__init__).parameters)
    options = {
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": getattr(loader, "pin_memory_device", ""),
        "in_order": getattr(loader, "in_order", True),
    }
    return {k: v for k, v in options.items() if k in accepted}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else 0
