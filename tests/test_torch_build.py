"""``scripts/torch_build.py``: the torch build ``make`` installs, chosen from the machine.

Each machine is a made-up tree (``/proc``, ``/sys``, ``/dev``, ``PATH``) handed to the
script's decision; the CPU index's reachability is asked of real HTTP servers on this
machine; the Makefile's set-up is read from ``make -n``.
"""

from __future__ import annotations

import http.server
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "torch_build.py"


@pytest.fixture(scope="module")
def tb():
    spec = importlib.util.spec_from_file_location("torch_build", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["torch_build"] = module
    spec.loader.exec_module(module)
    return module


def pci(root: Path, slot: str, vendor: str, kind: str) -> None:
    device = root / "sys" / "bus" / "pci" / "devices" / slot
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "class").write_text(kind + "\n")


@pytest.fixture
def machine(tmp_path: Path) -> Path:
    """A machine without an NVIDIA GPU: a host bridge, virtio devices, and an NVIDIA
    audio function (an HDMI output's: not a GPU)."""
    pci(tmp_path, "0000:00:00.0", "0x8086", "0x060000")
    pci(tmp_path, "0000:00:03.0", "0x1af4", "0x020000")
    pci(tmp_path, "0000:02:00.1", "0x10de", "0x040300")
    (tmp_path / "proc" / "driver").mkdir(parents=True)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia-caps").mkdir()  # no device node: a number is one
    return tmp_path


def never(url: str) -> str | None:
    raise AssertionError(f"{url} was asked, but the choice did not depend on it")


def reachable(url: str) -> str | None:
    return None


def unreachable(url: str) -> str | None:
    return "Name or service not known"


NO_PATH = {"PATH": "/usr/bin:/bin"}


def test_no_nvidia_gpu_on_linux_installs_the_cpu_build(tb, machine):
    choice = tb.decide(root=machine, environ=NO_PATH, platform="linux", probe=reachable)
    assert (choice.build, choice.index_url) == ("cpu", tb.CPU_INDEX)
    assert choice.line.startswith("torch: the CPU build from https://download.pytorch.org")
    assert "no NVIDIA GPU" in choice.line
    command = tb.pip_command(choice, "/v/bin/python", Path("constraints.txt"))
    assert command == [
        "/v/bin/python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "-c", "constraints.txt", "--index-url", "https://download.pytorch.org/whl/cpu", "torch",
    ]  # fmt: skip


def test_an_unreachable_cpu_index_falls_back_to_pips_own_saying_so(tb, machine):
    choice = tb.decide(root=machine, environ=NO_PATH, platform="linux", probe=unreachable)
    assert (choice.build, choice.index_url) == ("default", None)
    assert "cannot be reached (Name or service not known)" in choice.line
    assert "pip's own index instead" in choice.line and "TORCH_INDEX_URL" in choice.line
    assert "\n" not in choice.line
    command = tb.pip_command(choice, "python", Path("constraints.txt"))
    assert command[-1] == "torch" and "--index-url" not in command


@pytest.mark.parametrize(
    ("make", "evidence"),
    [
        (lambda r: (r / "proc" / "driver" / "nvidia" / "gpus").mkdir(parents=True),
         "the NVIDIA driver is loaded"),
        (lambda r: (r / "dev" / "nvidia0").touch(), "an NVIDIA device node"),
        (lambda r: pci(r, "0000:01:00.0", "0x10de", "0x030200"), "0000:01:00.0, class 0x030200"),
        (lambda r: pci(r, "0000:65:00.0", "0x10DE", "0x030000"), "on the PCI bus"),
    ],
)  # fmt: skip
def test_an_nvidia_gpu_gets_the_default_cuda_build(tb, machine, make, evidence):
    make(machine)
    choice = tb.decide(root=machine, environ=NO_PATH, platform="linux", probe=never)
    assert (choice.build, choice.index_url) == ("default", None)
    assert evidence in choice.line and "CUDA" in choice.line


def test_nvidia_smi_on_path_or_in_wsl_counts_as_a_gpu(tb, machine):
    smi = machine / "usr" / "lib" / "wsl" / "lib" / "nvidia-smi"
    smi.parent.mkdir(parents=True)
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    choice = tb.decide(root=machine, environ=NO_PATH, platform="linux", probe=never)
    assert choice.build == "default" and "nvidia-smi is here" in choice.line
    smi.unlink()
    (machine / "opt" / "nv").mkdir(parents=True)
    shutil.copy(SCRIPT, machine / "opt" / "nv" / "nvidia-smi")  # not executable: not a tool
    assert tb.decide(root=machine, environ={"PATH": "/opt/nv"}, probe=reachable).build == "cpu"
    (machine / "opt" / "nv" / "nvidia-smi").chmod(0o755)
    assert tb.decide(root=machine, environ={"PATH": "/opt/nv"}, probe=never).build == "default"


@pytest.mark.parametrize("platform", ["darwin", "win32"])
def test_other_systems_take_pips_own_index_unasked(tb, machine, platform):
    choice = tb.decide(root=machine, environ=NO_PATH, platform=platform, probe=never)
    assert (choice.build, choice.index_url) == ("default", None)
    assert platform in choice.line


def test_torch_index_url_is_the_users_choice(tb, machine):
    env = {**NO_PATH, "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cu126"}
    choice = tb.decide(root=machine, environ=env, platform="linux", probe=never)
    assert choice.index_url == "https://download.pytorch.org/whl/cu126"
    assert "your choice" in choice.line
    assert tb.pip_command(choice, "python", None)[-3:] == [
        "--index-url", "https://download.pytorch.org/whl/cu126", "torch"
    ]  # fmt: skip
    empty = tb.decide(root=machine, environ={**NO_PATH, "TORCH_INDEX_URL": ""}, probe=never)
    assert (empty.build, empty.index_url) == ("user", None)  # pip's own index, asked for


def test_an_installed_torch_meeting_the_pin_is_kept(tb, machine, tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# the pin\ntorch==2.13.0  # the CPU build here\nnumpy<3\n")
    pin = tb.pinned_torch(constraints)
    assert pin == "==2.13.0"
    kept = tb.decide(root=machine, environ=NO_PATH, installed="2.13.0+cpu", pin=pin, probe=never)
    assert kept.build == "installed" and "keeping torch 2.13.0+cpu" in kept.line
    assert tb.pip_command(kept, "python", constraints) is None  # nothing to run
    env = {**NO_PATH, "TORCH_INDEX_URL": "https://example.org/whl"}
    again = tb.decide(root=machine, environ=env, installed="2.13.0", pin=pin, probe=never)
    assert again.build == "installed" and "make clean first" in again.line


def test_an_installed_torch_off_the_pin_is_replaced_by_the_machines_build(tb, machine):
    choice = tb.decide(root=machine, environ=NO_PATH, platform="linux", installed="2.5.1",
                       pin="==2.13.0", probe=reachable)  # fmt: skip
    assert choice.build == "cpu"
    assert choice.line.startswith("torch: torch 2.5.1 does not meet torch==2.13.0")


@pytest.mark.parametrize(
    ("version", "spec", "ok"),
    [("2.13.0+cpu", "==2.13.0", True), ("2.13.0", "==2.13.0", True),
     ("2.12.1", "==2.13.0", False), ("2.13.1", ">=2.6,<2.14", True), ("2.13.0", None, True)],
)  # fmt: skip
def test_meets_reads_specifiers_as_pip_does(tb, version, spec, ok):
    assert tb.meets(version, spec) is ok


# ----------------------------------------------------------------------------- real probes


@pytest.fixture
def index(tmp_path: Path) -> Iterator[str]:
    """A real HTTP server on this machine, serving a package index with ``torch/`` in it."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    folder = tmp_path / "simple"
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "index.html").write_text("<a href='torch-2.13.0.whl'>torch</a>\n")
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: Quiet(*a, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_reach_says_none_for_an_index_that_answers(tb, index):
    assert tb.reach(index, timeout=30) is None
    assert tb.reach(index + "/nowhere", timeout=30) == "it answered HTTP 404"


def test_reach_says_why_for_an_index_that_does_not(tb):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    why = tb.reach(f"http://127.0.0.1:{port}/whl/cpu", timeout=30)
    assert why is not None and "refused" in why.lower()


# ----------------------------------------------------------------------------- the Makefile


def test_make_sets_up_torch_through_the_script_before_the_package():
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make here")
    for target in (".venv/.stamp-run", ".venv/.stamp-test"):
        out = subprocess.run(
            [make, "-n", "-B", "-C", str(ROOT), target],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.splitlines()  # fmt: skip
        chose = next(i for i, line in enumerate(out) if "scripts/torch_build.py" in line)
        assert "--constraint constraints.txt" in out[chose]
        installs = next(i for i, line in enumerate(out) if "pip install" in line and "-e" in line)
        assert chose < installs, out


def test_the_script_says_its_choice_in_one_line_and_the_command_it_would_run(tmp_path):
    """The script as make runs it, on a made-up machine without a GPU whose constraints pin
    a torch that is not installed: the one line, then the pip command."""
    (tmp_path / "constraints.txt").write_text("torch==1.0.0\n")  # not the torch here
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tmp_path), "--dry-run",
         "--constraint", str(tmp_path / "constraints.txt")],
        capture_output=True, text=True, timeout=120, check=True,
        env={**os.environ, "TORCH_INDEX_URL": "http://127.0.0.1:9/simple"},
    ).stdout.splitlines()  # fmt: skip
    assert len(out) == 2, out
    assert out[0].startswith("torch: torch ") and "does not meet torch==1.0.0" in out[0]
    assert "http://127.0.0.1:9/simple (TORCH_INDEX_URL: your choice)" in out[0]
    assert out[1].endswith(
        f"-c {tmp_path / 'constraints.txt'} --index-url http://127.0.0.1:9/simple torch"
    )
