"""Which device a bare spec names on a real NVIDIA GPU (``cuda`` marker: skipped without one).

Each check that depends on what the process has done to CUDA runs in a fresh interpreter,
so it sees exactly the state it sets up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import pytest

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.real_gpu(
        "NVML and CUDA's state, in fresh processes (a child has no simulated GPU)"
    ),
]

GiB = 2**30


def run_py(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_bare_cuda_spec_before_initialisation_creates_no_context():
    r = run_py(
        """
        import json, torch, anydevice as ad
        from anydevice.hardware.backends.cuda import driver_initialized
        from anydevice.hardware.selection import current_indices
        chosen = [str(ad.device("cuda")), str(ad.device("gpu")), str(ad.device())]
        ad.describe("cuda"); ad.devices("cuda")
        print(json.dumps({"chosen": chosen, "current": current_indices(),
                          "torch_init": torch.cuda.is_initialized(),
                          "driver_init": driver_initialized()}))
        """
    )
    assert r["chosen"] == ["cuda:0", "cuda:0", "cuda:0"]  # today's meaning before init
    assert r["current"] == {}
    assert r["torch_init"] is False and r["driver_init"] is False


def test_once_cuda_is_initialised_a_bare_cuda_is_torchs_current_device():
    # Compares with what torch itself does for x.to("cuda"); index filled in everywhere.
    r = run_py(
        """
        import json, torch, anydevice as ad
        from anydevice.hardware.selection import current_indices
        torch.cuda.init()
        theirs = str(torch.ones(1).to("cuda").device)
        ours = {
            "device": str(ad.device("cuda")),
            "gpu": str(ad.device("gpu")),
            "auto": str(ad.device()),
            "to_str": str(ad.to(torch.ones(1), "cuda").device),
            "to_device": str(ad.to(torch.ones(1), torch.device("cuda")).device),
            "describe": ad.describe("cuda", telemetry=False).spec,
        }
        print(json.dumps({"theirs": theirs, "ours": ours, "current": current_indices()}))
        """
    )
    assert r["theirs"].startswith("cuda:")
    assert set(r["ours"].values()) == {r["theirs"]}
    assert r["current"] == {"cuda": int(r["theirs"].split(":")[1])}


def test_with_two_gpus_a_bare_cuda_follows_set_device_everywhere():
    r = run_py(
        """
        import json, torch, anydevice as ad
        from torch.utils.data import DataLoader, TensorDataset
        count = torch.cuda.device_count()
        if count < 2:
            print(json.dumps({"count": count})); raise SystemExit
        torch.cuda.set_device(1)  # what a DDP rank with local_rank 1 does
        loader = ad.DeviceLoader(DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2), "cuda")
        placed = {
            "device": str(ad.device("cuda")),
            "auto": str(ad.device()),
            "to_str": str(ad.to({"x": torch.ones(1)}, "cuda")["x"].device),
            "to_device": str(ad.to(torch.ones(1), torch.device("cuda")).device),
            "loader": sorted({str(b[0].device) for b in loader}),
        }
        print(json.dumps({"count": count, "placed": placed}))
        """
    )
    if r["count"] < 2:
        pytest.skip(f"needs two GPUs; {r['count']} here")
    assert r["placed"] == {
        "device": "cuda:1",
        "auto": "cuda:1",
        "to_str": "cuda:1",
        "to_device": "cuda:1",
        "loader": ["cuda:1"],
    }


# ----------------------------------------------------------------------------- "free"


@pytest.fixture
def hog() -> Iterator[Callable[[int, int], None]]:
    """Start a process that holds ``size`` bytes on ``cuda:index`` until the test ends."""
    procs: list[subprocess.Popen[str]] = []

    def start(index: int, size: int) -> None:
        code = (
            "import sys, torch\n"
            f"x = torch.empty({size}, dtype=torch.uint8, device='cuda:{index}')\n"
            "torch.cuda.synchronize()\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n"
        )
        p = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.strip() == "ready", p.stderr.read() if p.stderr else ""

    yield start
    for p in procs:
        if p.stdin is not None:
            p.stdin.close()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)


def test_free_memory_read_for_free_is_live_and_counts_other_processes(hog):
    # One GPU is enough: the memory another process takes must show in what "free" sees.
    import anydevice as ad

    before = ad.describe("free", telemetry=False)
    assert before.memory_free is not None and before.index is not None
    taken = min(8 * GiB, before.memory_free // 2)
    hog(before.index, taken)
    during = ad.describe(f"cuda:{before.index}", telemetry=False).memory_free
    assert during is not None
    assert before.memory_free - during >= 0.9 * taken
    need = during + taken // 2  # fitted before the other process took its share
    with pytest.raises(ad.DeviceNotFoundError, match="need_memory"):
        ad.device(f"cuda:{before.index}", need_memory=need)


def test_with_two_gpus_free_avoids_the_one_another_process_fills(hog):
    import anydevice as ad

    gpus = ad.inventory(telemetry=False).of_kind("cuda")
    if len(gpus) < 2:
        pytest.skip(f"needs two GPUs; {len(gpus)} here")
    first, second = sorted(gpus, key=lambda d: -(d.memory_free or 0))[:2]
    assert first.memory_free is not None and second.memory_free is not None
    # Fill the emptiest GPU until it has 2 GiB less free than the runner-up.
    hog(first.index or 0, first.memory_free - second.memory_free + 2 * GiB)
    assert ad.describe("free", telemetry=False).index == second.index
    assert ad.device("free") == second.torch_device


def test_resolving_cuda_specs_in_a_loop_opens_one_nvml_session():
    # The GPUs' unchanging facts are read once per process; free memory only when a policy
    # compares it ("free", need_memory).
    r = run_py(
        """
        import json, pynvml, torch, anydevice as ad
        sessions = []
        real = pynvml.nvmlInit
        def counted():
            sessions.append(1)
            real()
        pynvml.nvmlInit = counted
        x = torch.ones(2)
        for _ in range(20):
            ad.device("cuda:0")
        before_cuda = len(sessions)
        for _ in range(10):
            ad.to(x, "cuda:0")
            with ad.side_stream("cuda"):
                pass
            with ad.Timer("cuda:0"):
                pass
        specs = len(sessions)
        ad.device("free")
        ad.device("cuda:0", need_memory=1)
        print(json.dumps({"before_cuda": before_cuda, "specs": specs, "all": len(sessions)}))
        """
    )
    assert r["before_cuda"] == 1 and r["specs"] == 1
    assert r["all"] == 3
