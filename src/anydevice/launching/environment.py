"""Which world this process is in: torchelastic, SLURM, MPI, plain env vars, or none.

:func:`detect` is a pure function of an environment mapping, so every launcher can be
checked with a hand-written dict. The order is the one that avoids false positives:

1. **torchelastic** (``torchrun``, ``anydevice launch``, ``ad.launch``): ``TORCHELASTIC_RUN_ID``.
   It comes first because its workers also inherit the variables of a SLURM step.
2. **env**: ``RANK`` and ``WORLD_SIZE`` set by hand or by ``torch.multiprocessing`` users,
   with ``MASTER_ADDR``/``MASTER_PORT`` (the ``env://`` contract).
3. **slurm**: a task of an ``srun`` step (``SLURM_PROCID`` and ``SLURM_STEP_ID``). A batch
   script itself is not a step: it runs once, as "task 0" of every task, so it is a world
   of one. Interactive jobs (job name ``bash`` or ``interactive``) are ignored too.
4. **mpi**: ``mpirun``/``mpiexec`` of Open MPI, MPICH / Intel MPI (PMI) or MVAPICH2.
5. **single**: none of these; a world of one.

>>> detect({}).launcher
'single'
>>> w = detect({"TORCHELASTIC_RUN_ID": "job", "RANK": "3", "WORLD_SIZE": "4",
...             "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
...             "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
>>> (w.launcher, w.rank, w.local_rank, w.node_rank, w.world_size)
('torchelastic', 3, 1, 1, 4)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from anydevice.errors import DistributedError

__all__ = [
    "World",
    "detect",
    "expand_nodelist",
    "slurm_port",
    "tasks_per_node",
]

#: SLURM job names that mean an interactive allocation, not a launched job (as Lightning).
_INTERACTIVE = ("bash", "interactive")


@dataclass(frozen=True)
class World:
    """Where this process sits: its ranks, its world, and how to reach rank 0."""

    launcher: str  #: torchelastic, env, slurm, mpi or single
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    nnodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str | None = None  #: the torchelastic run id or the SLURM job id
    restart_count: int = 0  #: torchelastic restarts so far

    @property
    def is_launched(self) -> bool:
        """True when a launcher started this process as one rank of a world."""
        return self.launcher != "single"

    @property
    def init_method(self) -> str | None:
        """The ``init_method`` for ``torch.distributed.init_process_group``, or None when
        rank 0's address is unknown."""
        if self.launcher in ("torchelastic", "env"):
            return "env://"
        if self.master_addr and self.master_port:
            return f"tcp://{self.master_addr}:{self.master_port}"
        return None

    def describe(self) -> str:
        """One line for messages: ``torchelastic rank 1/2 (local 1/2, node 0)``."""
        return (
            f"{self.launcher} rank {self.rank}/{self.world_size} "
            f"(local {self.local_rank}/{self.local_world_size}, node {self.node_rank})"
        )


def detect(environ: Mapping[str, str] | None = None) -> World:
    """The world this process is in, read from ``environ`` (default ``os.environ``).

    >>> detect({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5",
    ...         "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
    ...         "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
    ...         "SLURM_STEP_NODELIST": "gpu[07-10]"}).master_addr
    'gpu07'

    Raises:
        DistributedError: the variables contradict each other (``WORLD_SIZE=2`` without
            ``RANK``, a rank outside the world), so the world cannot be known.
    """
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_RUN_ID") or "RANK" in env or "WORLD_SIZE" in env:
        _check_values(env)
    if env.get("TORCHELASTIC_RUN_ID"):
        return _torchelastic(env)
    if "RANK" in env or "WORLD_SIZE" in env:
        world = _plain(env)
        if world is not None:
            return world
    if _is_slurm_step(env):
        world = _slurm(env)
        if world.world_size > 1:
            return world
    mpi = _mpi(env)
    if mpi is not None and mpi.world_size > 1:
        return mpi
    return World("single")


# ----------------------------------------------------------------------------- launchers


def _torchelastic(env: Mapping[str, str]) -> World:
    rank = _int(env, "RANK", "torchelastic")
    world_size = _int(env, "WORLD_SIZE", "torchelastic")
    return _checked(
        World(
            "torchelastic",
            rank=rank,
            world_size=world_size,
            local_rank=_int(env, "LOCAL_RANK", "torchelastic", default=rank),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", "torchelastic", default=world_size),
            node_rank=_int(env, "GROUP_RANK", "torchelastic", default=0),
            nnodes=_int(env, "GROUP_WORLD_SIZE", "torchelastic", default=1),
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=_opt_int(env, "MASTER_PORT", "torchelastic"),
            job_id=env.get("TORCHELASTIC_RUN_ID"),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", "torchelastic", default=0),
        )
    )


def _plain(env: Mapping[str, str]) -> World | None:
    if "WORLD_SIZE" not in env or "RANK" not in env:
        size, rank_text = env.get("WORLD_SIZE", "").strip(), env.get("RANK", "").strip()
        if size in ("", "0", "1") and rank_text in ("", "0"):
            return None  # a stray RANK=0 or WORLD_SIZE=1: a world of one either way
        missing = "RANK" if "RANK" not in env else "WORLD_SIZE"
        raise DistributedError(
            f"WORLD_SIZE={env.get('WORLD_SIZE')!r} and RANK={env.get('RANK')!r} are set, but "
            f"{missing} is not, so this process cannot know its place in the world and would "
            "train on its own. Start it with `anydevice launch` or torchrun, or set RANK, "
            "WORLD_SIZE, MASTER_ADDR and MASTER_PORT together."
        )
    rank = _int(env, "RANK", "env")
    world_size = _int(env, "WORLD_SIZE", "env")
    master_addr = env.get("MASTER_ADDR") or None
    if world_size == 1 and master_addr is None:
        return None  # RANK=0 WORLD_SIZE=1 and nowhere to meet: a world of one
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", "env", default=world_size)
    node = _int(env, "NODE_RANK", "env", default=rank // max(1, local_world_size))
    return _checked(
        World(
            "env",
            rank=rank,
            world_size=world_size,
            local_rank=_int(env, "LOCAL_RANK", "env", default=rank % local_world_size),
            local_world_size=local_world_size,
            node_rank=_int(env, "GROUP_RANK", "env", default=node),
            nnodes=max(1, world_size // local_world_size),
            master_addr=master_addr,
            master_port=_opt_int(env, "MASTER_PORT", "env"),
        )
    )


def _is_slurm_step(env: Mapping[str, str]) -> bool:
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return (
        "SLURM_PROCID" in env
        and step is not None
        and env.get("SLURM_JOB_NAME", "").strip() not in _INTERACTIVE
    )


def _slurm(env: Mapping[str, str]) -> World:
    rank = _int(env, "SLURM_PROCID", "slurm")
    world_size = _opt_int(env, "SLURM_STEP_NUM_TASKS", "slurm") or _int(
        env, "SLURM_NTASKS", "slurm", default=1
    )
    nnodes = _opt_int(env, "SLURM_STEP_NUM_NODES", "slurm") or _int(
        env, "SLURM_NNODES", "slurm", default=1
    )
    node_rank = _int(env, "SLURM_NODEID", "slurm", default=0)
    per_node_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    per_node = tasks_per_node(per_node_text) if per_node_text else []
    local_world_size = (
        per_node[node_rank] if node_rank < len(per_node) else max(1, world_size // nnodes)
    )
    nodelist = (
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    )
    hosts = expand_nodelist(nodelist) if nodelist else []
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    port = _opt_int(env, "MASTER_PORT", "slurm")
    if port is None and job_id and job_id.isdigit():
        port = slurm_port(job_id)
    return _checked(
        World(
            "slurm",
            rank=rank,
            world_size=world_size,
            local_rank=_int(env, "SLURM_LOCALID", "slurm", default=0),
            local_world_size=local_world_size,
            node_rank=node_rank,
            nnodes=nnodes,
            master_addr=env.get("MASTER_ADDR") or (hosts[0] if hosts else None),
            master_port=port,
            job_id=job_id,
        )
    )


#: (world size, rank, local rank, local size) variables of each MPI flavour.
_MPI_VARS = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE"),
)  # fmt: skip


def _mpi(env: Mapping[str, str]) -> World | None:
    for size_var, rank_var, local_var, local_size_var in _MPI_VARS:
        if size_var in env and rank_var in env:
            world_size = _int(env, size_var, "mpi")
            rank = _int(env, rank_var, "mpi")
            local_world_size = _int(env, local_size_var, "mpi", default=world_size)
            return _checked(
                World(
                    "mpi",
                    rank=rank,
                    world_size=world_size,
                    local_rank=_int(env, local_var, "mpi", default=rank % local_world_size),
                    local_world_size=local_world_size,
                    node_rank=rank // max(1, local_world_size),
                    nnodes=max(1, world_size // max(1, local_world_size)),
                    master_addr=env.get("MASTER_ADDR") or None,
                    master_port=_opt_int(env, "MASTER_PORT", "mpi"),
                )
            )
    return None


#: torchrun's variables: (what each means, its smallest value).
_MEANING = {
    "WORLD_SIZE": ("the number of processes in the job", 1),
    "RANK": ("this process's place in the job, 0 to WORLD_SIZE - 1", 0),
    "LOCAL_RANK": ("this process's place on its machine, 0 to LOCAL_WORLD_SIZE - 1", 0),
    "LOCAL_WORLD_SIZE": ("the number of processes on this machine", 1),
    "NODE_RANK": ("this machine's place among the machines", 0),
    "GROUP_RANK": ("this machine's place among the machines", 0),
    "MASTER_PORT": ("the TCP port rank 0 listens on, 1 to 65535", 1),
}


def _check_values(env: Mapping[str, str]) -> None:
    """Each of torchrun's variables that is set is a whole number in its range."""
    for name, (meaning, least) in _MEANING.items():
        text = env.get(name)
        if text is None or not text.strip():
            continue
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        port_ok = name != "MASTER_PORT" or (value is not None and value <= 65535)
        if value is not None and value >= least and port_ok:
            continue
        kind = "a whole number" if value is None else f"at least {least}"
        if name == "MASTER_PORT" and value is not None:
            kind = "between 1 and 65535"
        raise DistributedError(
            f"{name}={text!r} is not {kind}: {name} is {meaning}. Whatever set it "
            "(a launcher, a job script, a shell profile) set it wrong: unset it to run as a "
            "single process, or start the job with `anydevice launch` or torchrun, which "
            "set it for each process."
        )


def _int(env: Mapping[str, str], name: str, launcher: str, default: int | None = None) -> int:
    value = _opt_int(env, name, launcher)
    if value is not None:
        return value
    if default is None:
        raise DistributedError(
            f"The environment looks like a {launcher} launch, but {name} is not set; "
            "the launcher did not give this process its place in the world."
        )
    return default


def _opt_int(env: Mapping[str, str], name: str, launcher: str) -> int | None:
    text = env.get(name)
    if text is None or not text.strip():
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise DistributedError(
            f"{name}={text!r} is not a whole number; the {launcher} launcher's variables are "
            "garbled. Unset it, or start the job again with the launcher."
        ) from None


def _checked(w: World) -> World:
    if w.world_size < 1 or not 0 <= w.rank < w.world_size:
        raise DistributedError(
            f"{w.launcher}: rank {w.rank} is outside a world of {w.world_size}; check the "
            "launcher's variables (RANK, WORLD_SIZE or their SLURM/MPI equivalents)."
        )
    if not 0 <= w.local_rank < max(w.local_world_size, 1):
        raise DistributedError(
            f"{w.launcher}: local rank {w.local_rank} is outside {w.local_world_size} local "
            "ranks; check LOCAL_RANK / LOCAL_WORLD_SIZE (or SLURM_LOCALID)."
        )
    return w


# ----------------------------------------------------------------------------- SLURM text


def expand_nodelist(text: str) -> list[str]:
    """Host names from a SLURM node list, in order.

    >>> expand_nodelist("gpu[01-03,7],login1")
    ['gpu01', 'gpu02', 'gpu03', 'gpu7', 'login1']
    >>> expand_nodelist("rack[1-2]-n[0-1]")
    ['rack1-n0', 'rack1-n1', 'rack2-n0', 'rack2-n1']
    """
    hosts: list[str] = []
    for item in _split_top_level(text):
        hosts.extend(_expand_item(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_item(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    out: list[str] = []
    for part in m.group(1).split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise DistributedError(f"Cannot read the SLURM node list {item!r} (range {part!r}).")
        width = len(lo)
        for n in range(int(lo), int(hi if sep else lo) + 1):
            out.extend(_expand_item(f"{head}{n:0{width}d}{tail}"))
    return out


def tasks_per_node(text: str) -> list[int]:
    """SLURM's tasks-per-node text, one number per node.

    >>> tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise DistributedError(f"Cannot read SLURM's tasks per node {text!r}.")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def slurm_port(job_id: str) -> int:
    """The port rank 0 listens on in a SLURM job: 15000 + the job id's last four digits.

    Every task of the job computes the same port without talking to the others (the
    convention Lightning uses too). ``MASTER_PORT`` overrides it.

    >>> slurm_port("1234567")
    19567
    """
    return 15000 + int(job_id[-4:])
