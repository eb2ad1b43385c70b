"""Collectives that return values and work the same in a world of one.

torch's collectives work in place, need every rank to pass a tensor of the same shape,
need the tensor on the backend's device (CUDA for NCCL), and fail without a process group.
These return a new value, accept tensors of different first dimensions and plain Python
objects, move tensors to the backend's device and back, and — without a process group —
return what a world of one would. When the environment says ``WORLD_SIZE > 1`` but no group
exists they raise rather than let each rank see only its own value.

>>> all_reduce(3.0).item()
3.0
>>> all_gather({"loss": 0.5})
[{'loss': 0.5}]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from anydevice.errors import DistributedError
from anydevice.feeding.loader import DeviceLoader
from anydevice.launching import environment

__all__ = ["all_gather", "all_reduce", "broadcast", "gather_for_metrics"]

T = TypeVar("T")

_OPS = {"sum", "mean", "max", "min", "product"}


def all_reduce(x: torch.Tensor | float | int, op: str = "mean") -> torch.Tensor:
    """Reduce ``x`` over all ranks and return the result on every rank (``x`` is unchanged).

    >>> all_reduce(torch.tensor([1.0, 3.0]), op="sum")
    tensor([1., 3.])

    Args:
        x: a tensor or a number (same shape on every rank).
        op: ``"mean"`` (integers become floating point), ``"sum"``, ``"max"``, ``"min"``
            or ``"product"``.

    Returns:
        A new tensor on ``x``'s device (the CPU for a number).

    Raises:
        ValueError: an unknown ``op``.
        DistributedError: ``WORLD_SIZE > 1`` but no process group exists.
    """
    if op not in _OPS:
        raise ValueError(f"op={op!r}: use one of {', '.join(sorted(_OPS))}.")
    t = (x if isinstance(x, torch.Tensor) else torch.as_tensor(x)).detach()
    if op == "mean" and not (t.is_floating_point() or t.is_complex()):
        t = t.to(torch.get_default_dtype())
    size = _world_size("all_reduce")
    if size == 1:
        return t.clone()
    buf = t.to(_comm_device(), copy=True)
    reduce_op = {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT,
    }[op]
    dist.all_reduce(buf, op=reduce_op)
    if op == "mean":
        buf /= size
    return buf.to(t.device)


def all_gather(obj: T) -> list[T]:
    """Every rank's ``obj``, as a list in rank order, on every rank.

    Tensors travel as tensors (their first dimension may differ between ranks; the rest
    of the shape and the dtype must agree) and come back on ``obj``'s device. Anything else
    is pickled: numbers, strings, dicts, lists — tensors inside those travel pickled, so
    move them to the CPU first.

    >>> all_gather(torch.arange(3))
    [tensor([0, 1, 2])]

    Raises:
        DistributedError: tensors whose shapes or dtypes cannot be stacked; ``WORLD_SIZE > 1``
            without a process group.
    """
    size = _world_size("all_gather")
    if size == 1:
        return [obj]
    if isinstance(obj, torch.Tensor):
        return _gather_tensors(obj, size)  # type: ignore[return-value]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank. Other ranks may pass anything (``None``).

    A tensor travels as a tensor and lands on the caller's tensor's device, or — when the
    caller passed no tensor — on the backend's device (the CPU for gloo, this rank's GPU
    for NCCL). Anything else is pickled.

    >>> broadcast({"seed": 1234})
    {'seed': 1234}

    Raises:
        DistributedError: ``src`` is not a rank; ``WORLD_SIZE > 1`` without a process group.
    """
    size = _world_size("broadcast")
    if not 0 <= src < size:
        raise DistributedError(f"broadcast(src={src}): ranks are 0..{size - 1}.")
    if size == 1:
        return obj
    rank = dist.get_rank()
    if rank == src and isinstance(obj, torch.Tensor):
        header: list[Any] = [("tensor", tuple(obj.shape), obj.dtype)]
    else:
        header = [("object", obj if rank == src else None, None)]
    dist.broadcast_object_list(header, src=src)
    kind, payload, dtype = header[0]
    if kind == "object":
        return payload  # type: ignore[no-any-return]
    dev = _comm_device()
    if rank == src:
        assert isinstance(obj, torch.Tensor)
        buf = obj.detach().to(dev, copy=True)
    else:
        buf = torch.empty(payload, dtype=dtype, device=dev)
    dist.broadcast(buf, src=src)
    target = obj.device if isinstance(obj, torch.Tensor) else dev
    return buf.to(target)  # type: ignore[return-value]


def gather_for_metrics(
    x: T, loader: DataLoader[Any] | DeviceLoader[Any] | Sampler[Any] | int | None = None
) -> T:
    """Every rank's evaluation outputs, in sampler order, with the sampler's padding dropped.

    ``DistributedSampler`` pads the dataset so that every rank gets as many samples:
    10 samples on 4 ranks become 12, and samples 0 and 1 are seen twice. Averaging the
    gathered outputs would count them twice. Rank ``r``'s ``i``-th sample sits at place
    ``i * world_size + r`` of the sampler's padded order and the padding is the end of
    that order, so interleaving the ranks' outputs and keeping the first
    ``len(dataset)`` restores each sample exactly once.

    Collect what this rank computed over the whole loader, in the order the loader gave it,
    then call this once::

        preds = torch.cat([model(x).argmax(1) for x, _ in loader])
        preds = ad.gather_for_metrics(preds, loader)     # len(dataset) predictions

    >>> gather_for_metrics(torch.tensor([0.5, 0.7]))
    tensor([0.5000, 0.7000])

    Args:
        x: this rank's outputs: a tensor whose first dimension is samples, a list with one
            item per sample, or a tuple or dict of those.
        loader: the loader the outputs came from (``ad.prepare`` gives one), its
            ``DistributedSampler``, or the number of real samples. Optional in a world of one.

    Returns:
        The outputs of all ranks: each sample once, in the sampler's order (dataset order
        when it does not shuffle), of the same type as ``x``. In a world of one: ``x``.

    Raises:
        DistributedError: several ranks but no ``loader``, or a loader whose sampler is not
            a ``DistributedSampler`` of this world.
    """
    size = _world_size("gather_for_metrics")
    if size == 1:
        return x
    total = _real_samples(loader, size)
    return _gather_samples(x, total, size)  # type: ignore[return-value]


# ----------------------------------------------------------------------------- internals


def _world_size(what: str) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    world = environment.detect()
    if world.world_size > 1:
        raise DistributedError(
            f"ad.{what}: this process is {world.describe()}, but no process group exists, "
            "so it would see only its own value. Call it inside `with ad.distributed():`."
        )
    return 1


def _comm_device() -> torch.device:
    """Where the default group's backend wants tensors: this rank's GPU for NCCL/XCCL
    (the one rule, :func:`anydevice.hardware.backends.collective_device`)."""
    from anydevice.hardware.backends import collective_device

    return collective_device()


def _gather_tensors(t: torch.Tensor, size: int) -> list[torch.Tensor]:
    t = t.detach()
    meta: list[Any] = [None] * size
    dist.all_gather_object(meta, (tuple(t.shape), t.dtype))
    shapes = [m[0] for m in meta]
    dtypes = {m[1] for m in meta}
    ragged = len(set(shapes)) > 1
    if len(dtypes) > 1 or (ragged and (t.dim() == 0 or len({(len(s), s[1:]) for s in shapes}) > 1)):
        raise DistributedError(
            "all_gather: tensors must share their dtype and all but the first dimension; "
            f"ranks have shapes {shapes} and dtypes {[str(m[1]) for m in meta]}."
        )
    dev = _comm_device()
    longest = max(s[0] for s in shapes) if ragged else None
    buf = t.to(dev)
    if longest is not None and t.shape[0] < longest:
        pad = torch.zeros((longest - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=dev)
        buf = torch.cat([buf, pad])
    out = [torch.empty_like(buf) for _ in range(size)]
    dist.all_gather(out, buf.contiguous())
    return [o[: s[0]].to(t.device) for o, s in zip(out, shapes, strict=True)]


def _real_samples(loader: object, size: int) -> int:
    if isinstance(loader, int) and not isinstance(loader, bool):
        return loader
    sampler = loader.sampler if isinstance(loader, (DataLoader, DeviceLoader)) else loader
    if isinstance(sampler, DistributedSampler):
        if sampler.num_replicas != size:
            raise DistributedError(
                f"gather_for_metrics: the loader's DistributedSampler splits over "
                f"{sampler.num_replicas} ranks, but the world has {size}."
            )
        return len(sampler.dataset)  # type: ignore[arg-type]
    if loader is None:
        raise DistributedError(
            f"gather_for_metrics over {size} ranks needs the loader the outputs came from "
            "(or the number of real samples), to drop the DistributedSampler's padding: "
            "ad.gather_for_metrics(x, loader)."
        )
    raise DistributedError(
        f"gather_for_metrics: the loader's sampler is a {type(sampler).__name__}, not a "
        "DistributedSampler, so which samples are padding is unknown. Prepare the loader "
        "with ad.prepare(), or pass the number of real samples."
    )


def _gather_samples(x: object, total: int, size: int) -> object:
    if isinstance(x, tuple):
        items = [_gather_samples(v, total, size) for v in x]
        return cast(Any, type(x))(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, Mapping):
        return type(x)({k: _gather_samples(v, total, size) for k, v in x.items()})  # type: ignore[call-arg]
    if isinstance(x, torch.Tensor):
        parts = _gather_tensors(x.reshape(1) if x.dim() == 0 else x, size)
        position = torch.cat([torch.arange(len(p)) * size + r for r, p in enumerate(parts)])
        order = torch.argsort(position)
        keep = order[position[order] < total]
        return torch.cat(parts)[keep.to(parts[0].device)]
    if isinstance(x, list):
        lists: list[Any] = [None] * size
        dist.all_gather_object(lists, x)
        placed = [(i * size + r, v) for r, part in enumerate(lists) for i, v in enumerate(part)]
        placed.sort(key=lambda pair: pair[0])
        return [item for p, item in placed if p < total]
    raise TypeError(
        f"gather_for_metrics takes a tensor, a list (one item per sample), or a tuple or "
        f"dict of those, not {type(x).__name__}."
    )
