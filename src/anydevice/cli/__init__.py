"""The ``anydevice`` command (and ``python -m anydevice``). The top layer: nothing imports it.

Modules:

* :mod:`~anydevice.cli.commands`: the parser and the commands ``info``, ``top``,
  ``select``, ``doctor`` and ``launch``; :func:`main` runs one.
* :mod:`~anydevice.cli.top`: ``anydevice top``'s arguments, output and live keys.
"""

from anydevice.cli.commands import main

__all__ = ["main"]
