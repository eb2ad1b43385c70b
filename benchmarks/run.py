"""Run every benchmark (``make bench``), or those named: ``python benchmarks/run.py import``."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    wanted = sys.argv[1:]
    scripts = sorted(HERE.glob("bench_*.py"))
    for script in scripts:
        name = script.stem.removeprefix("bench_")
        if wanted and name not in wanted:
            continue
        print(f"\n##### {script.name}")
        sys.argv = [str(script)]
        runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
