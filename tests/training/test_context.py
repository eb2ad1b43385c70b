"""``with ad.distributed() as d:`` in a world of one and in real forked gloo worlds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from subprocess import PIPE

import pytest
import torch
import torch.distributed as dist

import anydevice as ad
from anydevice.training.context import backend_for, rank_device
from ranks import free_port, process_tree_guard, run_ranks


@pytest.fixture(autouse=True)
def no_process_left_behind():
    with process_tree_guard():
        yield


# ----------------------------------------------------------------------------- world of one


def test_outside_a_launcher_it_is_a_world_of_one_without_a_group():
    with ad.distributed() as d:
        assert (d.rank, d.local_rank, d.world_size, d.local_world_size) == (0, 0, 1, 1)
        assert d.is_main and d.is_local_main and not d.is_distributed
        assert (d.backend, d.launcher) == (None, "single")
        assert not dist.is_initialized()
        d.barrier()  # returns at once
    assert not dist.is_initialized()


def test_world_of_one_device_is_what_auto_selects():
    with ad.distributed() as d:
        assert d.device == ad.device()
    with ad.distributed(device="cpu") as d:
        assert d.device == torch.device("cpu")


def test_errors_inside_the_block_propagate():
    with pytest.raises(KeyError, match="inside"), ad.distributed():
        raise KeyError("inside")


def test_half_a_world_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ad.DistributedError, match="would train on its own"), ad.distributed():
        pass


def test_mpi_without_a_meeting_point_says_what_to_set(monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "0")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    with (
        pytest.raises(ad.DistributedError, match="MASTER_ADDR and MASTER_PORT"),
        ad.distributed(),
    ):
        pass
    assert not dist.is_initialized()


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch has NCCL")
def test_a_backend_this_torch_lacks_is_refused_before_joining(monkeypatch):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with (
        pytest.raises(ad.DistributedError, match="'nccl' is not built into this torch"),
        ad.distributed(backend="nccl"),
    ):
        pass
    assert not dist.is_initialized()


def test_backend_follows_the_device_kind():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    assert backend_for(torch.device("mps")) == "gloo"


def test_a_privateuse1_backend_gets_the_collective_backend_it_registered():
    # torch's own map, as an out-of-tree backend fills it (Ascend: npu -> hccl); in a child,
    # since renaming privateuse1 and registering a backend are for the life of a process.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from anydevice.training.context import backend_for
        torch.utils.rename_privateuse1_backend("npuish")
        dist.Backend.register_backend("fakecc", lambda *a: None, devices=["npuish"])
        print(backend_for(torch.device("npuish", 0)), backend_for(torch.device("xpu")))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    xccl = getattr(dist, "is_xccl_available", lambda: False)()
    assert out == ["fakecc", "xccl" if xccl else "gloo"]


def test_rank_device_is_the_spec_for_fixed_devices():
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert rank_device("auto", 3) == ad.devices("auto")[3 % len(ad.devices("auto"))]


# ----------------------------------------------------------------------------- an existing group


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_an_existing_group_is_used_and_left_alone(group_of_one):
    with ad.distributed() as d:
        assert (d.backend, d.world_size, d.rank) == ("gloo", 1, 0)
        assert d.is_distributed
        d.barrier()
    assert dist.is_initialized()  # not ours to destroy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "mpi"}, "backend 'gloo' already exists"),
        ({"timeout": 5}, "timeout was fixed"),
        ({"init_method": "file:///x"}, "cannot make another"),
    ],
)
def test_arguments_an_existing_group_cannot_honour_are_refused(group_of_one, kwargs, match):
    with pytest.raises(ad.DistributedError, match=match), ad.distributed(**kwargs):
        pass


# ----------------------------------------------------------------------------- real worlds


def test_forked_ranks_form_a_gloo_group_and_leave_it(tmp_path):
    def rank(init_method):
        with ad.distributed(init_method=init_method, timeout=30) as d:
            inside = dist.is_initialized()
            d.barrier()
            facts = (d.rank, d.world_size, d.local_rank, d.backend, d.launcher, str(d.device))
        return facts, inside, dist.is_initialized()

    results = run_ranks(rank, 2, tmp_path)
    assert [r[0] for r in results] == [
        (0, 2, 0, "gloo", "env", "cpu"),
        (1, 2, 1, "gloo", "env", "cpu"),
    ]
    assert all(inside and not after for _, inside, after in results)


def test_the_group_is_destroyed_when_the_block_raises(tmp_path):
    def rank(init_method):
        try:
            with ad.distributed(init_method=init_method, timeout=30) as d:
                d.barrier()  # both joined: a rank raising during the other's connect is not this
                raise RuntimeError("training failed")
        except RuntimeError as e:
            return str(e), dist.is_initialized()

    assert run_ranks(rank, 2, tmp_path) == [("training failed", False)] * 2


def test_a_missing_rank_times_out_instead_of_hanging(tmp_path):
    def rank(init_method):
        t = time.perf_counter()
        try:
            with ad.distributed(init_method=init_method, timeout=2):
                return "joined", 0.0
        except ad.DistributedTimeoutError as e:
            return str(e), time.perf_counter() - t

    [(message, waited)] = run_ranks(rank, 2, tmp_path, ranks=[0], timeout=60)
    assert "did not join within 2 s" in message
    assert "env rank 0/2" in message
    assert 1.5 <= waited < 30


def test_env_launch_meets_over_tcp_on_loopback(tmp_path):
    port = str(free_port())

    def rank(_init_method):
        with ad.distributed(timeout=30) as d:  # MASTER_ADDR/MASTER_PORT: env://
            return ad.all_reduce(float(d.rank + 1), op="sum").item()

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    assert run_ranks(rank, 2, tmp_path, env=env) == [3.0, 3.0]


# ----------------------------------------------------------------------------- GPU


@pytest.mark.cuda
@pytest.mark.real_gpu("an NCCL process group: collectives on the simulated GPUs are refused")
def test_world_of_one_on_a_gpu_uses_nccl(monkeypatch):
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    with ad.distributed(timeout=60) as d:
        assert (d.backend, d.device) == ("nccl", torch.device("cuda", 0))
        assert torch.cuda.current_device() == 0
        total = ad.all_reduce(torch.ones(3, device=d.device), op="sum")
        assert total.device == d.device and total.tolist() == [1.0, 1.0, 1.0]
        d.barrier()
    assert not dist.is_initialized()


def test_srun_tasks_form_a_group_from_slurm_variables(tmp_path):
    port = free_port()

    def rank(_init_method):
        r = os.environ.pop("RANK")  # be an srun task, not an env:// rank
        for k in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            del os.environ[k]
        os.environ.update(
            SLURM_JOB_ID="77", SLURM_JOB_NAME="train", SLURM_STEP_ID="0", SLURM_PROCID=r,
            SLURM_LOCALID=r, SLURM_NODEID="0", SLURM_STEP_NUM_TASKS="2",
            SLURM_STEP_NUM_NODES="1", SLURM_STEP_TASKS_PER_NODE="2",
            SLURM_STEP_NODELIST="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
        with ad.distributed(timeout=30) as d:
            return d.launcher, d.rank, d.world_size, ad.all_gather(d.local_rank)

    assert run_ranks(rank, 2, tmp_path) == [("slurm", 0, 2, [0, 1]), ("slurm", 1, 2, [0, 1])]


#: Two ranks whose DDP model outlives the block in a module-level name, then exit normally.
KEPT_MODEL = """\
import atexit, os, sys
import torch
import anydevice as ad

def after_anydevice():  # registered first, so it runs after anydevice's exit handler
    print("reducer held at exit:", "reducer" in net.__dict__, flush=True)

atexit.register(after_anydevice)
with ad.distributed(init_method=sys.argv[1], timeout=60, device="cpu") as d:
    net = ad.prepare(torch.nn.Linear(8, 8), strategy="ddp")
    net(torch.randn(4, 8)).sum().backward()
    ad.all_reduce(torch.ones(4))
print("trained", d.rank, flush=True)
"""


@pytest.mark.slow
def test_a_ddp_model_kept_past_the_block_lets_its_group_go_at_exit(tmp_path):
    """The block keeps the groups it destroyed; at exit the model still held drops its
    reducer first, so the groups end in the exit handler (GIL released), not from the
    reducer (GIL held: a hang) nor in the interpreter's finalisation (an abort)."""
    script = tmp_path / "kept.py"
    script.write_text(KEPT_MODEL)
    init = f"file://{tmp_path}/store"
    procs = []
    for r in (0, 1):
        world = {"RANK": r, "WORLD_SIZE": 2, "LOCAL_RANK": r, "LOCAL_WORLD_SIZE": 2}
        env = {**os.environ, **{k: str(v) for k, v in world.items()}}
        cmd = [sys.executable, str(script), init]
        procs.append(subprocess.Popen(cmd, env=env, text=True, stdout=PIPE, stderr=PIPE))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, err[-3000:]
        assert out.splitlines() == [f"trained {r}", "reducer held at exit: False"], out + err
        assert "terminate called" not in err and "Warning" not in err, err[-3000:]
