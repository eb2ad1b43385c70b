"""The README's quick start runs as written, on this machine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_quick_start_runs():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert code is not None
    assert len(code.group(1).splitlines()) <= 15
    out = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "torch.Size([4, 2])" in out.stdout


def test_measure_example_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "measure.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Measurement('forward, batch 64'" in out.stdout
    assert "largest batch that fits:" in out.stdout and "MemoryUsage(" in out.stdout
