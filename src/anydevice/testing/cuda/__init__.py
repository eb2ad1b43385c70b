"""Programs written for CUDA, run unchanged on the simulated accelerator.

``python -m anydevice.testing train.py`` (and the ``sim_cuda`` pytest fixture, and
:func:`simulate_cuda`) run code as it would run on a machine with CUDA GPUs, on the
simulator: ``torch.cuda``, ``"cuda"`` device names, ``.cuda()``, autocast and
``GradScaler("cuda")``, checkpoints with ``map_location="cuda"``, and anydevice itself all
land on the simulated devices, which read back as CUDA's. What only a GPU can run is
refused by name at its first call (:class:`NotSimulatedError`).

Modules:

- ``anydevice.testing.cuda.run``: :func:`simulate_cuda`, the block that maps and restores.
- ``anydevice.testing.cuda.devices``: the ``TorchFunctionMode`` that maps device names in
  torch calls and tensors' devices read back.
- ``anydevice.testing.cuda.module``: what each mapped ``torch.cuda`` name does (streams,
  events, memory, device facts, random numbers).
- ``anydevice.testing.cuda.names``: every public ``torch.cuda`` name, mapped, refused or
  not applicable (the table in ``docs/testing.md``).
- ``anydevice.testing.cuda.mapped``: torch's names beyond ``torch.cuda`` (checkpoints,
  autocast, ``torch.accelerator``, ``torch.cuda.comm``; refused: NCCL, ``torch.compile``'s
  GPU backend, CUDA extensions).
- ``anydevice.testing.cuda.backend``: anydevice's backend for the simulated ``cuda`` kind.
- ``anydevice.testing.cuda.refused``: :class:`NotSimulatedError` and the refusals.
"""

from __future__ import annotations

from anydevice.testing.cuda.refused import NotSimulatedError
from anydevice.testing.cuda.run import active, simulate_cuda

__all__ = ["NotSimulatedError", "active", "simulate_cuda"]
