"""What ``save_state``'s extras may hold: checked at the call, copied for a background
save, read back by ``load_state``.

``torch.load(weights_only=True)``, which ``load_state`` uses so that a checkpoint never runs
code, reads tensors, numbers, strings, bytes, ``None`` and dict/list/tuple/set (with
``OrderedDict`` and ``Counter``), ``torch.Size``/``dtype``/``device``. Left at that, a
``Path``, a namedtuple or numpy's RNG state would be written and then refused at the
resume. ``save_state`` accepts, and ``load_state`` reads back, also:

* ``frozenset`` (a ``defaultdict`` is refused: torch's reader cannot fill one);
* ``pathlib`` paths; numpy arrays, scalars and dtypes (numeric: no object arrays), so
  ``np.random.get_state()`` too;
* namedtuples, dataclasses and enum members of classes defined at a module's top level.
  ``load_state`` allows such a class only where it is imported already (it never imports
  a module a file names) and is of one of those kinds, for that one load.

Anything else is refused at the call, naming the key and the type (:func:`prepare`), so
a checkpoint is never written that cannot be resumed. :func:`readable` is the other half:
it lists the classes a file names beyond torch's own (the pickle's ``GLOBAL`` records,
read without loading), allows the ones above for the load, and restores torch's list of
allowed globals exactly afterwards.

A background save copies what it is given (:func:`prepare` with ``copy=True``): every
container, every tensor (to host memory) and every numpy array, so the loop may change
them at once.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import enum
import importlib
import importlib.util
import pathlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from anydevice.errors import CheckpointError

__all__ = ["prepare", "readable"]

#: Leaves torch reads back as they are, copied by reference (immutable).
_PLAIN = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
)
_PATHS = (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)

#: Globals a file of accepted extras may name, beyond torch's own, by their pickled name.
_ALLOWED: dict[str, Any] = {
    "builtins.frozenset": frozenset,
    **{f"pathlib.{t.__name__}": t for t in _PATHS},
}

#: Where numpy's pickles name its reconstruction functions and types (numpy 1 and 2).
_NUMPY_MODULES = ("numpy", "numpy.core.multiarray", "numpy._core.multiarray")

_ACCEPTED = (
    "tensors, numbers, strings, bytes, None, dict/list/tuple/set/frozenset, namedtuples, "
    "dataclasses and enums defined at a module's top level, pathlib paths and numpy arrays"
)


def prepare(value: Any, key: str, *, call: str, copy: bool = False) -> Any:
    """``value`` checked for what :func:`readable` reads back, and copied where ``copy``.

    Args:
        value: an extra.
        key: its name, for the error (``"extra 'cfg'"``).
        call: the call, for the error (``"ad.save_state('ckpt')"``).
        copy: return a copy the caller may keep while the original changes: containers
            and numpy arrays copied, tensors copied to host memory.

    Raises:
        CheckpointError: something in ``value`` would not load back; the message names
            where (``cfg['opts'][2]``) and its type.
    """
    return _walk(value, key, call, copy)


def _walk(v: Any, where: str, call: str, dup: bool) -> Any:
    kind = type(v)
    if isinstance(v, torch.Tensor):
        if kind not in (torch.Tensor, torch.nn.Parameter):
            raise _refused(
                call, where, v, f"a {kind.__name__} (a tensor subclass: save a plain tensor)"
            )
        if not dup:
            return v
        out = v.detach().to("cpu", copy=True)
        return torch.nn.Parameter(out, v.requires_grad) if kind is torch.nn.Parameter else out
    if kind in _PLAIN or kind in _PATHS or kind is torch.Size:
        return v
    if kind is bytearray:
        return bytearray(v) if dup else v
    if kind in _MAPPINGS:
        for k in v:
            _walk(k, f"{where} key {k!r}", call, False)
        walked = {k: _walk(x, f"{where}[{k!r}]", call, dup) for k, x in v.items()}
        if not dup:
            return v
        return walked if kind is dict else kind(walked)
    if kind is collections.defaultdict:
        raise _refused(
            call, where, v, "a defaultdict, which torch's reader cannot fill: save dict(it)"
        )
    if kind in (list, tuple, set, frozenset):
        walked_items = [_walk(x, f"{where}[{i}]", call, dup) for i, x in enumerate(v)]
        return kind(walked_items) if dup else v
    if isinstance(v, tuple) and hasattr(kind, "_fields") and hasattr(kind, "_make"):
        _importable(call, where, v, "namedtuple")
        fields = [
            _walk(x, f"{where}.{f}", call, dup) for f, x in zip(kind._fields, v, strict=False)
        ]
        return kind._make(fields) if dup else v
    if isinstance(v, enum.Enum):
        _importable(call, where, v, "enum")
        return v
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _dataclass(v, where, call, dup)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(v, (numpy.ndarray, numpy.generic, numpy.dtype)):
        return _numpy(numpy, v, where, call, dup)
    raise _refused(call, where, v, _what(v))


def _dataclass(v: Any, where: str, call: str, dup: bool) -> Any:
    kind = type(v)
    _importable(call, where, v, "dataclass")
    getstate = getattr(kind, "__getstate__", None)
    reduces = (getattr(kind, "__reduce__", None), getattr(kind, "__reduce_ex__", None))
    own = reduces != (object.__reduce__, object.__reduce_ex__) or getattr(
        getstate, "__qualname__", ""
    ) not in ("object.__getstate__", "_dataclass_getstate")
    if own:
        raise _refused(
            call,
            where,
            v,
            f"a {kind.__qualname__}, a dataclass with its own __reduce__ or __getstate__",
        )
    names = list(getattr(v, "__dict__", {})) + [
        f.name for f in dataclasses.fields(v) if not hasattr(v, "__dict__")
    ]
    walked = {n: _walk(getattr(v, n), f"{where}.{n}", call, dup) for n in names}
    if not dup:
        return v
    out = copy.copy(v)
    for name, value in walked.items():
        object.__setattr__(out, name, value)  # frozen dataclasses too
    return out


def _numpy(numpy: Any, v: Any, where: str, call: str, dup: bool) -> Any:
    dtype = v if isinstance(v, numpy.dtype) else v.dtype
    if dtype.hasobject:
        raise _refused(call, where, v, "a numpy array of Python objects")
    if isinstance(v, numpy.ndarray):
        if type(v) is not numpy.ndarray:
            raise _refused(
                call,
                where,
                v,
                f"a {type(v).__name__} (an ndarray subclass: save numpy.asarray of it)",
            )
        return v.copy() if dup else v
    return v


def _importable(call: str, where: str, v: Any, kind_name: str) -> None:
    """A class ``load_state`` can find again: at the top level of its module, by name."""
    cls = type(v)
    if "<locals>" in cls.__qualname__ or _find(cls.__module__, cls.__qualname__) is not cls:
        raise CheckpointError(
            f"{call}: {where} is a {kind_name} of class {cls.__qualname__}, which load_state "
            f"could not find again (defined inside a function, or not reachable as "
            f"{cls.__module__}.{cls.__qualname__}). Define it at the top level of a module, "
            "or save its fields as a dict.",
        )


def _find(module: str, qualname: str) -> Any:
    """``module.qualname`` where ``module`` is imported already (never imports one)."""
    target: Any = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target


def _what(v: Any) -> str:
    name = f"{type(v).__module__}.{type(v).__qualname__}".removeprefix("builtins.")
    if hasattr(v, "state_dict"):
        return f"a {name} (save its state_dict() instead)"
    if type(v).__name__ in ("function", "builtin_function_or_method", "method"):
        return "a function"
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _refused(call: str, where: str, v: Any, what: str) -> CheckpointError:
    return CheckpointError(
        f"{call}: {where} is {what}, which load_state cannot read back. Extras may hold "
        f"{_ACCEPTED}. Save what restores it instead (its state_dict(), its fields as a "
        "dict), or leave it out."
    )


# ----------------------------------------------------------------------------- loading


@contextlib.contextmanager
def readable(file: Path, *, call: str) -> Iterator[None]:
    """Load ``file`` inside this block: the classes it names beyond torch's own are
    allowed for the block where they are of the kinds :func:`prepare` accepts.

    Raises:
        CheckpointError: the file names a class that is not imported here, or of another
            kind (it was not written by ``save_state``); the message names it.
    """
    from torch.serialization import (
        add_safe_globals,
        clear_safe_globals,
        get_safe_globals,
        get_unsafe_globals_in_checkpoint,
    )

    try:
        names = get_unsafe_globals_in_checkpoint(file)
    except Exception:  # a damaged file: the load that follows says what is wrong
        names = []
    allowed = [g for name in names for g in _resolve(name, file, call)]
    if not allowed:
        yield
        return
    before = get_safe_globals()
    add_safe_globals(allowed)
    try:
        yield
    finally:
        clear_safe_globals()
        add_safe_globals(before)


def _resolve(name: str, file: Path, call: str) -> list[Any]:
    """What allowing ``name`` takes, or the error that says why it is not allowed."""
    if name in _ALLOWED:
        return [_ALLOWED[name]]
    module, _, attr = name.rpartition(".")
    if module in _NUMPY_MODULES:
        found = _numpy_globals(module, attr)
        if found:
            return found
        if "numpy" not in sys.modules and importlib.util.find_spec("numpy") is None:
            raise CheckpointError(
                f"{call}: {file.name} holds numpy arrays ({name}), and numpy is not "
                "installed here: pip install numpy.",
                path=str(file),
            )
    else:
        cls = _find(module, attr)
        if cls is None and "." in module:  # a nested class: module.Outer.Inner
            outer_module, _, outer = module.rpartition(".")
            cls = _find(outer_module, f"{outer}.{attr}")
        if _accepted_class(cls):
            return [cls]
        if cls is None:
            raise CheckpointError(
                f"{call}: {file.name} holds a {name}, which is not defined in this process. "
                f"Import the module that defines it (or define {attr}) before load_state.",
                path=str(file),
            )
    raise CheckpointError(
        f"{call}: {file.name} names {name}, which is not among what save_state writes "
        f"({_ACCEPTED}): it was not written by ad.save_state. Load it with "
        "torch.load(weights_only=False) only if you trust where it came from.",
        path=str(file),
    )


def _accepted_class(cls: Any) -> bool:
    if not isinstance(cls, type):
        return False
    named = issubclass(cls, tuple) and hasattr(cls, "_fields") and hasattr(cls, "_make")
    return named or issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls)


def _numpy_globals(module: str, attr: str) -> list[Any]:
    """numpy's own reconstruction functions and types (numpy 1 and 2 name them apart).
    A dtype is rebuilt by ``numpy.dtype(...)`` and then given its state, so the class of
    each dtype (``numpy.dtypes.Float32DType``) is allowed with it."""
    if attr not in ("_reconstruct", "scalar", "ndarray", "dtype"):
        return []
    try:
        found = getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return []
    if found is None:
        return []
    if attr != "dtype":
        return [found]
    dtypes = getattr(importlib.import_module("numpy"), "dtypes", None)
    classes = [c for n, c in vars(dtypes).items() if n.endswith("DType")] if dtypes else []
    return [found, *classes]
