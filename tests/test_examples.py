"""Every tutorial example runs as a user would run it, and its output says the right things.

The examples start together, each in its own process (one thread each, so that they share
the machine's cores instead of oversubscribing them), and are awaited with a time limit;
each test reads one example's output. The custom kernel example builds into this session's
cache folder, which tests/test_extension.py builds into too: the operator is compiled once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import anydevice as ad

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

RUNS: dict[str, list[str]] = {
    "which_device": ["which_device.py"],
    "device_tour": ["device_tour.py"],
    "multi_gpu_d2l": ["multi_gpu_d2l.py", "--replicas", "2", "--epochs", "2"],
    "data_parallel": ["data_parallel.py", "--tiny"],
    "preprocess": ["preprocess_pipeline.py", "--tiny"],
    "inference": ["inference.py", "--tiny"],
    "amp": ["amp_recipe.py"],
    "dqn": ["dqn_cartpole.py", "--tiny"],
    "custom_kernel": ["custom_kernel/bias_gelu.py", "--tiny"],
    "ddp": ["ddp_train.py", "--spawn", "2", "--epochs", "2"],
}

# Every example at once, then each checked: minutes (make test-long).
pytestmark = [pytest.mark.timeout(600), pytest.mark.long]

#: The device the examples pick here (read through NVML: no CUDA context in this process).
DEV = ad.device()
ON_CPU = DEV.type == "cpu"


@dataclass
class Run:
    returncode: int | None
    stdout: str
    stderr: str

    def check(self) -> str:
        assert self.returncode == 0, f"exit {self.returncode}\n{self.stdout}\n{self.stderr}"
        return self.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST")},
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # The cache folder tests/test_extension.py builds the same operator into.
        "XDG_CACHE_HOME": str(tmp_path_factory.getbasetemp() / "xdg-cache"),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(EXAMPLES / argv[0]), *argv[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # a timeout stops the whole process tree
        )
        for name, argv in RUNS.items()
    }
    deadline = time.monotonic() + 480
    out: dict[str, Run] = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            stderr += "\n(killed: the examples ran past their time limit)"
        out[name] = Run(proc.returncode, stdout, stderr)
    return out


def number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m is not None, f"{pattern!r} not in:\n{text}"
    return float(m.group(1))


def test_which_device(runs: dict[str, Run]):
    out = runs["which_device"].check()
    if ON_CPU:  # the device and why it was chosen
        assert f"ran on cpu (no accelerator here; torch {torch.__version__} is a " in out
        assert " build): output (8, 1)" in out
    else:
        assert f"ran on {DEV} (the best accelerator here): output (8, 1)" in out


def test_device_tour_reads_the_facts_without_initialising_cuda(runs: dict[str, Run]):
    out = runs["device_tour"].check()
    assert f"torch {torch.__version__}" in out
    assert "CUDA initialised by reading all that: False" in out
    assert f"device: {DEV} (" in out
    assert f"after ad.to(model, {str(DEV)!r}) it is on {DEV}" in out


def test_d2l_loop_keeps_replicas_equal_and_matches_one_device(runs: dict[str, Run]):
    out = runs["multi_gpu_d2l"].check()
    assert "devices: ['cpu', 'cpu'] (--replicas 2" in out
    if ON_CPU:
        assert "try_all_gpus() -> [device(type='cpu')]" in out
        assert "no GPU on this machine; using the CPU" in runs["multi_gpu_d2l"].stderr
    assert number(r"between replicas: ([0-9.e+-]+)", out) == 0.0
    assert number(r"from training on one device: ([0-9.e+-]+)", out) < 1e-5
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", out)]
    assert losses[1] < losses[0]
    assert number(r"test accuracy ([0-9.]+)", out) > 0.8


def test_data_parallel_shows_each_step_raising_on_the_cpu(runs: dict[str, Run]):
    out = runs["data_parallel"].check()
    assert "its output matches the module's: True" in out
    assert "DistributedDataParallel is faster" in out
    if not ON_CPU:
        return
    assert "device: cpu (no CUDA GPU here" in out
    for step in ("replicate", "scatter", "parallel_apply", "gather"):
        assert f"  {step}: raised" in out, step
    assert "device_ids=[], wraps the same module: True" in out
    assert re.search(r"\n\s+1 cpu\s+[0-9.]+\s+1\.00x\s+100%", out), out


def test_preprocessing_normalises_on_the_device(runs: dict[str, Run]):
    out = runs["preprocess"].check()
    assert f"device: {DEV}" in out
    assert f"torch.float32 (128, 3, 32, 32) on {DEV}" in out
    assert abs(number(r"mean ([+-][0-9.]+), std", out)) < 0.5
    assert 0.7 < number(r"std ([0-9.]+)\n", out) < 1.3
    assert f"LoaderStats(4 batches on {DEV}" in out
    losses = [float(v) for v in re.findall(r"mean loss ([0-9.]+)", out)]
    assert losses[1] < losses[0]


def test_inference_in_eval_mode_is_deterministic_and_on_the_host(runs: dict[str, Run]):
    out = runs["inference"].check()
    assert f"device: {DEV}" in out
    assert "2000 predictions on cpu, deterministic: True" in out
    assert number(r"eval \+ inference_mode: accuracy ([0-9.]+)", out) > 0.85
    assert "syncs, per-item loop: SyncReport(" in out


def test_amp_recipe_picks_a_mode_and_resumes(runs: dict[str, Run]):
    out = runs["amp"].check()
    assert "Precision(" in out
    assert "resumed at epoch 5; the checkpoint was trained in" in out
    assert "precision state restored: True" in out  # ad.save_state carried it
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", out)]
    assert losses[-1] < losses[0]


def test_dqn_keeps_the_replay_memory_on_the_host(runs: dict[str, Run]):
    out = runs["dqn"].check()
    assert f"device: {DEV} (" in out and "replay memory on the host (cpu)" in out
    transitions = number(r"replay memory: (\d+) transitions on cpu", out)
    updates = number(r"; (\d+) updates, each batch moved with one ad.to", out)
    steps = number(r"steps (\d+);", out)
    assert transitions == steps  # every step stored, none lost
    assert updates == steps - 128 + 1  # one update per step once a batch fits
    assert "a device other than the networks': 0" in out
    assert f"networks on {DEV}; " in out and "episodes 15" in out


def test_custom_kernel_runs_its_cpu_kernel_and_matches_torch(runs: dict[str, Run]):
    run = runs["custom_kernel"]
    out = run.check()
    assert "kernels registered: CPU" in out
    if ON_CPU:
        assert "device: cpu (no GPU here, so the CPU kernel runs)" in out
    if torch.version.cuda is None:
        assert "kernels registered: CPU\n" in out
        assert "leaving out bias_gelu_cuda.cu: torch" in run.stderr
    assert "opcheck: passed on 2 samples" in out
    assert number(r"from F.gelu\(x \+ bias\): ([0-9.e+-]+)", out) < 1e-5
    assert number(r"gradients: ([0-9.e+-]+)", out) < 1e-3
    assert "torch.compile(fullgraph=True) traced it" in out
    assert re.search(r"custom kernel: [0-9.]+ ms, plain torch: [0-9.]+ ms \(", out)


def test_ddp_example_under_ad_launch_agrees_across_ranks(runs: dict[str, Run]):
    out = runs["ddp"].check()
    assert "2 process(es), gloo, on cpu" in out or not ON_CPU
    accuracies = re.search(r"accuracy by rank: \{0: ([0-9.]+), 1: ([0-9.]+)\}", out)
    assert accuracies is not None, out
    assert accuracies.group(1) == accuracies.group(2)
    assert float(accuracies.group(1)) > 0.8
