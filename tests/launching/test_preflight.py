"""What would break a launch's workers as they start, refused before any starts: a
notebook's function or class under spawned workers, a lambda, forking after CUDA. Each
case runs in a real child ``python -c`` process, whose ``__main__`` is interactive as a
notebook's is, with real workers where they start. (The main guard's cases are
tests/launching/test_elastic.py's.)"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


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
    from anydevice.launching.preflight import main_references

    script = tmp_path / "train.py"
    script.write_text(
        "import sys\nsys.path.insert(0, sys.argv[1])\n"
        "from anydevice.launching.preflight import main_references\n"
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
@pytest.mark.real_gpu("a CUDA context in a fresh process (a child has no simulated GPU)")
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
