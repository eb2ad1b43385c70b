"""``simulate_cuda()``: a block of a process in which CUDA code runs on the simulator.

Entering enables the simulator (:func:`anydevice.testing.enable`) and then, for the
block only:

- maps ``torch.cuda`` (:mod:`~anydevice.testing.cuda.names`) and torch's other names that
  take ``"cuda"`` (:mod:`~anydevice.testing.cuda.mapped`);
- pushes :class:`~anydevice.testing.cuda.devices.CudaDevices` on this thread, and on each
  thread started during the block (``threading.Thread``), so device arguments and reads
  are mapped there too;
- lets anydevice see the simulated devices as ``cuda`` devices
  (:mod:`~anydevice.testing.cuda.backend`).

Leaving restores every name it replaced, pops the mode, and puts back the current device,
each device's current stream, the default device and the simulator's capacity, so a
process (a test session) goes on as before. Nothing of this happens on ``import``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from anydevice.testing.simulator import SimulatorError

if TYPE_CHECKING:
    import torch

__all__ = ["active", "simulate_cuda"]

_MISSING = object()
_KEEP: Any = object()  # a setting not given
_active: list[str] = []  # the simulator's name while a block runs


class _Patches:
    """Attributes replaced, in order, so that :meth:`restore` puts each back."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def __call__(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    def restore(self) -> None:
        while self._undo:
            owner, name, old = self._undo.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def active() -> str | None:
    """The simulator's name while a :func:`simulate_cuda` block runs, else None."""
    return _active[-1] if _active else None


@contextmanager
def simulate_cuda(
    devices: int = 1,
    *,
    name: str = "sim",
    bandwidth: Any = _KEEP,
    capacity: Any = _KEEP,
    races: Any = _KEEP,
) -> Iterator[torch.device]:
    """Run code written for CUDA on the simulated accelerator, unchanged, for a block.

    Inside, the process looks like a machine with ``devices`` CUDA GPUs:
    ``torch.cuda.is_available()`` is True, ``"cuda:k"`` and ``.cuda()`` place tensors on
    simulated GPU ``k``, ``torch.cuda``'s streams, events and memory counters are the
    simulator's, tensors read back ``cuda:k``, and ``ad.device()`` picks ``cuda:0``. What a
    GPU alone can run (NCCL, CUDA graphs, Triton, custom CUDA kernels) is refused at its
    first call with :class:`~anydevice.testing.cuda.NotSimulatedError`.

    >>> from anydevice.testing import simulate_cuda
    >>> with simulate_cuda():  # doctest: +SKIP
    ...     x = torch.ones(2).cuda()
    ...     print(x.device, x.is_cuda, torch.cuda.get_device_name())
    cuda:0 True anydevice simulated GPU

    Args:
        devices: how many simulated GPUs (fixed once the simulator is used in a process).
        name: the simulator's own device type (see :func:`anydevice.testing.enable`).
        bandwidth: the host-device link's speed (``"2GB/s"`` where not given and the
            simulator is not enabled yet; where it is, the speed stays as it is).
        capacity: each GPU's memory (None: the host's; where not given, as for
            ``bandwidth``).
        races: what a stream race does (``"raise"``, ``"warn"``, ``"off"``: see
            :func:`anydevice.testing.enable`; where not given, as for ``bandwidth``, so
            ``"raise"`` on a simulator this block enables).

    Yields:
        ``torch.device("cuda", 0)``.

    Raises:
        SimulatorError: a block is already running, or the simulator cannot be enabled
            with these settings; ``ExtensionError`` where it cannot be built.
    """
    import torch

    from anydevice.testing.simulator import enable

    if _active:
        raise SimulatorError(
            "simulate_cuda() is already running in this process; CUDA is simulated once "
            "per process at a time: leave the outer block first."
        )
    from anydevice.testing.simulator import enabled

    settings = {"bandwidth": bandwidth, "capacity": capacity, "races": races}
    if enabled() != name or any(v is not _KEEP for v in settings.values()):
        enable(name, devices=devices, **{k: v for k, v in settings.items() if v is not _KEEP})
    count = torch.accelerator.device_count()
    if count != devices:
        raise SimulatorError(
            f"the simulator already runs {count} device(s) in this process and cannot change "
            f"to devices={devices}; use devices={count}, or a fresh process."
        )
    state = _State(name)
    state.enter()  # restores what it changed, where it fails
    _active.append(name)
    try:
        yield torch.device("cuda", 0)
    finally:
        try:
            state.leave()
        finally:
            _active.pop()


class _State:
    """What one block changes, and what it restores."""

    def __init__(self, sim: str) -> None:
        self.sim = sim
        self.patches = _Patches()
        self.mode: Any = None
        self.before: dict[str, Any] = {}

    def enter(self) -> None:
        import torch

        from anydevice.testing import simulator
        from anydevice.testing.cuda import mapped, names
        from anydevice.testing.cuda.devices import CudaDevices
        from anydevice.testing.cuda.module import Simulated

        count = torch.accelerator.device_count()
        self.before = {
            "device": torch.accelerator.current_device_index(),
            "streams": [torch.accelerator.current_stream(i) for i in range(count)],
            "capacity": int(simulator._library().capacity()),
        }
        run = Simulated(self.sim)
        try:
            names.install(self.patches, run)
            mapped.install(self.patches, run)
            self._threads()
            self._backends()
            self.mode = CudaDevices(self.sim)
            self.mode.__enter__()
        except BaseException:
            self.patches.restore()
            undo = getattr(self, "undo_backends", None)
            if undo is not None:
                undo.restore()
            raise

    def _threads(self) -> None:
        """Each thread started in the block runs with the mode pushed."""
        from anydevice.testing.cuda.devices import CudaDevices

        bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]
        sim = self.sim

        def _bootstrap_inner(thread: threading.Thread) -> None:
            with CudaDevices(sim):
                bootstrap(thread)

        self.patches(threading.Thread, "_bootstrap_inner", _bootstrap_inner)

    def _backends(self) -> None:
        from anydevice.hardware import backends, selection
        from anydevice.testing.cuda.backend import SimulatedCuda, WithoutSimulator

        stood_in = {
            "cuda": backends.stand_in("cuda", SimulatedCuda(self.sim)),
            "accelerator": backends.stand_in("accelerator", WithoutSimulator(self.sim)),
        }
        selection.forget_checked()

        class _Undo:
            def restore(self) -> None:
                for kind, before in stood_in.items():
                    backends.stand_in(kind, before)
                selection.forget_checked()

        self.undo_backends = _Undo()

    def leave(self) -> None:
        import torch

        from anydevice.hardware.backends.torch_private import default_device_context
        from anydevice.testing import simulator
        from anydevice.testing.cuda.devices import is_cuda_name

        try:
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
        finally:
            self.patches.restore()
            undo = getattr(self, "undo_backends", None)
            if undo is not None:
                undo.restore()
        if is_cuda_name(default_device_context()[0]):
            torch.set_default_device(None)  # set in the block: it named the simulated GPU
        for stream in self.before["streams"]:
            torch.accelerator.set_stream(stream)
        torch.accelerator.set_device_index(self.before["device"])
        simulator._library().set_capacity(self.before["capacity"])
