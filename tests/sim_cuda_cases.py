"""Code written for CUDA, run on the simulated accelerator (``anydevice.testing.cuda``).

Run by ``tests/test_testing_cuda.py`` in a child pytest of its own (torch holds one
privateuse1 backend per process), with ``-p anydevice.testing.pytest_plugin``: each case
uses the ``sim_cuda`` fixture, as a user's test would, on three simulated GPUs. The first
cases follow PyTorch's "CUDA semantics" notes section by section, written afresh: each
checks what the notes say happens.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import anydevice as ad

GPUS = 3
N = 2**20  # floats: 4 MiB, 0.4 s over the slow link below


@pytest.fixture(scope="session", autouse=True)
def three_gpus() -> None:
    """The simulator with three devices; ``sim_cuda`` presents as many GPUs as it has."""
    from anydevice.errors import ExtensionError
    from anydevice.testing import SimulatorError, enable

    try:
        enable(devices=GPUS)
    except (ExtensionError, SimulatorError) as e:
        pytest.skip(f"the simulated accelerator is not available here: {e}")


def _warm() -> None:
    """The host's first operator on the device imports torch._dynamo (torch's Python meta
    kernels are wrapped to disable it): two seconds, longer than a slow copy takes to land,
    so a test's read that should come too early would come late."""
    (torch.ones(1, device="cuda") * 1).cpu()


@pytest.fixture
def slow_link() -> object:
    from anydevice import testing

    _warm()
    testing.set_bandwidth("10MB/s")
    yield
    torch.cuda.synchronize()
    testing.set_bandwidth("2GB/s")


def _line_of(text: str) -> int:
    """The line of this file that holds ``text`` (once)."""
    with open(__file__) as f:
        quoted = (f"'{text}", f'"{text}')
        (line,) = [
            i
            for i, got in enumerate(f, start=1)
            if text in got and not any(q in got for q in quoted)
        ]
    return line


# --- PyTorch's "CUDA semantics" notes ------------------------------------------------


def test_tensors_go_to_the_selected_gpu_and_results_stay_with_their_inputs(sim_cuda) -> None:
    cuda, cuda0, cuda2 = torch.device("cuda"), torch.device("cuda:0"), torch.device("cuda:2")
    x = torch.tensor([1.0, 2.0], device=cuda0)
    y = torch.tensor([1.0, 2.0]).cuda()
    assert x.device == y.device == torch.device("cuda", 0)
    with torch.cuda.device(1):
        a = torch.tensor([1.0, 2.0], device=cuda)
        b = torch.tensor([1.0, 2.0]).cuda()
        b2 = torch.tensor([1.0, 2.0]).to(device=cuda)
        assert a.device == b.device == b2.device == torch.device("cuda", 1)
        c = a + b
        z = x + y
        assert c.device == torch.device("cuda", 1) and z.device == torch.device("cuda", 0)
        d = torch.randn(2, device=cuda2)
        e = torch.randn(2).to(cuda2)
        f = torch.randn(2).cuda(cuda2)
        assert {t.device for t in (d, e, f)} == {torch.device("cuda", 2)}
        assert torch.cuda.current_device() == 1
    assert torch.cuda.current_device() == 0
    assert c.cpu().tolist() == [2.0, 4.0] and z.cpu().tolist() == [2.0, 4.0]


def test_tensors_on_different_gpus_do_not_mix(sim_cuda) -> None:
    with pytest.raises(RuntimeError):
        torch.ones(2, device="cuda:0") + torch.ones(2, device="cuda:1")


def test_events_time_queued_work_after_a_synchronize(sim_cuda) -> None:
    from anydevice import testing

    start_event = torch.cuda.Event(enable_timing=True)
    end_event = torch.cuda.Event(enable_timing=True)
    start_event.record()
    testing.busy(0.05)  # 50 ms of device work, queued: the host goes on at once
    end_event.record()
    assert not end_event.query()
    torch.cuda.synchronize()
    assert start_event.elapsed_time(end_event) >= 50.0


def test_a_side_stream_that_does_not_wait_reads_too_early_and_the_fix(sim_cuda, slow_link) -> None:
    """The notes' incorrect stream example, with a copy as the producer (over a slow link,
    still in flight): the race detector reports it at the line that reads too early, and
    the side stream read A before its copy landed (the poison: NaN)."""
    from anydevice.testing import expect_races

    cuda = torch.device("cuda")
    source = torch.full((N,), 1.0).pin_memory()
    s = torch.cuda.Stream()
    A = source.to(cuda, non_blocking=True)  # on the default stream, still landing
    with expect_races() as found, torch.cuda.stream(s):
        B = torch.sum(A)  # may start before A is there: it does here
    assert found[0].kind == "read after write", found[0]
    assert found[0].now.line == _line_of("B = torch.sum(A)  # may"), found[0]
    assert Path(__file__).name in found[0].now.site, found[0]
    assert found[0].before.line == _line_of("A = source.to(cuda, non_blocking=True)  # on")
    torch.cuda.synchronize()
    assert torch.isnan(B.cpu()), "the side stream read A before its copy landed"

    A = source.to(cuda, non_blocking=True)
    s.wait_stream(torch.cuda.default_stream(cuda))  # the fix
    with torch.cuda.stream(s):
        B = torch.sum(A)
    A.record_stream(s)
    torch.cuda.current_stream().wait_stream(s)
    assert B.item() == N


def test_memory_counters_follow_tensors_and_the_summary_reads_them(sim_cuda) -> None:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    x = torch.empty(1024, 1024, device="cuda")
    assert torch.cuda.memory_allocated() - before == x.nbytes
    assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.cuda.memory_allocated()
    nested = torch.cuda.memory_stats_as_nested_dict()
    assert nested["allocated_bytes"]["all"]["current"] == stats["allocated_bytes.all.current"]
    del x
    assert torch.cuda.memory_allocated() == before
    assert "PyTorch CUDA memory summary" in torch.cuda.memory_summary()
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total == torch.cuda.get_device_properties(0).total_memory


def test_backward_in_a_stream_context_and_its_gradients(sim_cuda) -> None:
    s = torch.cuda.Stream()
    w = torch.ones(4, device="cuda", requires_grad=True)
    loss = (w * 3).sum()
    with torch.cuda.stream(s):
        loss.backward()
    torch.cuda.current_stream().wait_stream(s)
    assert w.grad.cpu().tolist() == [3.0] * 4

    w.grad = None
    loss = (w * 2).sum()
    initial_grad = torch.ones_like(loss)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        initial_grad.record_stream(s)
        loss.backward(gradient=initial_grad)
    torch.cuda.current_stream().wait_stream(s)
    assert w.grad.cpu().tolist() == [2.0] * 4


def test_device_agnostic_code_takes_the_gpu_branch(sim_cuda) -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    assert device.type == "cuda"
    x = torch.empty((8, 42), device=device)
    net = nn.Linear(42, 3).to(device=device)
    assert net(x).is_cuda
    x_gpu = torch.empty(2, device=device)
    y_gpu = x_gpu.new_full([3, 2], fill_value=-5)
    assert y_gpu.device == torch.device("cuda", 0)
    assert "device='cuda:0'" in repr(y_gpu) and y_gpu.cpu().eq(-5).all()
    assert torch.zeros_like(x_gpu).device == torch.ones_like(x_gpu).device == y_gpu.device
    torch.backends.cuda.matmul.allow_tf32 = True  # settable; the simulator computes in fp32
    torch.backends.cudnn.benchmark = True


def test_pinned_memory_and_non_blocking_copies(sim_cuda) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.arange(6.0).pin_memory()
    assert x.is_pinned()
    y = x.cuda(non_blocking=True)
    torch.cuda.synchronize()
    assert y.cpu().tolist() == list(range(6))
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, pin_memory=True)
    batch = next(iter(loader))[0]
    assert batch.is_pinned()


def test_cuda_graphs_and_custom_allocators_are_refused_by_name(sim_cuda) -> None:
    from anydevice.testing import NotSimulatedError

    with pytest.raises(NotSimulatedError, match=r"torch\.cuda\.CUDAGraph .*CUDA graphs"):
        torch.cuda.CUDAGraph()
    with pytest.raises(NotSimulatedError, match=r"torch\.cuda\.graph "):
        torch.cuda.graph(None)
    with pytest.raises(NotSimulatedError, match="make_graphed_callables"):
        torch.cuda.make_graphed_callables(nn.Linear(2, 2), (torch.ones(1, 2),))
    with pytest.raises(NotSimulatedError, match="MemPool"):
        torch.cuda.MemPool()
    with pytest.raises(NotSimulatedError, match="CUDAPluggableAllocator"):
        torch.cuda.memory.CUDAPluggableAllocator("alloc.so", "my_malloc", "my_free")
    assert torch.cuda.is_current_stream_capturing() is False


# --- what reads back, and the mapped names -------------------------------------------


def test_what_code_reads_back_looks_like_cuda(sim_cuda) -> None:
    x = torch.ones(2, device="cuda")
    assert x.is_cuda and x.device.type == "cuda" and x.get_device() == 0
    assert x.type() == "torch.cuda.FloatTensor"
    assert str(x.device) == "cuda:0" and f"{x}".endswith("device='cuda:0')")
    assert torch.device("cuda").type == "cuda"  # a device stays what it names
    assert torch.cuda.get_device_name() == "anydevice simulated GPU"
    assert torch.cuda.get_device_capability() == (8, 0) and torch.cuda.is_bf16_supported()
    assert torch.cuda.device_count() == GPUS and torch.cuda.is_initialized()
    assert not torch.ones(2).is_cuda


def test_streams_and_events_are_the_simulators_own(sim_cuda) -> None:
    s = torch.cuda.Stream()
    assert isinstance(s, torch.Stream) and s.device == torch.device("cuda", 0)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    with torch.cuda.stream(s):
        assert torch.cuda.current_stream() == s == torch.accelerator.current_stream()
    assert torch.cuda.current_stream() != s
    e = torch.cuda.Event(enable_timing=True)
    assert type(e) is type(s.record_event(torch.Event()))  # torch's own: it times them
    recorded = s.record_event()
    recorded.synchronize()
    assert recorded.query()
    on1 = torch.cuda.Stream(device=1)
    assert on1.device == torch.device("cuda", 1) and on1.device_index == 1
    from anydevice.testing import NotSimulatedError

    with pytest.raises(NotSimulatedError, match="interprocess"):
        torch.cuda.Event(interprocess=True)


def test_the_generic_api_takes_the_devices_tensors_report(sim_cuda) -> None:
    x = torch.ones(4, device="cuda:1")
    torch.accelerator.synchronize(x.device)
    stream = torch.Stream(x.device)
    assert stream.device_index == 1
    assert torch.accelerator.memory.memory_allocated(x.device) >= x.nbytes
    event = torch.Event(x.device, enable_timing=True)
    assert isinstance(event, torch.Event) and isinstance(stream, torch.Stream)


def test_default_device_and_device_context_land_on_the_gpu(sim_cuda) -> None:
    with torch.device("cuda:2"):
        assert torch.zeros(2).device == torch.device("cuda", 2)
    torch.set_default_device("cuda")
    try:
        assert torch.ones(1).is_cuda
    finally:
        torch.set_default_device(None)


def test_threads_started_in_the_run_see_cuda_too(sim_cuda) -> None:
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.zeros(1, device="cuda").device))
    thread.start()
    thread.join(timeout=60)
    assert seen == [torch.device("cuda", 0)]


def test_checkpoints_record_cuda_and_load_onto_the_gpus(sim_cuda, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.arange(3.0, device="cuda")}, path)
    assert torch.load(path)["w"].device == torch.device("cuda", 0)
    assert torch.load(path, map_location="cuda:2")["w"].device == torch.device("cuda", 2)
    assert torch.load(path, map_location=torch.device("cuda", 1))["w"].device.index == 1
    assert torch.load(path, map_location="cpu")["w"].tolist() == [0.0, 1.0, 2.0]
    remap = torch.load(path, map_location={"cuda:0": "cuda:1"})
    assert remap["w"].device == torch.device("cuda", 1)
    from torch.serialization import location_tag

    assert location_tag(torch.ones(1, device="cuda:2").untyped_storage()) == "cuda:2"


def test_autocast_and_grad_scaler_as_written_for_cuda(sim_cuda) -> None:
    model = nn.Linear(4, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        assert torch.is_autocast_enabled("cuda") and torch.is_autocast_enabled()
        assert torch.get_autocast_dtype("cuda") == torch.float16
        loss = model(torch.ones(2, 4, device="cuda")).sum()
    assert not torch.is_autocast_enabled("cuda")
    with torch.cuda.amp.autocast():  # the deprecated spelling
        assert torch.is_autocast_enabled("cuda")
    scaled = scaler.scale(loss)
    assert scaled.item() == pytest.approx(loss.item() * 65536.0)
    scaled.backward()
    before = model.weight.detach().clone()
    model.weight.grad[0, 0] = float("inf")  # an overflowed step: skipped, scale halved
    scaler.step(opt)
    scaler.update()
    assert torch.equal(model.weight.detach(), before) and scaler.get_scale() == 32768.0


def test_autocast_takes_any_dtype_as_on_a_gpu(sim_cuda, recwarn) -> None:
    """CUDA's autocast runs with float32 too (nanoGPT's --dtype=float32 asks for it);
    the simulator's own check of dtypes would warn, naming itself, and turn it off."""
    with torch.autocast("cuda", dtype=torch.float32):
        assert torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cuda") == torch.float32
    torch.set_autocast_dtype("cuda", torch.float32)
    try:
        with torch.autocast("cuda"):  # the dtype set before, float32
            assert torch.is_autocast_enabled("cuda")
            assert torch.get_autocast_dtype("cuda") == torch.float32
    finally:
        torch.set_autocast_dtype("cuda", torch.float16)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False):
        assert not torch.is_autocast_enabled("cuda")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # other devices' as torch has them
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
    assert not [str(w.message) for w in recwarn if "autocast" in str(w.message)]


def test_module_to_keeps_parameters_an_optimizer_was_made_with(sim_cuda) -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    weight = model.weight
    model.to("cuda")
    assert model.weight is weight and weight.is_cuda
    model(torch.ones(1, 3, device="cuda")).sum().backward()
    opt.step()
    assert torch.allclose(weight.detach().cpu(), model.weight.detach().cpu())


def test_random_numbers_are_the_cpus_and_their_state_round_trips(sim_cuda) -> None:
    torch.manual_seed(0)
    on_gpu = torch.randn(5, device="cuda").cpu()
    torch.manual_seed(0)
    assert torch.equal(on_gpu, torch.randn(5))
    state = torch.cuda.get_rng_state()
    first = torch.rand(3, device="cuda").cpu()
    torch.cuda.set_rng_state(state)
    assert torch.equal(first, torch.rand(3, device="cuda").cpu())


def test_data_parallel_splits_the_batch_over_the_gpus(sim_cuda) -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 2).cuda()
    x = torch.randn(12, 6, device="cuda")
    parallel = nn.DataParallel(model)
    assert parallel.device_ids == list(range(GPUS))
    out = parallel(x)
    assert out.device == torch.device("cuda", 0)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    torch.testing.assert_close(model.weight.grad, x.sum(0).expand(2, 6))


def test_a_memory_fraction_caps_the_gpus(sim_cuda) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25)
    assert torch.cuda.get_per_process_memory_fraction() == pytest.approx(0.25, rel=1e-3)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(total // 2, dtype=torch.uint8, device="cuda")


def test_nvtx_ranges_do_nothing_and_telemetry_is_refused(sim_cuda) -> None:
    from anydevice.testing import NotSimulatedError

    assert torch.cuda.nvtx.range_push("step") == 0
    torch.cuda.nvtx.mark("here")
    assert torch.cuda.nvtx.range_pop() == 0
    with torch.cuda.nvtx.range("block"):
        pass
    with pytest.raises(NotSimulatedError, match=r"torch\.cuda\.utilization .*NVML"):
        torch.cuda.utilization()
    with pytest.raises(NotSimulatedError, match=r"torch\.cuda\.nccl\.all_reduce"):
        torch.cuda.nccl.all_reduce([torch.ones(1, device="cuda")])
    with pytest.raises(NotSimulatedError, match="legacy tensor types"):
        torch.cuda.FloatTensor(2)


def test_a_name_the_mapping_does_not_know_is_refused_naming_it() -> None:
    """A newer torch's name: refused in the block, untouched outside it."""
    from anydevice.testing import NotSimulatedError, simulate_cuda

    torch.cuda.brand_new_call = lambda: "a real GPU's answer"  # type: ignore[attr-defined]
    try:
        with simulate_cuda(GPUS), pytest.raises(NotSimulatedError) as e:
            torch.cuda.brand_new_call()  # type: ignore[attr-defined]
        assert "torch.cuda.brand_new_call" in str(e.value) and "does not know" in str(e.value)
        assert torch.cuda.brand_new_call() == "a real GPU's answer"  # type: ignore[attr-defined]
    finally:
        del torch.cuda.brand_new_call  # type: ignore[attr-defined]


def test_gpu_only_features_are_refused_at_the_first_call(sim_cuda, tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.utils import cpp_extension

    from anydevice.testing import NotSimulatedError

    with pytest.raises(NotSimulatedError, match=r"torch\.compile\(backend='inductor'\)"):
        torch.compile(nn.Linear(2, 2).cuda())
    doubled = torch.compile(lambda t: t * 2, backend="eager")
    assert doubled(torch.ones(2, device="cuda")).cpu().tolist() == [2.0, 2.0]
    with pytest.raises(NotSimulatedError, match=r"cpp_extension\.load\('op', \['k\.cu'\]\)"):
        cpp_extension.load("op", ["k.cpp", "k.cu"])
    with pytest.raises(NotSimulatedError, match=r"init_process_group\(backend='nccl'\)"):
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/g", rank=0, world_size=1)
    try:
        on_host = torch.ones(2)
        dist.all_reduce(on_host)  # collectives on the CPU run as they do
        assert on_host.tolist() == [1.0, 1.0]
        with pytest.raises(NotSimulatedError, match=r"torch\.distributed\.all_reduce on cuda:0"):
            dist.all_reduce(torch.ones(2, device="cuda"))
        with pytest.raises(NotSimulatedError, match="DistributedDataParallel"):
            nn.parallel.DistributedDataParallel(nn.Linear(2, 2).cuda())
    finally:
        dist.destroy_process_group()


def test_anydevice_sees_the_gpus_as_cuda(sim_cuda) -> None:
    assert sim_cuda == ad.device() == torch.device("cuda", 0)
    assert [d.spec for d in ad.inventory().accelerators] == ["cuda:0", "cuda:1", "cuda:2"]
    assert ad.devices("gpu") == [torch.device("cuda", i) for i in range(GPUS)]
    data = [torch.full((4,), float(i)) for i in range(3)]
    got = [b.cpu().tolist() for b in ad.DeviceLoader(data, "cuda")]
    assert got == [[float(i)] * 4 for i in range(3)]
    x = torch.ones(256, device="cuda")
    assert ad.memory("cuda:0").allocated >= x.nbytes
    assert ad.device_of(nn.Linear(2, 2).cuda()) == torch.device("cuda", 0)
    with ad.side_stream() as s:
        y = x * 2
    assert s.device_index == 0 and y.sum().item() == 512.0


def test_sleep_keeps_the_current_stream_busy_for_its_cycles(sim_cuda) -> None:
    """``torch.cuda._sleep(cycles)``, how GPU tests keep a stream busy: that many cycles of
    the nominal clock, queued on the current stream."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        start.record()
        torch.cuda._sleep(141_000_000)  # 0.1 s at 1.41 GHz
        end.record()
    assert torch.cuda.current_stream().query()  # the default stream has nothing queued
    end.synchronize()
    assert start.elapsed_time(end) >= 100.0  # ms
    assert torch.cuda.get_device_properties(0).clock_rate == 1_410_000  # kHz, as CUDA's
    with pytest.raises(TypeError, match=r"cycles=-1"):
        torch.cuda._sleep(-1)


def test_the_gpu_in_use_is_cuda_to_the_meters_and_timers(sim_cuda) -> None:
    """A meter or timer given no device follows the work to the GPU in use: ``cuda:0``,
    not the simulator's own name."""
    from anydevice.measure import clocks

    torch.cuda.set_device(1)
    try:
        x = torch.ones(1024, device="cuda")
        assert clocks.in_use() == [torch.device("cuda", i) for i in (1, 0, 2)]  # current first
        meter = ad.Throughput(samples_per_step=1, peak=None)
        for _ in range(3):
            x.mul_(1.0)
            meter.step()
        assert (meter.device, meter.clock) == (torch.device("cuda", 1), "cuda-event")
        with ad.Timer() as t:
            torch.cuda._sleep(14_100_000)  # 10 ms at the simulated GPUs' 1.41 GHz
        assert t.elapsed >= 0.01  # the timer waited for the GPU in use
    finally:
        torch.cuda.set_device(0)


def test_anydevice_refuses_a_process_group_on_the_gpus_and_forms_one_on_the_cpu(
    sim_cuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launched rank on the simulated GPUs would form an NCCL group: refused before it
    forms, saying why and what runs instead (not blamed on torch's build)."""
    import torch.distributed as dist

    from ranks import free_port

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    with (
        pytest.raises(ad.DistributedError, match=r"backend='nccl'\) on the simulated GPUs cannot"),
        ad.distributed(),
    ):
        pass
    assert not dist.is_initialized()
    with ad.distributed(device="cpu") as d:
        assert (d.backend, d.device) == ("gloo", torch.device("cpu"))
        assert ad.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]


def test_the_block_restores_torch_as_it_was() -> None:
    """Entered and left without the fixture: every replaced name, the default device, the
    current device and stream, the capacity and torch's switches come back."""
    from anydevice.hardware import backends
    from anydevice.testing import simulate_cuda

    names = {n: getattr(torch.cuda, n) for n in dir(torch.cuda) if not n.startswith("_")}
    compile_, load, stream_cls = torch.compile, torch.load, torch.Stream
    before_backend = backends.get("cuda")
    with simulate_cuda(GPUS):
        torch.set_default_device("cuda")
        torch.cuda.set_device(2)
        torch.cuda.set_per_process_memory_fraction(0.5)
        torch.cuda.set_stream(torch.cuda.Stream())
    assert {n: getattr(torch.cuda, n) for n in names} == names
    assert (torch.compile, torch.load, torch.Stream) == (compile_, load, stream_cls)
    assert backends.get("cuda") is before_backend
    assert not torch.cuda.is_available() and torch.get_default_device() == torch.device("cpu")
    assert torch.accelerator.current_device_index() == 0
    assert torch.accelerator.current_stream(2).stream_id == 0
    assert not torch.__future__.get_swap_module_params_on_conversion()
    assert torch.accelerator.get_memory_info(0)[1] > torch.accelerator.get_memory_info(0)[0] // 2
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
