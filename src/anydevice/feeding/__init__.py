"""Getting batches onto the device while it computes. Above :mod:`anydevice.placement`.

Modules:

* :mod:`~anydevice.feeding.loader`: :class:`~anydevice.DeviceLoader` and its statistics.
* :mod:`~anydevice.feeding.waiting`: the waiting share of a pass, chunk by chunk, and its
  spread (what the statistics' advice rests on).
* :mod:`~anydevice.feeding.transfer`: what to pin and how a batch is copied, with the
  events that keep a copy from being read early or freed while in flight.
* :mod:`~anydevice.feeding.copies`: the copy stream and events one loader pass uses.
* :mod:`~anydevice.feeding.streams`: ``ad.side_stream``, side streams ordered with the
  current stream in both directions.
* :mod:`~anydevice.feeding.resume`: a loader's position in its epoch and what its order
  is drawn from, saved, checked and restored.
* :mod:`~anydevice.feeding.startmethod`: what spawned workers cannot import, said before
  they start.
"""
