"""``ad.share(model)``: one set of parameters in shared memory, for Hogwild training.

Hogwild (Recht et al., 2011; pytorch/examples ``mnist_hogwild``) trains one model from
several CPU processes at once: each process computes gradients on its own batches and
applies them, without locks, to parameters that live in shared memory. On sparse or
small updates the races cost little and the processes add up.

The parameters and buffers go to shared memory (``Module.share_memory``); gradients must
not, or every process would add into the same ``.grad``: ``share`` drops any that exist,
and each process then allocates its own on its first ``backward``. Start the workers with
``torch.multiprocessing`` (``spawn`` or ``fork``) and pass them the model; give each its
own optimizer.
"""

from __future__ import annotations

from torch import nn

from anydevice.errors import DistributedError
from anydevice.hardware.backends import runtime

__all__ = ["share"]


def share(model: nn.Module) -> nn.Module:
    """Move ``model``'s parameters and buffers to shared memory, so that processes started
    from here with ``torch.multiprocessing`` all update the same ones. Returns ``model``.

    >>> import torch
    >>> m = share(torch.nn.Linear(3, 1))
    >>> all(p.is_shared() for p in m.parameters())
    True

    Raises:
        DistributedError: the model is not on the CPU (Hogwild shares host memory; for
            several GPUs use ``ad.launch`` with ``ad.prepare``, i.e. DDP).
    """
    tensors = (*model.parameters(), *model.buffers())
    places = sorted({str(t.device) for t in tensors})
    if not all(runtime(t.device.type).is_host for t in tensors):
        raise DistributedError(
            f"share() puts parameters in shared host memory, but the model is on "
            f"{', '.join(places)}. Keep it on the CPU for Hogwild (model.cpu()), or train on "
            "several GPUs with ad.launch and ad.prepare (DistributedDataParallel)."
        )
    for p in model.parameters():
        p.grad = None  # a shared .grad would be summed into by every process
    model.share_memory()
    return model
