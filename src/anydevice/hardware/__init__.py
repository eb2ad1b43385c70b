"""What hardware is here, and which of it to use. The lowest layer: it imports torch lazily,
and looking through it never initialises CUDA.

Modules:

* :mod:`~anydevice.hardware.backends`: one backend per device kind, the only place that
  names a kind: each kind's facts (a :class:`~anydevice.hardware.backends.kind.Kind`
  record: spec words, ``gpu``, collectives, precision, ...), discovery (what devices,
  their facts) and the run-time interface every other layer calls (streams, events,
  synchronisation, memory counters, the cache).
* :mod:`~anydevice.hardware.facts`: the data of each part (:class:`~anydevice.DeviceInfo`,
  :class:`~anydevice.HostInfo`, :class:`~anydevice.ProcessInfo`), byte sizes.
* :mod:`~anydevice.hardware.inventory`: :class:`~anydevice.Inventory` and
  ``ad.inventory()``, which gathers it from the backends.
* :mod:`~anydevice.hardware.torchbuild`: which torch is installed and what it was built
  for, read from its files without importing it.
* :mod:`~anydevice.hardware.override`: ``ANYDEVICE_DEVICE``, read in one place, torch-free.
* :mod:`~anydevice.hardware.freest`: the freest-GPU rule and ``anydevice select``, torch-free.
* :mod:`~anydevice.hardware.spec`: the device spec grammar, parsed without the hardware.
* :mod:`~anydevice.hardware.selection`: the policies and the one resolver of a spec to a
  ``torch.device`` (``ad.device``, ``ad.devices``, ``ad.describe``, ``ad.try_gpu``).
* :mod:`~anydevice.hardware.visibility`: the pure half of ``ad.restrict_visible``.
* :mod:`~anydevice.hardware.peaks`: datasheet peaks of known GPUs and the PCIe link's limit.
* :mod:`~anydevice.hardware.pulse`: this process's heartbeat, fed by the library's step
  points (steps; the device allocator's counters once a second).
* :mod:`~anydevice.hardware.processes`: the processes of this machine from ``/proc``: which
  run torch, their launcher's variables, CPU, memory, PID namespaces.
* :mod:`~anydevice.hardware.jobs`: processes as jobs and ranks, and which stalled (pure).
* :mod:`~anydevice.hardware.leftovers`: what ended processes left behind (pure).
* :mod:`~anydevice.hardware.gpuwatch`: ``anydevice top``'s readings: the host, every
  accelerator, the torch processes and their heartbeats; the JSON schema.
* :mod:`~anydevice.hardware.topview`: ``anydevice top``'s screen: tables, sparklines, order.
* :mod:`~anydevice.hardware.render`: the inventory as rich tables.
"""
