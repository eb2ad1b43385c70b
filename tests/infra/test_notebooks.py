"""A notebook run by a real Jupyter kernel, as Kaggle, Colab and JupyterLab run one.

The notebook is built with nbformat and executed cell by cell by an ipykernel through
nbclient, and each cell's outputs are read as a notebook front end reads them: the
inventory as an HTML table, ``ad.timeit``'s result, the doctor's progress (updated in
place, message by message) and report, two processes launched from a function defined in
a cell (forked, with an all_reduce between them; spawned ones are refused with the way
out), and the named refusal of a dataset defined in a cell under spawned DataLoader
workers. The kernel and every process it started are gone afterwards.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

WHY = "not installed; pip install -e '.[infra]' (nbclient, ipykernel, nbformat)"
nbformat = pytest.importorskip("nbformat", reason=f"nbformat {WHY}")
nbclient = pytest.importorskip("nbclient", reason=f"nbclient {WHY}")
pytest.importorskip("ipykernel", reason=f"ipykernel {WHY}")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

SRC = str(Path(__file__).resolve().parents[2] / "src")

CELLS = {
    "setup": "import os, torch\nimport anydevice as ad\nos.getpid()",
    "inventory": "ad.inventory()",
    "print": "print(ad.inventory())",
    "timeit": "a = torch.ones(64, 64)\nad.timeit(torch.mm, a, a, min_time=0.05, label='mm 64')",
    "define": (
        "def work(x):\n"
        "    import os\n"
        "    import torch.distributed as dist\n"
        "    with ad.distributed() as d:\n"
        "        total = torch.tensor([float(d.rank + 1)], device=d.device)\n"
        "        dist.all_reduce(total)\n"
        "        return (d.rank, os.getpid(), x * x, total.item())\n"
    ),
    "fork": "ad.launch(work, 3, nprocs=2, start_method='fork', timeout=120)",
    "spawn": "ad.launch(work, 3, nprocs=2, timeout=120)",
    "dataset": (
        "from torch.utils.data import DataLoader, Dataset\n"
        "class DS(Dataset):\n"
        "    def __len__(self):\n"
        "        return 4\n"
        "    def __getitem__(self, i):\n"
        "        return torch.tensor([float(i)])\n"
        "loader = DataLoader(DS(), batch_size=2, num_workers=2, multiprocessing_context='spawn')\n"
        "list(ad.DeviceLoader(loader, 'cpu'))"
    ),
    "dataset-fork": (
        "loader = DataLoader(DS(), batch_size=2, num_workers=2, multiprocessing_context='fork')\n"
        "[b.tolist() for b in ad.DeviceLoader(loader, 'cpu')]"
    ),
    # after the launches: on a GPU machine nothing may have initialised CUDA before
    "doctor": (
        "from anydevice.cli import main as anydevice\n"
        "anydevice(['doctor', '--quick', '--device', 'cpu'])"
    ),
    # last: CUDA, once initialised, stays so in the kernel
    "cuda-fork": (
        "torch.cuda.init()\nad.launch(work, 3, nprocs=2, start_method='fork', timeout=120)"
    ),
}


class RecordingClient(nbclient.NotebookClient):  # type: ignore[misc,name-defined]
    """nbclient's client, keeping every message the kernel sent, by cell."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.messages: dict[int, list[dict[str, Any]]] = {}

    def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
        self.messages.setdefault(cell_index, []).append(msg)
        return super().process_message(msg, cell, cell_index)


def _text(outputs: list[Any], mime: str = "text/plain") -> str:
    parts = []
    for o in outputs:
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            parts.append(o.data.get(mime, ""))
        elif o.output_type == "error":
            parts.append(f"{o.ename}: {o.evalue}")
    return "\n".join(parts)


def _error(outputs: list[Any]) -> tuple[str, str]:
    errors = [(o.ename, o.evalue) for o in outputs if o.output_type == "error"]
    return errors[0] if errors else ("", "")


def _execute(names: list[str], here: Path) -> tuple[dict[str, Any], RecordingClient]:
    """Run the named cells as one notebook in a fresh kernel in ``here``: the cells by name,
    after the run, and the client that ran them. The kernel and all it started are gone
    when it returns."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELLS[n]) for n in names])
    client = RecordingClient(
        nb,
        timeout=240,  # per cell; the doctor's quick plan measures for 10 s
        startup_timeout=120,
        kernel_name="python3",  # ipykernel's own kernel: this interpreter
        allow_errors=True,  # the refusals are errors, read below
        resources={"metadata": {"path": str(here)}},
        shutdown_kernel="graceful",
    )
    before = set(psutil.Process().children(recursive=True))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([SRC, old or ""])  # the kernel inherits it
    try:
        client.execute()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    left = [p for p in set(psutil.Process().children(recursive=True)) - before if _alive(p)]
    assert not left, f"processes left behind by the kernel: {left}"
    cells = dict(zip(names, nb.cells, strict=True))
    kernel_pid = int(_text(cells["setup"].outputs))
    assert not psutil.pid_exists(kernel_pid) or not _alive(psutil.Process(kernel_pid))
    return cells, client


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_notebook_in_a_real_kernel(tmp_path: Path) -> None:
    """One notebook, one kernel (one test, so that parallel test workers never run two)."""
    cells, client = _execute([n for n in CELLS if n != "cuda-fork"], tmp_path)
    _check_every_cell_ran(cells)
    _check_the_inventory_shows_as_a_table(cells)
    _check_timeit_shows_its_measurement(cells)
    _check_the_doctor_shows_progress_then_its_report(cells, client)
    _check_a_cell_function_launches_two_forked_processes(cells)
    _check_spawned_launch_refuses_a_cell_function(cells)
    _check_a_cell_dataset_under_spawned_loader_workers_is_named(cells)


def _check_every_cell_ran(cells: dict[str, Any]) -> None:
    for name in ("setup", "inventory", "print", "timeit", "doctor", "define", "fork"):
        assert _error(cells[name].outputs) == ("", ""), (name, cells[name].outputs)


def _check_the_inventory_shows_as_a_table(cells: dict[str, Any]) -> None:
    html = _text(cells["inventory"].outputs, "text/html")
    assert html.startswith("<div>") and "<table>" in html and "<b>host</b>" in html
    assert "torch" in html and "cpu" in html
    printed = _text(cells["print"].outputs)
    assert "Inventory(" not in printed and "torch" in printed and "host" in printed
    assert "\x1b[" not in printed  # plain text, no terminal colours


def _check_timeit_shows_its_measurement(cells: dict[str, Any]) -> None:
    shown = _text(cells["timeit"].outputs)
    assert shown.startswith("Measurement('mm 64', cpu): median"), shown
    assert "samples" in shown


def _check_the_doctor_shows_progress_then_its_report(
    cells: dict[str, Any], client: RecordingClient
) -> None:
    index = list(cells).index("doctor")
    messages = client.messages[index]
    shown = [m for m in messages if m["msg_type"] == "display_data"]
    updates = [m for m in messages if m["msg_type"] == "update_display_data"]
    progress_id = shown[0]["content"]["transient"]["display_id"]
    steps = [
        m["content"]["data"]["text/plain"]
        for m in updates
        if m["content"]["transient"]["display_id"] == progress_id
    ]
    assert len(steps) >= 3, steps  # a step at a time, as they happen
    assert steps[0].startswith("measuring 0/"), steps
    assert steps[-1].startswith("measured "), steps
    assert all("\x1b[" not in s for s in steps)
    assert "<progress" in updates[0]["content"]["data"]["text/html"]
    report = _text(cells["doctor"].outputs, "text/html")
    assert "checks" in report and "measured" in report
    results = [o for o in cells["doctor"].outputs if o.output_type == "execute_result"]
    assert results == [], results  # the exit status 0 is not echoed under the report


def _check_a_cell_function_launches_two_forked_processes(cells: dict[str, Any]) -> None:
    result = ast.literal_eval(_text(cells["fork"].outputs))  # {rank: (rank, pid, 9, 1 + 2)}
    assert sorted(result) == [0, 1]
    assert [r[0] for r in result.values()] == [0, 1]
    assert {r[2:] for r in result.values()} == {(9, 3.0)}  # an all_reduce between them
    kernel_pid = int(_text(cells["setup"].outputs))
    assert kernel_pid not in {r[1] for r in result.values()}  # two processes of their own


def _check_spawned_launch_refuses_a_cell_function(
    cells: dict[str, Any],
) -> None:
    name, said = _error(cells["spawn"].outputs)
    assert name == "WorkerImportError", cells["spawn"].outputs
    assert "function work" in said and "'spawn'" in said
    assert ".py file" in said and "start_method='fork'" in said


def _check_a_cell_dataset_under_spawned_loader_workers_is_named(cells: dict[str, Any]) -> None:
    name, said = _error(cells["dataset"].outputs)
    assert name == "WorkerImportError", cells["dataset"].outputs
    assert "dataset (class DS)" in said and "num_workers=0" in said and ".py file" in said
    assert ast.literal_eval(_text(cells["dataset-fork"].outputs)) == [
        [[0.0], [1.0]],
        [[2.0], [3.0]],
    ]


@pytest.mark.cuda
def test_forking_after_cuda_in_a_notebook_is_refused_with_the_fix(tmp_path: Path) -> None:
    cells, _ = _execute(["setup", "define", "cuda-fork"], tmp_path)
    name, said = _error(cells["cuda-fork"].outputs)
    assert name == "DistributedError", cells["cuda-fork"].outputs
    assert "CUDA is already initialised" in said and "restart the kernel" in said
