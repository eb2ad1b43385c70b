"""Run a script as one launched worker: ``python -m anydevice.distributed.runner SCRIPT ARGS``.

``anydevice launch`` starts each worker through this module rather than as ``python
SCRIPT``, so that an exception in the script is written to the worker's error file (torch's
``@record``) and the launcher can name the failing rank with its traceback — without the
script having to decorate anything. The script runs as ``__main__`` with ``sys.argv`` and
``sys.path[0]`` as ``python SCRIPT ARGS`` would give it; ``-m MODULE`` runs a module the way
``python -m MODULE`` does.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

__all__ = ["main", "run"]


def run(target: str, args: Sequence[str], *, module: bool = False) -> None:
    """Run ``target`` (a script path, or a module name when ``module``) as ``__main__``,
    recording an uncaught exception in ``TORCHELASTIC_ERROR_FILE`` when that is set."""
    from torch.distributed.elastic.multiprocessing.errors import record

    record(_execute)(target, list(args), module)


def _execute(target: str, args: list[str], module: bool) -> None:
    if module:
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()  # as `python -m MODULE` has it
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if not os.path.isfile(target):
        raise FileNotFoundError(f"anydevice launch: no script {target!r} (cwd {os.getcwd()})")
    sys.argv = [target, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` has it
    runpy.run_path(target, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m anydevice.distributed.runner [-m] TARGET ARGS...``"""
    argv = list(sys.argv[1:] if argv is None else argv)
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m anydevice.distributed.runner [-m] TARGET [ARGS...]")
    run(argv[0], argv[1:], module=module)


if __name__ == "__main__":
    main()
