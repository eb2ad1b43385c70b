"""Many devices, many machines: launch, process group, prepare, collectives, Hogwild.

* :mod:`~anydevice.distributed.environment` — which launcher started this process (pure).
* :mod:`~anydevice.distributed.elastic` — ``launch()`` through torch's elastic agent.
* :mod:`~anydevice.distributed.arguments` — what ``launch()`` takes, checked before it starts.
* :mod:`~anydevice.distributed.agent` — torch's agent run for a launch, under faults.
* :mod:`~anydevice.distributed.rendezvous` — where the nodes meet, every wait bounded.
* :mod:`~anydevice.distributed.tenants` — the runs that share a rendezvous store: another
  run id named.
* :mod:`~anydevice.distributed.failures` — which worker's failure is the root cause.
* :mod:`~anydevice.distributed.hangwatch` — the launcher's hang watch: every rank's state,
  one verdict when the job makes no progress.
* :mod:`~anydevice.distributed.verdict` — the verdict's rules (mismatch, deadlock, gone,
  stall), pure.
* :mod:`~anydevice.distributed.progress` — a rank's side: the collective it is in, from
  torch's flight recorder, published in its heartbeat.
* :mod:`~anydevice.distributed.runner` — how ``anydevice launch`` runs a script per worker.
* :mod:`~anydevice.distributed.output` — a worker's output in whole lines.
* :mod:`~anydevice.distributed.context` — ``with distributed() as d:``.
* :mod:`~anydevice.distributed.parallel` — ``prepare()`` / ``unwrap()``: DDP, DP, samplers.
* :mod:`~anydevice.distributed.accumulation` — ``d.accumulate()``: micro-batches that make
  one optimizer step, one gradient reduction per step.
* :mod:`~anydevice.distributed.sharding` — FSDP2 as ``prepare(strategy="fsdp")`` applies it.
* :mod:`~anydevice.distributed.state` — ``save_state()`` / ``load_state()`` on any world size.
* :mod:`~anydevice.distributed.sharded` — a checkpoint every rank writes, put in place only
  once all have; a full disk named.
* :mod:`~anydevice.distributed.integrity` — every file's size and CRC-32, taken while it is
  written, checked before it is loaded.
* :mod:`~anydevice.distributed.intact` — which checkpoint is intact, decided by the ranks
  together; the newest intact one of a ``keep=`` folder.
* :mod:`~anydevice.distributed.loop_state` — the loader, LR scheduler, precision and random
  state ``save_state`` carries beside model and optimizer.
* :mod:`~anydevice.distributed.ondisk` — what ``save_state`` may replace (its own
  checkpoints only), the replacing, what saves cut short leave.
* :mod:`~anydevice.distributed.extras` — what a checkpoint's extras may hold: checked at
  the call, copied for a background save, read back.
* :mod:`~anydevice.distributed.randomness` — the random state a resumed run needs.
* :mod:`~anydevice.distributed.arrival` — whether every rank called a collective of ours.
* :mod:`~anydevice.distributed.collectives` — ``all_reduce``, ``all_gather``, ``broadcast``,
  ``gather_for_metrics``.
* :mod:`~anydevice.distributed.sharing` — ``share()`` for Hogwild.
* :mod:`~anydevice.distributed.addressing` — the address of this node the others reach.
* :mod:`~anydevice.distributed.reaper` — every process the workers start ends with the launch.
* :mod:`~anydevice.distributed.preemption` — save on the scheduler's signal, then exit.
* :mod:`~anydevice.distributed.history` — a folder of step-numbered checkpoints.

Importing this package loads torch's own ``torch.distributed`` (which ``import torch``
already does) and nothing heavier: the elastic agent is imported when a launch starts.
"""

from __future__ import annotations

import sys
import types

from anydevice.distributed.collectives import all_gather, all_reduce, broadcast, gather_for_metrics
from anydevice.distributed.context import Distributed, distributed
from anydevice.distributed.elastic import launch
from anydevice.distributed.parallel import prepare, unwrap
from anydevice.distributed.sharing import share
from anydevice.distributed.state import load_state, save_state, wait_for_saves

__all__ = [
    "Distributed",
    "all_gather",
    "all_reduce",
    "broadcast",
    "distributed",
    "gather_for_metrics",
    "launch",
    "load_state",
    "prepare",
    "save_state",
    "share",
    "unwrap",
    "wait_for_saves",
]


class _Subpackage(types.ModuleType):
    """This package: each submodule is reachable through the function ``distributed`` too.

    ``import anydevice.distributed.state as st`` looks ``distributed`` up on ``anydevice``,
    then ``state`` on what it found. There ``distributed`` is the function
    ``ad.distributed`` (``anydevice._Package`` keeps it from being replaced by this
    package), so each submodule Python records on this package is recorded on the function
    as well: the import finds the module, and ``ad.distributed(...)`` stays the function.
    """

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            vars(distributed)[name] = value


def _record_submodules() -> None:
    for name, value in list(globals().items()):
        if isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            vars(distributed)[name] = value


_record_submodules()
sys.modules[__name__].__class__ = _Subpackage
