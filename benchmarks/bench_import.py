"""Import cost against accelerate, Lightning Fabric, ignite (`anydevice info`: bench_cli.py).

Extra import time is measured inside one fresh interpreter per sample, after torch is
already imported, so torch's own (large, noisy) import time cancels out:
``import torch; t0 = perf_counter(); import X; print(perf_counter() - t0)``. anydevice loads
its public names on first use, so it is timed importing and touching all of them.

Target: anydevice adds < 50 ms to ``import torch``.

Every package is timed from bytecode, as after ``pip install`` (which compiles it): the
source tree's modules are compiled first and ``PYTHONDONTWRITEBYTECODE`` is dropped, or an
editable install would be timed compiling itself against peers loading ``.pyc`` files.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, python, run_interleaved, save

PEERS = {
    "anydevice": "import anydevice; [getattr(anydevice, n) for n in anydevice.__all__]",
    "accelerate": "import accelerate",
    "lightning.fabric": "import lightning.fabric",
    "ignite": "import ignite.engine",
}


def extra_import(statement: str) -> float:
    code = (
        f"import time, torch; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    )
    out = subprocess.run(python(code), capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    import anydevice

    compileall.compile_dir(Path(anydevice.__file__).parent, quiet=1)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the children read and write .pyc
    present = {k: v for k, v in PEERS.items() if importlib.util.find_spec(k.split(".")[0])}
    imp = Result("import-overhead", "ms", baseline="anydevice")
    for label, samples in run_interleaved(
        {k: (lambda m=m: 1000 * extra_import(m)) for k, m in present.items()}, args.rounds
    ).items():
        imp.add(label, samples)
    imp.notes.append("time to import X after `import torch` in a fresh interpreter; target < 50 ms")
    missing = sorted(set(PEERS) - set(present))
    if missing:
        imp.notes.append(f"not installed, not measured: {', '.join(missing)}")
    save(imp)


if __name__ == "__main__":
    main()
