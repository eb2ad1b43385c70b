"""Which torch is installed, and what it was built for, read without importing it.

``import torch`` takes seconds; its version and build are plain text in ``torch/version.py``
(``__version__``, and each toolkit it was built with: ``cuda``, ``hip``, ...), and the
libraries and device extensions installed beside it are named by their ``*.dist-info``
directories. The command line reads
them from there, so ``anydevice info`` answers in a fraction of a second. Once torch is
imported, its module is the authority and is read instead.

The ``*.dist-info`` directories are read directly rather than through
``importlib.metadata``, whose own import (email, zipfile, csv) costs more than the rest of
``anydevice info`` together.

>>> build = read()
>>> build is not None and build.version.startswith("2.")
True
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TorchBuild", "device_extensions", "library_version", "read"]


@dataclass(frozen=True)
class TorchBuild:
    """torch's version and the toolkits it was built with.

    >>> TorchBuild("2.13.0", (("cuda", "13.0"),)).toolkit("cuda")
    '13.0'
    """

    version: str
    #: The toolkits it was built with, as ``torch.version`` names them (``("cuda",
    #: "12.8")``, ``("hip", ...)``, ``("xpu", ...)``); empty for a build for the CPU alone.
    #: What each means is the device kinds' to say
    #: (:func:`anydevice.hardware.backends.build_label`).
    toolkits: tuple[tuple[str, str], ...] = ()
    imported: bool = False  #: read from the imported module rather than from its files

    def toolkit(self, name: str) -> str | None:
        """The version of toolkit ``name`` this torch was built with, None if without."""
        return dict(self.toolkits).get(name)


#: What ``torch/version.py`` sets besides the toolkits.
_NOT_TOOLKITS = frozenset({"__version__", "git_version", "debug"})


def _toolkits(values: Mapping[str, object]) -> tuple[tuple[str, str], ...]:
    """The toolkits among ``torch.version``'s values: every other non-empty text."""
    return tuple(
        (name, value)
        for name, value in values.items()
        if name not in _NOT_TOOLKITS and not name.startswith("_") and isinstance(value, str)
        if value
    )


def read() -> TorchBuild | None:
    """The installed torch's build: from ``torch.version`` once torch is imported, else
    from ``torch/version.py`` parsed as text; ``None`` when torch is not installed."""
    module = sys.modules.get("torch")
    if module is not None and hasattr(module, "version"):
        return TorchBuild(
            version=str(module.__version__),
            toolkits=_toolkits(vars(module.version)),
            imported=True,
        )
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    values = _assignments(Path(next(iter(spec.submodule_search_locations))) / "version.py")
    version = values.get("__version__")
    if not isinstance(version, str):
        version = library_version("torch", parts=None)
        if version is None:
            return None
    return TorchBuild(version=version, toolkits=_toolkits(values))


def _assignments(path: Path) -> dict[str, Any]:
    """The literal values a module assigns at top level (``x = '1'``, ``x: str = '1'``)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            try:
                out[target.id] = ast.literal_eval(value)
            except ValueError:
                continue  # computed at import time: not readable as text
    return out


def library_version(*distributions: str, parts: int | None = 3) -> str | None:
    """The version of the first installed distribution named, cut to ``parts`` numbers.

    torch's CUDA wheels load cuDNN and NCCL from the ``nvidia-cudnn-cu12`` /
    ``nvidia-nccl-cu12`` (or ``-cu13``) packages, so their versions are the libraries'.

    >>> library_version("no-such-distribution") is None
    True
    """
    wanted = [_normalise(name) for name in distributions]
    found: dict[str, str] = {}
    for info in _dist_infos():
        name, _, version = info.name[: -len(".dist-info")].partition("-")
        found.setdefault(_normalise(name), version)
    for name in wanted:
        if name in found:
            version = found[name]
            return version if parts is None else ".".join(version.split(".")[:parts])
    return None


def device_extensions() -> tuple[str, ...]:
    """Out-of-tree device backends torch loads when imported (entry points ``torch.backends``).

    They register a ``privateuse1`` device (Ascend NPU, ...) only once torch is imported.

    >>> isinstance(device_extensions(), tuple)
    True
    """
    names: set[str] = set()
    for info in _dist_infos():
        try:
            text = (info / "entry_points.txt").read_text(encoding="utf-8")
        except OSError:
            continue
        if "[torch.backends]" not in text:
            continue
        section = text.split("[torch.backends]", 1)[1].split("\n[", 1)[0]
        names.update(m.group(1) for m in re.finditer(r"^\s*([^#=\s][^=]*?)\s*=", section, re.M))
    return tuple(sorted(names))


def _dist_infos() -> Iterator[Path]:
    """Every installed distribution's ``*.dist-info`` directory, in ``sys.path`` order."""
    for entry in sys.path:
        try:
            with os.scandir(entry or ".") as it:
                names = [e.name for e in it if e.name.endswith(".dist-info")]
        except OSError:
            continue
        for name in names:
            yield Path(entry or ".") / name


def _normalise(name: str) -> str:
    """A distribution name as PEP 503 compares them.

    >>> _normalise("Nvidia_CUDNN.cu12")
    'nvidia-cudnn-cu12'
    """
    return re.sub(r"[-_.]+", "-", name).lower()
