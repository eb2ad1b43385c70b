"""``anydevice.testing.races``: the stream race detector.

Each classic ordering bug of ``tests/race_cases.py`` (written in plain torch, with its
correct twin) runs in a child process on the simulated accelerator at its defaults; so do
scripts run as a user runs them (``python -m anydevice.testing``) and a user's pytest
suite with the plugin. This process checks what holds without the simulator: argument
errors, and the report's words.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from anydevice import testing
from anydevice.errors import AnydeviceError, DeviceSpecError
from test_testing import TIMEOUT, _child, _toolchain_or_skip

CASES = Path(__file__).with_name("race_cases.py")
pytestmark = pytest.mark.timeout(TIMEOUT + 30)

#: Values no argument takes: not a number, negative, absurdly large, past int64.
ABSURD = [math.nan, -1, -1.5, 1e300, 2**63, math.inf * -1]


@pytest.mark.slow
@pytest.mark.long  # the detection table, 36 programs a mode (make test-long)
@pytest.mark.parametrize("as_on_a_gpu", ["0", "1"], ids=["simulator", "as-on-a-real-gpu"])
def test_every_bug_is_reported_naming_its_line_and_every_twin_runs_clean(as_on_a_gpu: str) -> None:
    """On the simulator, and watched as a real accelerator is (detect_races(): reuse seen
    by address, no protected pinned memory)."""
    _toolchain_or_skip()
    proc = _child(
        ["-m", "pytest", str(CASES), "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly"],
        ANYDEVICE_RACES_AS_ON_A_GPU=as_on_a_gpu,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    bugs = CASES.read_text().count("\ndef bug_")
    assert bugs == 18, bugs
    assert f"{2 * bugs} passed" in out, out  # none skipped


SCRIPT = """\
import torch

dev = torch.device("sim")
src = torch.full((1024,), 7.0).pin_memory()
copier = torch.Stream(dev)
with copier:
    x = src.to(dev, non_blocking=True)
{fix}print((x * 2).cpu().unique().tolist())
"""


@pytest.mark.slow
def test_a_script_with_a_race_fails_naming_the_line_and_the_fix(tmp_path: Path) -> None:
    _toolchain_or_skip()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(fix=""))
    proc = _child(["-m", "anydevice.testing", str(script)], ANYDEVICE_DEVICE="sim")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "StreamRaceError: stream race: read after write" in proc.stderr, proc.stderr
    assert "train.py:8" in proc.stderr and "train.py:7" in proc.stderr, proc.stderr
    assert "wait_stream(copier)" in proc.stderr, proc.stderr

    script.write_text(SCRIPT.format(fix="torch.accelerator.current_stream().wait_stream(copier)\n"))
    proc = _child(["-m", "anydevice.testing", str(script)], ANYDEVICE_DEVICE="sim")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[14.0]"], proc.stdout


@pytest.mark.long  # a child run of minutes on a busy machine (make test-long)
@pytest.mark.slow
def test_a_race_the_script_caught_still_fails_the_run_and_warn_lets_it_pass(tmp_path: Path) -> None:
    _toolchain_or_skip()
    script = tmp_path / "caught.py"
    caught = "try:\n    (x * 2).cpu()\nexcept Exception:\n    torch.accelerator.synchronize()\n"
    body = SCRIPT.format(fix=caught)  # caught, then waited for: the rest of it runs right
    script.write_text(body)
    proc = _child(["-m", "anydevice.testing", str(script)], ANYDEVICE_DEVICE="sim")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 stream race(s) found" in proc.stderr and "caught.py:9" in proc.stderr, proc.stderr

    warned = tmp_path / "warned.py"
    warned.write_text(SCRIPT.format(fix=""))
    proc = _child(["-m", "anydevice.testing", "--races", "warn", str(warned)])
    assert proc.returncode == 0, proc.stderr
    assert "StreamRaceWarning: stream race: read after write" in proc.stderr, proc.stderr


@pytest.mark.long  # a child run of minutes on a busy machine (make test-long)
@pytest.mark.slow
def test_a_users_test_with_a_race_fails_even_when_it_caught_it(tmp_path: Path) -> None:
    _toolchain_or_skip()
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["anydevice.testing.pytest_plugin"]\n')
    (tmp_path / "test_user.py").write_text(
        "import torch\n"
        "from anydevice import testing\n\n"
        "def _racy(dev):\n"
        "    src = torch.ones(8).pin_memory()\n"
        "    copier = torch.Stream(dev)\n"
        "    with copier:\n"
        "        x = src.to(dev, non_blocking=True)\n"
        "    return x * 1\n\n"
        "def test_caught(sim_device):\n"
        "    try:\n"
        "        _racy(sim_device)\n"
        "    except Exception:\n"
        "        pass\n\n"
        "def test_expected(sim_device):\n"
        "    with testing.expect_races() as found:\n"
        "        _racy(sim_device)\n"
        "    assert found[0].kind == 'read after write'\n\n"
        "def test_clean(sim_device):\n"
        "    x = torch.ones(8).pin_memory().to(sim_device, non_blocking=True)\n"
        "    assert (x * 2).cpu().tolist() == [2.0] * 8\n"
    )
    proc = _child(
        ["-m", "pytest", str(tmp_path), "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 failed, 2 passed" in out, out
    assert re.search(r"FAILED \S*::test_caught", out) and "StreamRaceError" in out, out

    proc = _child(
        ["-m", "pytest", str(tmp_path), "-q", "-p", "no:cacheprovider", "--sim-races=warn"]
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "3 passed" in out, out
    assert "StreamRaceWarning" in out, out


# --- arguments, checked before anything is built or queued ---------------------------------


@pytest.mark.parametrize("value", [*ABSURD, 0, "1e300GB/s", "-2GB/s", True, 1.0])
def test_bandwidth_out_of_range_is_refused_saying_the_range(value: object) -> None:
    with pytest.raises(DeviceSpecError, match="bandwidth="):
        testing.parse_bandwidth(value)  # type: ignore[arg-type]
    with pytest.raises(DeviceSpecError, match="bandwidth="):
        testing.set_bandwidth(value)  # type: ignore[arg-type]


def test_bandwidth_takes_none_and_inf_for_a_link_without_delay() -> None:
    assert testing.parse_bandwidth(None) == testing.parse_bandwidth(math.inf) == math.inf
    assert testing.parse_bandwidth("inf") == math.inf
    assert testing.parse_bandwidth("500 MiB/s") == 500 * 2**20


@pytest.mark.parametrize("value", [*ABSURD, 0, "1e300GiB", "-1GiB", True, 2**61])
def test_capacity_out_of_range_is_refused_before_building(value: object) -> None:
    with pytest.raises(DeviceSpecError, match="capacity="):
        testing.enable(capacity=value)  # type: ignore[arg-type]
    with pytest.raises(DeviceSpecError, match="capacity="):
        testing.set_capacity(value)  # type: ignore[arg-type]
    assert testing.enabled() is None


@pytest.mark.parametrize("value", [math.nan, -1, 0, 17, 2**63, 1.5, True, "2"])
def test_device_counts_out_of_range_are_refused(value: object) -> None:
    with pytest.raises(DeviceSpecError, match="devices="):
        testing.enable(devices=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [*ABSURD, 3601, True, "1"])
def test_busy_refuses_a_time_it_cannot_queue(value: object) -> None:
    with pytest.raises(DeviceSpecError, match=r"seconds=.*out of range"):
        testing.busy(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["loud", None, 1, True, "RAISE"])
def test_races_mode_is_one_of_three(value: object) -> None:
    with pytest.raises(DeviceSpecError, match=r"races=.*'raise'.*'warn'.*'off'"):
        testing.enable(races=value)  # type: ignore[arg-type]
    with pytest.raises(DeviceSpecError, match="races="):
        testing.detect_races(value)  # type: ignore[arg-type]


def test_expect_races_needs_the_detector_on() -> None:
    with pytest.raises(AnydeviceError, match="detector is off"), testing.expect_races():
        pass


def test_a_report_reads_as_both_accesses_the_tensor_and_the_fix() -> None:
    from anydevice.testing.races import Access

    report = testing.RaceReport(
        kind="read after write",
        tensor="(4,) float32 on sim:0",
        now=Access("train.py:9", "aten::mul", "the default stream of sim:0", 9),
        before=Access("train.py:7", "aten::_to_copy", "stream 1 of sim:0", 7),
        fix="before line 9, `torch.accelerator.current_stream().wait_stream(copier)`",
        why="Nothing orders the read after the write: it may read the old bytes.",
    )
    assert str(report).splitlines() == [
        "stream race: read after write on a tensor (4,) float32 on sim:0",
        "  read    at train.py:9 (aten::mul) on the default stream of sim:0",
        "  written at train.py:7 (aten::_to_copy) on stream 1 of sim:0",
        "  Nothing orders the read after the write: it may read the old bytes.",
        "  fix: before line 9, `torch.accelerator.current_stream().wait_stream(copier)`",
    ]
    error = testing.StreamRaceError(report)
    assert error.report is report and str(error) == str(report)
