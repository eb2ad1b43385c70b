"""Which torch build ``make`` installs into ``.venv``, said in one line, then installed.

On Linux, PyPI's torch is the CUDA build: 16 ``nvidia-*`` packages, triton and the CUDA
libraries, several GB that can do nothing on a machine without an NVIDIA GPU. So, the
first rule that applies:

1. A torch is installed already (in the environment this Python runs) and meets the
   constraints file's pin: it is kept (the line says how to change it).
2. ``TORCH_INDEX_URL`` is set: torch comes from that index (empty: pip's own index).
3. Not Linux: pip's own index (PyPI's torch for macOS and Windows has no CUDA libraries).
4. An NVIDIA GPU is here (the driver in ``/proc/driver/nvidia``, a ``/dev/nvidia<N>``
   device node, a display or 3D controller of vendor 0x10de on the PCI bus, or
   ``nvidia-smi``, which is all WSL shows): pip's own index, the CUDA build.
5. Otherwise the CPU build, from torch's own CPU index, where that index answers; where
   it does not, pip's own index, saying so.

Standard library only: it runs before anything is installed. ``--root`` reads ``/proc``,
``/sys`` and ``/dev`` under another folder, so a test can hand it a made-up machine.

    python scripts/torch_build.py [--constraint constraints.txt] [--root /] [--dry-run]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
VARIABLE = "TORCH_INDEX_URL"
NVIDIA = "0x10de"
#: PCI classes of a GPU: 0x0300 VGA-compatible, 0x0302 3D controller (0x0380: other display)
GPU_CLASSES = ("0x0300", "0x0302", "0x0380")
#: Seconds the CPU index gets to answer before the fallback.
PROBE_SECONDS = 5.0


@dataclass(frozen=True)
class Choice:
    """What to install torch from, and why: one line for people."""

    build: str  #: "cpu", "default" (pip's own index), "user" (TORCH_INDEX_URL), "installed"
    index_url: str | None  #: the index torch comes from; None: pip's own
    reason: str

    @property
    def install(self) -> bool:
        return self.build != "installed"

    @property
    def line(self) -> str:
        return f"torch: {self.reason}"


def nvidia_gpu(root: Path, environ: Mapping[str, str]) -> str | None:
    """Where this machine shows an NVIDIA GPU (a sentence), or None."""
    driver = root / "proc" / "driver" / "nvidia"
    if driver.is_dir():
        return f"the NVIDIA driver is loaded ({driver})"
    nodes = sorted(p.name for p in (root / "dev").glob("nvidia*") if p.name[6:].isdigit())
    if nodes:
        return f"an NVIDIA device node is here ({root / 'dev' / nodes[0]})"
    for device in sorted((root / "sys" / "bus" / "pci" / "devices").glob("*")):
        vendor, kind = _read(device / "vendor"), _read(device / "class")
        if vendor == NVIDIA and kind.startswith(GPU_CLASSES):
            return f"an NVIDIA GPU is on the PCI bus ({device.name}, class {kind})"
    folders = [*environ.get("PATH", "").split(os.pathsep), "/usr/lib/wsl/lib"]
    for folder in folders:
        if not folder:
            continue
        smi = root / folder.lstrip("/") / "nvidia-smi"
        if smi.is_file() and os.access(smi, os.X_OK):
            return f"nvidia-smi is here ({smi})"
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return ""


def pinned_torch(constraints: Path | None) -> str | None:
    """The constraints file's specifier for torch (``"==2.13.0"``), or None."""
    if constraints is None or not constraints.is_file():
        return None
    for line in constraints.read_text().splitlines():
        m = re.match(r"\s*torch\s*([<>=!~].*?)\s*(#.*)?$", line)
        if m:
            return m.group(1).replace(" ", "")
    return None


def meets(version: str, specifier: str | None) -> bool:
    """Whether ``version`` meets ``specifier``, as pip reads it (a local label such as
    ``+cpu`` is ignored by ``==``)."""
    if not specifier:
        return True
    try:
        from pip._vendor.packaging.specifiers import SpecifierSet  # pip is in any venv
    except ImportError:  # no pip here: the exact pins this project uses, read by hand
        public = version.split("+")[0]
        pins = [s[2:] for s in specifier.split(",") if s.startswith("==")]
        return all(public == p or (p.endswith(".*") and public.startswith(p[:-1])) for p in pins)
    return SpecifierSet(specifier).contains(version, prereleases=True)


def installed_torch() -> str | None:
    """The version of the torch this Python would import, without importing it."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def reach(url: str, timeout: float = PROBE_SECONDS) -> str | None:
    """None where ``url`` answers; else why not (a short phrase)."""
    request = urllib.request.Request(url.rstrip("/") + "/torch/", method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        return f"it answered HTTP {e.code}"
    except urllib.error.URLError as e:
        return str(e.reason)
    except (OSError, ValueError) as e:  # a timeout, a malformed address
        return str(e) or type(e).__name__


def decide(
    *,
    root: Path = Path("/"),
    environ: Mapping[str, str] = os.environ,
    platform: str = sys.platform,
    installed: str | None = None,
    pin: str | None = None,
    probe: Callable[[str], str | None] = reach,
) -> Choice:
    """The build to install, by the rules in this module's docstring."""
    replaced = ""
    if installed is not None:
        if meets(installed, pin):
            change = (
                f"{VARIABLE} applies to a new .venv: make clean first"
                if VARIABLE in environ
                else f"to change it: make clean, then {VARIABLE}=<index> make"
            )
            return Choice(
                "installed", None, f"keeping torch {installed}, installed already ({change})."
            )
        replaced = f"torch {installed} does not meet torch{pin} (constraints.txt), so: "
    if VARIABLE in environ:
        url = environ[VARIABLE].strip()
        if not url:
            return Choice(
                "user", None, f"{replaced}pip's own index ({VARIABLE} is empty: your choice)."
            )
        return Choice("user", url, f"{replaced}from {url} ({VARIABLE}: your choice).")
    if not platform.startswith("linux"):
        return Choice(
            "default", None, f"{replaced}pip's own index ({platform}: PyPI's torch has no CUDA)."
        )
    gpu = nvidia_gpu(root, environ)
    if gpu is not None:
        return Choice(
            "default", None, f"{replaced}the default (CUDA) build from pip's index: {gpu}."
        )
    why = "no NVIDIA GPU here (no driver, no device on the PCI bus, no nvidia-smi)"
    problem = probe(CPU_INDEX)
    if problem is None:
        return Choice("cpu", CPU_INDEX, f"{replaced}the CPU build from {CPU_INDEX}: {why}.")
    return Choice(
        "default",
        None,
        f"{replaced}{why}, but {CPU_INDEX} cannot be reached ({problem}): pip's own index "
        f"instead (on Linux PyPI's torch is the CUDA build, several GB; {VARIABLE}=<index> "
        "chooses another).",
    )


def pip_command(choice: Choice, python: str, constraint: Path | None) -> list[str] | None:
    """The pip command that installs torch for ``choice``; None where nothing is to do."""
    if not choice.install:
        return None
    command = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if constraint is not None:
        command += ["-c", str(constraint)]
    if choice.index_url is not None:
        command += ["--index-url", choice.index_url]
    return [*command, "torch"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--constraint", "-c", type=Path, default=None, metavar="FILE")
    parser.add_argument("--root", type=Path, default=Path("/"), help="read /proc, /sys here")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run none")
    args = parser.parse_args(argv)
    choice = decide(root=args.root, installed=installed_torch(), pin=pinned_torch(args.constraint))
    print(choice.line, flush=True)
    command = pip_command(choice, sys.executable, args.constraint)
    if command is None:
        return 0
    if args.dry_run:
        print(shlex.join(command))
        return 0
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
