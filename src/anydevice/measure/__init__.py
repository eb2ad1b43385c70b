"""Measuring what the device does: time, work, rates and memory. Above
:mod:`anydevice.feeding`.

Modules:

* :mod:`~anydevice.measure.clocks`: waiting for a device, and the clock a measurement uses.
* :mod:`~anydevice.measure.samples`: :class:`~anydevice.Measurement` (statistics only;
  FLOPs and peaks annotate it), ``autorange`` and the sampling loop.
* :mod:`~anydevice.measure.timing`: ``ad.timeit`` and :class:`~anydevice.Timer`.
* :mod:`~anydevice.measure.flops`: ``ad.flops``, the work of one call.
* :mod:`~anydevice.measure.throughput`: peaks per dtype and the
  :class:`~anydevice.Throughput` meter (MFU).
* :mod:`~anydevice.measure.profiling`: ``ad.profile``, ``ad.find_syncs``, ``ad.nvtx_range``.
* :mod:`~anydevice.measure.idle`: where a profiler trace shows the device idle, and why.
* :mod:`~anydevice.measure.memory`: ``ad.memory``, ``ad.track_memory``, ``ad.free_memory``.
* :mod:`~anydevice.measure.memory_readings`: one reading of a device's memory counters.
* :mod:`~anydevice.measure.pinned`: the pinned host memory torch's allocator holds.
* :mod:`~anydevice.measure.memory_history`: the allocator's history, snapshot and timeline.
* :mod:`~anydevice.measure.batch_size`: ``ad.fit_batch_size``, the largest batch that fits.
"""
