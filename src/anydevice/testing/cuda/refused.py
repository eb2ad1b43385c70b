"""What the simulated CUDA cannot run, refused by name at the first call.

Each refusal says what was called, why the simulator cannot run it, and what to do; none
fakes a result. :func:`refusal` makes a stand-in for a function, :func:`refused_class`
one for a class, refused even where it is only looked at (``isinstance``,
``torch.cuda.FloatTensor(...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from anydevice.testing.simulator import SimulatorError

__all__ = [
    "COLLECTIVES_NOT_SIMULATED",
    "NotSimulatedError",
    "refusal",
    "refuse",
    "refused_class",
]

#: Why a process group or a collective on the simulated GPUs is refused.
COLLECTIVES_NOT_SIMULATED = "NCCL and collectives on the GPUs are not simulated"

#: What to do, said once for every refusal.
ADVICE = (
    "Run that part where a GPU is (mark its test @pytest.mark.cuda), or run it on the CPU "
    "in a process without the simulated CUDA (`python -m anydevice.testing --no-cuda`, or "
    "without anydevice.testing)."
)


class NotSimulatedError(SimulatorError, NotImplementedError):
    """A CUDA feature the simulated GPU cannot run: NCCL and other collectives, CUDA graphs,
    Triton and ``torch.compile``'s GPU backend, custom CUDA kernels, raw CUDA handles, NVML
    telemetry; or a ``torch.cuda`` name the simulation does not know."""


NotSimulatedError.__module__ = "anydevice.testing"  # where users import it from


def refuse(what: str, why: str, instead: str | None = None) -> NoReturn:
    """Raise :class:`NotSimulatedError` for ``what`` (``"torch.cuda.graph"``)."""
    raise NotSimulatedError(
        f"{what} cannot run on anydevice's simulated CUDA: {why}. {instead or ADVICE}"
    )


def refusal(what: str, why: str, instead: str | None = None) -> Callable[..., NoReturn]:
    """A function that refuses ``what`` whenever it is called."""

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        refuse(what, why, instead)

    refused.__name__ = refused.__qualname__ = what.rsplit(".", 1)[-1]
    refused.__doc__ = f"Refused on the simulated CUDA: {why}."
    return refused


class _Refused(type):
    """The type of the classes :func:`refused_class` makes: constructing one, or
    ``isinstance`` / ``issubclass`` with it, refuses."""

    _what: str
    _why: str
    _instead: str | None

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        refuse(cls._what, cls._why, cls._instead)

    def __instancecheck__(cls, obj: object) -> bool:
        refuse(cls._what, cls._why, cls._instead)

    def __subclasscheck__(cls, sub: type) -> bool:
        refuse(cls._what, cls._why, cls._instead)


def refused_class(what: str, why: str, instead: str | None = None) -> type:
    """A class standing for ``what`` (``"torch.cuda.CUDAGraph"``) that refuses when used."""
    name = what.rsplit(".", 1)[-1]
    return _Refused(name, (), {"_what": what, "_why": why, "_instead": instead})
