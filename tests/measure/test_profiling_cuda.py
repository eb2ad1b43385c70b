"""find_syncs, profile and nvtx_range on a real NVIDIA GPU (``cuda`` marker).

Each implicit synchronisation is made on a line marked ``# sync: <name>``; the report must
name that line of this file and the torch function called there.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_profiling import SlowDataset

import anydevice as ad

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.real_gpu(
        "torch's sync debug mode, CUDA kernel traces (CUPTI) and NVTX: the simulated GPU has "
        "none of them"
    ),
]

SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(SOURCE, start=1) if text.rstrip().endswith(marker))


def only_sync(report):
    assert report.applicable, report
    assert report.count == 1, report
    return report.syncs[0]


@pytest.fixture
def x():
    return torch.arange(8, dtype=torch.float32, device="cuda")


def test_item(x):
    s = only_sync(ad.find_syncs(lambda: x.sum().item()))  # sync: item
    assert (s.filename, s.lineno) == (__file__, line_of("# sync: item"))
    assert s.op == "torch.Tensor.item"


def test_cpu(x):
    def step():
        return x.cpu()  # sync: cpu

    s = only_sync(ad.find_syncs(step))
    assert (s.lineno, s.function, s.op) == (line_of("# sync: cpu"), "step", "torch.Tensor.cpu")
    assert s.code == "return x.cpu()  # sync: cpu"


def test_print_of_a_cuda_tensor(x, capsys):
    def step():
        print(x)  # sync: print

    report = ad.find_syncs(step)
    assert report.applicable and report.count >= 1
    assert {s.lineno for s in report.syncs} == {line_of("# sync: print")}
    assert all(s.op == "torch.Tensor.__repr__" for s in report.syncs)
    assert "tensor(" in capsys.readouterr().out


def test_nonzero(x):
    report = ad.find_syncs(lambda: torch.nonzero(x > 3))  # sync: nonzero
    assert report.applicable and report.count >= 1  # the count of nonzeros goes to the host
    assert {(s.lineno, s.op) for s in report.syncs} == {
        (line_of("# sync: nonzero"), "torch.nonzero")
    }


def test_blocking_host_to_device_copy():
    host = torch.ones(1024)
    s = only_sync(ad.find_syncs(lambda: host.to("cuda")))  # sync: h2d
    assert s.lineno == line_of("# sync: h2d") and s.op == "torch.Tensor.to"


def test_python_control_flow_on_a_cuda_value(x):
    def step():
        if x.sum() > 0:  # sync: bool
            return 1
        return 0

    s = only_sync(ad.find_syncs(step))
    assert s.lineno == line_of("# sync: bool") and s.op == "torch.Tensor.__bool__"


def test_repeated_syncs_are_counted_per_line(x):
    def step():
        return [x[i].item() for i in range(5)]  # sync: loop

    report = ad.find_syncs(step)
    assert report.count == 5
    [(first, n)] = report.by_location()
    assert n == 5 and first.lineno == line_of("# sync: loop")
    assert report.value == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_sync_free_code_reports_none(x):
    report = ad.find_syncs(lambda: (x * 2).sum())
    assert report.applicable and report.count == 0
    assert "no implicit synchronisation" in repr(report)


def test_debug_mode_is_restored_also_on_error(x):
    torch.cuda.set_sync_debug_mode("error")
    try:

        def broken():
            raise KeyError("boom")

        with pytest.raises(KeyError):
            ad.find_syncs(broken)
        assert torch.cuda.get_sync_debug_mode() == 2
        ad.find_syncs(lambda: x.sum().item())  # warn mode inside: no error raised
        assert torch.cuda.get_sync_debug_mode() == 2
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_profile_records_cuda_kernels(tmp_path):
    out = io.StringIO()
    a = torch.randn(1024, 1024, device="cuda")
    with ad.profile(tmp_path / "trace.json", device="cuda", print_to=out) as p:
        (a @ a).sum()
        torch.cuda.synchronize()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    assert "self_device_time_total" in out.getvalue()
    assert "CUDA" in p.table


def test_nvtx_range_is_active_on_cuda():
    @ad.nvtx_range("forward")
    def forward(t):
        return t * 2

    with ad.nvtx_range("block") as r:
        y = forward(torch.ones(2, device="cuda"))
    assert r.active
    assert y.sum().item() == 4.0


def test_decorating_with_nvtx_range_leaves_cuda_uninitialised():
    # A decorator runs at import time: it must not run cuInit, or restrict_visible (and
    # fork) are refused for the rest of the process.
    code = textwrap.dedent(
        """
        import anydevice as ad
        from anydevice.hardware.backends.cuda import driver_initialized

        @ad.nvtx_range("forward")
        def forward(x):
            return x * 2

        print("driver initialised:", driver_initialized())
        ad.restrict_visible("0")
        import torch
        with ad.nvtx_range("block"):
            y = forward(torch.ones(2, device="cuda"))
        print("ok", y.sum().item(), torch.cuda.device_count())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "driver initialised: False" in out.stdout
    assert out.stdout.strip().endswith("ok 4.0 1")


# ----------------------------------------------------------------------------- idle time


def test_profile_finds_a_launch_bound_loop(tmp_path):
    import time

    x = torch.randn(64, device="cuda")
    with ad.profile(tmp_path / "t.json", steps=5, device="cuda", print_to=None) as p:
        for _ in range(8):
            for _ in range(10):
                x.add_(1)
                time.sleep(0.001)  # the host is slow to launch the next tiny kernel
            p.step()
    idle = p.idle
    assert idle is not None and idle.active is not None
    assert idle.idle_share is not None and idle.idle_share > 0.8
    assert idle.host_wait is not None and idle.host_wait > 0.8 * (idle.idle or 0)
    assert idle.data_wait < 0.05 * idle.window


def test_profile_tells_waiting_on_data_from_waiting_on_launches(tmp_path):
    a = torch.randn(256, 256, device="cuda")
    loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=4)
    with ad.profile(tmp_path / "t.json", steps=3, device="cuda", print_to=None) as p:
        for batch in p.iterate(loader):
            torch.mm(a, a) + batch.to("cuda", non_blocking=True).sum()
    idle = p.idle
    assert idle is not None and idle.idle is not None
    assert idle.data_wait > 0.5 * idle.idle, idle


def test_profile_of_queued_big_matmuls_shows_a_busy_device(tmp_path):
    a = torch.randn(4096, 4096, device="cuda")
    with ad.profile(tmp_path / "t.json", steps=3, device="cuda", print_to=None) as p:
        for _ in range(6):
            for _ in range(20):
                torch.mm(a, a)
            p.step()
    assert p.idle is not None and p.idle.idle_share is not None
    assert p.idle.idle_share < 0.2, p.idle
