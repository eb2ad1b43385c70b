"""Many devices, many machines: launch, process group, prepare, collectives, Hogwild.

* :mod:`~anydevice.distributed.environment` — which launcher started this process (pure).
* :mod:`~anydevice.distributed.elastic` — ``launch()`` through torch's elastic agent.
* :mod:`~anydevice.distributed.agent` — torch's agent run for a launch, under faults.
* :mod:`~anydevice.distributed.failures` — which worker's failure is the root cause.
* :mod:`~anydevice.distributed.runner` — how ``anydevice launch`` runs a script per worker.
* :mod:`~anydevice.distributed.context` — ``with distributed() as d:``.
* :mod:`~anydevice.distributed.parallel` — ``prepare()`` / ``unwrap()``: DDP, DP, samplers.
* :mod:`~anydevice.distributed.accumulation` — ``d.accumulate()``: micro-batches that make
  one optimizer step, one gradient reduction per step.
* :mod:`~anydevice.distributed.sharding` — FSDP2 as ``prepare(strategy="fsdp")`` applies it.
* :mod:`~anydevice.distributed.state` — ``save_state()`` / ``load_state()`` on any world size.
* :mod:`~anydevice.distributed.collectives` — ``all_reduce``, ``all_gather``, ``broadcast``,
  ``gather_for_metrics``.
* :mod:`~anydevice.distributed.sharing` — ``share()`` for Hogwild.

Importing this package loads torch's own ``torch.distributed`` (which ``import torch``
already does) and nothing heavier: the elastic agent is imported when a launch starts.
"""

from __future__ import annotations

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
