"""Mixed precision by hardware: :func:`precision` picks bf16, fp16 with gradient scaling, or fp32.

The choice is a pure function of a :class:`~anydevice.DeviceInfo`, so it is the same
on every machine that has the same hardware and can be asked without touching any:

=====================================  ==========  ==============================================
device                                 ``auto``    why
=====================================  ==========  ==============================================
CUDA, compute capability >= 8.0        bf16        native bf16 Tensor Cores; fp32's range, so no
                                                   gradient scaling
CUDA, compute capability 7.x           fp16        fp16 Tensor Cores, no bf16: dynamic gradient
                                                   scaling (``torch.amp.GradScaler``)
CUDA, compute capability < 7.0         fp32        no Tensor Cores
CPU with AVX512-BF16, AMX or Arm BF16  bf16        oneDNN runs matmuls and convolutions in bf16
other CPUs                             fp32        bf16 would be emulated, slower than fp32
MPS                                    fp16        Apple GPUs compute fp16 natively
XPU with native bf16                   bf16        (else fp16 with gradient scaling)
XLA (TPU)                              bf16        (other XLA devices: fp32)
any other device                       fp32        (bf16 and fp16 refused)
=====================================  ==========  ==============================================

Each row is the kind's policy, declared with its backend (``Kind.precision`` in
``hardware/backends/<kind>.py``).

bf16 on CUDA is chosen by compute capability, never by ``torch.cuda.is_bf16_supported()``,
which also counts emulation. A forced mode that the device would only emulate on an
accelerator raises :class:`~anydevice.errors.PrecisionError` (bf16 before compute capability
8.0, bf16 on MPS before macOS 14, fp16 on XLA). On the CPU every mode runs, emulated ones
slowly, so that bf16 numerics and fp16 code paths (scaling, skipped steps) can be checked
before they meet a GPU. ``ANYDEVICE_PRECISION=<mode>`` overrides ``auto``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch.optim import Optimizer

from anydevice.errors import PrecisionError, StepOrderError
from anydevice.hardware import backends, pulse
from anydevice.hardware.backends.kind import PrecisionPolicy, who
from anydevice.hardware.facts import DeviceInfo
from anydevice.hardware.selection import describe
from anydevice.hardware.spec import DeviceLike

__all__ = ["Mode", "ModeLike", "Precision", "StepResult", "precision"]

logger = logging.getLogger("anydevice")

#: The three precision modes.
Mode = Literal["bf16", "fp16", "fp32"]
#: What ``mode=`` accepts: ``"auto"``, a mode, a common alias, or a torch dtype.
ModeLike = str | torch.dtype

_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
_NAMES: dict[str, str] = {
    "auto": "auto",
    **dict.fromkeys(("bf16", "bfloat16", "bf16-mixed"), "bf16"),
    **dict.fromkeys(("fp16", "float16", "half", "16-mixed"), "fp16"),
    **dict.fromkeys(("fp32", "float32", "float", "32-true"), "fp32"),
}
_ENV = "ANYDEVICE_PRECISION"


# ----------------------------------------------------------------------------- policy
# Each kind's policy is its backend's (``Kind.precision``, beside the backend in
# ``hardware/backends/<kind>.py``); a kind without one runs fp32 only.


def _fp32_policy(info: DeviceInfo) -> PrecisionPolicy:
    no = f"{info.kind!r} devices run fp32 only here. Use 'fp32' or 'auto'."
    return PrecisionPolicy(
        "fp32", f"{info.spec}: fp32 (no mixed precision)", {"bf16": no, "fp16": no}
    )


def _parse_mode(mode: ModeLike, origin: str = "") -> str:
    if isinstance(mode, torch.dtype):
        found = {v: k for k, v in _DTYPES.items()}.get(mode)
    elif isinstance(mode, str):
        found = _NAMES.get(mode.strip().lower())
    else:
        raise TypeError(f"mode is a str or a torch.dtype, not {type(mode).__name__} ({mode!r})")
    if found is None:
        raise PrecisionError(
            f"Unknown precision mode {mode!r}{origin}. Use 'auto', 'bf16', 'fp16' or 'fp32' "
            "(torch.bfloat16, torch.float16 and torch.float32 work too)."
        )
    return found


def _decide(info: DeviceInfo, mode: ModeLike, env: Mapping[str, str]) -> tuple[str, Mode, str]:
    """(requested, chosen mode, why): the policy, pure apart from reading ``env``."""
    origin = ""
    requested = _parse_mode(mode)
    if requested == "auto" and env.get(_ENV, "").strip():
        origin = f" (from {_ENV})"
        requested = _parse_mode(env[_ENV], origin)
    policy = (backends.facts(info.kind).precision or _fp32_policy)(info)
    if requested == "auto":
        return requested, policy.auto, policy.why
    if requested in policy.refused:
        raise PrecisionError(
            f"mode={requested!r}{origin} cannot run natively on {who(info)}: "
            f"{policy.refused[requested]}"
        )
    chosen: Mode = "bf16" if requested == "bf16" else "fp16" if requested == "fp16" else "fp32"
    if chosen == policy.auto:
        return requested, chosen, f"requested{origin}, and auto agrees: {policy.why}"
    caveat = policy.caveats.get(chosen)
    why = f"requested{origin}" + (f"; {caveat}" if caveat else "")
    return requested, chosen, f"{why} (auto would choose {policy.auto} on {who(info)})"


# ----------------------------------------------------------------------------- Precision


class StepResult:
    """Whether :meth:`Precision.step` updated the parameters; truthy when it did.

    Only fp16 ever skips a step (inf/NaN gradients). Its answer lives on the device, and
    reading it (``bool()``, :attr:`taken`, :attr:`scale`, ``repr``) waits for the device;
    not reading it keeps a fused optimizer's step free of host-device syncs.

    >>> bool(StepResult())
    True
    """

    __slots__ = ("_after", "_before", "_taken")

    def __init__(
        self, before: torch.Tensor | None = None, after: torch.Tensor | None = None
    ) -> None:
        self._before = before  #: loss scale before this step's update (fp16 only)
        self._after = after  #: and after it: lower means the step was skipped
        self._taken: bool | None = True if after is None else None

    @property
    def taken(self) -> bool:
        """True when every optimizer stepped; False when fp16 found inf/NaN gradients."""
        if self._taken is None:
            assert self._before is not None
            assert self._after is not None
            self._taken = bool((self._after >= self._before).item())
        return self._taken

    @property
    def scale(self) -> float | None:
        """The loss scale after this step (fp16), else None."""
        return None if self._after is None else float(self._after.item())

    def __bool__(self) -> bool:
        return self.taken

    def __repr__(self) -> str:
        if self._after is None or self._before is None:
            return "StepResult(taken=True)"
        before, after = float(self._before.item()), float(self._after.item())
        if self.taken:
            return f"StepResult(taken=True, scale={after:g})"
        return f"StepResult(taken=False: inf/NaN gradients, scale {before:g} -> {after:g})"


class Precision:
    """A device's precision mode: autocast, and gradient scaling when (only when) fp16.

    Made by :func:`precision`; ``Precision(info, mode)`` decides from a hand-built
    :class:`~anydevice.hardware.facts.DeviceInfo` without touching any hardware. The model,
    optimizer and loss stay the user's own; this object holds only the fp16 loss scaler
    (a plain ``torch.amp.GradScaler``, created on first use) and which step it is in.

    >>> from anydevice.hardware.facts import DeviceInfo
    >>> v100 = DeviceInfo(kind="cuda", index=0, name="Tesla V100", compute_capability=(7, 0))
    >>> p = Precision(v100)
    >>> p.mode, p.dtype, p.scaled
    ('fp16', torch.float16, True)

    Args:
        info: the device.
        mode: ``"auto"``, ``"bf16"``, ``"fp16"``, ``"fp32"``, an alias (``"bfloat16"``,
            ``"half"``, ``"bf16-mixed"``, ...) or a torch dtype.
        environ: read for ``ANYDEVICE_PRECISION`` when ``mode`` is ``"auto"`` (default:
            ``os.environ``).

    Raises:
        PrecisionError: an unknown mode, or one the device cannot run natively.
    """

    def __init__(
        self, info: DeviceInfo, mode: ModeLike = "auto", *, environ: Mapping[str, str] | None = None
    ) -> None:
        env = os.environ if environ is None else environ
        self._info = info
        self._requested, self._mode, self._reason = _decide(info, mode, env)
        self._scaler: torch.amp.GradScaler | None = None
        self._one: torch.Tensor | None = None
        self._unscaled: set[int] = set()
        self._backward_seen = False

    # --- what was chosen

    @property
    def info(self) -> DeviceInfo:
        """The device the mode was chosen for."""
        return self._info

    @property
    def device(self) -> torch.device:
        """The device, as a ``torch.device``; autocast uses its type."""
        return self._info.torch_device

    @property
    def mode(self) -> Mode:
        """``"bf16"``, ``"fp16"`` or ``"fp32"``."""
        return self._mode

    @property
    def requested(self) -> str:
        """What was asked for: ``"auto"`` or a mode."""
        return self._requested

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype; ``torch.float32`` when fp32 (autocast off)."""
        return _DTYPES[self._mode]

    @property
    def reason(self) -> str:
        """Why this mode, with the hardware facts it rests on."""
        return self._reason

    @property
    def scaled(self) -> bool:
        """Whether gradients are scaled (fp16 only)."""
        return self._mode == "fp16"

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The ``torch.amp.GradScaler`` in fp16 mode (created on first use), else None."""
        if self._mode != "fp16":
            return None
        if self._scaler is None:
            self._scaler = torch.amp.GradScaler(self.device.type)
        return self._scaler

    def __repr__(self) -> str:
        return f"Precision({self._mode} on {self._info.spec}: {self._reason})"

    # --- the training step

    def autocast(
        self, *, enabled: bool = True, cache_enabled: bool | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """``torch.amp.autocast`` for this device and mode; wrap the forward pass and loss.

        In fp32 mode it switches autocast off, also inside an outer autocast region.

        >>> p = precision("cpu", "bf16")
        >>> with p.autocast():
        ...     y = torch.nn.Linear(4, 2)(torch.randn(3, 4))
        >>> y.dtype
        torch.bfloat16
        """
        kind = self.device.type
        if not torch.amp.is_autocast_available(kind):
            return contextlib.nullcontext()
        on = enabled and self._mode != "fp32"
        dtype = self.dtype if self._mode != "fp32" else None
        return torch.amp.autocast(kind, dtype=dtype, enabled=on, cache_enabled=cache_enabled)

    def backward(
        self,
        loss: torch.Tensor,
        *,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """``loss.backward()``, with the loss scaled first in fp16 mode.

        Call it outside :meth:`autocast`. Gradient accumulation: call it several times,
        then :meth:`step` once.

        Raises:
            PrecisionError: ``loss`` is on another kind of device than this precision's
                (autocast did not apply to it).
        """
        kind = self.device.type
        if loss.device.type != kind:
            raise PrecisionError(
                f"loss is on {loss.device}, but this precision is for {self._info.spec}: "
                f"autocast({kind!r}) did not apply to its computation. Move the model and "
                f"batch to {self._info.spec}, or use ad.precision({str(loss.device)!r})."
            )
        if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
            warnings.warn(
                "backward() inside autocast: torch recommends running backward outside it; "
                "end the `with p.autocast():` block before p.backward(loss).",
                stacklevel=2,
            )
        scaler = self.scaler
        target = loss if scaler is None else scaler.scale(loss)
        target.backward(retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)
        self._backward_seen = True

    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the loss scale, before clipping them.

        At most once per optimizer per step, in every mode (in bf16 and fp32 it changes
        nothing), so a loop that is wrong under fp16 fails everywhere.

        Raises:
            StepOrderError: before any :meth:`backward`, or twice in one step.
        """
        if not self._backward_seen:
            raise StepOrderError(
                "unscale_() before backward(): there are no gradients of this step to unscale. "
                "Call p.backward(loss) first."
            )
        if id(optimizer) in self._unscaled:
            raise StepOrderError(
                "unscale_() was already called for this optimizer in this step; call it once, "
                "after the last p.backward(loss) and before clipping, then p.step(optimizer)."
            )
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: Optimizer, *more: Optimizer) -> StepResult:
        """Step each optimizer; in fp16, skip them on inf/NaN gradients and update the scale.

        Pass every optimizer of the model in one call: the scale is updated once per step.
        With ``fused=True`` optimizers (AdamW, Adam, SGD, Adagrad) the fp16 step needs no
        host-device sync; the result syncs only when read.

        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> p = precision("cpu", "fp32")
        >>> p.backward(model(torch.ones(1, 2)).sum())
        >>> bool(p.step(opt))
        True

        Returns:
            A :class:`StepResult`: truthy when the parameters were updated.

        Raises:
            StepOrderError: no :meth:`backward` since the last step.
        """
        if not self._backward_seen:
            raise StepOrderError(
                "step() without backward(): no gradients were produced through this precision "
                "since the last step (in fp16 they would not be scaled). Call p.backward(loss)."
            )
        optimizers = (optimizer, *more)
        scaler = self.scaler
        if scaler is None:
            for opt in optimizers:
                opt.step()
            result = StepResult()
        else:
            for opt in optimizers:
                scaler.step(opt)
            before = scaler.scale(self._unit())
            scaler.update()
            result = StepResult(before, scaler.scale(self._unit()))
        self._unscaled.clear()
        self._backward_seen = False
        pulse.tick("optimizer", self.device)  # this process's heartbeat: anydevice top
        return result

    def _unit(self) -> torch.Tensor:
        """A 1.0 on the device: ``scaler.scale(one)`` reads the scale without a sync."""
        if self._one is None:
            self._one = torch.ones((), device=self.device)
        return self._one

    # --- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The mode and, in fp16, the loss scaler's state, for checkpoints.

        >>> precision("cpu", "fp32").state_dict()
        {'mode': 'fp32', 'scaler': {}}
        """
        scaler = self.scaler
        return {"mode": self._mode, "scaler": {} if scaler is None else scaler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`, also one saved on other hardware.

        A checkpoint from an fp16 run resumed in bf16 or fp32 drops the scaler state; one
        from a bf16 run resumed in fp16 starts a fresh scaler.

        Raises:
            PrecisionError: ``state`` is not a :meth:`state_dict`.
        """
        if not isinstance(state, Mapping) or "mode" not in state:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise PrecisionError(
                f"not a Precision.state_dict() (got {keys}); expected keys 'mode' and 'scaler'."
            )
        if state["mode"] != self._mode:
            logger.info(
                "Resuming a %s checkpoint in %s (%s).", state["mode"], self._mode, self._reason
            )
        scaler_state = state.get("scaler") or {}
        if self.scaler is not None and scaler_state:
            self.scaler.load_state_dict(dict(scaler_state))


def precision(device: DeviceLike | DeviceInfo = "auto", mode: ModeLike = "auto") -> Precision:
    """The precision mode for a device: bf16, fp16 with gradient scaling, or fp32.

    ``auto`` follows the table in this module's docstring; ``ANYDEVICE_PRECISION`` overrides
    it. A typical step::

        p = ad.precision(device)
        with p.autocast():
            loss = loss_fn(model(x), y)
        p.backward(loss)
        p.unscale_(optimizer)                       # only if clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        p.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    >>> p = precision("cpu", "fp32")
    >>> p.mode, p.dtype
    ('fp32', torch.float32)

    Args:
        device: a device spec (as for :func:`anydevice.device`) or a ``DeviceInfo``.
        mode: ``"auto"`` or a forced mode (see :class:`Precision`).

    Raises:
        PrecisionError: an unknown mode, or one the device cannot run natively.
        DeviceNotFoundError: no such device here.
    """
    info = device if isinstance(device, DeviceInfo) else describe(device, telemetry=False)
    return Precision(info, mode)
