"""A training run's saved state: ``save_state`` / ``load_state`` on any world size.

Model and optimizer (plain, DDP or FSDP; DCP when distributed), the loop around them,
written by every rank and put in place only once all have, checked before it is loaded,
kept as a folder of step-numbered checkpoints. One file's atomic ``ad.save``/``ad.load``
is :mod:`anydevice.placement.checkpoint`'s, below.

* :mod:`~anydevice.checkpoints.state` — ``save_state()`` / ``load_state()`` on any world
  size.
* :mod:`~anydevice.checkpoints.sharded` — a checkpoint every rank writes, put in place only
  once all have; a full disk named.
* :mod:`~anydevice.checkpoints.integrity` — every file's size and CRC-32, taken while it is
  written, checked before it is loaded.
* :mod:`~anydevice.checkpoints.intact` — which checkpoint is intact, decided by the ranks
  together; the newest intact one of a ``keep=`` folder.
* :mod:`~anydevice.checkpoints.loop_state` — the loader, LR scheduler, precision and random
  state ``save_state`` carries beside model and optimizer.
* :mod:`~anydevice.checkpoints.ondisk` — what ``save_state`` may replace (its own
  checkpoints only), the replacing, what saves cut short leave.
* :mod:`~anydevice.checkpoints.extras` — what a checkpoint's extras may hold: checked at
  the call, copied for a background save, read back.
* :mod:`~anydevice.checkpoints.randomness` — the random state a resumed run needs.
* :mod:`~anydevice.checkpoints.arrival` — whether every rank called a collective of ours.
* :mod:`~anydevice.checkpoints.history` — a folder of step-numbered checkpoints.
"""
