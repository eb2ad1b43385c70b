"""CUDA's device names on the simulated devices: ``"cuda:k"`` in, ``cuda:k`` read back.

:class:`CudaDevices` is a ``TorchFunctionMode``: every call into torch's Python API passes
through it, so it sees each device argument and each read of a tensor's device.

- **In.** A device argument that names CUDA (``"cuda"``, ``"cuda:1"``,
  ``torch.device("cuda", 1)``), positional or keyword, names the simulator's device with
  the same index instead (``"sim:1"``; a bare ``"cuda"`` stays the *current* device);
  ``Tensor.cuda(k)`` is ``Tensor.to("sim:k")``; a factory call under
  ``torch.set_default_device("cuda")`` or ``with torch.device("cuda"):`` gets the simulated
  device.
- **Out.** ``tensor.device`` of a tensor on the simulated device reads ``cuda:k``,
  ``tensor.is_cuda`` is True, ``tensor.type()`` says ``torch.cuda.FloatTensor``, and a
  tensor's repr says ``device='cuda:k'``: the branches a program takes on a GPU are taken.

``torch.device("cuda")`` itself stays a CUDA device (``device.type == "cuda"`` holds in
user code): it is mapped where it is used. What a mode cannot reach, and why: objects
made in C keep the simulator's
name (``torch.accelerator.current_stream().device``, a storage's ``.device``); torch
disables a mode while it handles a call, so code that torch runs *inside* a call
(``Tensor.backward``'s custom ``Function.backward`` and tensor hooks, run on autograd's
threads) sees the simulator's names; threads started during the run get the mode (see
:mod:`anydevice.testing.cuda.run`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from anydevice.hardware.backends.torch_private import default_device_context
from anydevice.testing.cuda.refused import refuse

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["CUDA", "CudaDevices", "is_cuda_name", "to_cuda", "to_sim"]

CUDA = "cuda"
_PREFIX = CUDA + ":"


def is_cuda_name(value: object) -> bool:
    """Whether ``value`` is a device string or ``torch.device`` that names CUDA."""
    if type(value) is str:
        return value == CUDA or value.startswith(_PREFIX)
    return type(value) is torch.device and value.type == CUDA


def to_sim(value: Any, sim: str) -> Any:
    """``value`` with a CUDA device name replaced by the simulator's (``"cuda:1"`` ->
    ``"sim:1"``, ``torch.device("cuda")`` -> ``torch.device("sim")``); anything else as it is.

    >>> to_sim("cuda:1", "sim"), to_sim("cuda", "sim"), to_sim("cpu", "sim")
    ('sim:1', 'sim', 'cpu')
    """
    if type(value) is str:
        if value == CUDA:
            return sim
        if value.startswith(_PREFIX):
            return sim + value[len(CUDA) :]
        return value
    if type(value) is torch.device and value.type == CUDA:
        return torch.device(sim, value.index)
    return value


def to_cuda(device: torch.device, sim: str) -> torch.device:
    """A simulated device as CUDA's (``sim:1`` -> ``cuda:1``); any other device as it is."""
    return torch.device(CUDA, device.index) if device.type == sim else device


def _getter(name: str) -> object:
    return torch._C.TensorBase.__dict__[name]


_DEVICE = _getter("device")
_IS_CUDA = _getter("is_cuda")
_ARRAY_INTERFACE = torch.Tensor.__dict__["__cuda_array_interface__"]


class CudaDevices(TorchFunctionMode):
    """Maps CUDA's device names to the simulator's ``sim`` in every torch call, and the
    simulated devices back to CUDA's where user code reads them (see the module)."""

    def __init__(self, sim: str) -> None:
        super().__init__()
        self.sim = sim
        self._repr_from = f"device='{sim}:"
        self._type_from = f"torch.{sim}."
        self._constructors = default_device_context()[1]
        self._methods: dict[Any, Callable[..., Any]] = {
            torch.Tensor.cuda: self._cuda,
            torch.Tensor.type: self._type,
            torch.Tensor.__repr__: self._text,
            torch.Tensor.__str__: self._text,
            torch.Tensor.__format__: self._text,
        }
        self._getters: dict[Any, Callable[..., Any]] = {
            _DEVICE: self._device,
            _IS_CUDA: self._is_cuda,
        }

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        getter = self._getters.get(owner) if owner is not None else None
        if getter is not None:
            return getter(func, args)
        if owner is _ARRAY_INTERFACE:
            refuse(
                "Tensor.__cuda_array_interface__",
                "other libraries (CuPy, Numba) would read the simulator's memory as a GPU's",
            )
        method = self._methods.get(func)
        if method is not None:
            return method(func, args, kwargs)
        if func is torch.device:  # a device stays what it names; it is mapped where used
            return func(*args, **kwargs)
        sim = self.sim
        if any(is_cuda_name(a) for a in args):
            args = tuple(to_sim(a, sim) for a in args)
        device = kwargs.get("device")
        if device is not None:
            if is_cuda_name(device):
                kwargs = {**kwargs, "device": to_sim(device, sim)}
        elif func in self._constructors:
            default = default_device_context()[0]
            if is_cuda_name(default):
                kwargs = {**kwargs, "device": to_sim(default, sim)}
        return func(*args, **kwargs)

    # Reads of a tensor's device.
    def _device(self, func: Any, args: tuple[Any, ...]) -> Any:
        device = func(*args)
        return torch.device(CUDA, device.index) if device.type == self.sim else device

    def _is_cuda(self, func: Any, args: tuple[Any, ...]) -> bool:
        return bool(func(*args)) or args[0].device.type == self.sim

    def _text(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        text = func(*args, **kwargs)
        if isinstance(text, str):
            return text.replace(self._repr_from, "device='cuda:")
        return text

    def _type(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        wanted = args[1] if len(args) > 1 else kwargs.get("dtype")
        if wanted is None:
            text = func(*args, **kwargs)
            if isinstance(text, str) and text.startswith(self._type_from):
                return "torch.cuda." + text[len(self._type_from) :]
            return text
        if "cuda" in str(getattr(wanted, "__name__", wanted)):
            refuse(
                f"Tensor.type({wanted!r})",
                "legacy tensor types such as torch.cuda.FloatTensor are not simulated",
                "Write tensor.to('cuda', torch.float32) (or the dtype you need).",
            )
        return func(*args, **kwargs)

    # Tensor.cuda(device=None, non_blocking=False, memory_format=torch.preserve_format)
    def _cuda(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tensor, *rest = args
        options = dict(zip(("device", "non_blocking", "memory_format"), rest, strict=False))
        options.update(kwargs)
        device = options.pop("device", None)
        if device is None or (isinstance(device, int) and device < 0):
            target = torch.device(self.sim)
        elif isinstance(device, int) and not isinstance(device, bool):
            target = torch.device(self.sim, device)
        else:
            target = torch.device(to_sim(device, self.sim))
            if target.type != self.sim:
                raise ValueError(f"Invalid device, must be cuda device, not {device!r}")
        return tensor.to(target, **options)
