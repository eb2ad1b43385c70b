"""A notebook's dataset under spawned DataLoader workers: named before any worker starts.
Each case runs in a real child ``python -c`` process, whose ``__main__`` is interactive as
a notebook's is, with real DataLoader workers where they start."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest

CASE = """
import time, torch
import anydevice as ad
from torch.utils.data import DataLoader, Dataset

class DS(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return torch.tensor([float(i)])

def run(**kw):
    t = time.monotonic()
    try:
        batches = [b for b in ad.DeviceLoader(DataLoader(DS(), batch_size=2, **kw), "cpu")]
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t
    return "ok", [b.tolist() for b in batches], time.monotonic() - t
"""


def _run(body: str) -> str:
    code = CASE + textwrap.dedent(body)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_notebook_dataset_under_spawned_workers_is_named_before_they_start():
    out = _run(
        """
        kind, said, took = run(num_workers=2, multiprocessing_context="spawn")
        print(kind)
        print(said)
        """
    )
    kind, said = out.split("\n", 1)
    assert kind == "WorkerImportError", out  # torch: "DataLoader worker exited unexpectedly"
    assert "'spawn'" in said and "dataset (class DS)" in said
    assert "num_workers=0" in said and ".py file" in said


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_forked_workers_and_no_workers_import_nothing_and_run():
    out = _run(
        """
        print(run(num_workers=0)[:2])
        print(run(num_workers=2, multiprocessing_context="fork")[:2])
        """
    )
    assert out.splitlines() == ["('ok', [[[0.0], [1.0]], [[2.0], [3.0]]])"] * 2, out


def test_a_dataset_from_a_module_passes_under_spawn():
    """Defined in an importable module (here: torch's TensorDataset): nothing to say."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from anydevice.feeding.startmethod import check_loader_workers, unimportable

    loader = DataLoader(TensorDataset(torch.ones(4, 1)), num_workers=2,
                        multiprocessing_context="spawn")  # fmt: skip
    check_loader_workers(loader)  # does not raise
    assert unimportable([("dataset", loader.dataset)]) == []


LAUNCH = """
import operator
import anydevice as ad

class DS:
    pass

def square(x):
    return x * x

def run(fn, *args, **kw):
    try:
        return "ok", ad.launch(fn, *args, nprocs=2, timeout=60, **kw)
    except Exception as e:
        return type(e).__name__, str(e)
"""


def test_a_notebook_function_or_class_under_spawned_launch_workers_is_named():
    """``ad.launch`` from an interactive ``__main__``: the function itself, and a class met
    deep inside its arguments, are named before any worker starts."""
    out = _run(
        LAUNCH
        + textwrap.dedent(
            """
            print(repr(run(square, 3)))
            print(repr(run(operator.add, [[1]], [{"data": DS()}], start_method="forkserver")))
            """
        )
    )
    first, second = (ast.literal_eval(line) for line in out.splitlines())
    assert first[0] == "WorkerImportError", out
    assert "'spawn'" in first[1] and "function square" in first[1]
    assert ".py file" in first[1] and "start_method='fork'" in first[1]
    assert second[0] == "WorkerImportError", out
    assert "'forkserver'" in second[1] and "class DS" in second[1]
    assert "operator" not in second[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_notebook_function_launches_forked_workers():
    out = _run(LAUNCH + "\nprint(repr(run(square, 3, start_method='fork')))\n")
    assert ast.literal_eval(out) == ("ok", {0: 9, 1: 9}), out


def test_a_script_defined_function_is_not_refused(tmp_path):
    """A ``__main__`` with a file: spawned workers import it again, nothing to refuse."""
    from anydevice.feeding.startmethod import main_references

    script = tmp_path / "train.py"
    script.write_text(
        "import sys\nsys.path.insert(0, sys.argv[1])\n"
        "from anydevice.feeding.startmethod import main_references\n"
        "class DS: pass\n"
        "def fn(x): return x\n"
        "print(main_references((fn, [DS()])))\n"
    )
    out = subprocess.run(
        [sys.executable, str(script), sys.path[0]],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "[]", out.stderr
    assert main_references((len, [1, 2])) == []
    with pytest.raises(Exception, match="lambda"):
        main_references(lambda: 0)  # not picklable, and not from __main__: pickle says so


@pytest.mark.cuda
def test_forking_from_a_notebook_after_cuda_is_refused_with_the_way_out():
    out = _run(LAUNCH + "\nimport torch\ntorch.cuda.init()\n"
               "print(repr(run(square, 3, start_method='fork')))\n")  # fmt: skip
    kind, said = ast.literal_eval(out)
    assert kind == "DistributedError", out
    assert "CUDA is already initialised" in said and "restart the kernel" in said
    assert ".py file" in said


def test_a_notebook_lambda_is_refused_for_what_it_is():
    """Not importable from any module: pickle's refusal, not the advice to move it."""
    out = _run(LAUNCH + "\nprint(repr(run(lambda x: x, 3)))\n")
    kind, said = ast.literal_eval(out)
    assert kind == "DistributedError", out
    assert "not a lambda" in said and "<lambda>" in said
