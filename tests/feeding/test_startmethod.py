"""A notebook's dataset under spawned DataLoader workers: named before any worker starts.
Each case runs in a real child ``python -c`` process, whose ``__main__`` is interactive as
a notebook's is, with real DataLoader workers where they start."""

from __future__ import annotations

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
