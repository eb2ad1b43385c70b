"""``anydevice.testing``: the simulated accelerator.

torch holds one privateuse1 backend per process, so the cases that enable the simulator
(``tests/sim_cases.py``) run in a child pytest; this process keeps torch as it is and
checks what holds without it: argument errors, a missing compiler, another backend in
the slot.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from anydevice import testing
from anydevice.errors import DeviceSpecError
from anydevice.extension import find_compiler, find_ninja

CASES = Path(__file__).with_name("sim_cases.py")
#: The first run builds the backend (a minute on two busy cores); later runs load it.
TIMEOUT = 600
# A fresh checkout builds the simulator first (a minute on two busy cores), and a
# test in another worker waits for that build: each test is bounded by TIMEOUT instead.
pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def _child(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **env},
        check=False,
    )


def _torch_or_skip() -> None:
    import torch

    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < testing.MIN_TORCH:
        pytest.skip(
            f"the simulator needs torch >= {'.'.join(map(str, testing.MIN_TORCH))}; this is "
            f"torch {torch.__version__}"
        )


def _toolchain_or_skip() -> None:
    _torch_or_skip()
    if not find_compiler().found:
        pytest.skip(f"no C++ compiler to build the simulator: {find_compiler().detail}")
    if not find_ninja().found:
        pytest.skip(f"no ninja to build the simulator: {find_ninja().detail}")
    _built()


def _built() -> None:
    """Builds the simulator, if its cache lacks it, in a child bounded by TIMEOUT: a child
    pytest would build it inside its first test, under pytest's default timeout of 120 s,
    which a build on two busy cores can exceed (115 s seen at load 7)."""
    from anydevice.extension import is_built
    from anydevice.testing import simulator as sim

    if is_built(sim._EXTENSION, sim.SOURCES, extra_cflags=sim._CFLAGS, depends=sim.DEPENDS):
        return
    proc = _child(["-c", "from anydevice.testing import simulator; simulator.load()"])
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
@pytest.mark.long  # every simulator case in a child pytest, minutes (make test-long)
@pytest.mark.parametrize("name", ["sim", "simgpu"])
def test_simulator_cases_in_a_child_process(name: str) -> None:
    """The cases under two names; the second selects it through ANYDEVICE_DEVICE."""
    _toolchain_or_skip()
    env = {"ANYDEVICE_SIM_NAME": name}
    if name != "sim":
        env["ANYDEVICE_DEVICE"] = name
    proc = _child(["-m", "pytest", str(CASES), "-q", "-rs", "-p", "no:cacheprovider"], **env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    cases = CASES.read_text().count("\ndef test_")
    assert f"{cases} passed" in out, out  # none skipped


def test_without_a_compiler_the_cases_skip_saying_so() -> None:
    _torch_or_skip()
    code = (
        "import anydevice.testing as t\n"
        "try:\n"
        "    t.enable()\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    proc = _child(["-c", code], CXX="/nonexistent/c++")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ExtensionError No C++ compiler"), proc.stdout
    assert "/nonexistent/c++" in proc.stdout


def test_another_privateuse1_backend_keeps_the_slot() -> None:
    _torch_or_skip()
    code = (
        "import torch\n"
        "torch.utils.rename_privateuse1_backend('npu')\n"
        "import anydevice.testing as t\n"
        "try:\n"
        "    t.enable()\n"
        "except t.SimulatorError as e:\n"
        "    print(e)\n"
        "print(torch._C._get_privateuse1_backend_name())\n"
    )
    proc = _child(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert "already 'npu'" in proc.stdout and "stays off" in proc.stdout, proc.stdout
    assert proc.stdout.splitlines()[-1] == "npu"


def test_bandwidth_is_read_or_refused_with_the_fix() -> None:
    assert testing.parse_bandwidth("2GB/s") == 2e9
    assert testing.parse_bandwidth(1e6) == 1e6
    for bad in ("2GB", "fast/s", 0, -1.0, True):
        with pytest.raises(DeviceSpecError, match="bandwidth"):
            testing.parse_bandwidth(bad)  # type: ignore[arg-type]


def test_enable_refuses_bad_arguments_before_building() -> None:
    with pytest.raises(DeviceSpecError, match="name='Sim'"):
        testing.enable("Sim")
    with pytest.raises(DeviceSpecError, match="devices=0"):
        testing.enable(devices=0)
    with pytest.raises(DeviceSpecError, match="capacity='lots'"):
        testing.enable(capacity="lots")
    with pytest.raises(DeviceSpecError, match="'cuda' is a device type torch has"):
        testing.enable("cuda")
    assert testing.enabled() is None


def test_the_first_build_says_so_before_and_after_at_the_default_level(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A newcomer's first enable() was silent for a minute (the time was logged at INFO,
    which Python does not show). The build itself is stood in for: the messages around it
    are what is checked."""
    from anydevice import extension
    from anydevice.testing import simulator

    said: list[str] = []

    def build(*args: object, **kwargs: object) -> str:
        said.extend(r.getMessage() for r in caplog.records)
        return "the library"

    monkeypatch.setattr(simulator, "_lib", None)
    monkeypatch.setattr(extension, "is_built", lambda *a, **k: False)
    monkeypatch.setattr(extension, "load_extension", build)
    with caplog.at_level(logging.WARNING, logger="anydevice"):
        assert simulator.load() == "the library"
    assert len(said) == 1 and "building the simulated accelerator from C++" in said[0]
    assert "15 s on two idle cores, about a minute on busy ones" in said[0]
    after = [r for r in caplog.records if r.levelno >= logging.WARNING][-1].getMessage()
    assert re.fullmatch(r"anydevice.testing: built the simulated accelerator in \d+ s", after)


def test_settings_need_the_simulator() -> None:
    with pytest.raises(testing.SimulatorError, match=r"anydevice.testing.enable\(\) first"):
        testing.busy(0.1)


@pytest.mark.slow
def test_the_pytest_fixture_in_a_users_suite(tmp_path: Path) -> None:
    _toolchain_or_skip()
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["anydevice.testing.pytest_plugin"]\n')
    (tmp_path / "test_user.py").write_text(
        "import torch\n"
        "import anydevice as ad\n\n"
        "def test_on_the_simulator(sim_device):\n"
        "    assert sim_device == torch.device('sim', 0) == ad.device('sim')\n"
        "    x = torch.full((4,), 2.0).pin_memory().to(sim_device, non_blocking=True)\n"
        "    assert (x * 3).cpu().tolist() == [6.0] * 4\n"
    )
    proc = _child(["-m", "pytest", str(tmp_path), "-q", "-p", "no:cacheprovider"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in out, out


@pytest.mark.slow
def test_the_command_line_builds_ahead_of_use(tmp_path: Path) -> None:
    """``python -m anydevice.testing --build``, for a CI job's or an image's set-up: the
    library built, where it is; without a compiler, status 1 and why."""
    _toolchain_or_skip()
    _built()
    proc = _child(["-m", "anydevice.testing", "--build"])
    assert proc.returncode == 0, proc.stderr
    assert "building" not in proc.stderr, proc.stderr  # built already: nothing to build
    library = Path(proc.stdout.strip().rpartition("is built: ")[2])
    assert library.name == "anydevice_sim.so" and library.is_file(), proc.stdout

    missing = tmp_path / "no-such-c++"
    proc = _child(["-m", "anydevice.testing", "--build"], CXX=str(missing),
                  XDG_CACHE_HOME=str(tmp_path))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "cannot be built here: No C++ compiler" in proc.stderr and str(missing) in proc.stderr


#: Device-agnostic examples, and the lines of their output that must match the CPU's.
EXAMPLES = {
    "inference": (["inference.py", "--tiny"], r"accuracy [0-9.]+"),
    "preprocess": (["preprocess_pipeline.py", "--tiny"], r"mean loss [0-9.]+"),
    "dqn": (["dqn_cartpole.py", "--tiny"], r"mean return of the last \d+ [0-9.]+"),
}


@pytest.mark.slow
@pytest.mark.long  # whole programs, twice each (make test-long)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_give_the_cpus_results_on_the_simulated_gpu(name: str) -> None:
    """``python -m anydevice.testing`` presents the simulator as a CUDA GPU:
    ``ad.device()`` picks ``cuda:0`` there."""
    import re

    _toolchain_or_skip()
    argv, pattern = EXAMPLES[name]
    folder = Path(__file__).resolve().parents[1] / "examples"
    script = [str(folder / argv[0]), *argv[1:]]
    cpu = _child(script, ANYDEVICE_DEVICE="cpu")
    environ = {k: v for k, v in os.environ.items() if k != "ANYDEVICE_DEVICE"}
    sim = subprocess.run(
        [sys.executable, "-m", "anydevice.testing", *script],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**environ, "PYTHONDONTWRITEBYTECODE": "1"},
        check=False,
    )
    assert cpu.returncode == 0, cpu.stderr
    assert sim.returncode == 0, sim.stderr
    assert "cuda:0" in sim.stdout, sim.stdout
    expected = re.findall(pattern, cpu.stdout)
    assert expected and re.findall(pattern, sim.stdout) == expected, (cpu.stdout, sim.stdout)


@pytest.mark.slow
def test_the_readme_example_shows_the_bug_and_the_fix(tmp_path: Path) -> None:
    import re

    _toolchain_or_skip()
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("## Test your GPU code without a GPU") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert code is not None
    script = tmp_path / "example.py"  # a file, as a user runs it: the report quotes its lines
    script.write_text(code.group(1))
    proc = _child([str(script)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "before line 11, `torch.accelerator.current_stream().wait_stream(copier)`",
        "tensor([2., 2., 2., 2.])",
    ]


@pytest.mark.slow
def test_two_devices() -> None:
    _toolchain_or_skip()
    code = (
        "import torch, anydevice as ad, anydevice.testing as t\n"
        "t.enable(devices=2)\n"
        "x = torch.arange(4.0).to('sim:1')\n"
        "y = x.to('sim:0') * 2\n"
        "print(torch.accelerator.device_count(), x.device, y.device, y.cpu().tolist())\n"
        "print([d.spec for d in ad.inventory().of_kind('sim')])\n"
    )
    proc = _child(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "2 sim:1 sim:0 [0.0, 2.0, 4.0, 6.0]",
        "['sim:0', 'sim:1']",
    ], proc.stdout


@pytest.mark.slow
def test_later_work_on_the_source_waits_for_a_copy_to_another_device() -> None:
    """A copy from device 0 to device 1 waits its turn on device 1's busy stream; a kernel
    that writes the source right after it ran at once, and the copy read what it wrote.
    On a GPU the copy orders both devices' streams: the source keeps its values for it,
    and the race detector (on) sees that order, blocking or not."""
    _toolchain_or_skip()
    code = (
        "import torch, anydevice.testing as t\n"
        "t.enable(devices=2)\n"
        "for non_blocking in (False, True):\n"
        "    src = torch.full((4,), 1.0, device='sim:0')\n"
        "    dst = torch.empty(4, device='sim:1')\n"
        "    t.busy(0.5, 1)  # device 1's stream: the copy runs after this\n"
        "    dst.copy_(src, non_blocking=non_blocking)\n"
        "    src.fill_(7.0)  # later work on the source's stream\n"
        "    print(dst.cpu().tolist(), src.cpu().tolist())\n"
        "moved = src.to('sim:1', non_blocking=True)  # read next on device 1's stream\n"
        "print((moved * 2).cpu().tolist())\n"
    )
    proc = _child(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == [
        "[1.0, 1.0, 1.0, 1.0] [7.0, 7.0, 7.0, 7.0]",
        "[1.0, 1.0, 1.0, 1.0] [7.0, 7.0, 7.0, 7.0]",
        "[14.0, 14.0, 14.0, 14.0]",
    ], proc.stdout


@pytest.mark.slow
@pytest.mark.long  # whole programs (make test-long)
@pytest.mark.parametrize(
    "argv", [["which_device.py"], ["device_tour.py"], ["amp_recipe.py"]], ids=lambda a: a[0]
)
def test_more_examples_run_on_the_simulator_under_its_own_name(argv: list[str]) -> None:
    """With ``--no-cuda`` the simulator keeps its name, ``sim``. These print device facts
    or autocast numbers (the simulator casts nothing), so they are checked for running on
    it, not for the CPU's numbers."""
    _toolchain_or_skip()
    folder = Path(__file__).resolve().parents[1] / "examples"
    script = [str(folder / argv[0]), *argv[1:]]
    proc = _child(["-m", "anydevice.testing", "--no-cuda", *script], ANYDEVICE_DEVICE="sim")
    assert proc.returncode == 0, proc.stderr
    assert "sim:0" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.long  # a whole program (make test-long)
def test_the_measure_example_runs_clean_and_finds_the_simulated_memory_limit() -> None:
    """``ad.timeit``'s events, ``track_memory`` and ``fit_batch_size`` under the race
    detector, on a 64 MiB device: the search stops where the caching allocator runs out
    (the script's high end is 2**16, which the host's memory would fit)."""
    _toolchain_or_skip()
    script = Path(__file__).resolve().parents[1] / "examples" / "measure.py"
    proc = _child(["-m", "anydevice.testing", "--no-cuda", "--capacity", "64MiB", str(script)])
    assert proc.returncode == 0, proc.stderr
    assert "StreamRace" not in proc.stderr, proc.stderr
    found = re.search(r"largest batch that fits: (\d+)", proc.stdout)
    assert found is not None and 32 <= int(found.group(1)) < 2**16, proc.stdout
    assert "sim:0" in proc.stdout, proc.stdout


def test_synchronize_right_after_enable_waits_for_busy_work() -> None:
    """In a fresh process, ``busy`` straight after ``enable`` was waited for by nobody:
    torch skips synchronising a device type it has not initialised (``synchronize``
    returned in 0.1 ms)."""
    _toolchain_or_skip()
    code = (
        "import time, torch\n"
        "from anydevice import testing\n"
        "from anydevice.measure.clocks import synchronize\n"
        "dev = testing.enable()\n"
        "t = time.monotonic(); testing.busy(0.1); synchronize(dev)\n"
        "print(time.monotonic() - t)\n"
    )
    proc = _child(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip().splitlines()[-1]) >= 0.1, proc.stdout


@pytest.mark.slow
def test_waiting_for_a_copy_that_drops_a_python_kept_tensor_does_not_hang() -> None:
    """A finished copy drops the tensors it held; where that is the last hold on one that
    Python keeps (a tensor with attributes of its own), dropping it takes Python's lock.
    The host waited for the copy holding that lock: both waited for ever."""
    _toolchain_or_skip()
    code = (
        "import torch, anydevice.testing as t\n"
        "d = t.enable(bandwidth='10MB/s')\n"
        "src = torch.full((2**20,), 3.0).pin_memory()\n"
        "src.note = 'Python keeps this object while C++ holds the tensor'\n"
        "x = src.to(d, non_blocking=True)  # 0.4 s over the link; the copy holds src\n"
        "del src  # the copy's hold is now the last\n"
        "torch.accelerator.synchronize()  # the host waits for the copy that drops it\n"
        "print(x[:2].cpu().tolist())\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the host and the copy's worker waited for each other (no output in 300 s)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[3.0, 3.0]"


@pytest.mark.slow
@pytest.mark.long  # eight processes with the simulator: minutes on a busy machine
def test_exiting_right_after_a_backward_pass_does_not_abort() -> None:
    """Autograd's thread for the device freed its last task (which holds a Python object)
    while Python shut down: "terminate called without an active exception" in about one
    run in three. Eight runs, all must exit cleanly."""
    _toolchain_or_skip()
    code = (
        "import torch, anydevice.testing as t\n"
        "d = t.enable()\n"
        "x = torch.ones(2, device=d, requires_grad=True)\n"
        "(x * 2).sum().backward()\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
        for _ in range(8)
    ]
    results = [(p.wait(timeout=TIMEOUT), p.stderr.read() if p.stderr else "") for p in procs]
    for p in procs:
        if p.stderr:
            p.stderr.close()
    assert [code for code, _ in results] == [0] * 8, results
