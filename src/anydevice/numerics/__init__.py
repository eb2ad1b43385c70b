"""What math runs, by hardware. Above :mod:`anydevice.measure`.

Modules:

* :mod:`~anydevice.numerics.precision`: ``ad.precision``, bf16, fp16 with scaling or fp32.
* :mod:`~anydevice.numerics.matmul`: ``ad.fast_matmul``, fp32 matmul math, scoped.
* :mod:`~anydevice.numerics.layout`: ``ad.channels_last``, NHWC where it pays.
"""
