"""The rest of a training loop's state that ``save_state`` carries beside the model and
the optimizer: the loader's place in its epoch, the LR scheduler, the precision policy's
scaler, the random state (:mod:`~anydevice.checkpoints.randomness`).

They travel with the per-rank extras under reserved keys (:func:`carry`), taken out again
on load (:func:`restore`), so the dict ``load_state`` returns holds the user's extras
alone; the precision policy's state has a file (or entry) of its own. A mapping passed as
``scheduler=`` or ``precision=`` (a state dict: the way before these arguments) stays an
extra of that name, as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from anydevice.checkpoints import randomness

if TYPE_CHECKING:
    from anydevice.numerics.precision import Precision

__all__ = [
    "RESERVED",
    "carry",
    "check_precision",
    "load_precision",
    "precision_state",
    "restore",
]

logger = logging.getLogger("anydevice")

#: The ``extra`` entries anydevice keeps its own state under (taken out on load).
_LOADER = "_anydevice_loader"
_SCHEDULER = "_anydevice_scheduler"
_RNG = "_anydevice_rng"
#: Each reserved key, as an error names what is under it.
RESERVED = {
    _LOADER: "loader.state_dict()",
    _SCHEDULER: "scheduler.state_dict()",
    _RNG: "the random state",
}


def carry(
    extra: dict[str, Any], *, model: nn.Module, loader: Any, scheduler: Any, rng_state: bool
) -> None:
    """Put the loader's, the scheduler's and the random state into ``extra``."""
    if loader is not None:
        extra[_LOADER] = _loader_state(loader)
    if scheduler is not None:
        _scheduler_state(scheduler, extra)
    if rng_state:
        extra[_RNG] = randomness.capture(model)


def restore(
    extra: dict[str, Any],
    *,
    model: nn.Module,
    loader: Any,
    scheduler: Any,
    rng_state: bool,
    source: Path,
    own: bool,
) -> dict[str, Any]:
    """``extra`` without the reserved entries, each restored into what was passed; the
    random state last, and only where ``own`` (this rank saved it)."""
    extra = _restore_loader(loader, extra, source)
    _restore_scheduler(scheduler, extra.pop(_SCHEDULER, None), source)
    rng = extra.pop(_RNG, None)
    if rng_state:
        _restore_rng(rng, model, source, own)
    return extra


def _loader_state(loader: Any) -> dict[str, Any]:
    state = getattr(loader, "state_dict", None)
    if not callable(state):
        raise TypeError(
            f"ad.save_state(loader=...) takes the loop's ad.DeviceLoader (or anything with "
            f"state_dict()), not a {type(loader).__name__}; wrap a DataLoader in "
            "ad.DeviceLoader to resume it mid-epoch"
        )
    return dict(state())


def _restore_loader(loader: Any, extra: dict[str, Any], source: Path) -> dict[str, Any]:
    """``extra`` without the loader's entry, which goes into ``loader``."""
    state = extra.pop(_LOADER, None)
    if loader is None:
        return extra
    if state is None:
        logger.warning(
            "load_state(%s): the checkpoint holds no loader state (saved without loader=); "
            "the loader starts its epoch from the beginning",
            source,
        )
        return extra
    loader.load_state_dict(state)
    return extra


def _scheduler_state(scheduler: Any, extra: dict[str, Any]) -> None:
    """``scheduler.state_dict()`` into ``extra``; a mapping passed as ``scheduler=`` (a
    state dict, the way before this argument) stays an extra of that name."""
    if isinstance(scheduler, Mapping):
        extra["scheduler"] = scheduler
        return
    state = getattr(scheduler, "state_dict", None)
    if not callable(state) or not callable(getattr(scheduler, "load_state_dict", None)):
        raise TypeError(
            "ad.save_state(scheduler=...) takes the loop's LR scheduler (anything with "
            f"state_dict() and load_state_dict()), not a {type(scheduler).__name__}"
        )
    extra[_SCHEDULER] = state()


def _restore_scheduler(scheduler: Any, state: Any, source: Path) -> None:
    if scheduler is None:
        return
    if not callable(getattr(scheduler, "load_state_dict", None)):
        raise TypeError(
            "ad.load_state(scheduler=...) takes the loop's LR scheduler (anything with "
            f"load_state_dict()), not a {type(scheduler).__name__}"
        )
    if state is None:
        logger.warning(
            "load_state(%s): the checkpoint holds no scheduler state (saved without "
            "scheduler=); the scheduler keeps its own",
            source,
        )
        return
    scheduler.load_state_dict(state)


def _restore_rng(state: Any, model: nn.Module, source: Path, own: bool) -> None:
    if state is None:
        logger.info("load_state(%s): no random state saved (rng_state=False): left as is", source)
        return
    if not own:  # a rank the saving world did not have: rank 0's would repeat its draws
        logger.info(
            "load_state(%s): this rank was not in the saving world; its random state is "
            "left as it is (another rank's would repeat that rank's draws)",
            source,
        )
        return
    randomness.restore(state, model, where=f"load_state({source})")


def precision_state(precision: Any, extra: dict[str, Any]) -> dict[str, Any] | None:
    """``precision.state_dict()``; a mapping passed as ``precision=`` (what had to be done
    by hand before) stays an ``extra`` entry, as it was."""
    from anydevice.numerics.precision import Precision

    if precision is None:
        return None
    if isinstance(precision, Precision):
        return precision.state_dict()
    extra["precision"] = precision
    return None


def check_precision(precision: object) -> None:
    from anydevice.numerics.precision import Precision

    if precision is not None and not isinstance(precision, Precision):
        raise TypeError(
            f"ad.load_state(precision=...) takes the loop's ad.precision(...) policy, not a "
            f"{type(precision).__name__}; pass precision=p, or read a state saved as an extra "
            "from the returned dict and call p.load_state_dict on it."
        )


def load_precision(precision: Precision, state: Any, source: Path) -> None:
    if state is None:
        logger.warning(
            "load_state(%s): the checkpoint holds no precision state (saved without "
            "precision=); %s keeps its own",
            source,
            precision,
        )
        return
    precision.load_state_dict(state)
