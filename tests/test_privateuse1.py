"""Accelerators beyond the named kinds, through torch's ``privateuse1`` extension point.

torch registers one such backend per process, for good, so the cases that need it
(``tests/privateuse1_cases.py``) run in a child pytest here; this process keeps torch as
it is, and checks what holds without the backend.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import anydevice as ad
from anydevice.hardware import backends

CASES = Path(__file__).with_name("privateuse1_cases.py")
OPENREG = Path(__file__).with_name("openreg_cases.py")


def _run_cases(cases: Path, **env: str) -> str:
    """Run a cases file in a child pytest (a backend registers for its whole process)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(cases), "-q", "-rs", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **env},
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@pytest.mark.parametrize("name", ["npy", "tpu"])
def test_python_privateuse1_backend_in_a_child_process(name: str) -> None:
    """The same cases under two names: ``tpu`` also checks that a backend of that name (a
    native TPU backend) is taken for itself, not for torch_xla's device."""
    out = _run_cases(CASES, ANYDEVICE_TEST_BACKEND=name)
    assert "14 passed" in out, out
    # What the python backend cannot do is skipped, each with torch's own reason.
    assert "cannot synchronise" in out and "no device allocator" in out, out


def test_openreg_backend_in_a_child_process() -> None:
    """torch's C++ reference backend: real streams, timing events, pinned memory and
    allocator counters (``tests/openreg_cases.py``)."""
    if importlib.util.find_spec("torch_openreg") is None:
        pytest.skip(
            "torch's OpenReg backend (torch_openreg) is not installed: it is built from "
            "torch's source tree, test/cpp_extensions/open_registration_extension"
        )
    out = _run_cases(OPENREG)
    assert "6 passed" in out, out


def test_no_generic_accelerator_without_one() -> None:
    assert backends.generic_kinds() == ()
    assert backends.get("accelerator").probe().devices == ()
    with pytest.raises(KeyError, match="'npu'"):
        backends.get("npu")


def test_an_unregistered_name_is_a_spec_error() -> None:
    with pytest.raises(ad.DeviceSpecError, match="Unknown device 'npu'"):
        ad.device("npu")


def test_torch_free_probe_asks_nothing() -> None:
    code = (
        "import sys; from anydevice.hardware.backends import get; "
        "p = get('accelerator').probe_without_torch(); "
        "print(p is not None and p.devices == (), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert out == ["True", "False"]
    assert backends.get("accelerator").probe_without_torch() is None  # torch is here: ask it
    assert torch.accelerator.current_accelerator() is None or backends.generic_kinds() == ()
