"""Which launcher started this process, read from hand-written environments."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from anydevice.errors import DistributedError
from anydevice.launching.environment import (
    detect,
    expand_nodelist,
    slurm_port,
    tasks_per_node,
)

TORCHRUN_RANK3 = {
    "TORCHELASTIC_RUN_ID": "job7",
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RESTART_COUNT": "2",
}

SRUN_TASK5 = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
    "SLURM_STEP_NODELIST": "gpu[07-09,11]",
    "SLURM_NODELIST": "gpu[07-09,11]",
}


def test_no_launcher_is_a_world_of_one():
    w = detect({"PATH": "/usr/bin"})
    assert (w.launcher, w.rank, w.world_size, w.is_launched) == ("single", 0, 1, False)


def test_torchelastic_gives_ranks_node_and_restarts():
    w = detect(TORCHRUN_RANK3)
    assert w.launcher == "torchelastic"
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (3, 4, 1, 2)
    assert (w.node_rank, w.nnodes, w.restart_count, w.job_id) == (1, 2, 2, "job7")
    assert w.init_method == "env://"


def test_torchelastic_wins_over_the_slurm_step_its_agent_runs_in():
    assert detect({**SRUN_TASK5, **TORCHRUN_RANK3}).launcher == "torchelastic"


def test_hand_set_env_variables_are_the_env_launcher():
    w = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert (w.launcher, w.rank, w.world_size, w.local_rank) == ("env", 1, 2, 1)


def test_rank_zero_of_one_with_nowhere_to_meet_is_a_world_of_one():
    assert detect({"RANK": "0", "WORLD_SIZE": "1"}).launcher == "single"


@pytest.mark.parametrize(
    "env",
    [{"WORLD_SIZE": "2"}, {"RANK": "1"}],
)
def test_half_a_world_is_refused_rather_than_trained_alone(env):
    with pytest.raises(DistributedError, match="would train on its own"):
        detect(env)


def test_rank_outside_the_world_is_refused():
    with pytest.raises(DistributedError, match="outside a world of 2"):
        detect({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_garbled_numbers_name_the_variable():
    with pytest.raises(DistributedError, match="RANK='one'"):
        detect({**TORCHRUN_RANK3, "RANK": "one"})


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"WORLD_SIZE": "0"}, r"WORLD_SIZE='0' is not at least 1: WORLD_SIZE is the number"),
        ({"WORLD_SIZE": "abc"}, r"WORLD_SIZE='abc' is not a whole number"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"RANK='-1' is not at least 0"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, r"LOCAL_RANK='x' is not a whole"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, r"LOCAL_WORLD_SIZE='0'"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, r"between 1 and 65535"),
        ({"TORCHELASTIC_RUN_ID": "j", "RANK": "0", "WORLD_SIZE": "-3"}, r"WORLD_SIZE='-3'"),
    ],
)
def test_a_bad_value_is_named_with_what_is_wrong(env, match):
    with pytest.raises(DistributedError, match=match):
        detect(env)


def test_a_world_size_of_zero_is_refused_in_a_real_process():
    code = "import anydevice as ad\nwith ad.distributed():\n    print('trained alone')\n"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WORLD_SIZE": "0"},
    )
    assert out.returncode == 1
    assert "trained alone" not in out.stdout
    assert "DistributedError: WORLD_SIZE='0' is not at least 1" in out.stderr


def test_srun_task_reads_slurm_variables():
    w = detect(SRUN_TASK5)
    assert w.launcher == "slurm"
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (5, 8, 1, 2)
    assert (w.node_rank, w.nnodes, w.job_id) == (2, 4, "4242")
    assert (w.master_addr, w.master_port) == ("gpu07", slurm_port("4242"))
    assert w.init_method == f"tcp://gpu07:{slurm_port('4242')}"


def test_master_addr_and_port_override_slurms_guess():
    w = detect({**SRUN_TASK5, "MASTER_ADDR": "head", "MASTER_PORT": "6000"})
    assert (w.master_addr, w.master_port) == ("head", 6000)


def test_a_batch_script_is_not_a_step():
    batch = {k: v for k, v in SRUN_TASK5.items() if not k.startswith("SLURM_STEP")}
    assert detect(batch).launcher == "single"


def test_an_interactive_allocation_is_not_a_launch():
    assert detect({**SRUN_TASK5, "SLURM_JOB_NAME": "interactive"}).launcher == "single"


def test_one_task_srun_is_a_world_of_one():
    one = {**SRUN_TASK5, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    assert detect(one).launcher == "single"


def test_one_task_per_node_has_one_local_rank():
    env = {**SRUN_TASK5, "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "4"}
    env["SLURM_STEP_TASKS_PER_NODE"] = "1(x4)"
    w = detect(env)
    assert (w.world_size, w.local_world_size, w.nnodes) == (4, 1, 4)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
            (3, 4, 1, 2, 1),
        ),
        ({"PMI_SIZE": "2", "PMI_RANK": "1"}, (1, 2, 1, 2, 0)),
        (
            {"MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_RANK": "0",
             "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "1"},
            (0, 2, 0, 1, 0),
        ),
    ],
)  # fmt: skip
def test_mpi_flavours(env, expected):
    w = detect(env)
    assert w.launcher == "mpi"
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank) == expected
    assert w.init_method is None  # MPI names no rendezvous: MASTER_ADDR must be given


def test_mpi_with_master_address_meets_over_tcp():
    w = detect({"PMI_SIZE": "2", "PMI_RANK": "0", "MASTER_ADDR": "n1", "MASTER_PORT": "7"})
    assert w.init_method == "tcp://n1:7"


def test_describe_names_launcher_and_ranks():
    assert detect(TORCHRUN_RANK3).describe() == "torchelastic rank 3/4 (local 1/2, node 1)"


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("a,b", ["a", "b"]),
        ("gpu[01-03,7],login1", ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("rack[1-2]-n[0-1]", ["rack1-n0", "rack1-n1", "rack2-n0", "rack2-n1"]),
    ],
)
def test_nodelist_expansion(text, hosts):
    assert expand_nodelist(text) == hosts


def test_bad_nodelist_is_an_error():
    with pytest.raises(DistributedError, match="node list"):
        expand_nodelist("gpu[a-c]")


def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(DistributedError):
        tasks_per_node("two")


def test_slurm_port_is_stable_and_in_range():
    assert slurm_port("98765") == slurm_port("98765") == 15000 + 8765
    assert 15000 <= slurm_port("7") < 25000
