"""Moving things to a device: :func:`to`.

:func:`to` is called once per batch in training loops, so it is built for that: the
device is resolved once per call, the walk dispatches on the exact type first (``dict``,
``list``, ``tuple``, ``Tensor``) and falls back to ``isinstance`` only for other types, and
a tensor already on the target is returned as it is, without calling ``Tensor.to``.
Containers are rebuilt, never mutated; leaves that need no move are the same objects.

Where things are, and which are on the wrong device: :mod:`anydevice.placement.mismatch`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import gc
import inspect
import types
from collections.abc import Collection, Mapping, MutableMapping, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from anydevice.errors import MoveError
from anydevice.hardware.selection import resolve
from anydevice.hardware.spec import DeviceLike

__all__ = ["ATOMIC", "MAX_DEPTH", "NonBlocking", "target_device", "to"]

T = TypeVar("T")

#: ``"auto"``, or an explicit ``True`` / ``False`` for every copy.
NonBlocking = bool | Literal["auto"]

Tensor = torch.Tensor
#: Leaves that are never looked into (exact types; subclasses take the slower path).
ATOMIC: frozenset[type] = frozenset(
    {str, bytes, bytearray, int, float, complex, bool, type(None), torch.device, torch.dtype,
     torch.Size, range, slice, type(Ellipsis)}
)  # fmt: skip
#: Containers nested deeper than this are refused with a MoveError: well inside Python's
#: default recursion limit (1000 frames, about three per level), and far deeper than a batch.
MAX_DEPTH = 200

#: A container at least this long pauses Python's cyclic garbage collector until the walk
#: ends. The walk allocates only what it returns (moved tensors, new containers), so a
#: collection during it frees nothing it made; yet with 10**6 leaves CPython's collector
#: would run ~1,400 young and several full collections over them, ~40% of a plain loop's
#: time (``benchmarks/bench_to.py``, ``to-1e6-tensors``).
GC_PAUSE_AT = 4096


class _AsyncTargets(dict[str, bool]):
    """Per device type: whether a copy to it can be asynchronous (the host returns before
    the copy ends), which its backend's streams order: CUDA, XPU, privateuse1 backends.
    Filled on first use of each type, so the walk's test stays one dict lookup."""

    def __missing__(self, kind: str) -> bool:
        from anydevice.hardware.backends import runtime

        answer = self[kind] = runtime(kind).has_streams
        return answer


_ASYNC_TARGETS = _AsyncTargets()
_EMPTY: frozenset[Any] = frozenset()
_NONE = object()
_TOO_DEEP = -1  #: _Failure.target for a structure nested deeper than MAX_DEPTH


# ----------------------------------------------------------------------------- the device


#: The device ``to`` moves to: :func:`anydevice.hardware.selection.resolve`, the one resolver.
target_device = resolve


# ----------------------------------------------------------------------------- to()


def to(
    obj: T,
    device: DeviceLike,
    non_blocking: NonBlocking = "auto",
    skip_keys: str | tuple[Any, ...] | frozenset[Any] | set[Any] | list[Any] = (),
) -> T:
    """Move the tensors in ``obj`` to ``device``; return an object of the same shape.

    >>> import torch, anydevice as ad
    >>> batch = {"x": torch.ones(2), "meta": ["id-1", 7], "labels": torch.zeros(2)}
    >>> out = ad.to(batch, "meta", skip_keys=("labels",))
    >>> out["x"].device, out["labels"] is batch["labels"], out["meta"] == batch["meta"]
    (device(type='meta'), True, True)

    What it moves:

    * tensors (a tensor already on ``device`` is returned as it is, shared);
    * ``nn.Module``: moved in place with ``Module.to``; the same module is returned;
    * optimizers: each state tensor (Adam's ``exp_avg``, ...) goes to the device of its
      parameter, as ``Optimizer.load_state_dict`` does; ``step`` stays where torch keeps it
      (the CPU, unless ``capturable`` or ``fused``). The parameters are the model's: move
      the model first. The same optimizer is returned;
    * any object whose class has a ``.to`` method (``PackedSequence``, a tokenizer's
      ``BatchEncoding``, ``TensorDict``, ...): its ``.to(device)`` is called, with
      ``non_blocking`` when it is explicit and the method takes it; a ``.to`` that
      returns ``None`` moved the object in place, and the object is returned;
    * containers, rebuilt with the same type: ``dict``, ``OrderedDict``, ``defaultdict``
      (same ``default_factory``), ``UserDict`` and other mappings, ``list``, ``tuple``,
      named tuples, ``deque`` (same ``maxlen``), ``UserList``, sets, and dataclasses (frozen
      and slotted ones too; rebuilt without running ``__init__`` or ``__post_init__``, so
      ``init=False`` fields are kept). Tuple subclasses and named tuples are rebuilt
      without calling their ``__new__`` (as ``_make`` does), and keep their extra
      attributes, whose tensors move too.

    Everything else is returned untouched: ``str``, ``bytes``, numbers, ``None``, numpy
    arrays, other objects. The caller's containers are never changed. A tensor that
    appears twice in ``obj`` is copied once, so the result shares it the same way.

    ``non_blocking="auto"`` makes a copy asynchronous only where nobody can tell: between
    accelerators (the copy is ordered on the devices' streams). Copies from the host stay
    blocking, pinned source or not, as ``Tensor.to`` does: an asynchronous copy from a
    pinned buffer reads it after ``to`` has returned, so writing the next batch into that
    buffer would change what the device receives. Copies to the CPU stay blocking, since a
    non-blocking device-to-host copy holds garbage until the stream is synchronised; MPS
    targets stay blocking (pytorch#83015). :class:`~anydevice.DeviceLoader` owns its pinned
    buffers and copies asynchronously. With ``non_blocking=True`` every copy is
    asynchronous: after a copy to the CPU, call ``torch.accelerator.synchronize()`` (or
    synchronise the stream) before reading the result; after one from pinned memory, do
    not write into the source until the copy is done (record an event after ``to`` and
    wait on it before refilling).

    In a hot loop, resolve the device once (``dev = ad.device()``) and pass the
    ``torch.device``: a spec string is checked against the machine on every call.

    Args:
        obj: what to move.
        device: any spec :func:`anydevice.device` accepts, or a ``torch.device``.
        non_blocking: ``"auto"``, ``True`` or ``False``.
        skip_keys: mapping keys, dataclass fields and named-tuple fields whose values stay
            where they are, at every level of nesting.

    Returns:
        ``obj`` with its tensors on ``device``: new containers, the same module/optimizer.

    Raises:
        MoveError: a custom ``.to`` raised (the original is the ``__cause__`` and the
            message names the path, as in ``obj['inputs'][2]``), the structure contains
            itself or is nested deeper than :data:`MAX_DEPTH`, a container cannot be
            rebuilt, or an optimizer's parameters are not on ``device``.
        DeviceNotFoundError, DeviceSpecError: ``device`` names no device here.

    Errors from ``Tensor.to`` itself (``torch.OutOfMemoryError``, ...) keep their type;
    a note names the path.
    """
    x: Any = obj
    if (
        type(x) is Tensor
        and type(device) is torch.device
        and non_blocking == "auto"
        and x.device == device
    ):
        return obj  # the commonest call of all: nothing to do
    if non_blocking.__class__ is not bool and non_blocking != "auto":
        raise ValueError(f"non_blocking must be 'auto', True or False, not {non_blocking!r}")
    dev = target_device(device)
    if type(x) is Tensor and non_blocking == "auto":  # one tensor
        src = x.device
        if src == dev:
            return obj
        return x.to(dev, non_blocking=_auto_non_blocking(src, x, dev.type))  # type: ignore[return-value]
    if isinstance(skip_keys, str):
        skip_keys = (skip_keys,)
    mover = _Mover(dev, non_blocking, frozenset(skip_keys) if skip_keys else _EMPTY)
    try:
        return mover.move(obj)  # type: ignore[no-any-return]
    except _Failure as e:
        raise _move_error(e, dev) from e.__cause__
    except Exception as e:
        if hasattr(e, "add_note"):  # Python 3.11+: keep the type, say where
            e.add_note(f"(anydevice.to: while moving {_path_of(e)[0]} to {dev})")
        raise
    finally:
        if mover.gc_paused:
            gc.enable()


def _auto_non_blocking(src: torch.device, t: Tensor, target_type: str) -> bool:
    if not _ASYNC_TARGETS[target_type]:
        return False  # to the CPU (garbage until synchronised), MPS, XLA, meta: blocking
    # From the host: blocking, pinned or not. The caller owns the source; an asynchronous
    # copy from a pinned buffer would read it after to() returned, so refilling the buffer
    # (the usual staging pattern) would change what the device gets. DeviceLoader owns its
    # buffers and copies asynchronously itself.
    return _ASYNC_TARGETS[src.type]


_PATH, _DEVICE = "\x00path\x00", "\x00device\x00"  # filled in once the path is known


class _Failure(Exception):
    """Internal: a failure that becomes a :class:`MoveError` once its path is known."""

    def __init__(self, message: str, target: int | None = None) -> None:
        super().__init__(message)
        self.target = target  #: id of the container a cycle refers back to


def _add_path(e: BaseException, part: str, container: object) -> None:
    parts: list[str] | None = getattr(e, "_anydevice_path", None)
    if parts is None:
        parts = []
        try:
            e._anydevice_path = parts  # type: ignore[attr-defined]
        except AttributeError:  # an exception type that refuses attributes: no path then
            return
    if isinstance(e, _Failure) and e.target == id(container):
        e._anydevice_target_depth = len(parts)  # type: ignore[attr-defined]
    parts.append(part)


def _path_of(e: BaseException) -> tuple[str, int | None]:
    parts: list[str] = getattr(e, "_anydevice_path", [])
    return "obj" + "".join(reversed(parts)), getattr(e, "_anydevice_target_depth", None)


def _move_error(e: _Failure, dev: torch.device) -> MoveError:
    path, target_depth = _path_of(e)
    if e.target == _TOO_DEEP:
        parts = list(reversed(getattr(e, "_anydevice_path", [])))
        shown = "obj" + "".join(parts[:4]) + "..." + "".join(parts[-4:])
        return MoveError(
            f"to(): {shown} is nested more than {MAX_DEPTH} containers deep, deeper than "
            "to() follows (Python's recursion limit would end it). Flatten the structure, "
            "or move the deep part in pieces.",
            path=path,
        )
    if e.target is not None:
        parts = list(reversed(getattr(e, "_anydevice_path", [])))
        inside = len(parts) if target_depth is None else target_depth + 1  # + its own key
        back_to = "obj" + "".join(parts[: len(parts) - inside])
        return MoveError(
            f"to(): {path} is {back_to} itself (the structure contains itself), so it "
            "cannot be copied. Break the cycle, or move its tensors one by one.",
            path=path,
        )
    return MoveError(str(e).replace(_PATH, path).replace(_DEVICE, str(dev)), path=path)


class _Mover:
    """One :func:`to` call: the resolved device, options, and the state of the walk."""

    __slots__ = (
        "active",
        "dev",
        "gc_paused",
        "keep",
        "leaf_nb",
        "memo",
        "nb",
        "nb_from",
        "skip",
        "target_type",
    )

    def __init__(self, dev: torch.device, nb: NonBlocking, skip: frozenset[Any]) -> None:
        self.dev = dev
        self.target_type = dev.type
        self.nb = nb
        # Tensor.to's non_blocking for every leaf; None: "auto", answered per source type
        self.leaf_nb: bool | None = (
            nb if nb != "auto" else (None if _ASYNC_TARGETS[self.target_type] else False)
        )
        self.skip = skip
        self.active: set[int] = set()  # ids of the containers on the current path
        self.memo: dict[int, Tensor] = {}  # moved tensors, by the id of their source
        # The sources in memo, alive until the walk ends so that no id is reused; a list,
        # not (source, moved) tuples: a million tuples make the cyclic GC run again and again.
        self.keep: list[Tensor] = []
        self.nb_from: dict[str, bool] | None = None  # "auto"'s answer per source device type
        self.gc_paused = False  # this walk disabled the cyclic GC (see GC_PAUSE_AT)

    # The walk: exact types first, since they are almost all a batch is made of.
    def move(self, obj: Any) -> Any:
        t = type(obj)
        if t is Tensor:
            return obj if obj.device == self.dev else self.tensor(obj)
        if t is dict:
            return self.dict(obj)
        if t is list:
            return self.list(obj)
        if t is tuple:
            return tuple(self.list(obj))
        if t in ATOMIC:
            return obj
        return self.other(obj, t)

    def tensor(self, x: Tensor, src: torch.device | None = None) -> Tensor:
        """``x`` on the target; ``src``: its device, where the caller has read it already
        (and found it is not the target). Per leaf of a million-tensor batch, so lean."""
        if src is None:
            src = x.device
            if src == self.dev:
                return x
        key = id(x)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        nb = self.leaf_nb
        if nb is None:  # "auto" to a device that copies asynchronously: by source type
            known = self.nb_from
            if known is None:
                known = self.nb_from = {}
            nb = known.get(src.type)
            if nb is None:
                nb = known[src.type] = _auto_non_blocking(src, x, self.target_type)
        # non_blocking=False is Tensor.to's default; passing it costs a keyword parse per leaf
        moved = x.to(self.dev, non_blocking=True) if nb else x.to(self.dev)
        self.memo[key] = moved
        self.keep.append(x)
        return moved

    def enter(self, obj: object) -> None:
        key = id(obj)
        active = self.active
        if key in active:
            raise _Failure("cycle", target=key)
        if len(active) >= MAX_DEPTH:
            raise _Failure("too deep", target=_TOO_DEEP)
        active.add(key)

    def pause_gc(self) -> None:
        """Pause the cyclic GC for the rest of a long walk; :func:`to` resumes it."""
        if not self.gc_paused and gc.isenabled():
            gc.disable()
            self.gc_paused = True

    def dict(self, obj: dict[Any, Any]) -> dict[Any, Any]:
        self.enter(obj)
        if len(obj) >= GC_PAUSE_AT:
            self.pause_gc()
        out = {}
        dev, skip, tensor, move = self.dev, self.skip, self.tensor, self.move
        k: Any = None
        try:
            for k, v in obj.items():
                if skip and k in skip:
                    out[k] = v
                elif type(v) is Tensor:
                    src = v.device
                    out[k] = v if src == dev else tensor(v, src)
                else:
                    out[k] = move(v)
        except Exception as e:
            _add_path(e, f"[{k!r}]", obj)
            raise
        self.active.discard(id(obj))
        return out

    def list(self, obj: Collection[Any]) -> list[Any]:
        self.enter(obj)
        if len(obj) >= GC_PAUSE_AT:
            self.pause_gc()
        dev, tensor, move = self.dev, self.tensor, self.move
        out: list[Any] = []
        append = out.append
        try:
            for v in obj:
                if type(v) is Tensor:
                    src = v.device
                    append(v if src == dev else tensor(v, src))
                else:
                    append(move(v))
        except Exception as e:
            _add_path(e, f"[{len(out)}]", obj)  # the item that failed
            raise
        self.active.discard(id(obj))
        return out

    def other(self, obj: Any, t: type) -> Any:
        if isinstance(obj, Tensor):  # nn.Parameter, FakeTensor, other subclasses
            return self.tensor(obj)
        if isinstance(obj, nn.Module):
            if self.nb == "auto":
                obj.to(self.dev)
            else:
                obj.to(self.dev, non_blocking=self.nb)
            return obj
        if isinstance(obj, torch.optim.Optimizer):
            return self.optimizer(obj)
        method = getattr(t, "to", None)
        if method is not None and callable(method) and not isinstance(obj, type):
            return self.custom(obj, t)
        if isinstance(obj, Mapping):
            return self.mapping(obj, t)
        if isinstance(obj, tuple):
            if hasattr(t, "_fields"):  # a named tuple
                return self.named_tuple(obj, t)
            return self.tuple_subclass(obj, t, self.list(obj))
        if isinstance(obj, list):
            new = copy.copy(obj)  # keeps the subclass and its attributes
            new[:] = self.list(obj)
            return new
        if isinstance(obj, collections.deque):
            queue = copy.copy(obj)  # keeps maxlen, the subclass and its attributes
            queue.clear()
            queue.extend(self.list(obj))
            return queue
        if isinstance(obj, collections.UserList):
            user = copy.copy(obj)
            user.data = self.list(obj.data)
            return user
        if isinstance(obj, (set, frozenset)):
            self.enter(obj)
            out = t(self.move(v) for v in obj)
            self.active.discard(id(obj))
            return out
        if hasattr(t, "__dataclass_fields__"):
            return self.dataclass(obj, t)
        return obj  # numpy arrays and every other object stay as they are

    def custom(self, obj: Any, t: type) -> Any:
        try:
            if self.nb != "auto" and _accepts_non_blocking(t):
                out = obj.to(self.dev, non_blocking=self.nb)
            else:
                out = obj.to(self.dev)
        except torch.OutOfMemoryError:
            raise  # keeps its type; the path is added as a note
        except Exception as e:
            raise _Failure(
                f"to(): the .to() of {t.__module__}.{t.__qualname__} at {_PATH} raised "
                f"{type(e).__name__}: {e}. The original error is the __cause__; fix that "
                "method, or pass the key in skip_keys to leave the object where it is."
            ) from e
        return obj if out is None else out

    def mapping(self, obj: Mapping[Any, Any], t: type) -> Any:
        self.enter(obj)
        skip = self.skip
        changed: list[tuple[Any, Any]] = []
        k: Any = None
        try:
            for k, v in obj.items():
                if skip and k in skip:
                    continue
                new = self.move(v)
                if new is not v:
                    changed.append((k, new))
        except Exception as e:
            _add_path(e, f"[{k!r}]", obj)
            raise
        self.active.discard(id(obj))
        if t is collections.OrderedDict or t is collections.defaultdict:
            out: Any = copy.copy(obj)  # keeps default_factory
            out.update(changed)
            return out
        if isinstance(obj, MutableMapping):
            out = copy.copy(obj)  # dict and UserDict subclasses keep type and attributes
            for k, v in changed:
                out[k] = v
            return out
        if t is types.MappingProxyType:
            return types.MappingProxyType({**obj, **dict(changed)})
        try:
            return t({**obj, **dict(changed)})
        except Exception as e:
            raise _Failure(
                f"to(): cannot rebuild the read-only mapping {t.__qualname__} at {_PATH} "
                f"({type(e).__name__}: {e}). Give the class a .to(device) method."
            ) from e

    def named_tuple(self, obj: tuple[Any, ...], t: type) -> Any:
        skip = self.skip
        if not skip:
            return self.tuple_subclass(obj, t, self.list(obj))
        self.enter(obj)
        items = list(obj)
        for i, name in enumerate(t._fields):  # type: ignore[attr-defined]
            if name not in skip:
                try:
                    items[i] = self.move(items[i])
                except Exception as e:
                    _add_path(e, f".{name}", obj)
                    raise
        self.active.discard(id(obj))
        return self.tuple_subclass(obj, t, items)

    def tuple_subclass(self, obj: tuple[Any, ...], t: type, items: Sequence[Any]) -> Any:
        """``items`` in a ``t`` (see :func:`_new_tuple`), with ``obj``'s extra attributes,
        whose tensors are moved too."""
        if not _has_dict(t):  # the commonest case: a plain named tuple
            return _new_tuple(t, items)
        state = list(getattr(obj, "__dict__", {}).items())
        if not state:
            return _new_tuple(t, items)
        self.enter(obj)
        skip = self.skip
        name = ""
        try:
            for i, (name, v) in enumerate(state):
                if not (skip and name in skip):
                    state[i] = (name, self.move(v))
        except Exception as e:
            _add_path(e, f".{name}", obj)
            raise
        self.active.discard(id(obj))
        out = _new_tuple(t, items)
        try:
            for name, v in state:
                object.__setattr__(out, name, v)
        except (AttributeError, TypeError) as e:
            raise _Failure(
                f"to(): cannot rebuild the {t.__qualname__} at {_PATH}: setting its attribute "
                f"{name!r} failed ({type(e).__name__}: {e}). Give the class a .to(device) "
                "method."
            ) from e
        return out

    def dataclass(self, obj: Any, t: type) -> Any:
        plan = _dataclass_plan(t)
        self.enter(obj)
        skip = self.skip
        state = obj.__dict__ if plan.plain else None
        changed: list[tuple[str, Any]] = []
        name = ""
        try:
            for name in plan.fields:
                if skip and name in skip:
                    continue
                v = state.get(name, _NONE) if state is not None else getattr(obj, name, _NONE)
                if v is _NONE:
                    continue  # an init=False field that was never set
                new = self.move(v)
                if new is not v:
                    changed.append((name, new))
        except Exception as e:
            _add_path(e, f".{name}", obj)
            raise
        self.active.discard(id(obj))
        if state is not None:  # no slots, no custom copy: rebuild without __init__
            out: Any = object.__new__(t)
            out.__dict__.update(state)
            out.__dict__.update(changed)
            return out
        out = copy.copy(obj)
        for name, v in changed:
            object.__setattr__(out, name, v)  # works on frozen dataclasses too
        return out

    def optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        elsewhere = [
            (g, i, p.device)
            for g, group in enumerate(opt.param_groups)
            for i, p in enumerate(group["params"])
            if p.device != self.dev
        ]
        if elsewhere:
            where = ", ".join(
                f"param_groups[{g}]['params'][{i}] on {d}" for g, i, d in elsewhere[:3]
            )
            more = f" and {len(elsewhere) - 3} more" if len(elsewhere) > 3 else ""
            raise _Failure(
                f"to(): {_PATH} is an optimizer whose parameters are not on {_DEVICE}: "
                f"{where}{more}. An optimizer's parameters are the model's: move the model "
                "first (ad.to(model, dev)), then the optimizer; its state follows its "
                "parameters."
            )
        for group in opt.param_groups:
            keep_step = not (group.get("capturable", False) or group.get("fused", False))
            for p in group["params"]:
                state = opt.state.get(p)
                if not state:
                    continue
                for key, value in list(state.items()):
                    if key == "step" and keep_step:
                        continue  # torch keeps it on the CPU (pytorch#74424)
                    if isinstance(value, Tensor):
                        src = value.device
                        if src != p.device:
                            nb = self.nb
                            if nb == "auto":
                                nb = _auto_non_blocking(src, value, p.device.type)
                            state[key] = value.to(p.device, non_blocking=nb)
                    else:
                        state[key] = to(value, p.device, non_blocking=self.nb)
        return opt


@dataclasses.dataclass(frozen=True)
class _Plan:
    fields: tuple[str, ...]
    plain: bool  #: state in __dict__ and default copying: rebuild through __dict__


@functools.lru_cache(maxsize=512)
def _dataclass_plan(cls: type) -> _Plan:
    names = tuple(f.name for f in dataclasses.fields(cls))
    custom = any(
        getattr(cls, m, None) is not getattr(object, m, None)
        for m in ("__copy__", "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__")
    )
    slotted = any("__slots__" in vars(k) for k in cls.__mro__[:-1])
    # mypy sees two unrelated callables; at run time a plain class inherits object's.
    plain = not custom and not slotted and cls.__new__ is object.__new__  # type: ignore[comparison-overlap]
    return _Plan(names, plain)


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


def _new_tuple(t: type, items: Sequence[Any]) -> Any:
    """A ``t`` holding ``items``, built with ``tuple.__new__`` as ``namedtuple._make`` does,
    so a ``__new__`` with its own signature is not called; a class defined in C
    (``torch.return_types.max``) refuses that and is called with the items instead."""
    if t.__flags__ & _HEAP_TYPE:
        return tuple.__new__(t, items)
    try:
        return t(items)
    except Exception as e:
        raise _Failure(
            f"to(): cannot rebuild the {t.__module__}.{t.__qualname__} at {_PATH}: "
            f"{t.__qualname__}(items) raised {type(e).__name__}: {e}. Give the class a "
            ".to(device) method, or pass its key in skip_keys."
        ) from e


@functools.lru_cache(maxsize=512)
def _has_dict(cls: type) -> bool:
    """Whether instances of a tuple subclass carry a ``__dict__`` (no ``__slots__ = ()``).

    Tuple subclasses cannot have other slots, so that is where extra attributes live."""
    return any("__dict__" in vars(k) for k in cls.__mro__)


@functools.lru_cache(maxsize=512)
def _accepts_non_blocking(cls: type) -> bool:
    """Whether ``cls.to`` takes ``non_blocking`` (read once per class, never by trial)."""
    try:
        params = inspect.signature(cls.to).parameters.values()  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # a builtin without a signature: do not guess
        return False
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == "non_blocking" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        for p in params
    )
