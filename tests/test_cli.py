"""The ``anydevice`` command, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from anydevice import cli


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "anydevice", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_info_json_is_the_inventory():
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["schema"] == "anydevice.inventory/1"
    assert data["devices"][-1]["kind"] == "cpu"


def test_info_table_shows_host_and_devices():
    out = run("info")
    assert out.returncode == 0, out.stderr
    assert "host" in out.stdout and "torch" in out.stdout
    assert "cpu" in out.stdout


def test_doctor_json_exit_code_matches_verdict():
    out = run("doctor", "--json")
    data = json.loads(out.stdout)
    assert data["schema"] == "anydevice.doctor/1"
    assert out.returncode == (0 if data["ok"] else 1)
    assert len(data["checks"]) >= 6


def test_doctor_table_prints_a_verdict_line():
    out = run("doctor")
    assert "check" in out.stdout
    assert ("no check failed" in out.stdout) == (out.returncode == 0)


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_unknown_command_is_an_argparse_error():
    with pytest.raises(SystemExit) as info:
        cli.main(["teleport"])
    assert info.value.code == 2


def test_version():
    out = run("--version")
    assert out.returncode == 0
    assert out.stdout.startswith("anydevice ")
