"""A Python program run in a child process as a user runs it, for the tests that check a
whole program's output: this environment without pytest's and anydevice's own variables
(the suite's heartbeat folder, a device chosen for the tests), bounded in time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float = 0.0

    def ok(self) -> str:
        """The output of a run that exited 0."""
        assert self.returncode == 0, f"exit {self.returncode}\n{self.stdout}\n{self.stderr}"
        return self.stdout

    def clean(self) -> str:
        """The output of a run that exited 0 with no stream race reported."""
        out = self.ok()
        assert "StreamRace" not in self.stderr and "stream race" not in self.stderr, self.stderr
        return out


def run_python(args: list[str], *, timeout: float, cwd: Path | None = None, **env: str) -> Run:
    """``python *args`` in ``cwd``, with ``env`` added to the user's environment; a run
    that outlasts ``timeout`` is killed and returned with exit -1, saying so."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "ANYDEVICE_"))}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**environ, "PYTHONDONTWRITEBYTECODE": "1", **env},
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        said = [_text(e.stdout), _text(e.stderr)]
        return Run(-1, said[0], f"timed out after {timeout} s: {args}\n{said[1]}", timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


def _text(output: str | bytes | None) -> str:
    # A timed-out run's output comes as bytes, even with text=True.
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""
