"""Training on many devices, inside each rank: the process group, prepare, collectives.

What a rank's own code calls (``ad.distributed``, ``ad.prepare``, the collectives),
whichever launcher started it. It reads which launcher that was from
:mod:`anydevice.launching` below it, and saves through :mod:`anydevice.checkpoints`.

* :mod:`~anydevice.training.context` — ``with distributed() as d:``.
* :mod:`~anydevice.training.parallel` — ``prepare()`` / ``unwrap()``: DDP, DP, samplers.
* :mod:`~anydevice.training.accumulation` — ``d.accumulate()``: micro-batches that make
  one optimizer step, one gradient reduction per step.
* :mod:`~anydevice.training.sharding` — FSDP2 as ``prepare(strategy="fsdp")`` applies it.
* :mod:`~anydevice.training.collectives` — ``all_reduce``, ``all_gather``, ``broadcast``,
  ``gather_for_metrics``.
* :mod:`~anydevice.training.sharing` — ``share()`` for Hogwild.
* :mod:`~anydevice.training.preemption` — save on the scheduler's signal, then exit.
"""
