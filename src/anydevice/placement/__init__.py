"""Where tensors are, and putting them where they belong. Above :mod:`anydevice.hardware`.

Modules:

* :mod:`~anydevice.placement.move`: ``ad.to``, the one walk that moves nested containers,
  modules and optimizers to a device (non-blocking where that is safe).
* :mod:`~anydevice.placement.mismatch`: ``ad.device_of``, ``ad.devices_of``,
  ``ad.check_devices`` and ``ad.diagnose``: which tensor is on the wrong device, by name.
* :mod:`~anydevice.placement.checkpoint`: ``ad.save`` and ``ad.load``: atomic checkpoints
  that load onto any device.
"""
