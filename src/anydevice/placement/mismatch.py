"""Where tensors are, and which are on the wrong device.

:func:`device_of` and :func:`devices_of` say where a model, optimizer or batch lives.
:func:`check_devices` and :func:`diagnose` answer torch's "Expected all tensors to be on
the same device" with a short report: parameters and buffers grouped by module path (a
subtree entirely on one device collapses to ``model.encoder.*``), each input by its path,
each with its device::

    model.encoder.* on cuda:0 (124 tensors); model.head.weight on cpu; input batch['mask'] on cpu

:func:`diagnose` also names the module method that failed and the devices of the tensors
it held. It reads them from the error's traceback, only once an error has happened: the
innermost frame whose ``self`` is an ``nn.Module`` is the failing module, and that frame's
locals are its arguments and intermediate tensors at the moment of failure. Nothing is
hooked, so a block under :func:`diagnose` runs exactly as fast as without it. (Forward
hooks on every submodule were measured first: registering and removing them cost ~17 us
per submodule on each entry, and torch.compile would recompile on them.)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType, TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from anydevice.errors import DeviceMismatchError, NoTensorError
from anydevice.hardware import backends
from anydevice.hardware.backends import runtime
from anydevice.placement.move import ATOMIC

Tensor = torch.Tensor

__all__ = [
    "check_devices",
    "device_of",
    "devices_of",
    "diagnose",
    "is_device_mismatch",
    "mps_fallback_advice",
    "report",
    "tensors",
    "walk",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The wordings torch uses for a device mismatch (torch 2.13; older ones kept).
_MISMATCH = re.compile(
    "|".join(
        [
            r"Expected all tensors to be on the same device",  # TensorIterator, codegen checks
            r"is not on the expected device",  # prims: "Tensor on device cpu is not on the ..."
            r"\b(?:to|must|need to) (?:all )?be on the same device",  # linalg, stft, optimizers...
            r"is on CPU, but expected (?:it|them) to be on GPU",  # checkAllSameGPU
            r"to have the same device as tensor for argument",  # checkSameGPU
            r"indices should be either on cpu or on the same device",  # advanced indexing
            r"tensors are not at the same device",  # RNNs
            r"(?:have|has) (?:the )?same device type",  # SDPA, bucketize, cdist
            r"Expected object of device type",  # older releases
        ]
    )
)
_TYPE_PAIR = re.compile(
    r"Input type \(([^)]*)\) and (?:weight|bias) type \(([^)]*)\) should be the same"
)
_LINE_CAP = 12
_PLAIN = " (a plain tensor attribute: Module.to() does not move it; use register_buffer)"


def is_device_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's error for tensors on different devices.

    Several wordings exist ("Expected all tensors to be on the same device", "Input type
    (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same", "...
    is on CPU, but expected it to be on GPU", "indices should be either on cpu or on the
    same device as the indexed tensor", ...). A dtype mismatch is not a device mismatch.

    >>> is_device_mismatch(RuntimeError("Input type (torch.cuda.FloatTensor) and weight "
    ...     "type (torch.FloatTensor) should be the same"))
    True
    >>> is_device_mismatch(RuntimeError("Input type (torch.cuda.HalfTensor) and weight "
    ...     "type (torch.cuda.FloatTensor) should be the same"))
    False
    """
    if not isinstance(exc, (RuntimeError, ValueError)) or isinstance(exc, DeviceMismatchError):
        return False
    text = str(exc)
    if _MISMATCH.search(text):
        return True
    pair = _TYPE_PAIR.search(text)
    return pair is not None and _device_word(pair.group(1)) != _device_word(pair.group(2))


def _device_word(type_name: str) -> str:
    """The device kind a legacy tensor type name names (``torch.cuda.FloatTensor``: cuda),
    the host's where it names none (``torch.FloatTensor``)."""
    low = type_name.lower()
    for kind in (*(k.name for k in backends.kinds()), *backends.generic_kinds()):
        if kind in low:
            return kind
    return backends.host().name


# ----------------------------------------------------------------------------- where


def tensors(obj: object, root: str = "obj") -> Iterator[tuple[str, Tensor]]:
    """Every tensor in ``obj`` with its path, in the order :func:`to` visits them.

    >>> [p for p, _ in tensors({"x": torch.ones(1), "y": [torch.ones(1)]}, "batch")]
    ["batch['x']", "batch['y'][0]"]
    """
    for parts, t in walk(obj):
        yield root + "".join(parts), t


def walk(obj: object) -> Iterator[tuple[tuple[str, ...], Tensor]]:
    """Every tensor in ``obj`` with its path as parts (``("['x']", "[0]")``).

    A module yields its parameters and buffers (``.encoder``, ``.weight``); an optimizer
    its parameters and their state (not the ``step`` counters, which torch keeps on the
    CPU); a ``PackedSequence`` its data and indices (``batch_sizes`` lives on the CPU by
    design). Containers seen twice are visited once; other objects are not looked into.
    """
    yield from _walk(obj, (), set())


def _walk(
    obj: object, path: tuple[str, ...], seen: set[int]
) -> Iterator[tuple[tuple[str, ...], Tensor]]:
    if isinstance(obj, Tensor):
        yield path, obj
        return
    if type(obj) in ATOMIC or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        for name, t in (*obj.named_parameters(), *obj.named_buffers()):
            yield (*path, *("." + part for part in name.split("."))), t
    elif isinstance(obj, torch.optim.Optimizer):
        for g, group in enumerate(obj.param_groups):
            for i, p in enumerate(group["params"]):
                at = (*path, f".param_groups[{g}]['params'][{i}]")
                yield at, p
                for key, value in obj.state.get(p, {}).items():
                    if key != "step":
                        yield from _walk(value, (*at, f".state[{key!r}]"), seen)
    elif isinstance(obj, nn.utils.rnn.PackedSequence):
        yield (*path, ".data"), obj.data
        for name in ("sorted_indices", "unsorted_indices"):
            t = getattr(obj, name)
            if t is not None:
                yield (*path, "." + name), t
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _walk(v, (*path, f"[{k!r}]"), seen)
    elif isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        for name, v in zip(type(obj)._fields, obj, strict=True):  # type: ignore[attr-defined]
            yield from _walk(v, (*path, "." + name), seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, (*path, f"[{i}]"), seen)
    elif isinstance(obj, (set, frozenset)):
        for v in obj:
            yield from _walk(v, (*path, "{...}"), seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name, None), (*path, "." + f.name), seen)


def devices_of(obj: object) -> dict[torch.device, int]:
    """Every device ``obj``'s tensors are on, with how many tensors, most first.

    The variant of :func:`device_of` that does not insist on one device. An empty dict
    means no tensor.

    >>> devices_of({"x": torch.ones(1), "y": torch.ones(1, device="meta")})
    {device(type='cpu'): 1, device(type='meta'): 1}
    """
    counts: collections.Counter[torch.device] = collections.Counter(
        t.device for _, t in tensors(obj)
    )
    return dict(counts.most_common())


def device_of(obj: object) -> torch.device:
    """The one device a model (its parameters and buffers), a batch or a tensor is on.

    >>> device_of(torch.nn.Linear(2, 2))
    device(type='cpu')
    >>> device_of({"x": torch.ones(1), "y": [torch.ones(1)]})
    device(type='cpu')

    Objects are looked into as :func:`to` moves them; every tensor is looked at. For all
    devices with their counts, use :func:`devices_of`.

    Raises:
        DeviceMismatchError: the tensors are on several devices; the message lists which
            are where (the report of :func:`anydevice.check_devices`).
        NoTensorError: ``obj`` holds no tensor (a model with no parameter or buffer, a
            batch of strings).
    """
    if isinstance(obj, Tensor):
        return obj.device
    found = devices_of(obj)
    if len(found) == 1:
        return next(iter(found))
    if not found:
        raise NoTensorError(
            f"device_of(): the {type(obj).__name__} holds no tensor, so it is on no device "
            "(a model needs a parameter or buffer; a batch needs a tensor)."
        )
    name = "model" if isinstance(obj, nn.Module) else "obj"
    raise report([(name, obj)], f"device_of(): the {type(obj).__name__} is on {len(found)} devices")


# ----------------------------------------------------------------------------- the report


class _Node:
    __slots__ = ("children", "count", "devices", "note")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.devices: collections.Counter[torch.device] = collections.Counter()
        self.count = 0
        self.note = ""


class _Survey:
    """Tensors by label (``model``, ``input batch``) and path, grouped for the report."""

    def __init__(self) -> None:
        self.roots: list[tuple[str, bool, _Node]] = []

    def _insert(self, root: _Node, parts: Iterable[str], dev: torch.device, note: str) -> None:
        node = root
        node.devices[dev] += 1
        node.count += 1
        for part in parts:
            node = node.children.setdefault(part, _Node())
            node.devices[dev] += 1
            node.count += 1
        node.note = note

    def add_model(self, model: nn.Module, label: str = "model", recurse: bool = True) -> None:
        root = _Node()
        for name, t in (
            *model.named_parameters(recurse=recurse),
            *model.named_buffers(recurse=recurse),
        ):
            self._insert(root, _dotted(name), t.device, "")
        modules = model.named_modules() if recurse else [("", model)]
        for prefix, module in modules:
            for attr, value in vars(module).items():
                if isinstance(value, torch.Tensor):
                    parts = [*_dotted(prefix), "." + attr] if prefix else ["." + attr]
                    self._insert(root, parts, value.device, _PLAIN)
        if root.count:
            self.roots.append((label, True, root))

    def add(self, label: str, obj: object) -> None:
        if isinstance(obj, nn.Module):
            self.add_model(obj, label)
            return
        root = _Node()
        for parts, t in walk(obj):
            self._insert(root, parts, t.device, "")
        if root.count:
            self.roots.append((label, False, root))

    def devices(self) -> dict[torch.device, int]:
        total: collections.Counter[torch.device] = collections.Counter()
        for _, _, root in self.roots:
            total.update(root.devices)
        return dict(total.most_common())

    def groups(self) -> list[tuple[str, torch.device, int, str]]:
        out: list[tuple[str, torch.device, int, str]] = []
        for label, is_model, root in self.roots:
            _collapse(root, label, is_model, out)
        return out

    def error(
        self,
        headline: str,
        extra: Iterable[str] = (),
        suggest_from: Mapping[torch.device, int] | None = None,
    ) -> DeviceMismatchError:
        devices = self.devices()
        groups = self.groups()
        lines = [f"{path} on {dev}{note}" for path, dev, _, note in groups[:_LINE_CAP]]
        if len(groups) > _LINE_CAP:
            lines.append(f"and {len(groups) - _LINE_CAP} more groups")
        where = ", ".join(f"{d} ({n} tensor{'s' if n != 1 else ''})" for d, n in devices.items())
        best = _suggest(devices if suggest_from is None else suggest_from)
        fix = (
            f'Move everything to {best}: ad.to(model, "{best}") moves a model in place; '
            f'batch = ad.to(batch, "{best}") moves a batch.'
        )
        message = "\n".join(
            [*extra, f"{headline}: {where}.", "; ".join(lines) + ".", fix]
            if lines and len(devices) > 1
            else [*extra, f"{headline}: {where}.", fix]
        )
        return DeviceMismatchError(
            message,
            devices=devices,
            groups=tuple((p, d, n) for p, d, n, _ in groups),
            suggested=best,
        )


def _dotted(name: str) -> list[str]:
    return ["." + part for part in name.split(".")] if name else []


def _collapse(
    node: _Node, prefix: str, is_model: bool, out: list[tuple[str, torch.device, int, str]]
) -> None:
    while node.count == 1 and node.children:  # one tensor: name it by its full path
        part, node = next(iter(node.children.items()))
        prefix += part
    if len(node.devices) == 1:
        dev = next(iter(node.devices))
        if not node.children:
            out.append((prefix, dev, node.count, node.note))
        elif is_model:
            out.append((f"{prefix}.*", dev, node.count, f" ({node.count} tensors)"))
        else:
            out.append((prefix, dev, node.count, f" ({node.count} tensors)"))
        return
    for part, child in node.children.items():
        _collapse(child, prefix + part, is_model, out)


def _suggest(devices: Mapping[torch.device, int]) -> torch.device:
    """The device to move everything to: the accelerator most tensors are on, else CPU."""

    def accelerator(dev: torch.device) -> bool:
        backend = runtime(dev.type)
        return backend.holds_data and not backend.is_host

    ranked = sorted(devices.items(), key=lambda kv: (not accelerator(kv[0]), -kv[1]))
    return ranked[0][0] if ranked else torch.device("cpu")


def report(objects: Iterable[tuple[str, object]], headline: str) -> DeviceMismatchError:
    """The :class:`DeviceMismatchError` for ``(label, object)`` pairs (not raised)."""
    survey = _Survey()
    for label, obj in objects:
        survey.add(label, obj)
    return survey.error(headline)


# ----------------------------------------------------------------------------- check_devices


def check_devices(model: nn.Module | None, *inputs: object, **named_inputs: object) -> torch.device:
    """The one device ``model`` and its inputs are on, or a report of which are where.

    >>> import torch, anydevice as ad
    >>> model = torch.nn.Linear(2, 2)
    >>> ad.check_devices(model, torch.ones(1, 2))
    device(type='cpu')
    >>> try:
    ...     ad.check_devices(model, batch={"x": torch.ones(1, 2, device="meta")})
    ... except ad.DeviceMismatchError as e:
    ...     print(e)  # doctest: +NORMALIZE_WHITESPACE
    Tensors that must share a device are on 2 devices: cpu (2 tensors), meta (1 tensor).
    model.* on cpu (2 tensors); input batch['x'] on meta.
    Move everything to cpu: ad.to(model, "cpu") moves a model in place;
    batch = ad.to(batch, "cpu") moves a batch.

    Parameters and buffers are grouped by module path: a subtree entirely on one device is
    one line (``model.encoder.* on cuda:0 (124 tensors)``). Plain tensor attributes of a
    module, which ``Module.to()`` does not move, are checked too and flagged.

    Args:
        model: the model, or ``None`` to check inputs only.
        inputs: batches, tensors, anything :func:`anydevice.to` can move; named
            ``args[0]``, ``args[1]``, ... in the report.
        named_inputs: the same, named by their keyword (``batch=batch``).

    Returns:
        The device everything is on.

    Raises:
        DeviceMismatchError: tensors on more than one device; its ``devices``, ``groups``
            and ``suggested`` attributes hold the report's facts.
        NoTensorError: there is no tensor at all.
    """
    survey = _Survey()
    if model is not None:
        survey.add_model(model)
    for i, x in enumerate(inputs):
        survey.add(f"input args[{i}]", x)
    for name, x in named_inputs.items():
        survey.add(f"input {name}", x)
    devices = survey.devices()
    if len(devices) == 1:
        return next(iter(devices))
    if not devices:
        raise NoTensorError("check_devices(): the model and the inputs hold no tensor.")
    raise survey.error(f"Tensors that must share a device are on {len(devices)} devices")


# ----------------------------------------------------------------------------- diagnose


class diagnose:
    """Turn torch's device-mismatch errors in a block into a report that names the tensors.

    >>> import torch, anydevice as ad
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> try:
    ...     with ad.diagnose(model):
    ...         model(torch.ones(1, 2, device="meta"))
    ... except ad.DeviceMismatchError as e:
    ...     print(e)  # doctest: +NORMALIZE_WHITESPACE
    Tensor on device cpu is not on the expected device meta!
    It failed in model.0 (Linear.forward): input on meta; model.0.* on cpu (2 tensors).
    The model is on 1 device: cpu (2 tensors).
    Move everything to cpu: ad.to(model, "cpu") moves a model in place;
    batch = ad.to(batch, "cpu") moves a batch.

    Use it as ``with ad.diagnose(model, batch=batch): ...`` or as a decorator,
    ``@ad.diagnose(model)``, where the decorated function's arguments are the inputs the
    report names. Only device mismatches are replaced (with :class:`DeviceMismatchError`,
    the original as ``__cause__``); an operator MPS does not implement gets
    :func:`mps_fallback_advice` (a ``NotImplementedError`` still, the original as
    ``__cause__``); every other exception passes through untouched.

    The report names the module method that failed and the devices of the tensors it held
    at that moment (its arguments and locals, and the module's own parameters and buffers),
    read from the error's traceback; when the error came from code outside any module (a
    loss, the training step), that code's tensors instead. Nothing is hooked or wrapped, so
    the block runs exactly as fast as without ``diagnose``, compiled models included.

    Args:
        model: the model whose parameters and buffers the report lists.
        inputs, named_inputs: inputs to list too (``args[0]``, or by keyword).

    Raises:
        DeviceMismatchError: the block raised torch's device-mismatch error.
    """

    def __init__(self, model: nn.Module, *inputs: object, **named_inputs: object) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"diagnose() takes an nn.Module, not {type(model).__name__}")
        self.model = model
        self.inputs = inputs
        self.named_inputs = named_inputs

    def __enter__(self) -> diagnose:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and is_device_mismatch(exc):
            raise self._error(exc, self._inputs()) from exc
        _raise_with_mps_advice(exc)

    def __call__(self, fn: F) -> F:
        try:
            signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if is_device_mismatch(e):
                    raise self._error(e, self._inputs(signature, args, kwargs)) from e
                _raise_with_mps_advice(e)
                raise

        return wrapper  # type: ignore[return-value]

    def _inputs(
        self,
        signature: inspect.Signature | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[tuple[str, object]]:
        named: list[tuple[str, object]] = [
            (f"input args[{i}]", x) for i, x in enumerate(self.inputs)
        ]
        named += [(f"input {k}", v) for k, v in self.named_inputs.items()]
        kwargs = kwargs or {}
        if signature is not None:
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = {}
            named += [(f"input {k}", v) for k, v in bound.items()]
        else:
            named += [(f"input args[{i}]", x) for i, x in enumerate(args)]
            named += [(f"input {k}", v) for k, v in kwargs.items()]
        return [(k, v) for k, v in named if not isinstance(v, nn.Module)]

    def _error(self, exc: BaseException, inputs: list[tuple[str, object]]) -> DeviceMismatchError:
        text = str(exc).strip()
        where, seen = _failed_in(exc, self.model)
        extra = [text.splitlines()[0][:400] if text else type(exc).__name__, where]
        survey = _Survey()
        survey.add_model(self.model)
        for label, obj in inputs:
            survey.add(label, obj)
        seen.update(survey.devices())
        n = len(survey.devices())
        what = "The model and the inputs are" if inputs else "The model is"
        headline = f"{what} on {n} device{'s' if n != 1 else ''}"
        return survey.error(headline, extra=extra, suggest_from=seen)


# ----------------------------------------------------------------------------- MPS

#: torch's wording for an operator without an MPS kernel (and no CPU fallback enabled).
_MPS_UNIMPLEMENTED = re.compile(
    r"operator '([^']+)' is not (?:currently )?implemented for the MPS device"
)


def mps_fallback_advice(exc: BaseException, environ: Mapping[str, str] | None = None) -> str | None:
    """What to do about an operator MPS does not implement; None for any other error.

    ``PYTORCH_ENABLE_MPS_FALLBACK=1`` runs such operators on the CPU, but torch reads it
    once, when it is imported: set in the script after ``import torch`` it does nothing.

    >>> e = NotImplementedError(
    ...     "The operator 'aten::_fft_r2c' is not currently implemented for the MPS device.")
    >>> print(mps_fallback_advice(e, {}).split(" (")[0])
    aten::_fft_r2c has no MPS kernel in this torch
    >>> mps_fallback_advice(NotImplementedError("abstract method"), {}) is None
    True
    """
    if not isinstance(exc, NotImplementedError):
        return None
    found = _MPS_UNIMPLEMENTED.search(str(exc))
    if found is None:
        return None
    env = os.environ if environ is None else environ
    already = env.get("PYTORCH_ENABLE_MPS_FALLBACK", "").strip()
    late = (
        f" PYTORCH_ENABLE_MPS_FALLBACK={already} is set in this process now, so it was set "
        "after torch was imported, too late to count."
        if already
        else ""
    )
    return (
        f"{found.group(1)} has no MPS kernel in this torch ({torch.__version__}).{late} To run "
        "the operators MPS lacks on the CPU (slower; the rest stays on MPS), set "
        "PYTORCH_ENABLE_MPS_FALLBACK=1 before torch is imported: in the shell "
        "(PYTORCH_ENABLE_MPS_FALLBACK=1 python train.py), or at the top of the script "
        "before `import torch`; setting os.environ after the import does nothing. Or run "
        "on the CPU: ad.device('cpu')."
    )


def _raise_with_mps_advice(exc: BaseException | None) -> None:
    """Raise ``exc`` again, as a NotImplementedError with :func:`mps_fallback_advice`
    added, when it is an operator MPS does not implement; otherwise return."""
    advice = None if exc is None else mps_fallback_advice(exc)
    if advice is not None:
        raise NotImplementedError(f"{str(exc).rstrip()}\n{advice}") from exc


def _frames(exc: BaseException) -> list[tuple[FrameType, int]]:
    """The frames of ``exc``'s traceback, outermost first, with the line each was on."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def _is_library(frame: FrameType) -> bool:
    name = frame.f_globals.get("__name__", "")
    return isinstance(name, str) and name.split(".")[0] in ("torch", "anydevice", "contextlib")


def _failed_in(
    exc: BaseException, model: nn.Module
) -> tuple[str, collections.Counter[torch.device]]:
    """Where ``exc`` was raised: the innermost module method on its traceback (else the
    innermost frame of the caller's code), with the devices of the tensors it held."""
    frames = _frames(exc)
    if not frames:
        return "Where it failed is unknown (the error carries no traceback).", collections.Counter()
    module_frame = next(
        (f for f, _ in reversed(frames) if isinstance(f.f_locals.get("self"), nn.Module)), None
    )
    survey = _Survey()
    module: nn.Module | None = None
    if module_frame is not None:
        module = module_frame.f_locals["self"]
        names = {id(m): name for name, m in model.named_modules()}
        name = names.get(id(module))
        label = "model" if name == "" else f"model.{name}" if name else type(module).__name__
        outside = "" if name is not None else ", which is not part of the model"
        place = f"{label} ({type(module).__name__}.{module_frame.f_code.co_name}{outside})"
        frame = module_frame
    else:
        frame, line = next(((f, n) for f, n in reversed(frames) if not _is_library(f)), frames[-1])
        place = (
            f"{frame.f_code.co_name}() at {frame.f_code.co_filename}:{line}, outside the "
            "model's modules"
        )
        label = ""
    top_level = frame.f_code.co_name == "<module>"  # its locals are a script's globals
    for key, value in frame.f_locals.items():
        if key == "self" or isinstance(value, nn.Module):
            continue
        if not top_level or isinstance(value, torch.Tensor):
            survey.add(key, value)
    if module is not None:
        survey.add_model(module, label, recurse=False)
    groups = survey.groups()
    held = "; ".join(f"{p} on {d}{note}" for p, d, _, note in groups[:_LINE_CAP])
    text = f"It failed in {place}: {held or 'it holds no tensor'}."
    devices = collections.Counter(survey.devices())
    if len(devices) <= 1:
        text += (
            " Everything it holds is on one device, so the other tensor was made inside the "
            "failing call (torch.zeros, arange, tensor, ... without device=x.device) or is "
            "kept where this report cannot see it (a list, another object)."
        )
    return text, devices
