"""Profiling on the CPU for real: traces written and read back, the table, the schedule;
find_syncs and nvtx_range where there is no CUDA (their CUDA side is in the cuda tests)."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import sys

import pytest
import torch

import anydevice as ad
from anydevice.hardware.backends.cuda import cuda_built

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour without CUDA")


def names(trace_path) -> list[str]:
    opener = gzip.open if str(trace_path).endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        data = json.load(f)
    return [e.get("name", "") for e in data["traceEvents"]]


def test_profile_writes_a_trace_with_the_ops_that_ran(tmp_path):
    out = io.StringIO()
    path = tmp_path / "sub" / "trace.json"
    a = torch.randn(64, 64)
    with ad.profile(path, device="cpu", print_to=out) as p:
        torch.mm(a, a)
    assert p.trace_written and p.path == path
    assert "aten::mm" in names(path)
    assert "Top ops by self_cpu_time_total" in out.getvalue()
    assert "aten::mm" in p.table and "aten::mm" in out.getvalue()


def test_profile_records_only_the_active_steps(tmp_path):
    path = tmp_path / "steps.json"
    with ad.profile(path, steps=2, wait=1, warmup=1, device="cpu", print_to=None) as p:
        for i in range(6):
            with torch.profiler.record_function(f"iteration-{i}"):
                torch.ones(8).sum()
            p.step()
    recorded = {n for n in names(path) if n.startswith("iteration-")}
    assert recorded == {"iteration-2", "iteration-3"}
    assert p.steps_done == 6


def test_profile_iterate_steps_after_each_item(tmp_path):
    path = tmp_path / "trace.json.gz"
    with ad.profile(path, steps=1, wait=0, device="cpu", print_to=None) as p:
        for i in p.iterate(range(3)):
            with torch.profiler.record_function(f"item-{i}"):
                torch.ones(4).add_(1)
    assert p.steps_done == 3
    assert {n for n in names(path) if n.startswith("item-")} == {"item-1"}


def test_profile_table_goes_to_a_logger(caplog):
    log = logging.getLogger("anydevice.test")
    with (
        caplog.at_level(logging.INFO, logger="anydevice.test"),
        ad.profile(None, device="cpu", print_to=log) as p,
    ):
        torch.ones(16).cumsum(0)
    assert not p.trace_written and p.path is None
    assert "aten::cumsum" in caplog.text


def test_profile_records_memory_when_asked():
    with ad.profile(None, device="cpu", record_memory=True, print_to=None) as p:
        torch.ones(2**16)
    assert "CPU Mem" in p.table


def test_profile_warns_when_the_block_ends_before_recording(tmp_path):
    path = tmp_path / "never.json"
    with (
        pytest.warns(RuntimeWarning, match="recorded nothing"),
        ad.profile(path, steps=3, wait=2, warmup=1, device="cpu", print_to=None) as p,
    ):
        p.step()
    assert not path.exists() and not p.trace_written


def test_profile_stops_the_profiler_when_the_block_raises():
    with pytest.raises(KeyError), ad.profile(None, device="cpu", print_to=None):
        raise KeyError("boom")
    assert not torch.autograd.profiler._is_profiler_enabled


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"warmup": 0}, "warmup >= 1"), ({"wait": -1}, "wait >= 0"), ({"steps": 0}, "steps")],
)
def test_profile_rejects_a_schedule_that_skews_results(kwargs, match):
    with pytest.raises(ValueError, match=match), ad.profile(None, device="cpu", **kwargs):
        pass


@no_cuda
def test_find_syncs_without_cuda_says_not_applicable():
    ran = []
    report = ad.find_syncs(lambda x: ran.append(x) or x * 2, 21)
    assert ran == [21] and report.value == 42
    assert report.applicable is False and report.count is None
    assert "not applicable" in repr(report) and "CUDA" in repr(report)
    with pytest.raises(ad.MeasurementError, match="not applicable"):
        _ = report.syncs  # not an empty tuple that reads as "no syncs"
    with pytest.raises(ad.MeasurementError):
        report.by_location()


@pytest.mark.skipif(cuda_built(), reason="says why on a CPU-only build of torch")
def test_find_syncs_on_a_cpu_build_says_what_it_takes_in_a_whole_sentence():
    report = ad.find_syncs(lambda: 1)
    assert repr(report) == (
        f"SyncReport(not applicable: this torch ({torch.__version__}) is a CPU-only build; "
        "finding implicit synchronisations takes CUDA's sync debug mode, so a CUDA build of "
        "torch and an NVIDIA GPU)"
    )


def test_find_syncs_lets_errors_through():
    def broken():
        raise ZeroDivisionError("inside fn")

    with pytest.raises(ZeroDivisionError, match="inside fn"):
        ad.find_syncs(broken)


@no_cuda
def test_nvtx_range_without_cuda_does_nothing_but_wraps_correctly():
    @ad.nvtx_range("double")
    def double(x):
        return 2 * x

    assert double(4) == 8
    with ad.nvtx_range("block") as r:
        assert r.active is False
    assert "inactive" in repr(r)
    with pytest.raises(ValueError, match="inner"), ad.nvtx_range("raises"):
        raise ValueError("inner")


def test_nvtx_range_never_asks_whether_cuda_is_available():
    # Watched, not replaced: a profile hook sees every Python call into torch.cuda's
    # initialisation while the decorator is applied and the range is entered.
    asked: list[str] = []
    watched = {"is_available", "device_count", "init", "_lazy_init", "is_initialized"}
    cuda_init = os.path.join("torch", "cuda", "__init__.py")

    def watch(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name in watched and code.co_filename.endswith(cuda_init):
            asked.append(code.co_name)

    sys.setprofile(watch)
    try:

        @ad.nvtx_range("step")
        def step(x):
            return x + 1

        with ad.nvtx_range("block"):
            assert step(1) == 2
    finally:
        sys.setprofile(None)
    assert asked == []


def test_sync_report_groups_repeated_lines():
    from anydevice.measure.profiling import Sync, SyncReport

    a = Sync("torch.Tensor.item", "/x/train.py", 10, "step", "loss.item()")
    b = Sync("torch.nonzero", "/x/train.py", 12, "step", "idx = mask.nonzero()")
    report = SyncReport(True, "watched cuda:0", (a, b, a, a))
    assert report.count == 4
    assert report.by_location() == [(a, 3), (b, 1)]
    text = repr(report)
    assert "4 implicit synchronisation(s)" in text
    assert text.index("3x") < text.index("1x")
    assert "train.py:10 torch.Tensor.item: loss.item()" in text
    assert "no implicit synchronisation" in repr(SyncReport(True, "watched cuda:0"))


def test_a_sync_is_placed_on_the_innermost_line_of_user_code():
    import json
    import traceback

    import hypothesis as installed_package  # site-packages: user code for this purpose

    from anydevice.measure.profiling import _sync_from_stack

    def frame(path, line, name, code=""):
        return traceback.FrameSummary(path, line, name, line=code)

    stack = [
        frame("/home/me/train.py", 40, "main", "step()"),
        frame(installed_package.__file__, 7, "wrapper"),
        frame("/home/me/train.py", 12, "step", "print(loss)"),
        frame(json.__file__, 99, "dumps"),  # the standard library
        frame(torch.__file__, 120, "__repr__"),  # torch itself
    ]
    s = _sync_from_stack(stack, "torch.Tensor.__repr__")
    assert (s.filename, s.lineno, s.function, s.code) == (
        "/home/me/train.py",
        12,
        "step",
        "print(loss)",
    )
    assert s.stack[-1] == "/home/me/train.py:12 in step"
    assert any("wrapper" in f for f in s.stack)  # installed packages count as user code


# ----------------------------------------------------------------------------- idle time


class SlowDataset(torch.utils.data.Dataset):
    """Each item takes 20 ms to load: 80 ms a batch, far above what the profiler's own
    bookkeeping costs a step even on a busy machine."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        import time

        time.sleep(0.02)
        return torch.ones(8)


def test_profile_reports_the_hosts_wait_for_data_from_a_real_trace(tmp_path):
    out = io.StringIO()
    loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=4)
    with ad.profile(tmp_path / "t.json", steps=3, device="cpu", print_to=out) as p:
        for x in p.iterate(loader):
            torch.mm(x, x.t())
    assert p.idle is not None and p.idle.active is None  # no accelerator here
    assert p.idle.data_wait / p.idle.window > 0.5  # 80 ms loading a batch, a tiny matmul
    assert "waited on data (DataLoader)" in out.getvalue()


def test_profile_without_a_trace_file_still_reads_idle_time():
    out = io.StringIO()
    batches = [torch.randn(128, 128) for _ in range(6)]
    with ad.profile(None, steps=3, device="cpu", print_to=out) as p:
        for x in p.iterate(batches):  # data already in memory: no DataLoader
            torch.mm(x, x)
    assert p.idle is not None and p.idle.data_wait == 0 and p.idle.window > 0
    assert not p.trace_written
