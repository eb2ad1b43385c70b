"""The random state a resumed run needs to draw what the uninterrupted one would have.

Dropout masks, augmentations and a sampler without a generator draw from torch's global
generator on the CPU and from the accelerator's default generator; user code often draws
from Python's ``random`` and numpy's global generator. ``save_state`` keeps all four, per
rank (each rank draws its own), and ``load_state`` puts them back last, so the next draw
of a resumed run is the next draw of the run that was never stopped.

* torch's CPU generator: ``torch.get_rng_state()``;
* the accelerator's: through the device backend (``Backend.rng_state``: the kind's device
  module, ``torch.get_device_module(kind).get_rng_state(device)``), for each device the
  model lives on — no device is initialised for it, and a checkpoint resumed on other
  devices (a GPU's on the CPU) leaves theirs as they are, saying so;
* Python's ``random``: ``random.getstate()``;
* numpy's global generator, where numpy is imported: its MT19937 keys as a tensor, so
  that the file holds nothing numpy must rebuild.
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["capture", "restore"]

logger = logging.getLogger("anydevice")


def capture(model: nn.Module) -> dict[str, Any]:
    """The random state of this process, and of the accelerator devices ``model`` is on."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": (version, internal, gauss),
        "devices": [(str(d), rng) for d, rng in _device_states(model)],
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (str(kind), torch.from_numpy(keys.astype("int64")), int(pos),
                          int(has_gauss), float(cached))  # fmt: skip
    return state


def restore(state: dict[str, Any], model: nn.Module, *, where: str) -> None:
    """Put back what :func:`capture` took; devices the model is not on now keep theirs."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved_numpy = state.get("numpy")
    if saved_numpy is not None:
        _restore_numpy(saved_numpy, where)
    saved = state.get("devices") or []
    if not saved:
        return
    from anydevice.hardware.backends import runtime

    here = [device for device, _ in _device_states(model)]
    if [torch.device(d).type for d, _ in saved] != [d.type for d in here]:
        logger.warning(
            "%s: the random state of %s was saved, and this model is on %s: their "
            "generators keep their own state (draws there differ from the saved run's)",
            where,
            ", ".join(d for d, _ in saved),
            ", ".join(str(d) for d in here) or "the CPU alone",
        )
        return
    for device, (_, rng) in zip(here, saved, strict=True):
        if not runtime(device.type).set_rng_state(device, rng):
            logger.warning("%s: %s cannot take a random state: not restored", where, device)


def _restore_numpy(saved: Any, where: str) -> None:
    try:
        import numpy
    except ImportError:
        logger.warning("%s: numpy's random state was saved; numpy is not installed here", where)
        return
    kind, keys, pos, has_gauss, cached = saved
    numpy.random.set_state((kind, keys.numpy().astype(numpy.uint32), pos, has_gauss, cached))


def _accelerators(model: nn.Module) -> list[torch.device]:
    """The devices of ``model``'s parameters and buffers that keep a generator of their own
    (not the CPU, not ``meta``), in a stable order."""
    from anydevice.hardware.backends import runtime

    found = {t.device for t in (*model.parameters(), *model.buffers())}
    mine = [d for d in found if not runtime(d.type).is_host and runtime(d.type).holds_data]
    return sorted(mine, key=str)


def _device_states(model: nn.Module) -> list[tuple[torch.device, torch.Tensor]]:
    """Each of ``model``'s devices whose kind keeps a generator, with its state."""
    from anydevice.hardware.backends import runtime

    states = []
    for device in _accelerators(model):
        state = runtime(device.type).rng_state(device)
        if state is not None:
            states.append((device, state.cpu()))
    return states
