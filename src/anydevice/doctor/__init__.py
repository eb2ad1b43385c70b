"""``anydevice doctor``: what this machine has, what is off, what it does, and what to do.

:func:`examine` runs the configuration checks (:mod:`anydevice.doctor.checks`) and, when
asked, measures each device (:mod:`anydevice.doctor.measure`): throughput, bandwidth, what
each lever buys here, and a side-by-side table of the devices with advice.

Modules:

* :mod:`~anydevice.doctor.examination` — :func:`examine`: the checks, then the
  measurements when asked, into one ``Report``.
* :mod:`~anydevice.doctor.targets` — which devices a run measures.
* :mod:`~anydevice.doctor.checks` — the configuration checks, each a verdict with its fix;
  :mod:`~anydevice.doctor.toolchain` — the compiler, ninja and nvcc check.
* :mod:`~anydevice.doctor.results` — what was found and measured, as frozen data (the
  ``Report``).
* :mod:`~anydevice.doctor.workloads` — the plans (how long, how large) and what is timed.
* :mod:`~anydevice.doctor.measure` — the measurements; :mod:`~anydevice.doctor.levers` —
  what each lever buys, from interleaved A/B timings.
* :mod:`~anydevice.doctor.budget` — time budgets and self-sizing;
  :mod:`~anydevice.doctor.load` — whether other processes used the cores meanwhile.
* :mod:`~anydevice.doctor.render` — the report as rich tables;
  :mod:`~anydevice.doctor.plot` — as one picture (``--plot``).
"""

from anydevice.doctor.examination import examine
from anydevice.doctor.results import Check, Report
from anydevice.doctor.targets import resolve_devices

__all__ = ["Check", "Report", "examine", "resolve_devices"]
