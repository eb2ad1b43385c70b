"""fp32 matmul and convolution math: :func:`fast_matmul`, scoped and exactly restored.

torch keeps these settings twice. The legacy API (``torch.backends.cuda.matmul.allow_tf32``,
``torch.backends.cudnn.allow_tf32``, ``torch.set_float32_matmul_precision``) and, since
torch 2.9, a tree of ``fp32_precision`` values: ``torch.backends`` (generic), then per
backend (``cudnn`` = cuda, ``mkldnn``), then per op (``matmul``, ``conv``, ``rnn``). A
value of ``"none"`` inherits from the level above. The legacy getters check the two for
agreement and raise when they disagree (``"mix of the legacy and new APIs"``).

:class:`MathSettings` reads what is in force and writes nothing: each tree value as torch
resolves it (what cuBLAS and cuDNN read), and the legacy matmul getter's answer, or None
where it refuses. :func:`fast_matmul` sets both APIs, so code inside reads consistent values
whichever API it asks, and on exit restores what was there, including state the getters
do not show: which tree values are inherited rather than set, and the legacy values hidden
behind them. Finding that hidden state out moves settings for an instant, so only
:func:`fast_matmul` and :func:`strict_fp32` do it: they change the settings anyway.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from anydevice.errors import PrecisionError
from anydevice.hardware import backends
from anydevice.hardware.backends.torch_private import (
    cudnn_allow_tf32,
    fp32_precision,
    has_fp32_precision_tree,
    set_fp32_precision,
)

__all__ = ["MathSettings", "fast_matmul", "strict_fp32"]

Node = tuple[str, str]  #: (backend, op) in torch's fp32_precision tree
_GENERIC: Node = ("generic", "all")
#: The tree's backends, as the device kinds declare them (``Kind.math``): cuBLAS and cuDNN's
#: (``"cuda"``), oneDNN's (``"mkldnn"``).
_BACKENDS: tuple[str, ...] = tuple(k.math for k in backends.kinds() if k.math)
#: The backend of the kind whose fp32 math may run as TF32: the legacy cuDNN flag writes its
#: conv and RNN nodes, and :meth:`MathSettings.precision` answers for it unless asked.
_TF32: str = next(k.math for k in backends.kinds() if k.tf32 and k.math)
_PARENTS: tuple[Node, ...] = tuple((b, "all") for b in _BACKENDS)
_LEAVES: tuple[Node, ...] = tuple((b, op) for b in _BACKENDS for op in ("matmul", "conv", "rnn"))
_CUDNN: tuple[Node, ...] = ((_TF32, "conv"), (_TF32, "rnn"))
_MATMUL: tuple[Node, ...] = tuple((b, "matmul") for b in _BACKENDS)
#: How torch starts cuDNN conv and RNN: they inherit, and are "tf32" when nothing above is
#: set. No setter can put this state back, so it is never written, only left alone.
DEFAULT = "default"


@contextlib.contextmanager
def _legacy_on_purpose() -> Iterator[None]:
    """torch 2.9 to 2.12 warn once that the legacy TF32 API will be deprecated. Here it is
    used on purpose, to keep both APIs in agreement: the warning would only mislead."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "Please use the new API settings to control TF32", UserWarning
        )
        yield


def _has_tree() -> bool:
    return has_fp32_precision_tree()


def _get(node: Node) -> str:
    return fp32_precision(*node)


def _put(node: Node, value: str) -> None:
    set_fp32_precision(*node, value)


def _stored_parent(parent: Node, generic: str) -> str:
    """What ``parent`` stores, ``"none"`` when it inherits: move the root, see if it follows."""
    seen = _get(parent)
    probe = "tf32" if seen == "ieee" else "ieee"  # valid at every node
    _put(_GENERIC, probe)
    try:
        return "none" if _get(parent) == probe else seen
    finally:
        _put(_GENERIC, generic)


def _stored_leaf(leaf: Node, tree: dict[Node, str]) -> str:
    """What ``leaf`` stores: a value, ``"none"`` (inherits) or :data:`DEFAULT`.

    The getter resolves inheritance, so a value read at a leaf may be stored there or come
    from above. Moving the parent tells the two apart; clearing everything above then
    tells torch's initial cuDNN state (reads "tf32") from a plain "none". Only the
    parent and the root are written, and put back.
    """
    parent = (leaf[0], "all")
    seen = _get(leaf)
    probe = "tf32" if seen == "ieee" else "ieee"
    _put(parent, probe)
    try:
        if _get(leaf) != probe:
            return seen
        _put(parent, "none")
        _put(_GENERIC, "none")
        try:
            return DEFAULT if _get(leaf) == "tf32" else "none"
        finally:
            _put(_GENERIC, tree[_GENERIC])
    finally:
        _put(parent, tree[parent])


def _legacy_matmul(tree: dict[Node, str]) -> str:
    """The legacy matmul precision. Its getter refuses to answer when the matmul leaves
    contradict it; with both at "ieee" there is nothing to contradict."""
    try:
        for node in _MATMUL:
            _put(node, "ieee")
        return torch.get_float32_matmul_precision()
    finally:
        for node in _MATMUL:
            _put(node, tree[node])


def _legacy_cudnn(tree: dict[Node, str]) -> bool:
    """The legacy cuDNN flag. Its getter answers only when cuDNN conv and RNN agree with
    it: with both at "tf32" it answers True, or refuses when the flag is False. They are
    made "tf32" through their parent where they inherit, so DEFAULT is never written."""
    touched = [(_TF32, "all"), *(n for n in _CUDNN if tree[n] not in ("none", DEFAULT))]
    try:
        for node in touched:
            _put(node, "tf32")
        try:
            return cudnn_allow_tf32()
        except RuntimeError:  # "a mix of the legacy and new APIs": the flag is False
            return False
    finally:
        for node in touched:
            _put(node, tree[node])


@dataclass(frozen=True)
class MathSettings:
    """The fp32 math settings in force, as torch's getters show them. Reading writes nothing.

    ``precision(op)`` is what an fp32 op runs in: the value torch resolves at that leaf
    of its ``fp32_precision`` tree (``"none"`` inherits from the level above), which is
    what cuBLAS and cuDNN read; before torch 2.9, the legacy flags.

    >>> with fast_matmul():
    ...     s = MathSettings.capture()
    >>> s.precision("matmul"), s.precision("conv")
    ('tf32', 'tf32')
    >>> MathSettings.capture().precision("matmul")  # the block restored the settings
    'ieee'
    """

    #: legacy ``torch.get_float32_matmul_precision()``'s answer; None where torch refuses
    #: (the new API set a state the legacy one cannot name)
    matmul_precision: str | None
    #: whether cuDNN convolutions and RNNs both run in TF32, what the legacy
    #: ``torch.backends.cudnn.allow_tf32`` means; None where the two differ
    cudnn_tf32: bool | None
    #: every fp32_precision node as its getter resolves it, root first; empty before 2.9
    tree: tuple[tuple[Node, str], ...] = ()

    @classmethod
    def capture(cls) -> MathSettings:
        """Read the settings in force: the tree first, then the legacy matmul getter.

        Nothing is written, not even the warning filters: no getter read here warns (the
        legacy cuDNN getter does in torch 2.9 to 2.12, so its meaning is read off the tree).
        """
        if not _has_tree():  # torch < 2.9: only the legacy flags exist
            return cls(torch.get_float32_matmul_precision(), bool(torch.backends.cudnn.allow_tf32))
        tree = tuple((node, _get(node)) for node in (_GENERIC, *_PARENTS, *_LEAVES))
        cudnn = {dict(tree)[leaf] == "tf32" for leaf in _CUDNN}
        try:
            matmul: str | None = torch.get_float32_matmul_precision()
        except RuntimeError:  # "a mix of the legacy and new APIs": no legacy name for it
            matmul = None
        return cls(matmul, cudnn.pop() if len(cudnn) == 1 else None, tree)

    def precision(self, op: str = "matmul", backend: str | None = None) -> str:
        """What fp32 ``op`` (``"matmul"``, ``"conv"``, ``"rnn"``) runs in on ``backend``
        (``"cuda"``, the default: cuBLAS and cuDNN; ``"mkldnn"``: oneDNN on CPUs):
        ``"tf32"``, ``"bf16"`` or ``"ieee"`` (full fp32).

        Raises:
            ValueError: ``op`` or ``backend`` names no leaf of torch's tree.
        """
        backend = _TF32 if backend is None else backend
        if (backend, op) not in _LEAVES:
            names = ", ".join(repr(b) for b in _BACKENDS)
            raise ValueError(
                f"precision(op={op!r}, backend={backend!r}): op is one of 'matmul', 'conv', "
                f"'rnn' and backend one of {names}."
            )
        if self.tree:
            value = dict(self.tree)[(backend, op)]
        elif backend != _TF32:
            value = "bf16" if op == "matmul" and self.matmul_precision == "medium" else "ieee"
        elif op == "matmul":
            value = "ieee" if self.matmul_precision == "highest" else "tf32"
        else:
            value = "tf32" if self.cudnn_tf32 else "ieee"
        return value if value in ("tf32", "bf16") else "ieee"


@dataclass(frozen=True)
class _Saved:
    """Every fp32 math setting :func:`fast_matmul` changes, as stored, to put back exactly.

    What a node stores (a value, or ``"none"``: inherited) and the legacy values behind
    the tree are not what the getters show: :meth:`save` finds them out by moving a parent
    and seeing whether the node follows, and puts everything back before it returns.
    Other threads may see those moves, so only code that changes the settings anyway saves.
    """

    matmul_precision: str  #: legacy: torch.get_float32_matmul_precision()'s value
    cudnn_tf32: bool  #: legacy: torch.backends.cudnn.allow_tf32's value
    #: fp32_precision values as stored (``"none"``: inherited), root first; empty before 2.9
    tree: tuple[tuple[Node, str], ...] = ()

    @classmethod
    def save(cls) -> _Saved:
        """The stored settings (briefly moving some, to tell stored from inherited)."""
        with _legacy_on_purpose():
            return cls._read()

    @classmethod
    def _read(cls) -> _Saved:
        if not _has_tree():  # torch < 2.9: only the legacy flags exist
            return cls(torch.get_float32_matmul_precision(), bool(torch.backends.cudnn.allow_tf32))
        tree = {_GENERIC: _get(_GENERIC)}  # the root inherits from nothing
        for parent in _PARENTS:
            tree[parent] = _stored_parent(parent, tree[_GENERIC])
        for leaf in _LEAVES:
            tree[leaf] = _stored_leaf(leaf, tree)
        return cls(_legacy_matmul(tree), _legacy_cudnn(tree), tuple(tree.items()))

    def restore(self) -> None:
        """Put these settings back: the legacy values, then the tree from the root down.

        torch's initial cuDNN conv/RNN state cannot be set; it comes back only if nothing
        wrote those two settings in between (:func:`fast_matmul` never does).
        """
        with _legacy_on_purpose():
            self._write()

    def _write(self) -> None:
        torch.set_float32_matmul_precision(self.matmul_precision)  # writes the matmul leaves
        if not self.tree:
            torch.backends.cudnn.allow_tf32 = self.cudnn_tf32
            return
        if _Saved._read().cudnn_tf32 != self.cudnn_tf32:
            torch.backends.cudnn.allow_tf32 = self.cudnn_tf32  # writes cuDNN conv and RNN
        for node, value in self.tree:
            if value != DEFAULT:
                _put(node, value)

    def _turn_on(self, precision: str) -> None:
        """TF32 on, starting from these settings (which must be the current ones)."""
        torch.set_float32_matmul_precision(precision)
        if not self.cudnn_tf32 or not self.tree:
            # The legacy flag is False only after its setter wrote conv and RNN: no DEFAULT.
            torch.backends.cudnn.allow_tf32 = True
            return
        tree = dict(self.tree)
        for leaf in _CUDNN:
            if _get(leaf) != "tf32":
                _put((_TF32, "all") if tree[leaf] == DEFAULT else leaf, "tf32")


@contextlib.contextmanager
def fast_matmul(precision: Literal["high", "medium"] = "high") -> Iterator[MathSettings]:
    """Let fp32 matmuls and convolutions use TF32 Tensor Cores, inside this block only.

    Sets ``torch.set_float32_matmul_precision(precision)`` and cuDNN's TF32 flag (conv and
    RNN), through both of torch's APIs, and on exit restores exactly what was there, also
    when the block raises. Works as a decorator. On Ampere and later GPUs TF32 matmuls are
    several times faster than fp32, with ~1e-3 relative error instead of ~1e-6; under bf16
    or fp16 autocast it speeds up only the ops autocast leaves in fp32. The settings are
    process-wide: other threads see them while the block runs.

    >>> with fast_matmul():
    ...     torch.get_float32_matmul_precision()
    'high'
    >>> torch.get_float32_matmul_precision()
    'highest'

    Args:
        precision: ``"high"`` (TF32) or ``"medium"``, which also lets oneDNN compute fp32
            matmuls in bf16 on CPUs that have it (AVX512-BF16, AMX).

    Yields:
        The :class:`MathSettings` that were in force before, restored exactly on exit.

    Raises:
        PrecisionError: ``precision`` is neither ``"high"`` nor ``"medium"``.
    """
    if precision not in ("high", "medium"):
        raise PrecisionError(
            f"fast_matmul({precision!r}): use 'high' (TF32) or 'medium' (TF32, and bf16 for "
            "oneDNN fp32 matmuls on CPUs that have it)."
        )
    before = MathSettings.capture()
    saved = _Saved.save()
    try:
        with _legacy_on_purpose():
            saved._turn_on(precision)
        yield before
    finally:
        saved.restore()


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """fp32 matmuls in full fp32 (no TF32, no bf16) inside the block; settings restored.

    What fp32 throughput is measured under. cuDNN's flag is left alone: writing it would
    lose torch's initial conv/RNN state, which no setter can put back, and no matmul reads it.
    """
    saved = _Saved.save()
    try:
        with _legacy_on_purpose():
            torch.set_float32_matmul_precision("highest")
        yield
    finally:
        saved.restore()
