"""What a process with the simulator does before it exits: autograd's device threads let
go of their last backward pass.

A backward pass of a simulated device's tensors runs on autograd's thread for that
device, which keeps its task until its next one. torch 2.13 puts a Python object (the
caller's ``contextvars`` context) in each task; freed on that thread while Python shuts
down, it needs the interpreter, which is gone: the process aborts ("terminate called
without an active exception", exit status 134), in about one run in three that ends
right after a backward pass. :func:`release_autograd_threads`, registered at exit by
:func:`anydevice.testing.enable`, gives each device thread a task of its own that holds
no Python object, which it can take only once it has let go of the one before.
"""

from __future__ import annotations

__all__ = ["release_autograd_threads"]


def release_autograd_threads(name: str) -> None:
    """Make autograd's thread of each ``name`` device let go of its last task."""
    import torch

    from anydevice.hardware.backends.torch_private import engine_backward

    for i in range(torch.accelerator.device_count()):
        x = torch.ones(1, device=torch.device(name, i), requires_grad=True)
        engine_backward((x * 1).sum())
