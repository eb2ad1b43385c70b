"""Fully sharded data parallelism: torch's FSDP2 (``fully_shard``) as ``ad.prepare`` applies it.

Each rank keeps ``1/N`` of every parameter, gradient and optimizer state and gathers a
block's full parameters only while that block runs (forward and backward), so a model and
its optimizer that do not fit on one device fit on ``N``. ``prepare(..., strategy="fsdp")``:

1. picks the blocks — by default the children of the model's largest ``nn.ModuleList`` or
   ``nn.Sequential`` (a transformer's layers), or what ``shard=`` names;
2. calls ``fully_shard`` on each block that has parameters, then on the root, over a
   one-dimensional ``DeviceMesh`` of the whole world. Sharding blocks first is what lets
   FSDP2 free each block's gathered parameters after it ran and overlap the next block's
   all-gather with this one's compute;
3. sets the mixed-precision policy from :func:`anydevice.numerics.precision`: parameters gathered
   in bf16 (or fp16) where the device computes in it natively, gradients reduced in fp32;
   fp32 elsewhere (a CPU without native bf16 would emulate it, much more slowly);
4. points the optimizer at the sharded parameters.

``fully_shard`` changes the module in place (its class becomes ``FSDP<Name>``, its
parameters ``DTensor``\\ s): the model that comes back is the user's own object.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from anydevice.errors import DistributedError
from anydevice.hardware.backends import runtime
from anydevice.numerics.precision import Precision, precision

__all__ = ["ShardSpec", "blocks", "fully_shard_model", "mixed_precision", "swap_parameters"]

logger = logging.getLogger("anydevice")

#: What ``shard=`` accepts: a predicate on modules, a module class, or a tuple of classes.
ShardSpec = Callable[[nn.Module], bool] | type[nn.Module] | tuple[type[nn.Module], ...]


def blocks(model: nn.Module, shard: ShardSpec | None = None) -> list[nn.Module]:
    """The submodules to shard one by one before the root, innermost first.

    By default the children of the model's largest ``nn.ModuleList`` or ``nn.Sequential``
    (by parameter count), skipping those without parameters; with ``shard=``, every
    submodule (the root excluded) that is an instance of the class(es) or for which the
    predicate is true.

    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> [type(b).__name__ for b in blocks(net)]
    ['Linear', 'Linear']
    >>> len(blocks(net, shard=lambda m: isinstance(m, nn.ReLU)))
    1
    """
    if shard is None:
        containers = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
        if not containers:
            return []
        largest = max(containers, key=_numel)  # the first of equals: the outermost
        return [c for c in largest.children() if _numel(c) > 0]
    if isinstance(shard, (type, tuple)):
        classes = shard
        test: Callable[[nn.Module], bool] = lambda m: isinstance(m, classes)  # noqa: E731
    elif callable(shard):
        test = shard
    else:
        raise TypeError(
            f"shard={shard!r}: pass a module class, a tuple of classes, or a function "
            "module -> bool."
        )
    found = [m for m in model.modules() if m is not model and test(m)]
    return found[::-1]  # modules() is pre-order: reversed, children come before parents


def mixed_precision(mode: Precision | str, device: torch.device) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a precision mode on ``device``.

    bf16 and fp16 gather parameters (and run the forward) in that dtype and reduce
    gradients in fp32, so the sharded fp32 master weights are updated from full-precision
    sums; fp32 changes nothing.

    >>> mixed_precision("fp32", torch.device("cpu")).param_dtype is None
    True
    >>> mixed_precision("bf16", torch.device("cpu")).param_dtype
    torch.bfloat16
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = mode if isinstance(mode, Precision) else precision(device, mode)
    if p.mode == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=p.dtype, reduce_dtype=torch.float32)


def fully_shard_model(
    model: nn.Module,
    device: torch.device,
    world_size: int,
    *,
    shard: ShardSpec | None = None,
    mode: Precision | str = "auto",
    cpu_offload: bool = False,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """``fully_shard`` each block of ``model``, then the model, over the whole world.

    ``fsdp_kwargs`` go to torch's ``fully_shard`` (``reshard_after_forward``, ``mesh``,
    ``mp_policy``, ``offload_policy``); ``mp_policy`` and ``offload_policy`` given there
    win over ``mode`` and ``cpu_offload``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    if isinstance(model, FSDPModule):
        return model
    if "mesh" not in fsdp_kwargs:
        fsdp_kwargs["mesh"] = init_device_mesh(device.type, (world_size,))
    fsdp_kwargs.setdefault("mp_policy", mixed_precision(mode, device))
    if cpu_offload:
        # Pinned host memory needs an accelerator; on the CPU the parameters are already
        # in host memory and offloading only keeps the code path the same.
        fsdp_kwargs.setdefault(
            "offload_policy", CPUOffloadPolicy(pin_memory=not runtime(device.type).is_host)
        )
    parts = blocks(model, shard)
    for block in parts:
        fully_shard(block, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    logger.info(
        "prepare: fully_shard on %d block(s) and the root over %d ranks (%s)",
        len(parts),
        world_size,
        fsdp_kwargs["mp_policy"],
    )
    return model


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): its name}``, taken before sharding replaces the parameters."""
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def swap_parameters(
    optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module
) -> None:
    """Point ``optimizer``'s param groups at ``model``'s (now sharded) parameters, by name.

    The groups, their order and hyper-parameters stay; the optimizer object stays the
    same, so an LR scheduler made on it keeps working. State cannot follow (it has the
    full shapes), so an optimizer that has already stepped is refused.
    """
    if any(optimizer.state.values()):
        raise DistributedError(
            f"The {type(optimizer).__name__} already has state (it has stepped), which "
            "cannot be moved onto sharded parameters. Create the optimizer before training, "
            "pass it to ad.prepare, then restore its state with ad.load_state."
        )
    now = dict(model.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        group["params"] = [now[names[id(p)]] for p in group["params"]]
    optimizer.state.clear()


def build_optimizer(
    factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], model: nn.Module
) -> torch.optim.Optimizer:
    """``factory(model.parameters())``, checked to be an optimizer."""
    built = factory(model.parameters())
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(
            f"The optimizer factory returned a {type(built).__name__}, not a "
            "torch.optim.Optimizer. Pass e.g. functools.partial(torch.optim.AdamW, lr=1e-3)."
        )
    return built


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
