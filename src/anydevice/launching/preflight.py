"""What would break a launch's workers as they start, refused before any starts.

* A script that calls ``launch`` outside ``if __name__ == "__main__":`` — each ``spawn``
  or ``forkserver`` worker runs the script's top level again as it starts, and would
  launch once more (:func:`check_main_guard`, :func:`refuse_while_a_worker_starts`).
* A function or arguments that the workers cannot be sent: not picklable (a lambda, a
  nested function), or made of classes and functions defined in an interactive
  ``__main__`` (a notebook cell, the REPL, ``python -c``), which a new process has no
  module to import from (:func:`check_sendable`, :func:`main_references`); and ``fork``
  once CUDA is initialised in this process.

The DataLoader's workers have the same trap: :mod:`anydevice.feeding.startmethod`.
"""

from __future__ import annotations

import ast
import os
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

from anydevice.errors import DistributedError, WorkerImportError
from anydevice.feeding.startmethod import interactive_main

__all__ = [
    "check_importable",
    "check_main_guard",
    "check_sendable",
    "main_references",
    "refuse_while_a_worker_starts",
]


def refuse_while_a_worker_starts() -> None:
    """Stop a ``spawn``/``forkserver`` worker that runs ``launch`` while it starts.

    Such a worker first runs the launching script's top level again (as ``__mp_main__``);
    a ``launch`` call there that no ``if __name__ == "__main__":`` guards would launch
    once more, and Python's multiprocessing then fails with its long "bootstrapping
    phase" error. :func:`check_main_guard` refuses that script before any worker starts;
    this is for a call it could not see (a script whose source cannot be read).
    """
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(
            "anydevice: ad.launch was called again in a starting worker: the script calls "
            f"it {_GUARD_FIX.format(method='spawn')}"
        )


#: What to do about a ``launch`` call that workers would run again as they start.
_GUARD_FIX = (
    'outside `if __name__ == "__main__":`, which each {method}ed worker runs again as it '
    "starts. Put the call under that guard."
)


def check_main_guard(start_method: str) -> None:
    """Refuse a ``launch`` from the top level of the ``__main__`` script outside ``if
    __name__ == "__main__":``, which each ``spawn``/``forkserver`` worker would run again.

    The call is found on the stack (the ``__main__`` module's own frame) and its line in
    the script's syntax tree; a script that cannot be read or parsed is let through.
    """
    if start_method == "fork":
        return
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return  # `python -m package`: multiprocessing does not run a package's __main__ again
    if spec_name is None and not getattr(main, "__file__", None):
        return  # an interactive session: nothing for a worker to run again
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"
    ):
        frame = frame.f_back  # type: ignore[assignment]  # None ends the loop
    if frame is None:
        return
    path, line = frame.f_code.co_filename, frame.f_lineno
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return
    if _guarded(tree, line):
        return
    raise DistributedError(
        f"{os.path.basename(path)} line {line} calls ad.launch "
        + _GUARD_FIX.format(method=start_method)
    )


def _guarded(tree: ast.Module, line: int) -> bool:
    """Whether ``line`` of the module lies in the body of an ``if`` that tests
    ``__name__`` against ``"__main__"``."""
    nodes: list[ast.stmt | ast.excepthandler] = list(tree.body)
    while nodes:
        node = next((n for n in nodes if n.lineno <= line <= (n.end_lineno or n.lineno)), None)
        if node is None:
            return False
        if isinstance(node, ast.If) and _tests_main(node.test):
            return any(n.lineno <= line <= (n.end_lineno or n.lineno) for n in node.body)
        nodes = []
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.stmt, ast.excepthandler)):
                nodes.append(child)
            elif isinstance(child, ast.match_case):
                nodes.extend(child.body)
    return False


def _tests_main(test: ast.expr) -> bool:
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    texts = {n.value for n in ast.walk(test) if isinstance(n, ast.Constant)}
    return "__name__" in names and "__main__" in texts


def check_sendable(fn: Callable[..., Any], args: tuple[Any, ...], start_method: str) -> None:
    """Refuse ``fn`` and ``args`` that the workers could not be sent: under ``fork`` after
    CUDA was initialised here; else not picklable, or made of an interactive
    ``__main__``'s classes and functions (:func:`main_references`).

    Raises:
        DistributedError: CUDA is initialised and ``start_method`` is ``fork``; or ``fn``
            and ``args`` cannot be pickled.
        WorkerImportError: see :func:`check_importable`.
    """
    if start_method == "fork":
        from anydevice.hardware.backends.cuda import driver_initialized

        if driver_initialized():
            raise DistributedError(
                "CUDA is already initialised in this process, so forked workers cannot use "
                "it (and may hang). Use start_method='spawn' (the default)"
                + (
                    ", with the function in a .py file next to the notebook, imported from "
                    "there; or restart the kernel and launch before anything uses CUDA."
                    if interactive_main()
                    else "."
                )
            )
        return
    try:
        check_importable(fn, args, start_method)  # a notebook's function or class: say so now
    except WorkerImportError:
        raise
    except Exception as e:
        raise DistributedError(
            f"Cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to "
            f"{start_method}ed workers: {type(e).__name__}: {e}. Define the function at module "
            "level (not a lambda or a nested function) and pass picklable arguments, or use "
            "start_method='fork'."
        ) from e


class _Discard:
    """A file that keeps nothing: pickling into it only walks the object."""

    def write(self, data: bytes) -> int:
        return len(data)


class _MainFinder(pickle.Pickler):
    """A pickler that notes each class and function of ``__main__`` it meets, however
    deep (``persistent_id`` sees every object pickled)."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        self.found: dict[str, str] = {}

    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            what = "class" if isinstance(obj, type) else "function"
            self.found.setdefault(f"{what} {obj.__qualname__}", what)


def main_references(obj: Any) -> list[str]:
    """The classes and functions of an interactive ``__main__`` that ``obj`` is made of,
    at any depth, as pickle sends them (``["function train", "class DS"]``); empty when
    ``__main__`` is a file (a script's workers import it again as ``__mp_main__``).

    Raises:
        Exception: whatever pickling ``obj`` raises (a lambda, an open file, ...).
    """
    finder = _MainFinder()
    finder.dump(obj)  # a lambda or a nested function fails here: not a question of modules
    return list(finder.found) if interactive_main() else []


def check_importable(fn: Any, args: tuple[Any, ...], start_method: str) -> None:
    """Refuse an ``ad.launch`` whose workers could not import ``fn`` or what ``args`` are
    made of (a notebook's definitions); nothing for forked workers.

    Raises:
        WorkerImportError: naming what is defined in the interactive ``__main__``, the
            start method, and the ways out.
        Exception: whatever pickling ``fn`` and ``args`` raises.
    """
    if start_method == "fork":
        return
    names = main_references((fn, args))
    if names:
        raise WorkerImportError(
            f"ad.launch's workers start with {start_method!r} and cannot import "
            f"{', '.join(names)}: defined in an interactive session (a notebook cell, the "
            "REPL, python -c), it has no module to import it from, and each worker would "
            "die with \"Can't get attribute ... on <module '__main__'>\". Move the "
            "definition into a .py file next to the notebook and import it from there; or, "
            "on Linux before CUDA is used in this process, pass start_method='fork'."
        )
