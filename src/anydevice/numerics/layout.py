"""Memory layout: :func:`channels_last` converts a model's convolutions where NHWC pays.

The rule (:func:`channels_last_pays`) is a pure function of a
:class:`~anydevice.hardware.facts.DeviceInfo`:

* CUDA with Tensor Cores (compute capability >= 7.0): yes. cuDNN's Tensor Core convolutions
  work in NHWC; NCHW costs a transpose around each one. PyTorch's memory-format tutorial
  reports 8-35% on Volta under AMP, and the tuning guide pairs channels_last with AMP. On
  7.x the gain needs fp16 autocast, which :func:`anydevice.numerics.precision` picks there; from 8.0
  TF32 and bf16 run on Tensor Cores as well.
* CPU: yes. oneDNN's convolutions are fastest in NHWC (the tutorial: 26-76% on Ice Lake).
* XPU: yes (oneDNN as well).
* CUDA before 7.0, MPS, XLA and anything unknown: no. Without Tensor Cores nothing is
  gained; MPS converts to NCHW for its kernels; XLA chooses layouts itself.

Only models with 2-D or 3-D convolutions change; ``anydevice doctor`` measures the effect.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import torch
from torch import nn

from anydevice.hardware.facts import DeviceInfo
from anydevice.hardware.selection import describe, device as selection_device
from anydevice.hardware.spec import DeviceLike

__all__ = ["channels_last", "channels_last_pays"]

logger = logging.getLogger("anydevice")

M = TypeVar("M", bound=nn.Module)

_CONV2D = (nn.Conv2d, nn.ConvTranspose2d)
_CONV3D = (nn.Conv3d, nn.ConvTranspose3d)


def channels_last_pays(info: DeviceInfo) -> tuple[bool, str]:
    """Whether channels_last convolutions pay on this device, and why (pure).

    >>> from anydevice.hardware.facts import DeviceInfo
    >>> channels_last_pays(DeviceInfo(kind="mps", index=0, name="Apple M2 GPU"))[0]
    False
    """
    from anydevice.hardware.backends import runtime

    return runtime(info.kind).channels_last_pays(info)


def channels_last(model: M, device: DeviceLike | DeviceInfo | None = None) -> M:
    """Convert ``model``'s convolution weights to channels_last where it pays; return it.

    2-D convolutions get ``torch.channels_last``, 3-D ones ``torch.channels_last_3d``
    (``model.to(memory_format=...)``, torch's own conversion). Models without them, and
    devices where it does not pay (see :func:`channels_last_pays`), are left as they are.
    The model is the same object, converted in place. Inputs may stay NCHW: the first
    convolution's output follows its weight's layout. The decision is logged on the
    ``anydevice`` logger.

    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3))
    >>> channels_last(net, "cpu") is net
    True
    >>> net[0].weight.is_contiguous(memory_format=torch.channels_last)
    True

    Args:
        model: the user's module.
        device: where it runs (default: where its first parameter or buffer is).

    Returns:
        ``model`` itself.
    """
    convs2d = [m for m in model.modules() if isinstance(m, _CONV2D)]
    convs3d = [m for m in model.modules() if isinstance(m, _CONV3D)]
    if not convs2d and not convs3d:
        logger.debug("channels_last: %s has no 2-D or 3-D convolution; left as is.", _name(model))
        return model
    pays, why = channels_last_pays(_info(model, device))
    if not pays:
        logger.info("channels_last: %s left as is: %s.", _name(model), why)
        return model
    if not convs3d:
        _to_format(model, torch.channels_last)
    elif not convs2d:
        _to_format(model, torch.channels_last_3d)
    else:  # both kinds: each conv its own format (a model-wide .to() refuses 5-D tensors)
        for conv2d in convs2d:
            _to_format(conv2d, torch.channels_last)
        for conv3d in convs3d:
            _to_format(conv3d, torch.channels_last_3d)
    logger.info(
        "channels_last: converted %d convolution(s) of %s: %s.",
        len(convs2d) + len(convs3d),
        _name(model),
        why,
    )
    return model


def _to_format(module: nn.Module, memory_format: torch.memory_format) -> None:
    # torch's own conversion of 4-D (5-D) parameters and buffers; its stubs omit the keyword.
    module.to(memory_format=memory_format)  # type: ignore[call-overload]


def _name(model: nn.Module) -> str:
    return type(model).__name__


def _info(model: nn.Module, device: DeviceLike | DeviceInfo | None) -> DeviceInfo:
    if isinstance(device, DeviceInfo):
        return device
    if device is None:
        tensor: torch.Tensor | None = next(model.parameters(), None)
        if tensor is None:
            tensor = next(model.buffers(), None)
        device = tensor.device if tensor is not None else torch.device("cpu")
    target = device if isinstance(device, torch.device) else selection_device(device)
    from anydevice.hardware.backends import runtime

    if not runtime(target.type).policies_need_facts:  # the kind alone: no hardware lookup
        return DeviceInfo(kind=target.type, index=target.index, name=target.type.upper())
    return describe(target, telemetry=False)
