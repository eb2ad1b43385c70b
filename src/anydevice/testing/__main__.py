"""Run a script on the simulated accelerator: ``python -m anydevice.testing script.py [args]``.

By default the script runs as it would on a machine with CUDA GPUs (``--devices N`` of
them, one by default): ``torch.cuda``, ``"cuda"`` and ``.cuda()`` land on the simulated
devices (:func:`anydevice.testing.simulate_cuda`). With ``--no-cuda`` the simulator keeps
its own name (``sim``): ``ANYDEVICE_DEVICE`` is set to it unless already set, so
``ad.device()`` picks it, and ``torch.cuda`` is left alone. ``--name``, ``--bandwidth``,
``--capacity`` and ``--races`` are :func:`anydevice.testing.enable`'s. The script runs as
``__main__`` with the arguments after it, and ``sys.path[0]`` its directory, as ``python
script.py`` sets it (so it imports the modules beside it from any working directory);
processes it starts do not have the simulator (torch registers a backend per process).

A stream race fails the run: with ``--races raise`` (the default) it raises
:class:`~anydevice.testing.StreamRaceError` at the racing line, and a race the script
caught still makes the run exit with status 1, with its report; ``--races warn`` reports
each race as a warning and leaves the exit status to the script.

``python -m anydevice.testing --build`` builds the simulator's library (if the build cache
lacks it) and exits, printing where it is: for a CI job's or a container image's set-up,
so that no test pays the build; status 1 with the reason when it cannot be built.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import NoReturn

from anydevice.testing.races import MODES, race_mode, uncaught
from anydevice.testing.simulator import enable


def build() -> NoReturn:
    """Build (or find built) the simulator's library, say where it is, and exit."""
    from anydevice.errors import ExtensionError
    from anydevice.testing.simulator import load

    try:
        library = load()
    except ExtensionError as e:
        print(f"anydevice.testing: the simulated accelerator cannot be built here: {e}",
              file=sys.stderr)  # fmt: skip
        sys.exit(1)
    print(f"anydevice.testing: the simulated accelerator is built: {library.__file__}")
    sys.exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m anydevice.testing",
        description="Run a script on anydevice's simulated accelerator, as CUDA GPUs by default.",
    )
    parser.add_argument("--name", default="sim", help="the simulator's device type (default: sim)")
    parser.add_argument("--bandwidth", default="2GB/s", help="the link's speed (2GB/s)")
    parser.add_argument("--capacity", default=None, help="memory per device (default: host's)")
    parser.add_argument("--devices", type=int, default=1, help="how many devices (1)")
    parser.add_argument(
        "--races",
        choices=MODES,
        default="raise",
        help="a stream race raises at the racing line and fails the run (raise, the "
        "default), is a warning (warn), or is not looked for (off)",
    )
    parser.add_argument(
        "--cuda",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="present the devices as CUDA GPUs (default); --no-cuda: as the simulator's own",
    )
    parser.add_argument(
        "--build",
        action="store_true",
        help="build the simulator's library if the build cache lacks it, say where it is, "
        "and exit (no script): for a CI job's or an image's set-up",
    )
    parser.add_argument("script", nargs="?", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = parser.parse_args(argv)
    if ns.build:
        if ns.script is not None:
            parser.error(f"--build takes no script (given {ns.script!r}); run the script apart")
        build()
    if ns.script is None:
        parser.error("the following arguments are required: script (or --build)")
    sys.argv = [ns.script, *ns.args]
    _path_first(ns.script)
    code: str | int | None = 0
    try:
        if ns.cuda:
            from anydevice.testing.cuda import simulate_cuda

            with simulate_cuda(
                ns.devices,
                name=ns.name,
                bandwidth=ns.bandwidth,
                capacity=ns.capacity,
                races=ns.races,
            ):
                runpy.run_path(ns.script, run_name="__main__")
        else:
            enable(
                ns.name,
                bandwidth=ns.bandwidth,
                capacity=ns.capacity,
                devices=ns.devices,
                races=ns.races,
            )
            os.environ.setdefault("ANYDEVICE_DEVICE", ns.name)
            runpy.run_path(ns.script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    caught = uncaught()
    if caught and race_mode() == "raise" and code in (0, None):
        print(
            f"anydevice.testing: {len(caught)} stream race(s) found; the first:\n{caught[0]}",
            file=sys.stderr,
        )
        code = 1
    sys.exit(code)


def _path_first(script: str) -> None:
    """``sys.path[0]`` as ``python script.py`` sets it: the script's directory, links
    resolved, where ``-m`` put the working directory (``-P``, Python 3.11's, puts neither)."""
    if os.path.isfile(script) and not getattr(sys.flags, "safe_path", False):
        sys.path[0] = os.path.dirname(os.path.realpath(script))


if __name__ == "__main__":
    main()
