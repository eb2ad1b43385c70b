"""Run a script on the simulated accelerator: ``python -m anydevice.testing script.py [args]``.

The simulator is enabled in this process (``--name``, ``--bandwidth``, ``--capacity``,
``--devices`` are :func:`anydevice.testing.enable`'s), ``ANYDEVICE_DEVICE`` is set to its
name unless already set, so ``ad.device()`` picks it, and the script runs as ``__main__``
with the arguments after it. Processes the script starts do not have the simulator (torch
registers a backend per process).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from anydevice.testing.simulator import enable


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m anydevice.testing",
        description="Run a script with anydevice's simulated accelerator enabled.",
    )
    parser.add_argument("--name", default="sim", help="the device type (default: sim)")
    parser.add_argument("--bandwidth", default="2GB/s", help="the link's speed (2GB/s)")
    parser.add_argument("--capacity", default=None, help="memory per device (default: host's)")
    parser.add_argument("--devices", type=int, default=1, help="how many devices (1)")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = parser.parse_args(argv)
    enable(ns.name, bandwidth=ns.bandwidth, capacity=ns.capacity, devices=ns.devices)
    os.environ.setdefault("ANYDEVICE_DEVICE", ns.name)
    sys.argv = [ns.script, *ns.args]
    runpy.run_path(ns.script, run_name="__main__")


if __name__ == "__main__":
    main()
