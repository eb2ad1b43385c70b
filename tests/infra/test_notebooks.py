"""A notebook run by a real Jupyter kernel (ipykernel, driven by nbclient), as Kaggle and
Colab run one: the cells' ``__main__`` is the kernel's, not a script's.

What it proves: an inventory shows as a table (HTML as a cell's value, the text table under
``print``); ``ad.timeit`` runs; a Dataset defined in a cell under spawned DataLoader workers
is named by :class:`~anydevice.WorkerImportError` before any worker starts; ``ad.launch``
runs a function defined in a cell on two forked processes; the kernel is gone afterwards.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

nbformat = pytest.importorskip(
    "nbformat", reason="nbformat is not installed: pip install -e '.[infra]' (make test-infra)"
)
nbclient = pytest.importorskip(
    "nbclient", reason="nbclient is not installed: pip install -e '.[infra]' (make test-infra)"
)
pytest.importorskip(
    "ipykernel", reason="ipykernel is not installed: pip install -e '.[infra]' (make test-infra)"
)

SRC = Path(__file__).resolve().parents[2] / "src"

CELLS = [
    # 0: the kernel's pid, to check it is gone afterwards; this checkout's anydevice.
    f"import os, sys\nsys.path.insert(0, {str(SRC)!r})\nprint('KERNEL_PID', os.getpid())",
    # 1: an inventory as a cell's value.
    "import anydevice as ad\nad.inventory()",
    # 2: the same under print().
    "print(ad.inventory())",
    # 3: a measurement.
    "import torch\n"
    "a = torch.ones(64, 64)\n"
    "m = ad.timeit(torch.mm, a, a, min_time=0.05)\n"
    "print('TIMEIT', len(m.times), m.median > 0)",
    # 4: a Dataset defined in a cell, under spawned workers.
    "class CellDataset(torch.utils.data.Dataset):\n"
    "    def __len__(self):\n"
    "        return 8\n"
    "    def __getitem__(self, i):\n"
    "        return torch.tensor([float(i)])\n"
    "loader = torch.utils.data.DataLoader(\n"
    "    CellDataset(), batch_size=2, num_workers=2, multiprocessing_context='spawn'\n"
    ")\n"
    "for batch in ad.DeviceLoader(loader, device='cpu'):\n"
    "    pass",
    # 5: a function defined in a cell, on two forked processes.
    "def rank_times_ten(offset):\n"
    "    import torch.distributed as dist\n"
    "    with ad.distributed() as d:\n"
    "        total = torch.tensor([float(d.rank + 1)])\n"
    "        dist.all_reduce(total)\n"
    "        return (d.rank * 10 + offset + int(total.item()) * 100, os.getpid())\n"
    "results = ad.launch(rank_times_ten, 1, nprocs=2, start_method='fork', timeout=120)\n"
    "print('LAUNCH', sorted((r, v[0]) for r, v in results.items()))\n"
    "print('WORKER_PIDS', ' '.join(str(v[1]) for v in results.values()))",
]


def _text(cell: Any) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _gone(pid: int, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return False


def test_a_notebook_in_a_real_kernel(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=180,
        allow_errors=True,  # cell 4 must raise; every other cell is checked for errors below
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute(env=env)  # starts the kernel, runs every cell, shuts the kernel down

    cells = nb.cells
    for i, cell in enumerate(cells):
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if i != 4:
            assert not errors, f"cell {i} raised: {errors}"

    kernel_pid = int(_text(cells[0]).split()[1])

    (value,) = [o for o in cells[1].outputs if o.output_type == "execute_result"]
    html = value["data"]["text/html"]
    assert "<table>" in html and "host" in html and "cpu" in html.lower()

    printed = _text(cells[2])
    assert "Inventory(" not in printed
    assert "host" in printed and "cpu" in printed.lower() and len(printed.splitlines()) > 3

    assert _text(cells[3]).split()[0] == "TIMEIT" and _text(cells[3]).split()[2] == "True"
    assert int(_text(cells[3]).split()[1]) > 0

    (error,) = [o for o in cells[4].outputs if o.output_type == "error"]
    assert error["ename"] == "WorkerImportError", error
    assert "CellDataset" in error["evalue"]
    assert "DataLoader worker" not in error["evalue"]  # said before any worker died

    lines = _text(cells[5]).splitlines()
    assert lines[0] == "LAUNCH [(0, 301), (1, 311)]", lines
    worker_pids = [int(p) for p in lines[1].split()[1:]]
    assert len(set(worker_pids)) == 2 and kernel_pid not in worker_pids

    assert _gone(kernel_pid), f"the kernel (pid {kernel_pid}) is still running"
    for pid in worker_pids:
        assert _gone(pid), f"a launched worker (pid {pid}) is still running"
