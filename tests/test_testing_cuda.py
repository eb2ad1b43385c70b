"""``anydevice.testing.cuda``: programs written for CUDA, run unchanged on the simulator.

The programs in ``tests/fixtures/cuda_programs`` are written as their users write them
for a GPU (the tutorials' versions of ``examples/``, and training scripts in the style of
pytorch/examples' MNIST, nanoGPT and event-timed benchmarks). Each runs under ``python
-m anydevice.testing`` and, where it has a CPU path, as a plain CPU program; the results
must match. The cases of ``tests/sim_cuda_cases.py`` run in a child pytest (torch holds
one privateuse1 backend per process); this process checks what holds without the
simulator: the table of ``torch.cuda`` names, the docs' copy of it, and that importing
anydevice maps nothing.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from anydevice.testing.cuda import names
from children import Run, run_python

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "tests" / "fixtures" / "cuda_programs"
CASES = ROOT / "tests" / "sim_cuda_cases.py"
TIMEOUT = 600
pytestmark = pytest.mark.timeout(TIMEOUT + 60)

#: A run: how it is started ("cpu", or the simulator's options) and its program's argv.
RUNS: dict[str, tuple[list[str] | None, list[str]]] = {
    "which_device/cpu": (None, ["which_device.py"]),
    "which_device/sim": ([], ["which_device.py"]),
    "inference/cpu": (None, ["inference.py"]),
    "inference/sim": ([], ["inference.py"]),
    "amp_recipe/cpu": (None, ["amp_recipe.py"]),
    "amp_recipe/sim": ([], ["amp_recipe.py"]),
    "preprocess/cpu": (None, ["preprocess_pipeline.py"]),
    "preprocess/sim": ([], ["preprocess_pipeline.py"]),
    "mnist/cpu": (None, ["mnist_amp.py", "--no-cuda"]),
    "mnist/sim": ([], ["mnist_amp.py"]),
    "nanogpt/cpu": (None, ["nanogpt_style.py", "--device=cpu", "--compile=False"]),
    "nanogpt/sim": ([], ["nanogpt_style.py", "--compile=False"]),
    "nanogpt-compile/sim": ([], ["nanogpt_style.py", "--max_iters=1"]),
    "data_parallel/cpu": (None, ["data_parallel.py"]),
    "data_parallel/sim2": (["--devices", "2"], ["data_parallel.py"]),
    "d2l/sim1": ([], ["multi_gpu_d2l.py"]),
    "d2l/sim2": (["--devices", "2"], ["multi_gpu_d2l.py"]),
    "device_tour/sim": ([], ["device_tour.py"]),
    "measure/sim": (["--capacity", "192MiB"], ["measure.py"]),
    "event_benchmark/sim": ([], ["event_benchmark.py"]),
    "ddp/sim": ([], ["ddp_train.py"]),
    "custom_kernel/sim": ([], ["custom_kernel.py"]),
}

#: The line of mnist_amp.py that the planted bug removes: the prefetcher's wait.
WAIT = "torch.cuda.current_stream().wait_stream(self.stream)"


def _toolchain_or_skip() -> None:
    from anydevice import testing
    from anydevice.extension import find_compiler, find_ninja

    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < testing.MIN_TORCH:
        pytest.skip(f"the simulator needs torch >= {testing.MIN_TORCH}; this is {version}")
    if not (find_compiler().found and find_ninja().found):
        pytest.skip("no C++ compiler or ninja to build the simulator")


def _run(sim: list[str] | None, argv: list[str], cwd: Path, **env: str) -> Run:
    command = ["-m", "anydevice.testing", *sim] if sim is not None else []
    return run_python([*command, *argv], timeout=TIMEOUT, cwd=cwd, OMP_NUM_THREADS="1", **env)


def _planted(tmp: Path) -> Path:
    """mnist_amp.py with its prefetcher's wait for the batch's copy taken out."""
    source = (PROGRAMS / "mnist_amp.py").read_text()
    assert source.count(WAIT) == 1
    bugged = tmp / "mnist_amp_without_wait.py"
    bugged.write_text(source.replace(WAIT, "pass  # planted: the wait for the copy is gone"))
    return bugged


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every run, a few at a time (each is a process with one thread)."""
    _toolchain_or_skip()
    tmp = tmp_path_factory.mktemp("cuda_programs")
    jobs = {name: (sim, argv, PROGRAMS, {}) for name, (sim, argv) in RUNS.items()}
    jobs["ddp/sim"] = (
        [],
        ["ddp_train.py"],
        PROGRAMS,
        {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"},
    )
    jobs["mnist-planted/sim"] = (
        ["--bandwidth", "10MB/s"],
        [str(_planted(tmp))],
        tmp,
        {},
    )
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            name: pool.submit(_run, sim, argv, cwd, **env)
            for name, (sim, argv, cwd, env) in jobs.items()
        }
        return {name: f.result() for name, f in futures.items()}


def numbers(text: str, pattern: str) -> list[float]:
    """The numbers in the lines of ``text`` that match ``pattern`` (in order), leaving out
    durations (``time 93.19ms``: the machine's, never the same twice)."""
    found = []
    for line in text.splitlines():
        if re.search(pattern, line):
            line = re.sub(r"\d+\.\d+\s*m?s\b", "", line)
            found += [float(x) for x in re.findall(r"-?\d+\.\d+(?:e-?\d+)?|nan", line)]
    return found


def same(a: list[float], b: list[float], rel: float = 1e-5, abs_: float = 1e-6) -> bool:
    return len(a) == len(b) > 0 and all(
        math.isclose(x, y, rel_tol=rel, abs_tol=abs_) for x, y in zip(a, b, strict=True)
    )


# --- the programs' results -------------------------------------------------------------

#: Program -> the lines whose numbers must be the CPU's, and the tolerance.
MATCHES = {
    "which_device": (r"^result:", 1e-6),
    "inference": (r"^accuracy", 1e-9),
    "amp_recipe": (r"loss", 1e-6),
    "preprocess": (r"mean loss", 1e-6),
    "mnist": (r"loss", 1e-5),
    # fused AdamW on the GPU, a loop on the CPU: the same update, summed in another order
    "nanogpt": (r"loss", 2e-4),
    "data_parallel": (r"^loss", 1e-5),
}


@pytest.mark.slow
def test_a_short_program_runs_as_on_a_gpu_and_a_gpu_only_call_is_refused() -> None:
    """The quick check of ``make test`` (the whole set of programs is ``make test-long``):
    the tutorials' device boilerplate takes its GPU branch with the CPU's numbers, and a
    custom CUDA kernel is refused by name, saying what to do."""
    _toolchain_or_skip()
    jobs = {
        "cpu": (None, ["which_device.py"]),
        "sim": ([], ["which_device.py"]),
        "kernel": ([], ["custom_kernel.py"]),
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {k: pool.submit(_run, sim, argv, PROGRAMS) for k, (sim, argv) in jobs.items()}
        done = {k: f.result() for k, f in futures.items()}
    sim = done["sim"].ok()
    assert "device: cuda:0" in sim and "is_cuda: True on cuda:0" in sim, sim
    pattern, rel = MATCHES["which_device"]
    assert same(numbers(done["cpu"].ok(), pattern), numbers(sim, pattern), rel=rel)
    kernel = done["kernel"]
    assert kernel.returncode != 0, kernel.stdout
    last = kernel.stderr.strip().splitlines()[-1]
    assert last.startswith("anydevice.testing.NotSimulatedError: "), kernel.stderr
    assert "torch.utils.cpp_extension.load('bias_gelu_cuda', [" in last, last


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("program", sorted(MATCHES))
def test_a_cuda_program_gives_the_cpus_results_on_the_simulated_gpu(
    runs: dict[str, Run], program: str
) -> None:
    pattern, rel = MATCHES[program]
    cpu = runs[f"{program}/cpu"].ok()
    sim_name = next(k for k in runs if k.startswith(f"{program}/sim"))
    sim = runs[sim_name].ok()
    assert same(numbers(cpu, pattern), numbers(sim, pattern), rel=rel), (cpu, sim)


@pytest.mark.slow
@pytest.mark.long
def test_the_gpu_branches_are_taken(runs: dict[str, Run]) -> None:
    assert "device: cuda:0" in runs["which_device/sim"].ok()
    assert "is_cuda: True on cuda:0" in runs["which_device/sim"].stdout
    assert "GPU: anydevice simulated GPU" in runs["which_device/sim"].stdout
    assert "is_cuda: False on cpu" in runs["which_device/cpu"].ok()
    assert "restored on cuda:0 scale 65536.0" in runs["amp_recipe/sim"].ok()
    assert "using fused AdamW: True" in runs["nanogpt/sim"].ok()
    assert "Let's use 2 GPUs!" in runs["data_parallel/sim2"].ok()
    assert "In Model: input size (15, 5)" in runs["data_parallel/sim2"].stdout


@pytest.mark.slow
@pytest.mark.long
def test_device_facts_and_counters_read_as_a_gpus(runs: dict[str, Run]) -> None:
    tour = runs["device_tour/sim"].ok()
    assert "CUDA available: True" in tour and "devices: 1 current: 0" in tour
    assert "cuda:0 anydevice simulated GPU capability 8.0" in tour
    assert "model on cuda:0" in tour and "PyTorch CUDA memory summary" in tour
    allocated = re.search(r"allocated: (\d+) reserved: (\d+)", tour)
    assert allocated is not None and int(allocated.group(1)) > 0
    measure = runs["measure/sim"].ok()
    peak = re.search(r"peak memory of a step: ([\d.]+) MiB", measure)
    assert peak is not None and float(peak.group(1)) > 0
    fits = re.search(r"largest batch that fits: (\d+)", measure)
    assert fits is not None and 0 < int(fits.group(1)) < 4096  # 192 MiB: it had to halve


@pytest.mark.slow
@pytest.mark.long
def test_the_event_timed_benchmark_times_and_computes_as_the_cpu(runs: dict[str, Run]) -> None:
    out = runs["event_benchmark/sim"].ok()
    timed = re.findall(r"n=(\d+): ([\d.]+) ms/iter, \S+ TFLOP/s, checksum (-?[\d.]+)", out)
    assert [int(n) for n, _, _ in timed] == [64, 128, 256]
    assert all(float(ms) > 0 for _, ms, _ in timed)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n, _, checksum in timed:
            a, b = torch.randn(int(n), int(n)), torch.randn(int(n), int(n))
            assert math.isclose(float(checksum), torch.mm(a, b).sum().item(), rel_tol=1e-5)
    finally:
        torch.set_num_threads(threads)
    assert re.search(r"on a side stream: [\d.]+ ms, done: True", out)


@pytest.mark.slow
@pytest.mark.long
def test_multi_gpu_training_matches_one_gpu(runs: dict[str, Run]) -> None:
    one, two = runs["d2l/sim1"].ok(), runs["d2l/sim2"].ok()
    assert "['cuda:0', 'cuda:1']" in two
    assert same(numbers(one, "loss"), numbers(two, "loss"), rel=1e-4)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(
    ("run", "refusal", "advice"),
    [
        (
            "ddp/sim",
            "torch.distributed.init_process_group(backend='nccl') cannot run on",
            "Run the collective part on the CPU under the simulator",
        ),
        (
            "custom_kernel/sim",
            "torch.utils.cpp_extension.load('bias_gelu_cuda', [",
            "Build the operator's CPU kernel alone under the simulator",
        ),
        (
            "nanogpt-compile/sim",
            "torch.compile(backend='inductor') cannot run on",
            "Run the model without torch.compile under the simulator",
        ),
    ],
    ids=["ddp", "custom_kernel", "compile"],
)
def test_what_only_a_gpu_runs_is_refused_by_name(
    runs: dict[str, Run], run: str, refusal: str, advice: str
) -> None:
    result = runs[run]
    assert result.returncode != 0, result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("anydevice.testing.NotSimulatedError: "), result.stderr
    assert refusal in last and advice in last, last  # what was called, and what to do


@pytest.mark.slow
@pytest.mark.long
def test_a_planted_stream_bug_is_reported_at_its_line(runs: dict[str, Run]) -> None:
    """The prefetcher's wait for the batch's copy taken out: the first layer reads the
    batch before it lands. The race detector stops the run there, naming that line and
    the line of the copy, where the program without the bug gives the CPU's losses."""
    planted = runs["mnist-planted/sim"]
    assert same(numbers(runs["mnist/cpu"].ok(), "loss"), numbers(runs["mnist/sim"].ok(), "loss"))
    assert planted.returncode == 1, (planted.stdout, planted.stderr)
    source = (PROGRAMS / "mnist_amp.py").read_text().splitlines()
    read = source.index("        x = F.relu(self.conv1(x))") + 1  # the batch's first reader
    copy = source.index("            self.next_data = self.next_data.cuda(non_blocking=True)") + 1
    report = planted.stderr[planted.stderr.rindex("StreamRaceError: ") :]
    assert report.startswith("StreamRaceError: stream race: read after write"), report
    assert re.search(rf"read +at mnist_amp_without_wait\.py:{read} in forward\(\)", report), report
    assert re.search(rf"written at mnist_amp_without_wait\.py:{copy} in preload\(\)", report), (
        report
    )
    assert "wait_stream(self.stream)" in report  # the fix: the wait that was taken out


# --- the simulated CUDA's own cases ------------------------------------------------------


@pytest.mark.slow
def test_cuda_cases_in_a_child_process() -> None:
    _toolchain_or_skip()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(CASES),
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-p",
            "anydevice.testing.pytest_plugin",
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    cases = CASES.read_text().count("\ndef test_")
    assert f"{cases} passed" in out, out  # none skipped


# --- without the simulator -------------------------------------------------------------


def _all_of_torch_cuda() -> list[str]:
    """``torch.cuda``'s public names once each of its submodules is imported (a run imports
    ``torch.cuda.comm``; other code may have imported any)."""
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(torch.cuda.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"torch.cuda.{info.name}")
    return names.public_names(torch.cuda)


def test_the_table_names_every_public_torch_cuda_name() -> None:
    here = set(_all_of_torch_cuda())
    missing = sorted(here - set(names.TABLE))
    assert not missing, f"add these torch.cuda names to the table: {missing}"
    if torch.__version__.startswith("2.13."):
        assert not sorted(set(names.TABLE) - here), "names torch 2.13 does not have"
    assert {status for status, _ in names.TABLE.values()} == {
        names.MAPPED,
        names.REFUSED,
        names.NOT_APPLICABLE,
    }


def test_the_docs_show_the_table_the_code_applies() -> None:
    text = (ROOT / "docs" / "testing.md").read_text()
    assert names.markdown() in text, (
        "docs/testing.md's table of torch.cuda names is not the one the code applies: paste "
        "`python -m anydevice.testing.cuda.names` into it"
    )


def test_importing_anydevice_maps_nothing() -> None:
    code = (
        "import threading, torch\n"
        "stream, compile_, load = torch.Stream, torch.compile, torch.load\n"
        "bootstrap = threading.Thread._bootstrap_inner\n"
        "import anydevice, anydevice.testing, anydevice.testing.cuda\n"
        "from torch.overrides import _get_current_function_mode_stack\n"
        "assert (torch.Stream, torch.compile, torch.load) == (stream, compile_, load)\n"
        "assert threading.Thread._bootstrap_inner is bootstrap\n"
        "assert torch.cuda.is_available.__module__ == 'torch.cuda'\n"
        "assert torch.cuda.is_available() is False\n"
        "assert _get_current_function_mode_stack() == []\n"
        "assert anydevice.testing.enabled() is None\n"
        "print('untouched')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "untouched"


def test_the_command_line_offers_the_cuda_switch_and_the_device_count() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "anydevice.testing", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--cuda, --no-cuda" in proc.stdout and "--devices DEVICES" in proc.stdout
