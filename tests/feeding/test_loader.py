"""DeviceLoader on the CPU: iteration semantics and failures, with real DataLoaders.

Faults are switched by real files (a worker process cannot see a flag set in the test), and
worker processes are really killed. The CUDA path (side stream, pinning, overlap) is tested
on a GPU in test_loader_cuda.py.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import anydevice as ad
from anydevice.feeding.loader import DeviceLoader, LoaderStats


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "anydevice-prefetch"]


def wait_until(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


class Squares(Dataset):
    """x -> (x, x**2); fails at index ``fail_at`` while ``switch`` exists (a real file)."""

    def __init__(self, n: int, fail_at: int | None = None, switch: Path | None = None,
                 mode: str = "raise", delay: float = 0.0) -> None:  # fmt: skip
        self.n, self.fail_at, self.switch, self.mode, self.delay = n, fail_at, switch, mode, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        if i == self.fail_at and self.switch is not None and self.switch.exists():
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"bad sample {i}")
        x = torch.tensor([float(i)])
        return x, x**2


def values(loader) -> list[float]:
    return [v for x, _ in loader for v in x.flatten().tolist()]


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    yield
    assert wait_until(lambda: not prefetch_threads(), 5), prefetch_threads()


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_arrive_in_order_with_len_and_again_next_epoch(workers):
    dl = DataLoader(Squares(10), batch_size=3, num_workers=workers)
    loader = DeviceLoader(dl, "cpu", prefetch=True)
    assert len(loader) == len(dl) == 4
    assert values(loader) == [float(i) for i in range(10)]
    assert values(loader) == [float(i) for i in range(10)]  # re-iterable per epoch
    x, y = next(iter(loader))
    assert torch.equal(y, x**2)
    assert x.device == torch.device("cpu")


def test_plain_lists_and_nested_batches():
    batches = [{"x": torch.ones(2), "meta": ["a", 1]}, {"x": torch.zeros(2), "meta": ["b", 2]}]
    out = list(DeviceLoader(batches, "cpu", prefetch=True))
    assert [b["meta"] for b in out] == [["a", 1], ["b", 2]]
    assert [b["x"].sum().item() for b in out] == [2.0, 0.0]


def test_generator_source_is_read_once():
    gen = (torch.full((2,), float(i)) for i in range(3))
    loader = DeviceLoader(gen, "cpu", prefetch=True)
    assert [b[0].item() for b in loader] == [0.0, 1.0, 2.0]
    assert list(loader) == []  # a generator cannot be read twice; nothing to fake
    with pytest.raises(TypeError, match="has no len"):
        len(loader)


def test_transform_runs_on_each_batch_after_the_move():
    raw = [torch.arange(4, dtype=torch.uint8) for _ in range(3)]
    loader = DeviceLoader(raw, "cpu", transform=lambda b: b.float() / 255, prefetch=True)
    out = list(loader)
    assert all(b.dtype == torch.float32 for b in out)
    assert torch.allclose(out[0], torch.arange(4) / 255)


@dataclass
class Pair:
    a: torch.Tensor
    b: torch.Tensor


def test_dataclass_batches_are_delivered():
    loader = DeviceLoader([Pair(torch.ones(1), torch.zeros(1))], "cpu", prefetch=True)
    (batch,) = list(loader)
    assert isinstance(batch, Pair)
    assert batch.a.item() == 1.0


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("prefetch", [True, False])
def test_dataset_error_reaches_the_consumer_and_the_next_epoch_works(tmp_path, workers, prefetch):
    switch = tmp_path / "fail"
    switch.touch()
    dl = DataLoader(Squares(8, fail_at=5, switch=switch), batch_size=1, num_workers=workers)
    loader = DeviceLoader(dl, "cpu", prefetch=prefetch)
    seen: list[float] = []
    with pytest.raises(ValueError, match="bad sample 5") as info:
        for x, _ in loader:
            seen.append(x.item())
    assert seen == [0.0, 1.0, 2.0, 3.0, 4.0]  # batch 4 is not lost to the failure of 5
    text = "".join(traceback.format_exception(info.value))
    assert "__getitem__" in text  # the dataset's own frame (or the worker's traceback)
    switch.unlink()
    assert values(loader) == [float(i) for i in range(8)]


def test_killed_worker_is_reported_and_the_next_epoch_works(tmp_path):
    switch = tmp_path / "kill"
    switch.touch()
    dl = DataLoader(Squares(16, fail_at=6, switch=switch, mode="kill"), batch_size=2,
                    num_workers=2, timeout=0)  # fmt: skip
    loader = DeviceLoader(dl, "cpu", prefetch=True)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        for _ in loader:
            pass
    assert time.monotonic() - t0 < 60
    switch.unlink()
    assert values(loader) == [float(i) for i in range(16)]


def test_a_killed_worker_leaves_no_worker_and_no_thread_once_its_error_is_handled(tmp_path):
    switch = tmp_path / "kill"
    switch.touch()
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    threads = set(threading.enumerate())
    dl = DataLoader(Squares(64, fail_at=6, switch=switch, mode="kill", delay=0.01),
                    batch_size=2, num_workers=2)  # fmt: skip
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        for _ in DeviceLoader(dl, "cpu", prefetch=True):
            pass
    # at once, not at some later status check: the sibling worker and the prefetch thread
    alive = [p.pid for p in me.children(recursive=True) if p.pid not in before
             and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # fmt: skip
    assert alive == []
    assert prefetch_threads() == []
    # the worker queues' feeder threads were told to end by then; they only finish flushing
    assert wait_until(lambda: set(threading.enumerate()) <= threads, 5), threading.enumerate()


ABORTED_PASSES = """
import sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import psutil
from torch.utils.data import DataLoader
from test_loader import Squares, wait_until
from anydevice.feeding.loader import DeviceLoader

switch = Path(sys.argv[1])
switch.touch()
me = psutil.Process()
threads_before = set(threading.enumerate())
busy = set(me.children())  # the contention the test started
for _ in range(20):
    dl = DataLoader(Squares(64, fail_at=9, switch=switch, delay=0.002), batch_size=2,
                    num_workers=2)
    try:
        for _ in DeviceLoader(dl, "cpu", prefetch=True):
            pass
    except ValueError:
        pass
    else:
        raise SystemExit("the pass did not fail")
workers = lambda: [p for p in me.children(recursive=True) if p not in busy and p.is_running()
                   and p.status() != psutil.STATUS_ZOMBIE]
extra = lambda: [t.name for t in threading.enumerate() if t not in threads_before]
wait_until(lambda: not workers() and not extra(), timeout=30)
print(f"threads left: {extra()}; workers left: {len(workers())}", flush=True)
"""


@pytest.mark.timeout(240)
def test_passes_ended_by_a_dataset_error_under_load_release_everything(tmp_path):
    import subprocess
    import sys

    busy = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 120\n"
                              "while time.time() < end: pass"]) for _ in range(3)]  # fmt: skip
    try:
        argv = [sys.executable, "-c", ABORTED_PASSES, str(tmp_path / "fail")]
        here = str(Path(__file__).parent)
        run = subprocess.run([*argv, here], capture_output=True, text=True, timeout=200)
    finally:
        for p in busy:
            p.kill()
            p.wait(timeout=30)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "threads left: []; workers left: 0" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "terminate called" not in run.stderr
    assert "Exception ignored" not in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize("workers", [0, 2])
def test_early_break_leaves_no_thread_and_no_worker(workers):
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    dl = DataLoader(Squares(100, delay=0.001), batch_size=2, num_workers=workers)
    loader = DeviceLoader(dl, "cpu", prefetch=True)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert wait_until(lambda: not prefetch_threads())
    assert wait_until(lambda: {p.pid for p in me.children(recursive=True)} <= before)


def test_keyboard_interrupt_leaves_no_thread():
    loader = DeviceLoader(DataLoader(Squares(50), batch_size=1), "cpu", prefetch=True)
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(loader):
            if i == 3:
                raise KeyboardInterrupt
    assert wait_until(lambda: not prefetch_threads())


def test_a_new_pass_closes_the_unfinished_one():
    loader = DeviceLoader(DataLoader(Squares(50), batch_size=1), "cpu", prefetch=True)
    first = iter(loader)
    next(first)
    assert values(loader) == [float(i) for i in range(50)]
    assert wait_until(lambda: not prefetch_threads())


def test_empty_loader_yields_nothing_and_says_nothing_is_wrong():
    loader = DeviceLoader(
        DataLoader(TensorDataset(torch.zeros(0, 2)), batch_size=4), "cpu", prefetch=True
    )
    assert list(loader) == []
    assert len(loader) == 0
    assert loader.stats.batches == 0
    assert loader.stats.verdict == "no batch delivered yet"


def test_prefetch_false_never_starts_a_thread():
    seen_threads: list[int] = []
    loader = DeviceLoader(DataLoader(Squares(5), batch_size=1), "cpu", prefetch=False)
    for _ in loader:
        seen_threads.append(len(prefetch_threads()))
    assert seen_threads == [0] * 5


def torch_order(n: int, epoch: int, rank: int = 1) -> list[float]:
    """The samples torch's own DistributedSampler deals rank ``rank`` of 2 at ``epoch``."""
    sampler = DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return [float(i) for i in sampler]


def sharded(n: int = 40, **kw) -> DeviceLoader:
    ds = Squares(n)
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
    return DeviceLoader(DataLoader(ds, batch_size=5, sampler=sampler), "cpu", **kw)


def test_set_epoch_reaches_the_distributed_sampler():
    loader = sharded(20, prefetch=True)
    loader.set_epoch(7)
    assert loader.sampler.epoch == 7
    assert values(loader) == torch_order(20, 7)
    assert values(loader) == torch_order(20, 7)  # the epoch is the user's: kept, as in torch


def test_each_complete_pass_advances_the_epoch_when_the_user_never_sets_it():
    loader = sharded()
    assert [values(loader) for _ in range(3)] == [torch_order(40, e) for e in range(3)]
    assert loader.sampler.epoch == 2  # the epoch just run, as torch's sampler reads


class IntEpochSampler(DistributedSampler):
    """A sampler that stores ``int(epoch)``: the loader cannot mark the epoch it set."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)


def test_a_sampler_that_stores_a_plain_int_still_advances_and_keeps_the_users_epoch():
    ds = Squares(40)
    sampler = IntEpochSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
    loader = DeviceLoader(DataLoader(ds, batch_size=5, sampler=sampler), "cpu")
    assert [values(loader) for _ in range(2)] == [torch_order(40, e) for e in range(2)]
    sampler.set_epoch(5)
    assert [values(loader) for _ in range(2)] == [torch_order(40, 5)] * 2


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_sampler_reads_the_epoch_just_run_as_torchs_does(prefetch):
    loader = sharded(prefetch=prefetch)
    for epoch in range(3):  # the DDP tutorial's loop: set, run a full pass, read
        loader.sampler.set_epoch(epoch)
        assert values(loader) == torch_order(40, epoch)
        assert loader.sampler.epoch == epoch
    auto = sharded(prefetch=prefetch)
    for epoch in range(2):
        assert values(auto) == torch_order(40, epoch)
        assert auto.sampler.epoch == epoch
        assert str(auto.sampler.epoch) == str(epoch)


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_peek_or_a_break_does_not_use_up_an_epoch(prefetch):
    loader = sharded(prefetch=prefetch)
    next(iter(loader))  # a peek
    for i, _ in enumerate(loader):
        if i == 1:
            break
    assert values(loader) == torch_order(40, 0)
    assert values(loader) == torch_order(40, 1)


@pytest.mark.parametrize("where", ["loader", "sampler"])
def test_resume_at_epoch_three_gives_torchs_order_for_epoch_three(where):
    loader = sharded()
    target = loader if where == "loader" else loader.sampler
    target.set_epoch(3)
    assert values(loader) == torch_order(40, 3)
    assert values(loader) == torch_order(40, 3)  # theirs from then on, as with torch's sampler


def test_the_ddp_tutorials_sampler_set_epoch_is_never_overridden():
    loader = sharded()
    got = []
    for epoch in (0, 1, 2, 1, 5):  # in order, then a replay and a jump
        loader.sampler.set_epoch(epoch)
        got.append(values(loader))
    assert got == [torch_order(40, e) for e in (0, 1, 2, 1, 5)]


def test_setting_the_sampler_to_the_epoch_just_run_replays_it():
    loader = sharded()
    first = values(loader)  # automatic epoch 0
    loader.sampler.set_epoch(0)
    assert values(loader) == first == torch_order(40, 0)


def test_stats_call_a_slow_source_input_bound():
    dl = DataLoader(Squares(8, delay=0.02), batch_size=1, num_workers=0)
    loader = DeviceLoader(dl, "cpu", prefetch=True)
    for _ in loader:
        pass
    s = loader.stats
    assert isinstance(s, LoaderStats)
    assert s.batches == 8
    assert s.wait_fraction > 0.5
    assert s.verdict.startswith("input-bound")
    # More workers, unless other jobs keep every core busy (then: "unless it waits on I/O")
    assert ("raise num_workers (now 0)" in s.verdict) == (not s.saturated), s
    assert s.bytes_moved == 0  # nothing crossed a device boundary
    assert "8 batches on cpu" in repr(s)


def test_stats_call_a_slow_consumer_compute_bound():
    loader = DeviceLoader([torch.ones(4)] * 6, "cpu", prefetch=True)
    for _ in loader:
        time.sleep(0.03)
    s = loader.stats
    assert s.batches == 6
    assert s.wait_fraction < 0.2
    assert s.verdict.startswith("compute-bound")
    assert s.num_workers is None
    assert s.total_seconds >= 0.15


def _stats(**kw) -> LoaderStats:
    """A pass's statistics by hand: 100 batches of 10 ms, a waiting share and its spread."""
    base = dict(batches=100, bytes_moved=0, wait_seconds=0.0, total_seconds=1.0,
                copy_seconds=None, device="cpu", num_workers=2, pinned=None)  # fmt: skip
    return LoaderStats(**{**base, **kw})


def test_a_waiting_share_on_both_sides_of_the_line_gets_no_advice():
    """Two identical runs on a loaded machine said 'raise num_workers' and 'compute-bound'
    from shares either side of 20 %: the spread over the pass shows why, and says so."""
    s = _stats(wait_seconds=0.25, steady=0.25, wait_low=0.05, wait_high=0.6)
    assert s.verdict.startswith("noisy: 25% of the step waiting for data, from 5% to 60%")
    assert "measure again when the machine is quiet" in s.verdict
    assert s.advice is None and "num_workers" not in s.verdict
    held = _stats(wait_seconds=0.25, steady=0.25, wait_low=0.22, wait_high=0.3, cores=8,
                  cpu_busy=3.0)  # fmt: skip
    assert (
        held.verdict.startswith("input-bound: 25%") and held.advice == "raise num_workers (now 2)"
    )
    calm = _stats(wait_seconds=0.05, steady=0.05, wait_low=0.01, wait_high=0.12)
    assert calm.verdict.startswith("compute-bound") and calm.advice is None


def test_workers_are_not_advised_where_the_cores_were_busy():
    busy = _stats(wait_seconds=0.6, steady=0.6, wait_low=0.5, wait_high=0.7, cores=2,
                  cpu_busy=1.9)  # fmt: skip
    assert busy.saturated and busy.verdict.startswith("input-bound: 60%")
    assert "raise num_workers" not in busy.verdict
    assert "the 2 usable core(s) were busy (1.9 on average" in busy.verdict
    assert "transform=" in busy.advice
    spare = dataclasses.replace(busy, cores=8)
    assert not spare.saturated and spare.advice == "raise num_workers (now 2)"
    no_reading = dataclasses.replace(busy, cpu_busy=None)  # not read: the old advice
    assert not no_reading.saturated and "raise num_workers (now 2)" in no_reading.verdict


def test_a_pass_that_waits_in_one_half_only_is_called_noisy():
    """A real pass: the source is slow for its first half (the consumer waits for it) and
    instant for the second (the consumer's own 30 ms are the step). On the whole it waits
    ~60 % of the time, which said 'input-bound'; stretch by stretch it is 0 % or ~100 %,
    whatever the machine's load, and the verdict says it cannot tell."""

    class Halves(Dataset):
        def __len__(self):
            return 24

        def __getitem__(self, i):
            if i < 12:
                time.sleep(0.04)
            return torch.tensor([float(i)])

    loader = DeviceLoader(DataLoader(Halves(), batch_size=1), "cpu", prefetch=True)
    for x in loader:
        if x.item() >= 12:
            time.sleep(0.03)
    s = loader.stats
    assert s.batches == 24
    assert s.wait_low is not None and s.wait_low < 0.2 <= s.wait_high, s
    assert s.verdict.startswith("noisy: "), s.verdict
    assert s.advice is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
@pytest.mark.timeout(360)
def test_a_worker_that_fills_the_one_usable_core_is_not_told_to_add_workers(tmp_path):
    """The real path: a process allowed one core, whose one DataLoader worker spins to make
    each sample. The pass waits for data, the core is full (every process counted), so
    more workers are not the advice (they were: "raise num_workers (now 1)")."""
    code = textwrap.dedent(
        """
        import os, time, torch
        from torch.utils.data import DataLoader, Dataset
        import anydevice as ad

        class Spin(Dataset):
            def __len__(self):
                return 24
            def __getitem__(self, i):
                end = time.process_time() + 0.03  # 30 ms of CPU per sample
                while time.process_time() < end:
                    pass
                return torch.tensor([float(i)])

        if __name__ == "__main__":
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            loader = ad.DeviceLoader(DataLoader(Spin(), batch_size=1, num_workers=1), "cpu")
            for _ in loader:
                pass
            s = loader.stats
            print(s.cores, s.saturated, round(s.cpu_busy, 2), s.verdict, sep=chr(10))
        """
    )
    script = tmp_path / "spin.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    cores, saturated, busy, verdict = out.stdout.strip().splitlines()[-4:]
    assert float(busy) >= 0.5, out.stdout  # the one core, busy
    assert (cores, saturated) == ("1", "True"), out.stdout
    assert verdict.startswith("input-bound"), verdict
    assert "raise num_workers" not in verdict and "usable core(s) were busy" in verdict


def test_the_waiting_shares_stay_few_chunks_over_a_long_pass():
    from anydevice.feeding.waiting import Shares

    shares = Shares()
    for i in range(1000):
        shares.add(0.001 if i % 2 else 0.009, 0.01)  # 10 % and 90 %, alternately
    assert len(shares.chunks) <= Shares.CHUNKS
    assert sum(c[2] for c in shares.chunks) == 1000
    assert shares.share() == pytest.approx(0.5)
    low, high = shares.spread()
    assert low == pytest.approx(0.5) and high == pytest.approx(0.5)  # evened out by chunk


@pytest.mark.parametrize("prefetch", [True, False])
def test_stats_of_a_pass_a_dataset_error_ended_give_no_advice(tmp_path, prefetch):
    switch = tmp_path / "fail"
    switch.touch()
    dl = DataLoader(Squares(8, fail_at=3, switch=switch, delay=0.02), batch_size=1)
    loader = DeviceLoader(dl, "cpu", prefetch=prefetch)
    seen = 0
    with pytest.raises(ValueError, match="bad sample 3"):
        for _ in loader:
            seen += 1
    s = loader.stats
    assert s.aborted is not None and "ValueError: bad sample 3" in s.aborted
    assert s.verdict.startswith(f"aborted after {seen} batches by ValueError: bad sample 3")
    assert "input-bound" not in repr(s) and "num_workers" not in s.verdict
    switch.unlink()
    for _ in loader:  # a later complete pass gets its verdict again
        pass
    assert loader.stats.aborted is None
    assert loader.stats.verdict.startswith("input-bound")


class Feedback:
    """A source that makes batch k+1 only once the consumer has used batch k (an RL
    rollout, a queue fed by the step): it waits, bounded, for the value the consumer sets."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.used = threading.Event()
        self.gave_up = False

    def __iter__(self):
        for k in range(self.n):
            if k and not self.used.wait(timeout=10):
                self.gave_up = True
                return
            self.used.clear()
            yield torch.tensor([float(k)])


class FeedbackDataset(torch.utils.data.IterableDataset):
    def __init__(self, source: Feedback) -> None:
        self.source = source

    def __iter__(self):
        return iter(self.source)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("wrap", ["iterable", "dataloader"])
def test_a_batch_is_delivered_before_the_source_made_the_next(prefetch, wrap):
    source = Feedback(3)
    wrapped = source if wrap == "iterable" else DataLoader(FeedbackDataset(source), batch_size=None)
    loader = DeviceLoader(wrapped, "cpu", prefetch=prefetch)
    got: list[float] = []
    done = threading.Event()

    def consume() -> None:
        for batch in loader:
            got.append(batch.item())
            source.used.set()  # the step that lets the source make the next batch
        done.set()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    assert done.wait(timeout=30), f"the loader held a batch back: got {got}"
    consumer.join(timeout=10)
    assert got == [0.0, 1.0, 2.0] and not source.gave_up


def test_device_is_resolved_once_from_any_spec(monkeypatch):
    loader = DeviceLoader([torch.ones(1)], "auto")
    assert loader.device == ad.device()
    with pytest.raises(ad.DeviceSpecError):
        DeviceLoader([], "cdua")
    with pytest.raises(ValueError, match="depth"):
        DeviceLoader([], "cpu", depth=0)


def test_batches_move_to_another_device():
    # 'meta' is torch's data-less device: a real move between two devices on a CPU machine.
    loader = DeviceLoader([torch.ones(3), torch.ones(3)], "meta")
    out = list(loader)
    assert all(b.device.type == "meta" for b in out)
    assert loader.stats.bytes_moved == 2 * 3 * 4


def test_attributes_it_does_not_define_are_the_sources():
    source = DataLoader(range(6), batch_size=3)
    dl = ad.DeviceLoader(source, "cpu")
    assert dl.dataset is source.dataset and dl.sampler is source.sampler and dl.batch_size == 3
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = dl.nope


def test_prefetch_auto_starts_a_thread_only_for_accelerators():
    assert DeviceLoader([torch.ones(1)], "cpu").prefetch is False  # nothing to copy here
    assert DeviceLoader([torch.ones(1)], "meta").prefetch is True  # any non-CPU device
    assert DeviceLoader([torch.ones(1)], "cpu", prefetch=True).prefetch is True
    loader = DeviceLoader(DataLoader(Squares(5), batch_size=1), "cpu")
    seen = []
    for _ in loader:
        seen.append(len(prefetch_threads()))
    assert seen == [0] * 5
    with pytest.raises(ValueError, match="prefetch must be True, False or 'auto', not 'yes'"):
        DeviceLoader([], "cpu", prefetch="yes")
