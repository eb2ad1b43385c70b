"""Counting the floating-point work of one call: :func:`flops` -> :class:`FlopCount`.

The counting is torch's own: ``torch.utils.flop_counter.FlopCounterMode`` with its
formulas, which count 2 FLOPs per multiply-add (fvcore counts 1, which halves every MFU
computed from it) for matmuls, convolutions and attention, forward and backward. On top of
it, :func:`flops` keeps what the counter does not show:

* the module tree with **forward and backward apart** (the counter adds them up),
* the **dtype** each FLOP ran in (bf16 under autocast, fp8 for fp8 matmuls, TF32 for fp32
  matmuls and convolutions on CUDA where torch's settings allow it: ``fast_matmul``,
  ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` or the legacy flags), so an MFU
  can be set against the right peak,
* the ops that ran and that the counter has **no formula for** although they plausibly do
  real math (a cuDNN RNN, a linear solve, an FFT, a custom op): counted as zero by torch,
  named here, so a total that is too low says so.

Elementwise ops, reductions and normalisations are not counted, by design (torch's choice
too): next to the matmuls of a real model they are a few percent of the FLOPs.

>>> import torch
>>> model = torch.nn.Linear(64, 32)
>>> count = flops(model, torch.randn(8, 64))
>>> count.total == 2 * 8 * 64 * 32, count.backward
(True, 0)
"""

from __future__ import annotations

import copy
import functools
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from anydevice.hardware.backends import facts
from anydevice.hardware.backends.base import META
from anydevice.hardware.backends.torch_private import TorchDispatchMode, overload_packet

__all__ = ["FlopCount", "ModuleFlops", "flops"]

#: Op names that do real arithmetic, and that an op missing from the counter's registry
#: may be (matched on the op's name, without its namespace for aten ops).
_HEAVY = re.compile(
    r"mm|matmul|conv|linear|einsum|tensordot|\bdot\b|vdot|\bmv\b|addr|addmv|"
    r"rnn|lstm|gru|attention|attn|fft|linalg|cholesky|svd|\bqr\b|\blu|solve|inverse|"
    r"\bdet\b|eig|cdist|triangular|bilinear"
)
#: Namespaces of ops that move, communicate or record, and do no arithmetic of their own.
_NO_MATH = frozenset(
    {"prim", "prims", "profiler", "c10d", "_c10d_functional", "_c10d_functional_autograd"}
)
#: Op families whose fp32 work runs in TF32 when torch's matmul (cuBLAS) or conv (cuDNN)
#: setting says so (CUDA only).
_MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
_CONV_OPS = frozenset({"convolution", "_convolution", "cudnn_convolution", "convolution_backward"})
_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


@dataclass(frozen=True)
class ModuleFlops:
    """FLOPs counted inside one module (its submodules included), forward and backward."""

    name: str  #: dotted path from the root module's class name, e.g. ``"GPT.blocks.0.attn"``
    forward: int
    backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward

    @property
    def depth(self) -> int:
        """0 for a root module, 1 for its children, ..."""
        return self.name.count(".")


@dataclass(frozen=True, repr=False)
class FlopCount:
    """The FLOPs of one call, where they were spent, and what could not be counted.

    ``total`` is ``forward + backward`` (2 FLOPs per multiply-add). ``modules`` is the
    module tree in call order, each node with its own forward and backward FLOPs (a parent's
    include its children's). ``by_dtype`` splits the total by the precision the math ran
    in (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ...), ``by_op`` by op.
    ``unsupported`` names ops that ran, have no formula in torch's counter and plausibly do
    arithmetic: their FLOPs are missing from every number here.

    >>> c = FlopCount(forward=100, backward=200, by_dtype={"bf16": 300})
    >>> c.total, c.dtype
    (300, 'bf16')
    """

    forward: int
    backward: int = 0
    modules: tuple[ModuleFlops, ...] = ()
    by_op: Mapping[str, int] = field(default_factory=dict)
    by_dtype: Mapping[str, int] = field(default_factory=dict)
    unsupported: tuple[str, ...] = ()
    device: str = "cpu"  #: where the counted call ran ("meta": nothing ran)
    notes: tuple[str, ...] = ()  #: where the split below differs from torch's total

    @property
    def total(self) -> int:
        """Forward plus backward FLOPs."""
        return self.forward + self.backward

    @property
    def dtype(self) -> str | None:
        """The precision most of the FLOPs ran in, the one an MFU is set against."""
        if not self.by_dtype:
            return None
        return max(self.by_dtype.items(), key=lambda kv: kv[1])[0]

    def module(self, name: str) -> ModuleFlops:
        """The counts of the module with this dotted name.

        Raises:
            KeyError: no module of that name ran (the message lists those that did).
        """
        for m in self.modules:
            if m.name == name:
                return m
        known = ", ".join(m.name for m in self.modules) or "none"
        raise KeyError(f"no module named {name!r} was counted; modules counted: {known}")

    @property
    def warnings(self) -> tuple[str, ...]:
        """What makes this count too low, for people."""
        if not self.unsupported:
            return self.notes
        return (
            f"{len(self.unsupported)} op(s) that do arithmetic have no FLOP formula in "
            f"torch's counter and count as zero: {', '.join(self.unsupported)}. The total "
            "is low by their work.",
            *self.notes,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain types for JSON."""
        return {
            "total": self.total,
            "forward": self.forward,
            "backward": self.backward,
            "dtype": self.dtype,
            "device": self.device,
            "modules": [
                {"name": m.name, "forward": m.forward, "backward": m.backward} for m in self.modules
            ],
            "by_op": dict(self.by_op),
            "by_dtype": dict(self.by_dtype),
            "unsupported": list(self.unsupported),
        }

    def __repr__(self) -> str:
        dtypes = ", ".join(f"{k} {_si(v)}" for k, v in self.by_dtype.items())
        lines = [
            f"FlopCount({self.device}: {_si(self.total, 'FLOP')} = forward {_si(self.forward)} + "
            f"backward {_si(self.backward)}" + (f"; {dtypes}" if dtypes else "") + ")"
        ]
        if self.modules:
            width = max(len(m.name) + 2 * m.depth for m in self.modules)
            lines.append(f"  {'module'.ljust(width)}  {'forward':>9}  {'backward':>9}  share")
            for m in self.modules:
                share = m.total / self.total if self.total else 0.0
                label = ("  " * m.depth + m.name).ljust(width)
                lines.append(f"  {label}  {_si(m.forward):>9}  {_si(m.backward):>9}  {share:6.1%}")
        lines += [f"  WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)


def _si(n: float, unit: str = "") -> str:
    """``1.29e6`` -> ``"1.29 M"`` (``"1.29 MFLOP"`` with a unit)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


# ----------------------------------------------------------------------------- flops()


def flops(fn: Callable[..., object], *args: Any, meta: bool = False, **kwargs: Any) -> FlopCount:
    """Count the FLOPs of one call ``fn(*args, **kwargs)``, per module, forward and backward.

    The call runs once for real (its side effects happen: a ``fn`` that steps an optimizer
    steps it), under torch's ``FlopCounterMode``. A ``fn`` that calls ``backward()`` is
    counted with its backward; a forward-only ``fn`` has ``backward == 0``. Autocast and
    :func:`~anydevice.numerics.matmul.fast_matmul` set around the call, or inside ``fn``, decide the
    dtype recorded for each FLOP.

    With ``meta=True`` nothing runs on a real device: tensors among the arguments become
    meta tensors of the same shape and dtype, and modules among ``fn`` and the arguments are
    counted through a structural copy whose parameters and buffers are meta tensors (no
    data is copied, and the originals are not touched). A model that ``fn`` reaches only
    through a closure cannot be swapped: build it under ``with torch.device("meta"):``, or
    pass it as an argument. Some kernels choose their algorithm from the device (attention
    backends), so a meta count can differ slightly from the count on the real device.

    Linear layer: 2 FLOPs per multiply-add, ``2 * batch * in * out`` forward, twice that
    backward (the gradients of the input and of the weight).

    >>> import torch
    >>> layer = torch.nn.Linear(128, 64)
    >>> x = torch.randn(4, 128, requires_grad=True)
    >>> c = flops(lambda: layer(x).sum().backward())
    >>> c.forward == 2 * 4 * 128 * 64, c.backward == 2 * c.forward
    (True, True)
    >>> flops(layer, x, meta=True).total == c.forward
    True

    Args:
        fn: the function, or a module, to count; ``args`` and ``kwargs`` are passed to it.
        meta: count on the meta device, running nothing (see above).

    Returns:
        A :class:`FlopCount`.
    """
    from torch.utils.flop_counter import FlopCounterMode

    if meta:
        fn, args, kwargs = _to_meta((fn, args, kwargs))
    counter = FlopCounterMode(display=False, custom_mapping=_cpu_attention())
    recorder = _Recorder(counter)
    with recorder, counter:
        fn(*args, **kwargs)
    phases = recorder.counts
    forward = phases["Global"][0]
    backward = phases["Global"][1]
    notes: tuple[str, ...] = ()
    if forward + backward != counter.get_total_flops():  # the formulas are the counter's own
        notes = (  # ops the counter handles itself: torch.cond's branches, triton kernels
            f"FlopCounterMode's own total is {counter.get_total_flops()} FLOPs (control flow or "
            "triton kernels it counts its own way); the split here is of the ops that ran.",
        )
    modules = tuple(
        ModuleFlops(name, *phases[name]) for name in _tree_order(phases) if name != "Global"
    )
    return FlopCount(
        forward=forward,
        backward=backward,
        modules=modules,
        by_op=dict(sorted(recorder.by_op.items(), key=lambda kv: -kv[1])),
        by_dtype=dict(sorted(recorder.by_dtype.items(), key=lambda kv: -kv[1])),
        unsupported=tuple(sorted(recorder.unsupported)),
        device=META.name if meta else recorder.device,
        notes=notes,
    )


def _tree_order(names: Mapping[str, object]) -> list[str]:
    """Dotted names, each parent before its children and siblings in the order first seen."""
    seen = {name: i for i, name in enumerate(names)}

    def path(name: str) -> tuple[int, ...]:
        parts = name.split(".")
        return tuple(seen.get(".".join(parts[: i + 1]), -1) for i in range(len(parts)))

    return sorted(names, key=path)


def _cpu_attention() -> dict[Any, Any]:
    """Formulas for the CPU's fused attention kernels, which torch's counter lacks (it
    counts them as zero): torch's own attention formulas, as for the CUDA kernels."""
    aten = torch.ops.aten
    mapping: dict[Any, Any] = {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _attention_forward),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _attention_backward),
    ):
        op = getattr(aten, name, None)
        if op is not None:
            mapping[op] = formula
    return mapping


def _attention_forward(
    query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any
) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


def _attention_backward(
    grad_out_shape: Any,
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    **kwargs: Any,
) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return int(sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape))


class _Recorder(TorchDispatchMode):
    """Sees every op the counter runs (it is entered first, so it sits below the counter on
    the mode stack) and splits the counter's formulas by phase, module and dtype.

    Only public attributes of ``FlopCounterMode`` are read: ``flop_registry`` (its formulas)
    and ``mod_tracker`` (a ``ModuleTracker``: ``parents`` and ``is_bw``).
    """

    def __init__(self, counter: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.counter = counter
        self.counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.counts["Global"]  # first, so the tree keeps call order below it
        self.by_op: dict[str, int] = defaultdict(int)
        self.by_dtype: dict[str, int] = defaultdict(int)
        self.unsupported: set[str] = set()
        self.device = "cpu"

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = overload_packet(func)
        formula = self.counter.flop_registry.get(packet)
        if formula is None:
            name = str(getattr(func, "name", lambda: func)())
            if _heavy(name) and not getattr(func, "is_view", False):
                self.unsupported.add(name.split(".")[0])
            return out
        n = int(formula(*args, **kwargs, out_val=out))
        if n == 0:
            return out
        tracker = self.counter.mod_tracker
        phase = 1 if tracker.is_bw else 0
        for parent in set(tracker.parents):
            self.counts[parent][phase] += n
        op = str(packet).removeprefix("aten.")
        self.by_op[op] += n
        first = next(_tensors((args, kwargs)), None)
        if first is not None:
            self.device = first.device.type if first.device.index is None else str(first.device)
            self.by_dtype[self._dtype(op, first)] += n
        return out

    def _dtype(self, op: str, tensor: torch.Tensor) -> str:
        dtype = tensor.dtype
        if dtype == torch.float32 and facts(tensor.device.type).tf32 and _tf32(op):
            return "tf32"
        if dtype.is_floating_point and dtype.itemsize == 1:
            return "fp8"
        return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _tf32(op: str) -> bool:
    """Whether an fp32 ``op`` on CUDA runs in TF32 now: the value torch resolves at the
    ``matmul`` leaf (cuBLAS) or the ``conv`` leaf (cuDNN) of its fp32 math settings,
    whichever API set them. Read when the op runs (a ``fn`` may turn TF32 on inside), and
    read only: nothing is written."""
    from anydevice.numerics.matmul import MathSettings

    if op in _MATMUL_OPS:
        return MathSettings.capture().precision("matmul") == "tf32"
    if op in _CONV_OPS:
        return MathSettings.capture().precision("conv") == "tf32"
    return False


def _heavy(name: str) -> bool:
    """Whether an op's name says it does real arithmetic (``aten::`` prefix removed)."""
    namespace, _, short = name.partition("::")
    if not short:
        namespace, short = "aten", namespace
    if namespace in _NO_MATH:
        return False
    if namespace != "aten":
        return True  # a custom op: unknown work, worth naming
    op = short.split(".")[0]
    return bool(_HEAVY.search(op)) and "convert" not in op


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    """The tensors of nested tuples, lists and dicts, depth first."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point():
            yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _to_meta(tree: Any) -> Any:
    """A copy of ``tree`` with every tensor, and every module's parameters and buffers, on
    the meta device: one deep copy whose memo maps each tensor to its meta twin, so module
    structure is copied and tensor data never is."""
    memo: dict[int, Any] = {}
    for tensor in _all_tensors(tree):
        if id(tensor) in memo:
            continue
        twin = torch.empty_like(tensor, device=META.name)
        if isinstance(tensor, torch.nn.Parameter):
            twin = torch.nn.Parameter(twin, requires_grad=tensor.requires_grad)
        else:
            twin.requires_grad_(tensor.requires_grad)
        memo[id(tensor)] = twin
    return copy.deepcopy(tree, memo)


def _all_tensors(tree: object, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    seen = set() if seen is None else seen
    if id(tree) in seen:
        return
    seen.add(id(tree))
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, torch.nn.Module):
        yield from tree.parameters()
        yield from tree.buffers()
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _all_tensors(item, seen)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _all_tensors(item, seen)
    elif isinstance(tree, functools.partial):
        yield from _all_tensors((tree.func, tree.args, tree.keywords), seen)
