"""Import cost and `anydevice info` wall time, against accelerate, Lightning Fabric, ignite.

Extra import time is measured inside one fresh interpreter per sample, after torch is
already imported, so torch's own (large, noisy) import time cancels out:
``import torch; t0 = perf_counter(); import X; print(perf_counter() - t0)``.

Targets: anydevice adds < 50 ms to ``import torch``; ``anydevice info --json`` < 1.5 s.

Every package is timed from bytecode, as after ``pip install`` (which compiles it): the
source tree's modules are compiled first and ``PYTHONDONTWRITEBYTECODE`` is dropped, or an
editable install would be timed compiling itself against peers loading ``.pyc`` files.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, python, run_interleaved, save, wall

PEERS = {
    "anydevice": "anydevice",
    "accelerate": "accelerate",
    "lightning.fabric": "lightning.fabric",
    "ignite": "ignite.engine",
}


def extra_import(module: str) -> float:
    code = (
        "import time, torch; t = time.perf_counter(); import "
        f"{module}; print(time.perf_counter() - t)"
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

    cmds = {
        "import torch (floor)": wall(python("import torch")),
        "anydevice info --json": wall([sys.executable, "-m", "anydevice", "info", "--json"]),
        "python -m torch.utils.collect_env": wall(
            [sys.executable, "-m", "torch.utils.collect_env"]
        ),
    }
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    if accelerate:
        cmds["accelerate env"] = wall([accelerate, "env"])
    info = Result("info-wall-time", "s", baseline="anydevice info --json")
    for label, samples in run_interleaved(cmds, args.rounds).items():
        info.add(label, samples)
    over = info.rows["anydevice info --json"] - info.rows["import torch (floor)"]
    info.extra["info_minus_import_torch_s"] = over
    info.notes.append(
        f"anydevice info --json takes {over * 1000:.0f} ms beyond `import torch` itself; "
        "target < 1.5 s in all"
    )
    save(info)


if __name__ == "__main__":
    main()
