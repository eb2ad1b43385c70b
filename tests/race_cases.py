"""Classic stream-ordering bugs, each written as a user would in plain torch (the
device-generic API), with its correct twin; run on the simulated accelerator by
``tests/test_races.py`` in a child process (torch holds one privateuse1 backend per
process; nothing is registered when this file is imported).

``bug_<name>(dev)`` has the bug; the line marked ``# race`` is the one the detector must
name. ``twin_<name>(dev)`` is the same program written right: it returns what it got and
what it should have got. The patterns are those of PyTorch's "CUDA semantics" notes and
of the prefetchers and pinned-memory code seen in the wild.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

import pytest
import torch

NAME = os.environ.get("ANYDEVICE_SIM_NAME", "sim")
N = 2**16


def pinned(value: float, n: int = N) -> torch.Tensor:
    return torch.full((n,), value).pin_memory()


def current() -> torch.Stream:
    return torch.accelerator.current_stream()


# --- a side stream that never waited ---------------------------------------------------


def bug_side_stream_never_waited(dev: torch.device) -> None:
    a = pinned(2.0).to(dev, non_blocking=True)  # queued on the current stream
    side = torch.Stream(dev)
    with side:
        a * 2  # race


def twin_side_stream_never_waited(dev: torch.device) -> tuple[object, object]:
    a = pinned(2.0).to(dev, non_blocking=True)
    side = torch.Stream(dev)
    side.wait_stream(current())
    with side:
        b = a * 2
    current().wait_stream(side)
    return b.cpu().unique().tolist(), [4.0]


# --- the notes' own example: torch.sum(A) on a side stream while A is written ------------


def bug_sum_on_a_side_stream_while_written(dev: torch.device) -> None:
    A = torch.empty(N, device=dev).normal_(0.0, 1.0)
    s = torch.Stream(dev)
    with s:
        torch.sum(A)  # race


def twin_sum_on_a_side_stream_while_written(dev: torch.device) -> tuple[object, object]:
    torch.manual_seed(0)
    A = torch.empty(N, device=dev).normal_(0.0, 1.0)
    s = torch.Stream(dev)
    s.wait_stream(current())
    with s:
        B = torch.sum(A)
    current().wait_stream(s)
    return round(B.item(), 3), round(A.cpu().sum().item(), 3)


# --- compute on a side stream used without a wait ---------------------------------------


def bug_side_stream_result_used_without_wait(dev: torch.device) -> None:
    x = torch.ones(N, device=dev)
    side = torch.Stream(dev)
    side.wait_stream(current())
    with side:
        y = x * 2
    y + 1  # race


def twin_side_stream_result_used_without_wait(dev: torch.device) -> tuple[object, object]:
    x = torch.ones(N, device=dev)
    side = torch.Stream(dev)
    side.wait_stream(current())
    with side:
        y = x * 2
    current().wait_stream(side)
    return (y + 1).cpu().unique().tolist(), [3.0]


# --- a non-blocking copy to the host read before a synchronisation ----------------------


def bug_non_blocking_copy_to_host_read_before_sync(dev: torch.device) -> None:
    x = torch.full((N,), 3.0, device=dev)
    y = x.to("cpu", non_blocking=True)
    y.sum()  # race


def twin_non_blocking_copy_to_host_read_before_sync(dev: torch.device) -> tuple[object, object]:
    x = torch.full((N,), 3.0, device=dev)
    y = x.to("cpu", non_blocking=True)
    torch.accelerator.synchronize()
    return y.sum().item(), 3.0 * N


# --- a pinned staging buffer refilled while its copy still reads it ---------------------


def bug_pinned_staging_buffer_refilled(dev: torch.device) -> None:
    batches = [torch.full((N,), float(i)) for i in range(2)]
    staging = torch.empty(N).pin_memory()
    for batch in batches:
        staging.copy_(batch)  # race
        staging.to(dev, non_blocking=True)


def twin_pinned_staging_buffer_refilled(dev: torch.device) -> tuple[object, object]:
    batches = [torch.full((N,), float(i)) for i in range(2)]
    staging = torch.empty(N).pin_memory()
    copied = torch.Event()
    out = []
    for batch in batches:
        copied.synchronize()  # the last copy from the buffer is done
        staging.copy_(batch)
        out.append(staging.to(dev, non_blocking=True))
        copied.record()
    return [t.cpu().unique().item() for t in out], [0.0, 1.0]


# --- a pinned DataLoader batch changed in place while its copy is pending ---------------


def _loader() -> torch.utils.data.DataLoader[torch.Tensor]:
    data = torch.arange(4 * N, dtype=torch.float32).reshape(4, N)
    return torch.utils.data.DataLoader(data, batch_size=2, pin_memory=True)


def bug_pinned_loader_batch_changed_in_place(dev: torch.device) -> None:
    for batch in _loader():
        batch.to(dev, non_blocking=True)
        batch.mul_(0.5)  # race


def twin_pinned_loader_batch_changed_in_place(dev: torch.device) -> tuple[object, object]:
    sums = []
    for batch in _loader():
        x = batch.to(dev, non_blocking=True)
        copied = torch.Event()
        copied.record()
        copied.synchronize()
        batch.mul_(0.5)
        sums.append(x.sum().item())
    expected = torch.arange(4 * N, dtype=torch.float32).reshape(2, 2 * N).sum(1).tolist()
    return sums, expected


# --- an event recorded on the wrong stream ----------------------------------------------


def bug_event_recorded_on_the_wrong_stream(dev: torch.device) -> None:
    src = pinned(7.0)
    copier = torch.Stream(dev)
    with copier:
        x = src.to(dev, non_blocking=True)
    copied = torch.Event()
    copied.record()  # on the current stream, not the copier
    current().wait_event(copied)
    x * 1  # race


def twin_event_recorded_on_the_wrong_stream(dev: torch.device) -> tuple[object, object]:
    src = pinned(7.0)
    copier = torch.Stream(dev)
    with copier:
        x = src.to(dev, non_blocking=True)
    copied = torch.Event()
    copied.record(copier)
    current().wait_event(copied)
    return (x * 1).cpu().unique().tolist(), [7.0]


# --- elapsed_time without a synchronisation ---------------------------------------------


def bug_elapsed_time_without_sync(dev: torch.device) -> None:
    x = torch.randn(256, 256, device=dev)
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    x @ x
    end.record()
    start.elapsed_time(end)  # race


def twin_elapsed_time_without_sync(dev: torch.device) -> tuple[object, object]:
    x = torch.randn(256, 256, device=dev)
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    x @ x
    end.record()
    end.synchronize()
    return start.elapsed_time(end) >= 0.0, True


# --- a tensor freed without record_stream while another stream reads it ------------------


def bug_freed_without_record_stream(dev: torch.device) -> None:
    x = torch.ones(N, device=dev)
    side = torch.Stream(dev)
    side.wait_stream(current())
    with side:
        x * 2  # read on the side stream
    del x  # back to the current stream's pool, while the side stream may still read it
    torch.zeros(N, device=dev)  # race


def twin_freed_without_record_stream(dev: torch.device) -> tuple[object, object]:
    x = torch.ones(N, device=dev)
    side = torch.Stream(dev)
    side.wait_stream(current())
    with side:
        y = x * 2
    x.record_stream(side)
    del x
    z = torch.zeros(N, device=dev)
    current().wait_stream(side)
    return (y.cpu().unique().tolist(), z.cpu().unique().tolist()), ([2.0], [0.0])


# --- an overwrite while a side stream still reads -----------------------------------------


def bug_overwrite_while_a_side_stream_reads(dev: torch.device) -> None:
    x = torch.ones(N, device=dev)
    side = torch.Stream(dev)
    side.wait_stream(current())
    with side:
        x * 2
    x.fill_(0.0)  # race


def twin_overwrite_while_a_side_stream_reads(dev: torch.device) -> tuple[object, object]:
    x = torch.ones(N, device=dev)
    side = torch.Stream(dev)
    side.wait_stream(current())
    with side:
        y = x * 2
    current().wait_stream(side)
    x.fill_(0.0)
    return (y.cpu().unique().tolist(), x.cpu().unique().tolist()), ([2.0], [0.0])


# --- a prefetcher overwriting a buffer still in use ---------------------------------------


def bug_prefetcher_overwrites_a_buffer_in_use(dev: torch.device) -> None:
    batches = [pinned(float(i)) for i in range(3)]
    buffer = torch.empty(N, device=dev)
    copier = torch.Stream(dev)
    for batch in batches:
        with copier:
            buffer.copy_(batch, non_blocking=True)  # race
            ready = torch.Event()
            ready.record()
        current().wait_event(ready)
        buffer * 2  # the step reads the buffer on the current stream


def twin_prefetcher_overwrites_a_buffer_in_use(dev: torch.device) -> tuple[object, object]:
    batches = [pinned(float(i)) for i in range(3)]
    buffer = torch.empty(N, device=dev)
    copier = torch.Stream(dev)
    out = []
    for batch in batches:
        copier.wait_stream(current())  # the last step's reads of the buffer first
        with copier:
            buffer.copy_(batch, non_blocking=True)
            ready = torch.Event()
            ready.record()
        current().wait_event(ready)
        out.append(buffer * 2)
    return [t.cpu().unique().item() for t in out], [0.0, 2.0, 4.0]


# --- the host synchronising the wrong stream ------------------------------------------------


def bug_host_synchronizes_the_wrong_stream(dev: torch.device) -> None:
    x = torch.full((N,), 5.0, device=dev)
    copier = torch.Stream(dev)
    copier.wait_stream(current())
    with copier:
        y = x.to("cpu", non_blocking=True)
    current().synchronize()  # the current stream, not the copier
    y.sum()  # race


def twin_host_synchronizes_the_wrong_stream(dev: torch.device) -> tuple[object, object]:
    x = torch.full((N,), 5.0, device=dev)
    copier = torch.Stream(dev)
    copier.wait_stream(current())
    with copier:
        y = x.to("cpu", non_blocking=True)
    copier.synchronize()
    return y.sum().item(), 5.0 * N


# --- wait_event before record -----------------------------------------------------------------


def bug_wait_event_before_record(dev: torch.device) -> None:
    src = pinned(3.0)
    copier = torch.Stream(dev)
    copied = torch.Event()
    current().wait_event(copied)  # nothing recorded yet: waits for nothing
    with copier:
        x = src.to(dev, non_blocking=True)
        copied.record()
    x + 1  # race


def twin_wait_event_before_record(dev: torch.device) -> tuple[object, object]:
    src = pinned(3.0)
    copier = torch.Stream(dev)
    copied = torch.Event()
    with copier:
        x = src.to(dev, non_blocking=True)
        copied.record()
    current().wait_event(copied)
    return (x + 1).cpu().unique().tolist(), [4.0]


# --- backward on a side stream, its gradients used without a wait ---------------------------


def _model(dev: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 4).to(dev)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(32, 64, device=dev)


def bug_backward_on_a_side_stream_without_wait(dev: torch.device) -> None:
    model, opt, x = _model(dev)
    side = torch.Stream(dev)
    side.wait_stream(current())
    with side:
        model(x).square().mean().backward()
    opt.step()  # race


def twin_backward_on_a_side_stream_without_wait(dev: torch.device) -> tuple[object, object]:
    model, opt, x = _model(dev)
    side = torch.Stream(dev)
    side.wait_stream(current())
    with side:
        model(x).square().mean().backward()
    current().wait_stream(side)
    opt.step()
    cpu_model, cpu_opt, cpu_x = _model(torch.device("cpu"))
    cpu_model(cpu_x).square().mean().backward()
    cpu_opt.step()
    return torch.allclose(model.weight.cpu(), cpu_model.weight, atol=1e-6), True


# --- a side-stream copy racing the kernel that makes its input --------------------------------


def bug_side_stream_copy_races_its_producer(dev: torch.device) -> None:
    x = torch.ones(N, device=dev)
    y = x * 4  # the producer, on the current stream
    side = torch.Stream(dev)
    with side:
        y.to("cpu", non_blocking=True)  # race


def twin_side_stream_copy_races_its_producer(dev: torch.device) -> tuple[object, object]:
    x = torch.ones(N, device=dev)
    y = x * 4
    side = torch.Stream(dev)
    side.wait_stream(current())
    with side:
        z = y.to("cpu", non_blocking=True)
    side.synchronize()
    return z.unique().tolist(), [4.0]


# --- a side-stream device-to-device copy without a wait --------------------------------------


def bug_side_stream_device_copy_without_wait(dev: torch.device) -> None:
    x = torch.ones(N, device=dev) + 1
    out = torch.empty(N, device=dev)
    side = torch.Stream(dev)
    with side:
        out.copy_(x)  # race


def twin_side_stream_device_copy_without_wait(dev: torch.device) -> tuple[object, object]:
    x = torch.ones(N, device=dev) + 1
    out = torch.empty(N, device=dev)
    side = torch.Stream(dev)
    side.wait_stream(current())
    with side:
        out.copy_(x)
    current().wait_stream(side)
    return out.cpu().unique().tolist(), [2.0]


# --- a copy made on a copy stream, read without a wait ---------------------------------------


def bug_copy_stream_result_read_without_wait(dev: torch.device) -> None:
    src = pinned(9.0)
    copier = torch.Stream(dev)
    with copier:
        x = src.to(dev, non_blocking=True)
    x.sum()  # race


def twin_copy_stream_result_read_without_wait(dev: torch.device) -> tuple[object, object]:
    src = pinned(9.0)
    copier = torch.Stream(dev)
    with copier:
        x = src.to(dev, non_blocking=True)
    current().wait_stream(copier)
    return x.sum().item(), 9.0 * N


# --- a non-blocking copy to the host read with tolist() before a sync -----------------------


def bug_copy_to_host_read_with_tolist(dev: torch.device) -> None:
    x = torch.arange(8.0, device=dev)
    y = x.to("cpu", non_blocking=True)
    y.tolist()  # race


def twin_copy_to_host_read_with_tolist(dev: torch.device) -> tuple[object, object]:
    x = torch.arange(8.0, device=dev)
    y = x.to("cpu", non_blocking=True)
    torch.accelerator.current_stream().synchronize()
    return y.tolist(), [float(i) for i in range(8)]


# -------------------------------------------------------------------------------------------

CASES = sorted(name[len("bug_") :] for name in dir() if name.startswith("bug_"))


def race_line(fn: Callable[..., object]) -> int:
    """The line marked ``# race`` in ``fn``."""
    lines, start = inspect.getsourcelines(fn)
    (index,) = [i for i, line in enumerate(lines) if line.rstrip().endswith("# race")]
    return start + index


@pytest.fixture(scope="session", autouse=True)
def sim() -> torch.device:
    """Enables the simulator at its defaults: only in the child process, never on import.

    With ``ANYDEVICE_RACES_AS_ON_A_GPU=1`` the detector watches it as it watches a real
    accelerator (``detect_races()``): no word from the allocator about frees (a reuse is
    seen as a new tensor at an old address), no protected pinned memory."""
    from anydevice.errors import ExtensionError
    from anydevice.testing import SimulatorError, enable, races, simulator

    try:
        if os.environ.get("ANYDEVICE_RACES_AS_ON_A_GPU") != "1":
            return enable(NAME)
        dev = enable(NAME, races="off")
        races.start(simulator.load(), NAME, simulated=False, mode="raise")
        return dev
    except (ExtensionError, SimulatorError) as e:
        pytest.skip(f"the simulated accelerator is not available here: {e}")


@pytest.fixture(autouse=True)
def settled() -> object:
    yield
    torch.accelerator.synchronize()


@pytest.mark.parametrize("case", CASES)
def test_the_bug_is_reported_naming_its_line(case: str, sim: torch.device) -> None:
    from anydevice.testing import StreamRaceError

    bug = globals()[f"bug_{case}"]
    with pytest.raises(StreamRaceError) as caught:
        bug(sim)
    report = caught.value.report
    assert report is not None
    assert report.now.line == race_line(bug), str(report)
    assert os.path.basename(__file__) in report.now.site, str(report)
    assert report.fix, str(report)


@pytest.mark.parametrize("case", CASES)
def test_the_twin_runs_clean_and_right(case: str, sim: torch.device) -> None:
    got, expected = globals()[f"twin_{case}"](sim)
    assert got == expected
