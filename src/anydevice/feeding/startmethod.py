"""What worker processes can import, checked before they start.

A process started with ``spawn`` or ``forkserver`` (macOS, Windows, and Linux's default
from Python 3.14) re-imports what it is sent by module and name. A class or function
defined in an interactive ``__main__`` — a notebook cell, the REPL, ``python -c`` — has no
module to import it from: the worker dies on ``Can't get attribute 'DS' on <module
'__main__'>`` and torch's DataLoader reports only that a worker "exited unexpectedly".
:func:`check_loader_workers` (for ``DeviceLoader``) names such a definition, and what to
do, before any worker starts; :mod:`anydevice.launching.preflight` does the same for
``ad.launch``.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterable
from typing import Any

from anydevice.errors import WorkerImportError

__all__ = [
    "check_loader_workers",
    "interactive_main",
    "start_method_of",
    "unimportable",
]


def interactive_main() -> bool:
    """Whether ``__main__`` is interactive (a notebook, the REPL, ``python -c``): it has
    no file a new process could import it from."""
    main = sys.modules.get("__main__")
    return main is not None and not getattr(main, "__file__", None)


def start_method_of(context: Any = None) -> str:
    """The start method of a DataLoader's ``multiprocessing_context`` (a name, a context,
    or None: this process's default)."""
    if isinstance(context, str):
        return context
    if context is not None and hasattr(context, "get_start_method"):
        return str(context.get_start_method())
    return str(multiprocessing.get_start_method(allow_none=False))


def unimportable(objects: Iterable[tuple[str, Any]]) -> list[str]:
    """The named objects (``("dataset", ds)``, ...) that are, or are instances of, classes
    and functions defined in an interactive ``__main__``, as ``"dataset (class DS)"``."""
    if not interactive_main():
        return []
    found = []
    for role, obj in objects:
        if obj is None:
            continue
        defined = (
            obj
            if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__"))
            else type(obj)
        )
        if getattr(defined, "__module__", None) == "__main__":
            what = "class" if isinstance(defined, type) else "function"
            found.append(f"{role} ({what} {defined.__qualname__})")
    return found


def check_loader_workers(loader: Any) -> None:
    """Refuse a DataLoader whose worker processes could not import its dataset, sampler,
    collate_fn or worker_init_fn (see the module docstring); nothing for one without
    workers or whose workers are forked.

    Raises:
        WorkerImportError: naming what is defined in the interactive ``__main__``, the
            start method, and the ways out.
    """
    workers = getattr(loader, "num_workers", 0)
    if not isinstance(workers, int) or workers <= 0 or not hasattr(loader, "dataset"):
        return
    method = start_method_of(getattr(loader, "multiprocessing_context", None))
    if method == "fork":
        return
    names = unimportable(
        [
            ("dataset", loader.dataset),
            ("collate_fn", getattr(loader, "collate_fn", None)),
            ("worker_init_fn", getattr(loader, "worker_init_fn", None)),
            ("sampler", getattr(loader, "sampler", None)),
            ("batch_sampler", getattr(loader, "batch_sampler", None)),
        ]
    )
    if names:
        raise WorkerImportError(
            f"The DataLoader's {workers} worker process(es) start with {method!r} and "
            f"cannot import {', '.join(names)}: defined in an interactive session "
            "(a notebook cell, the REPL, python -c), it has no module to import it from, "
            "and each worker would die with \"Can't get attribute ... on <module "
            "'__main__'>\". Move the definition into a .py file next to the notebook and "
            "import it from there; or pass num_workers=0; or, on Linux before CUDA is "
            "used, multiprocessing_context='fork'."
        )
