"""Run every GPU benchmark: each function named ``gpu_*`` in ``benchmarks/bench_*.py``.

``scripts/gpu-check.sh`` runs this on a machine with an NVIDIA GPU. Without CUDA it says
so and exits 0. ``python benchmarks/gpu.py to precision`` runs only those modules.

Every ``gpu_*`` function takes ``device`` (default ``"cuda"``) and ``quick`` (tiny sizes:
a smoke run of every line) and returns its result(s); ``tests/test_benchmarks.py`` runs
each with ``device="cpu", quick=True``, so one that crashes fails ``make test``.
``--quick`` here does the same on the GPU.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: GPU benchmarks skipped")
        return 0
    sys.path.insert(0, str(HERE))
    quick = "--quick" in sys.argv[1:]
    wanted = [a for a in sys.argv[1:] if a != "--quick"]
    failed = 0
    for script in sorted(HERE.glob("bench_*.py")):
        name = script.stem.removeprefix("bench_")
        if wanted and name not in wanted:
            continue
        spec = importlib.util.spec_from_file_location(script.stem, script)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        for attr in sorted(vars(module)):
            fn = getattr(module, attr)
            if attr.startswith("gpu_") and callable(fn):
                print(f"\n##### {script.name}:{attr}", flush=True)
                try:
                    fn(quick=quick)
                except Exception:  # report every benchmark, then fail at the end
                    traceback.print_exc()
                    failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
