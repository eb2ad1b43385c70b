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
from children import Run, run_python

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
    assert simulator._BUILD_SECONDS in said[0] and re.search(r"\d+ s on two idle", said[0])
    after = [r for r in caplog.records if r.levelno >= logging.WARNING][-1].getMessage()
    assert re.fullmatch(r"anydevice.testing: built the simulated accelerator in \d+ s", after)


def test_the_build_cache_key_holds_every_file_the_sources_include() -> None:
    """A file the two sources include but DEPENDS leaves out changes without a rebuild:
    the cached library goes on running its old code."""
    from anydevice.testing import simulator as sim

    included: set[str] = set()
    todo = list(sim.SOURCES)
    while todo:
        text = todo.pop().read_text()
        for name in re.findall(r'^#include "([^"]+)"', text, flags=re.M):
            if name not in included:
                included.add(name)
                todo.append(sim.SOURCES[0].with_name(name))
    assert {"kernels.cpp", "pinned.cpp", "races.h"} <= included
    assert included == {p.name for p in sim.DEPENDS}


@pytest.mark.slow
def test_a_script_imports_the_modules_beside_it_from_any_working_directory(
    tmp_path: Path,
) -> None:
    """As under ``python path/to/train.py``: sys.path[0] is the script's folder (public
    training scripts import their model.py and data.py so), not the working directory."""
    _toolchain_or_skip()
    folder = tmp_path / "program"
    folder.mkdir()
    (folder / "helper.py").write_text("WHERE = 'beside the script'\n")
    (folder / "main.py").write_text(
        "import os, sys\nimport helper\n"
        "print(helper.WHERE, sys.path[0] == os.path.dirname(__file__))\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cuda in ("--cuda", "--no-cuda"):
        proc = subprocess.run(
            [sys.executable, "-m", "anydevice.testing", cuda, str(folder / "main.py")],
            cwd=elsewhere,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "beside the script True", proc.stdout


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


ROOT = Path(__file__).resolve().parents[1]


def _example(argv: list[str], sim: list[str] | None = None, **env: str) -> Run:
    """An example, as a user runs it: on the CPU (``sim`` None: ``ANYDEVICE_DEVICE=cpu``),
    or on simulated CUDA GPUs (``python -m anydevice.testing *sim``, the race detector on)."""
    command = ["-m", "anydevice.testing", *sim] if sim is not None else []
    device = {"ANYDEVICE_DEVICE": "cpu"} if sim is None else {}
    return run_python([*command, str(ROOT / "examples" / argv[0]), *argv[1:]],
                      timeout=TIMEOUT, **device, **env)  # fmt: skip


def _numbers(text: str) -> list[str]:
    """Every number the output prints, in order (the lines a run computed)."""
    return re.findall(r"-?\d+\.\d+(?:e[-+]?\d+)?", text)


@pytest.mark.slow
@pytest.mark.long  # whole programs (make test-long)
@pytest.mark.parametrize("gpus", [1, 2])
def test_d2l_multi_gpu_loop_gives_the_cpus_numbers_on_simulated_gpus(gpus: int) -> None:
    """d2l's loop with one replica per simulated GPU prints what the same loop prints with
    as many replicas on the CPU: losses, the replicas' spread, the drift from one device,
    the accuracy."""
    _toolchain_or_skip()
    sim = _example(["multi_gpu_d2l.py"], ["--devices", str(gpus)]).clean()
    cpu = _example(["multi_gpu_d2l.py", "--replicas", str(gpus)]).clean()
    assert f"devices: {[f'cuda:{i}' for i in range(gpus)]} (one replica per GPU)" in sim, sim
    results = [line for line in sim.splitlines() if line.startswith(("epoch", "largest", "test"))]
    assert len(results) == 9 and _numbers("\n".join(results)) == _numbers(cpu), (sim, cpu)


@pytest.mark.slow
@pytest.mark.long  # whole programs (make test-long)
def test_data_parallel_runs_its_four_steps_on_two_simulated_gpus() -> None:
    """On the CPU each of DataParallel's steps raises (the example prints that); on two
    simulated GPUs each runs, and DataParallel's output is the module's."""
    _toolchain_or_skip()
    out = _example(["data_parallel.py", "--tiny"], ["--devices", "2"]).clean()
    assert "replicate: 2 copies of the module, on ['cuda:0', 'cuda:1']" in out, out
    assert "scatter: batch (64, 64) split into [(32, 64), (32, 64)]" in out, out
    assert "parallel_apply: one thread per device; outputs on ['cuda:0', 'cuda:1']" in out, out
    assert "gather: outputs concatenated: (64, 10) on cuda:0" in out, out
    assert "device_ids=[0, 1], wraps the same module: True" in out, out
    assert "its output matches the module's: True" in out, out
    assert re.search(r"^ +2 cuda:0, cuda:1 +[0-9.]+ ", out, flags=re.M), out  # a row per count
    cpu = _example(["data_parallel.py", "--tiny"]).clean()
    assert "replicate: raised ValueError" in cpu and "matches the module's: True" in cpu, cpu


@pytest.mark.slow
@pytest.mark.long  # whole programs, four runs (make test-long)
def test_ddp_example_trains_saves_and_resumes_as_on_the_cpu_and_refuses_a_gpu_world(
    tmp_path: Path,
) -> None:
    """In one process the DDP example trains on the simulated GPU with the CPU's losses,
    saving in the background (``ad.save_state``'s staging to host memory under the race
    detector), and a second run resumes as the CPU's does. Launched as a rank, it would
    form an NCCL group on the GPU: refused before the group forms, saying why."""
    _toolchain_or_skip()
    runs = {}
    for where, sim in (("cpu", None), ("sim", [])):
        argv = ["ddp_train.py", "--checkpoints", str(tmp_path / where), "--save-every", "5"]
        runs[where] = (_example(argv, sim).clean(), _example(argv, sim).clean())
    (cpu, cpu_again), (sim, sim_again) = runs["cpu"], runs["sim"]
    assert "1 process(es), no process group, on cuda:0" in sim, sim
    assert "on cpu" in cpu and _numbers(sim) == _numbers(cpu), (sim, cpu)
    assert sorted(p.name for p in (tmp_path / "sim").iterdir()) == [
        "step-000000090",
        "step-000000095",
    ]  # saved every 5 steps, the newest two kept
    assert "resumed at step 95, epoch 2" in sim_again, sim_again
    assert _numbers(sim_again) == _numbers(cpu_again), (sim_again, cpu_again)
    rank = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    refused = _example(["ddp_train.py"], [], MASTER_PORT="1", **rank)
    assert refused.returncode == 1, refused
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("anydevice.errors.DistributedError: a process group "), last
    assert "(backend='nccl') on the simulated GPUs cannot run" in last, last
    assert "NCCL and collectives on the GPUs are not simulated" in last, last
    assert "ad.distributed(device='cpu')" in last, last  # what runs instead


@pytest.mark.slow
@pytest.mark.long  # three processes of a minute on a busy machine (make test-long)
def test_hogwild_runs_on_the_host_under_the_simulator() -> None:
    """Hogwild shares host memory (``ad.share`` refuses a model on a GPU): under the
    simulator it trains on the host, in processes the simulator does not reach, and the
    parent's evaluation runs with the detector on; it trains as it does on the CPU."""
    _toolchain_or_skip()
    out = _example(["hogwild.py", "--steps", "60"], []).clean()
    before = float(re.search(r"before: accuracy ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    after = float(re.search(r"after 2 x 60 steps: accuracy ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert after > max(0.8, before + 0.2), out


@pytest.mark.slow
@pytest.mark.long  # a C++ build of a minute (make test-long)
def test_custom_kernel_example_runs_its_cpu_kernel_beside_the_simulated_gpu() -> None:
    """torch here is built without CUDA, so ``ad.load_extension`` leaves the .cu source out
    (saying so when it builds) and the operator has a CPU kernel only: with a simulated GPU
    present the example says so and runs on the CPU, checked against torch's own GELU.
    (The tutorial's ``cpp_extension.load`` of the .cu source is refused by name:
    tests/test_testing_cuda.py.)"""
    _toolchain_or_skip()
    import torch

    if torch.version.cuda is not None:
        pytest.skip(f"torch {torch.__version__} builds the CUDA kernel: test_extension.py's")
    out = _example(["custom_kernel/bias_gelu.py", "--tiny"], []).clean()
    assert re.search(r"kernels registered: CPU$", out, flags=re.M), out  # no CUDA kernel
    assert "device: cpu (cuda:0 is here but this operator has no kernel for it" in out, out
    assert "opcheck: passed" in out, out
    diff = re.search(r"max abs difference from F.gelu\(x \+ bias\): ([0-9.e+-]+)", out)
    assert diff is not None and float(diff.group(1)) < 1e-4, out


#: The suite's tests marked cuda, on two simulated CUDA GPUs with the race detector on
#: (``make test-sim`` runs the same); 4 GiB each keeps the tests that fill a GPU small.
SIM_CUDA = [
    *("-p", "anydevice.testing.pytest_plugin", "--sim-cuda", "--sim-devices", "2"),
    *("--sim-capacity", "4GiB", "-m", "cuda"),
]
#: Skips a cuda test makes itself, from the GPU's name (every other skip on the simulated
#: GPUs is a ``real_gpu`` mark's: "needs a physical GPU: <why>").
GPU_NAMED_SKIPS = ("the 0.7 MFU anchor is an H100's", "is not in the peaks table")


@pytest.mark.slow
@pytest.mark.long  # the suite's cuda tests in a child pytest, minutes (make test-long)
def test_the_suites_cuda_tests_run_clean_on_simulated_gpus() -> None:
    """Every test written for a GPU either passes on the simulated ones with the race
    detector on (a race would fail it), or is skipped saying what only a physical GPU
    gives; none is skipped for want of a GPU."""
    assert " ".join(SIM_CUDA) in (ROOT / "Makefile").read_text()  # make test-sim's too
    _toolchain_or_skip()
    files = [  # the files with cuda tests, as make test-sim collects (a minute less)
        str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("test_*.py"))
        if "pytest.mark.cuda" in p.read_text() and p.parent.name != "infra"
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *SIM_CUDA, "-q", "-rs", "-p", "no:cacheprovider",
         "-p", "no:randomly", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed is not None and int(passed.group(1)) > 0, summary
    assert "failed" not in summary and "error" not in summary, summary
    assert "StreamRace" not in out, out
    reasons = re.findall(r"^SKIPPED \[\d+\] [^:]+(?::\d+)?: (.*)$", out, flags=re.M)
    unstated = [
        r for r in reasons
        if not r.startswith("needs a physical GPU: ") and not r.endswith(GPU_NAMED_SKIPS)
    ]  # fmt: skip
    assert reasons and not unstated, unstated


USERS_CONFTEST = """
import pytest, torch

pytest_plugins = ["anydevice.testing.pytest_plugin"]


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or config.getoption("--sim-cuda", default=False):
        return
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason="no GPU here"))
"""

USERS_TESTS = """
import pytest, torch


@pytest.mark.cuda
def test_clean():
    x = torch.full((4,), 2.0).pin_memory().cuda(non_blocking=True)
    assert (x * 3).cpu().tolist() == [6.0] * 4


@pytest.mark.cuda
def test_races():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.full((2**16,), 1.0).pin_memory().cuda(non_blocking=True)
    assert (x * 2).sum().item() == 2.0**17  # the current stream never waited for side


@pytest.mark.cuda
def test_with_the_fixture_too(sim_cuda):
    assert sim_cuda == torch.device("cuda", 0) and torch.cuda.device_count() == 2


@pytest.mark.cuda
@pytest.mark.real_gpu("reads NVML")
def test_nvml():
    raise AssertionError("a real_gpu test ran on the simulated GPUs")


def test_without_the_mark():
    assert not torch.cuda.is_available()  # not simulated
"""


@pytest.mark.slow
def test_sim_cuda_runs_a_suites_cuda_tests_and_a_race_fails_its_test(tmp_path: Path) -> None:
    _toolchain_or_skip()
    (tmp_path / "conftest.py").write_text(USERS_CONFTEST)
    (tmp_path / "test_user.py").write_text(USERS_TESTS)
    plain = _child(["-m", "pytest", str(tmp_path), "-q", "-rs", "-p", "no:cacheprovider"])
    out = plain.stdout + plain.stderr
    assert plain.returncode == 0, out
    assert "1 passed, 4 skipped" in out and out.count(": no GPU here") == 4, out  # as before
    sim = _child(
        ["-m", "pytest", str(tmp_path), "-q", "-rs", "-p", "no:cacheprovider", "--sim-cuda",
         "--sim-devices", "2"]
    )  # fmt: skip
    out = sim.stdout + sim.stderr
    assert sim.returncode == 1, out
    assert "1 failed, 3 passed, 1 skipped" in out, out
    assert re.search(r"^_+ test_races _+$", out, flags=re.M), out  # the one that failed
    assert "StreamRaceError: stream race: read after write" in out, out
    line = USERS_TESTS.splitlines().index("    assert (x * 2).sum().item() == 2.0**17  # the "
                                          "current stream never waited for side") + 1  # fmt: skip
    assert re.search(rf"read +at \S*test_user\.py:{line} in test_races\(\)", out), out
    assert "needs a physical GPU: reads NVML" in out, out


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
