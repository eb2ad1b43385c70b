"""Public training scripts written for CUDA, run unchanged on the simulated GPU.

``tests/fixtures/public_cuda_programs`` holds byte-identical copies of public programs
(each folder with the repository's LICENSE and a README naming the repository, path and
commit): nanoGPT's ``train.py`` and its synchronize-timed ``bench.py``
(karpathy/nanoGPT), and pytorch/examples' word language model (an LSTM: ``main.py``, then
``generate.py``). Each runs under ``python -m anydevice.testing`` with the arguments
its README documents and synthetic data written here, and on the CPU; the losses must be
the CPU's to the digits printed. A copy of ``train.py`` with one stream bug planted in it
must stop with a report naming that line.

The arguments only shrink the programs and pick what they offer: ``--compile=False``
(``torch.compile``'s GPU backend makes Triton kernels, which the simulator refuses by
name) and ``--dtype=float32`` (bf16 autocast on a GPU computes other numbers than the
CPU's fp32; float32 keeps the math the same on both).
"""

from __future__ import annotations

import hashlib
import math
import pickle
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from children import Run, run_python
from test_testing_cuda import _toolchain_or_skip

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ROOT / "tests" / "fixtures" / "public_cuda_programs"
NANOGPT = PUBLIC / "nanogpt"
WORD_LM = PUBLIC / "word_language_model"
#: Per process: bench.py is GPT-2's 124M parameters whatever its arguments (two minutes on
#: one busy core, each way).
TIMEOUT = 900
pytestmark = pytest.mark.timeout(2 * TIMEOUT)

#: nanoGPT's train.py, made small (its configurator takes --key=value).
TRAIN = [
    "--dataset=synthetic",
    "--compile=False",
    "--dtype=float32",
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=64",
    "--block_size=32",
    "--batch_size=4",
    "--gradient_accumulation_steps=1",
    "--max_iters=6",
    "--eval_interval=3",
    "--eval_iters=2",
    "--log_interval=1",
]
#: nanoGPT's bench.py: its model is fixed (GPT-2 124M); one sequence of 16 tokens a step.
BENCH = ["--compile=False", "--dtype=float32", "--batch_size=1", "--block_size=16"]
#: The word language model, made small.
WORD = [
    "--data=corpus",
    "--emsize=32",
    "--nhid=32",
    "--nlayers=2",
    "--epochs=3",
    "--batch_size=4",
    "--bptt=8",
    "--log-interval=10",
]
GENERATE = ["--data=corpus", "--words=40"]

#: bench.py has no CPU path: on a machine without a GPU torch refuses ``pin_memory()``
#: (no accelerator to pin for) and ``torch.cuda.synchronize()``. The CPU's reference run
#: (only it) replaces those two calls: pinning changes no value, and a CPU op is done when
#: it returns. The simulated GPU runs bench.py as it is.
BENCH_ON_THE_CPU = """\
import os, runpy, sys, torch
torch.Tensor.pin_memory = lambda self, device=None: self
torch.cuda.synchronize = lambda device=None: None
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""

#: The line of train.py that the planted bug replaces: the batch's copy to the GPU.
COPY = (
    "        x, y = x.pin_memory().to(device, non_blocking=True), "
    "y.pin_memory().to(device, non_blocking=True)\n"
)
#: The bug: the copy moved to a fresh side stream, which nothing waits for.
PLANTED = "        with torch.cuda.stream(torch.cuda.Stream()): " + COPY.lstrip()


def _run(commands: list[list[str]], cwd: Path) -> Run:
    """Runs each command in turn in ``cwd`` (one thread each), until one fails."""
    out, err, seconds = "", "", 0.0
    for command in commands:
        run = run_python(command, timeout=TIMEOUT, cwd=cwd, OMP_NUM_THREADS="1")
        out, err, seconds = out + run.stdout, err + run.stderr, seconds + run.seconds
        if run.returncode != 0:
            return Run(run.returncode, out, err, seconds)
    return Run(0, out, err, seconds)


def _nanogpt_folder(where: Path, train: str | None = None) -> Path:
    """Copies of nanoGPT's files (its configurator is read from the working directory),
    with ``train`` as train.py where given; and synthetic token files in nanoGPT's format:
    uint16 memmaps, and a meta.pkl with the vocabulary's size, as its character-level
    datasets have."""
    where.mkdir()
    for name in ("train.py", "model.py", "configurator.py", "bench.py"):
        shutil.copyfile(NANOGPT / name, where / name)
    if train is not None:
        (where / "train.py").write_text(train)
    rng = np.random.default_rng(0)
    for dataset, vocab in (("synthetic", 65), ("openwebtext", 50257)):
        folder = where / "data" / dataset
        folder.mkdir(parents=True)
        for split, n in (("train", 20_000), ("val", 4_000)):
            rng.integers(0, vocab, n, dtype=np.uint16).tofile(folder / f"{split}.bin")
    with open(where / "data" / "synthetic" / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65}, f)
    return where


def _corpus(where: Path) -> Path:
    """A corpus in the word language model's layout: train.txt, valid.txt, test.txt of
    words from a vocabulary of 40, in runs the model can learn."""
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(40)]
    folder = where / "corpus"
    folder.mkdir(parents=True)
    for split, lines in (("train", 120), ("valid", 20), ("test", 20)):
        text = []
        for _ in range(lines):
            start = rng.randrange(40)
            length = rng.randrange(5, 15)
            text.append(
                " ".join(words[(start + 3 * k + rng.randrange(2)) % 40] for k in range(length))
            )
        (folder / f"{split}.txt").write_text("\n".join(text) + "\n")
    return where


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every run, three at a time (each a process with one thread); bench.py's first."""
    _toolchain_or_skip()
    tmp = tmp_path_factory.mktemp("public_cuda_programs")
    ng = _nanogpt_folder(tmp / "nanogpt")
    source = (NANOGPT / "train.py").read_text()
    assert source.count(COPY) == 1
    planted = _nanogpt_folder(tmp / "planted", train=source.replace(COPY, PLANTED))
    words = _corpus(tmp / "word_language_model")  # main.py runs from its own folder
    sim = ["-m", "anydevice.testing"]
    main, generate = str(WORD_LM / "main.py"), str(WORD_LM / "generate.py")
    jobs = {
        "bench/cpu": ([["-c", BENCH_ON_THE_CPU, "bench.py", "--device=cpu", *BENCH]], ng),
        "bench/sim": ([[*sim, "bench.py", *BENCH]], ng),
        "train/cpu": ([["train.py", "--device=cpu", "--out_dir=out_cpu", *TRAIN]], ng),
        "train/sim": ([[*sim, "train.py", "--out_dir=out_sim", *TRAIN]], ng),
        "train-planted/sim": ([[*sim, "train.py", *TRAIN]], planted),
        "word/cpu": (
            [
                [main, *WORD, "--save=cpu.pt"],
                [generate, *GENERATE, "--checkpoint=cpu.pt", "--outf=cpu.txt"],
            ],
            words,
        ),
        "word/sim": (
            [
                [*sim, main, *WORD, "--cuda", "--save=sim.pt"],
                [*sim, generate, *GENERATE, "--cuda", "--checkpoint=sim.pt", "--outf=sim.txt"],
                # the checkpoint the simulated GPU saved, sampled on a machine without one
                [generate, *GENERATE, "--checkpoint=sim.pt", "--outf=sim-on-cpu.txt"],
            ],
            words,
        ),
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(_run, *job) for name, job in jobs.items()}
        done = {name: f.result() for name, f in futures.items()}
    for name in ("cpu", "sim", "sim-on-cpu"):  # what generate.py wrote
        text = words / f"{name}.txt"
        done[f"word/{name}.txt"] = Run(0, text.read_text() if text.exists() else "", "", 0.0)
    times = ", ".join(f"{name} {run.seconds:.0f} s" for name, run in done.items() if run.seconds)
    print(f"\npublic CUDA programs: {times}")
    return done


def values(text: str, pattern: str) -> list[float]:
    """The numbers ``pattern``'s groups catch in ``text``, line by line, in order."""
    return [float(x) for m in re.finditer(pattern, text, flags=re.M) for x in m.groups()]


def printed_alike(cpu: list[float], sim: list[float], unit: float) -> bool:
    """Equal to the digits printed: at most one unit of the last one apart (a value on a
    rounding boundary may print either way)."""
    return len(cpu) == len(sim) > 0 and all(
        math.isclose(a, b, rel_tol=0, abs_tol=unit * 1.01) for a, b in zip(cpu, sim, strict=True)
    )


# --- the programs are the public ones --------------------------------------------------


def _blob(path: Path) -> str:
    """The file's git blob id, as ``git ls-tree`` prints it in its repository."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.mark.parametrize("folder", [NANOGPT, WORD_LM], ids=lambda p: p.name)
def test_the_fixtures_are_the_public_files_unchanged(folder: Path) -> None:
    """Each file's git blob id is the one its README records from the repository's commit,
    and the repository's licence is beside it."""
    readme = (folder / "README.md").read_text()
    assert re.search(r"https://github\.com/[\w-]+/[\w-]+/tree/[0-9a-f]{40}", readme), readme
    recorded = dict(re.findall(r"^\| `([\w.]+)` \| `([0-9a-f]{40})` \|$", readme, flags=re.M))
    here = {p.name for p in folder.iterdir() if p.is_file()} - {"README.md"}
    assert "LICENSE" in here and set(recorded) == here, (recorded, here)
    for name, blob in recorded.items():
        assert _blob(folder / name) == blob, f"{folder.name}/{name} differs from the public file"


# --- their results ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_nanogpt_trains_on_the_simulated_gpu_with_the_cpus_losses(runs: dict[str, Run]) -> None:
    cpu, sim = runs["train/cpu"].ok(), runs["train/sim"].ok()
    assert "using fused AdamW: True" in sim and "using fused AdamW: False" in cpu  # its GPU branch
    assert "StreamRace" not in runs["train/sim"].stderr
    for pattern, count in (
        (r"^iter \d+: loss (\S+),", 7),  # iterations 0 to 6
        (r"^step \d+: train loss (\S+), val loss (\S+)$", 6),  # evaluations at 0, 3, 6
    ):
        expected, got = values(cpu, pattern), values(sim, pattern)
        assert len(expected) == count and printed_alike(expected, got, 1e-4), (cpu, sim)


@pytest.mark.slow
@pytest.mark.long
def test_nanogpts_synchronize_timed_benchmark_gives_the_cpus_losses(
    runs: dict[str, Run],
) -> None:
    cpu, sim = runs["bench/cpu"].ok(), runs["bench/sim"].ok()
    pattern = r"^\d+/\d+ loss: (\S+)$"
    assert len(values(cpu, pattern)) == 30  # its burn-in and its timed steps
    assert printed_alike(values(cpu, pattern), values(sim, pattern), 1e-4), (cpu, sim)
    timed = re.search(r"^time per iteration: ([\d.]+)ms, MFU: ([\d.]+)%$", sim, flags=re.M)
    assert timed is not None and float(timed.group(1)) > 0, sim
    assert "using fused AdamW: True" in sim
    assert "StreamRace" not in runs["bench/sim"].stderr


@pytest.mark.slow
@pytest.mark.long
def test_the_word_language_model_trains_and_samples_as_on_the_cpu(runs: dict[str, Run]) -> None:
    """An LSTM (the fused cells torch sends a GPU's LSTM to), trained with --cuda from
    another working directory, saved, loaded back on the GPU, then sampled: the CPU's
    losses and perplexities, and the CPU's words."""
    cpu, sim = runs["word/cpu"].ok(), runs["word/sim"].ok()
    assert "WARNING: You have a CUDA device" not in sim  # --cuda given, and taken
    for pattern, unit in (
        (r"\| loss +(\S+) \| ppl +(\S+)$", 0.01),
        (r"\| valid loss +(\S+) \| valid ppl +(\S+)$", 0.01),
        (r"\| test loss +(\S+) \| test ppl +(\S+)$", 0.01),
    ):
        assert printed_alike(values(cpu, pattern), values(sim, pattern), unit), (cpu, sim)
    assert len(values(cpu, r"\| loss +(\S+) \|")) == 9  # 3 epochs, 3 reports each
    words = runs["word/cpu.txt"].stdout
    assert len(words.split()) == 40
    assert runs["word/sim.txt"].stdout == words
    assert runs["word/sim-on-cpu.txt"].stdout == words


@pytest.mark.slow
@pytest.mark.long
def test_a_stream_bug_planted_in_nanogpt_is_reported_at_its_line(runs: dict[str, Run]) -> None:
    """The batch's copy moved to a side stream that nothing waits for: the model's first
    layer reads the batch before it lands. The race detector stops the run there, naming
    the line that reads it and the planted line that copies it, where train.py as
    published runs clean with the CPU's losses (the test above)."""
    planted = runs["train-planted/sim"]
    assert planted.returncode == 1, (planted.stdout, planted.stderr)
    line = (NANOGPT / "train.py").read_text().splitlines(keepends=True).index(COPY) + 1
    read = (NANOGPT / "model.py").read_text().splitlines()
    first = next(i for i, t in enumerate(read, 1) if "tok_emb = self.transformer.wte(idx)" in t)
    report = planted.stderr[planted.stderr.rindex("StreamRaceError: ") :]
    assert report.startswith("StreamRaceError: stream race: read after write"), report
    assert re.search(rf"read +at model\.py:{first} in forward\(\)", report), report
    assert re.search(
        rf"written at train\.py:{line} in get_batch\(\) .*made at train\.py:{line}", report
    ), report
    assert f"fix: before line {first}, " in report and ".wait_stream(" in report, report
