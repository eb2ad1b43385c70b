"""``ad.launch(fn, ...)``: one process per device through torch's elastic agent.

The agent is the one ``torchrun`` runs (``LocalElasticAgent``, built in :mod:`.agent`):
it rendezvouses the nodes, starts and watches the workers, restarts them, records each
worker's traceback in an error file, and stops the others when one fails. anydevice only
fills in its configuration — the parts that are easy to get wrong:

* **Standalone** (one node): a c10d rendezvous on ``127.0.0.1:0``, so the operating system
  hands out a free port (no race) and nothing listens beyond this machine.
* **Several nodes**: c10d at ``rdzv_endpoint`` with a bounded ``join_timeout`` (torch's
  default waits 600 s for a missing node); the node with ``node_rank=0`` hosts the store
  (:mod:`.rendezvous`: every wait bounded, an endpoint another job holds named as such).
  One node given an ``rdzv_endpoint`` hosts it.
* **Restarts and elastic node ranges** set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with
  torch's shared store a restarted group often reconnects to the previous attempt's peers
  (pytorch/pytorch#135712, #167288) — with it, restarts recover.
* **Threads**: unless ``OMP_NUM_THREADS`` is set, each worker gets its share of the usable
  cores (torchrun gives each 1).
* **Logs** go to a temporary directory that is removed afterwards, unless ``log_dir`` is given.
* **Spawn** by default: forking after CUDA or ``torch._dynamo`` was loaded is unsafe.
* **Faults** (:mod:`~anydevice.launching.agent`): nothing listens beyond loopback on one
  node, every wait is bounded by ``timeout``, workers die with the launcher, a hung rank is
  named with its stack, and nothing is left behind.

Environment variables change only for the duration of the launch and are restored after.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from anydevice.errors import DeviceNotFoundError, DistributedError
from anydevice.hardware import backends
from anydevice.hardware.inventory import Inventory
from anydevice.launching import addressing, arguments, environment, preflight
from anydevice.launching.agent import LOOPBACK, Preempted, run_agent, scoped_environ
from anydevice.launching.environment import World
from anydevice.launching.options import LaunchOptions, LaunchPlan

__all__ = [
    "launch",
    "launch_script",
    "plan",
    "resolve_nprocs",
    "run_agent",
    "scoped_environ",
]

logger = logging.getLogger("anydevice")

T = TypeVar("T")


def launch(
    fn: Callable[..., T],
    *args: Any,
    nprocs: int | str = "auto",
    nnodes: int | str = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    run_id: str | None = None,
    max_restarts: int = 0,
    start_method: str = "spawn",
    timeout: float = 300.0,
    grace: float = 30.0,
    log_dir: str | os.PathLike[str] | None = None,
    verbose: bool = False,
    local_addr: str | None = None,
    hang_after: float = 30.0,
) -> dict[int, T]:
    """Run ``fn(*args)`` in one process per device and return what each rank returned.

    Called in a process that a launcher already started (``torchrun``, ``anydevice
    launch``, ``srun`` with one task per GPU, ``mpirun``), it launches nothing: it runs
    ``fn(*args)`` here, once, as this rank.

    >>> import operator
    >>> launch(operator.add, 2, 3, nprocs=2)      # two processes, each computing 2 + 3
    {0: 5, 1: 5}

    A training script::

        def train(steps):
            with ad.distributed() as d:
                ...
                return d.rank

        if __name__ == "__main__":
            print(ad.launch(train, 20, nprocs=2))   # {0: 0, 1: 1}

    Args:
        fn: the worker function. With ``spawn`` it must be importable: defined at module
            level, and the call to ``launch`` guarded by ``if __name__ == "__main__":``.
        args: passed to ``fn`` in every worker (pickled).
        nprocs: processes on this node: ``"auto"`` (one per visible GPU, else 1),
            ``"gpu"`` (one per GPU; an error without one), or an int.
        nnodes: number of nodes, or ``"MIN:MAX"`` for an elastic range.
        node_rank: 0 on the node that hosts the rendezvous (the ``rdzv_endpoint`` host).
            Ranks are assigned at rendezvous, so it decides only who hosts.
        rdzv_endpoint: ``HOST:PORT`` every node can reach; needed when ``nnodes > 1``.
        run_id: the job's name, the same on every node (default ``"anydevice"``, or the
            SLURM job id).
        max_restarts: how often to restart the workers of this node after a failure.
        start_method: ``"spawn"`` (default), ``"forkserver"`` or ``"fork"`` (faster, but
            unsafe once CUDA or ``torch._dynamo`` was loaded in this process).
        timeout: seconds that any wait of the launcher may last: reaching the rendezvous
            (connecting, and each answer of its store), all nodes joining, the nodes
            finishing together.
        grace: seconds the workers get to exit after a signal reaches the launcher
            (SIGTERM from a scheduler, Ctrl-C): the signal is passed on at once, a worker
            with ``ad.distributed(on_preempt=save)`` saves and exits, and only workers
            still running after ``grace`` are killed. A second signal kills them at once.
            Keep it below the scheduler's own (SLURM's ``KillWait``, Kubernetes'
            ``terminationGracePeriodSeconds``, 30 s by default).
        log_dir: keep each worker's logs and error files there (default: a temporary
            directory, removed afterwards, also when the launcher is killed).
        verbose: let torch elastic's own log lines through, and have each failing worker
            print its traceback as well as the summary.
        local_addr: with several nodes, the address of this node the others reach (the
            workers' ``MASTER_ADDR`` where it hosts; gloo and NCCL listen on its
            interface). Default: the source address of the route to ``rdzv_endpoint``.
        hang_after: seconds a rank may wait in one collective before the launch says why
            the job makes no progress (which rank is where, and what holds it: see
            docs/hangs.md); at least twice the longest gap between collectives seen. Ranks
            that call different collectives stop the job at once. 0 turns the watch off.

    Returns:
        ``{global_rank: return value}`` for the workers this call ran, in rank order. On one
        node that is every rank: ``result[0]`` is rank 0's. With several nodes, each node
        gets its own workers' values (gather across nodes inside ``fn`` with
        ``ad.all_gather``). In place under a launcher: ``{this rank: fn(*args)}``.

    Raises:
        WorkerFailedError: a worker failed; the message names the rank that caused it
            and carries its traceback, or names the ranks that never arrived where the
            others timed out waiting, with their stacks, and what the hang watch saw. The
            other workers are stopped. Also when the ranks call different collectives
            (the hang watch stops the job; exit code 1).
        DistributedTimeoutError: not all nodes joined within ``timeout``, or the
            rendezvous endpoint could not be reached within it.
        KeyboardInterrupt: SIGINT (Ctrl-C) reached the launcher; the workers were stopped.
        SystemExit: SIGTERM, SIGHUP or SIGQUIT reached the launcher; the workers were
            stopped; the code is 128 + the signal's number (143 for SIGTERM). Also when
            the workers stopped for a preemption (``on_preempt`` ran on each, and they
            exited with 128 + the signal), with a line saying which rank the signal
            reached.
        DistributedError: the launch cannot start as asked: an argument it does not take,
            named with its value and what to give (:mod:`~anydevice.launching.arguments`:
            ``timeout=inf``, a port beyond 65535, an empty ``run_id``, ...), ``fn`` cannot
            be pickled for ``spawn``, ``fork`` after CUDA was initialised, a missing
            ``rdzv_endpoint``, a script that calls ``launch`` outside ``if __name__ ==
            "__main__":``, which every ``spawn``/``forkserver`` worker would run again; or
            the nodes came under different run ids (:mod:`~anydevice.launching.tenants`).
        DeviceNotFoundError: ``nprocs="gpu"`` on a machine without a GPU.
        WorkerImportError: ``fn``, or something in ``args``, is defined in an interactive
            session (a notebook cell) that ``spawn``ed workers cannot import from.
    """
    preflight.refuse_while_a_worker_starts()
    options = LaunchOptions(
        nprocs=nprocs,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        run_id=run_id,
        max_restarts=max_restarts,
        start_method=start_method,
        timeout=timeout,
        grace=grace,
        hang_after=hang_after,
        verbose=verbose,
        local_addr=local_addr,
        log_dir=log_dir,
    )
    arguments.check(fn=fn, **options.given())
    world = environment.detect()
    if world.is_launched and not _is_slurm_node_launcher(world, nprocs):
        return _run_in_place(fn, args, world, nprocs)
    preflight.check_main_guard(start_method)
    chosen = _plan_here(world, options)
    preflight.check_sendable(fn, args, start_method)
    try:
        results: dict[int, T] = run_agent(chosen, fn, args, log_dir=log_dir, verbose=verbose)
    except Preempted as e:
        logger.warning("anydevice: %s", e.report)
        raise
    return results


def launch_script(
    target: str,
    args: list[str] | tuple[str, ...] = (),
    options: LaunchOptions | None = None,
    *,
    module: bool = False,
) -> int:
    """``anydevice launch``: run a script (or ``-m`` module) in one process per device.

    Each worker is ``python -u -m anydevice.launching.runner SCRIPT ARGS``, which runs
    the script as ``__main__`` and records an uncaught exception for the launcher. Under a
    launcher already (torchrun, srun with one task per GPU, mpirun) the script runs here,
    in this process, as the rank it is. ``options`` as :func:`launch` takes them (the
    workers start with ``spawn``: a new interpreter each).

    Returns:
        0 when every worker succeeded (failures raise, as in :func:`launch`).

    Raises:
        FileNotFoundError: there is no such script.
    """
    options = dataclasses.replace(options or LaunchOptions(), start_method="spawn")
    arguments.check(target=target, args=args, module=module, **options.given("start_method"))
    if not module and not os.path.isfile(target):
        raise FileNotFoundError(f"No script {target!r} (in {os.getcwd()}).")
    world = environment.detect()
    if world.is_launched and not _is_slurm_node_launcher(world, options.nprocs):
        from anydevice.launching import runner

        logger.info("already %s: running %s in place", world.describe(), target)
        runner.run(target, list(args), module=module)
        return 0
    chosen = _plan_here(world, options)
    head = ["-u", "-m", "anydevice.launching.runner", *(["-m"] if module else [])]
    run_agent(
        chosen,
        sys.executable,
        [*head, target, *args],
        log_dir=options.log_dir,
        verbose=options.verbose,
    )
    return 0


def resolve_nprocs(nprocs: int | str, inv: Inventory) -> int:
    """How many processes ``nprocs`` means on the machine ``inv`` describes (pure).

    >>> from anydevice.hardware.inventory import inventory
    >>> resolve_nprocs(3, inventory(telemetry=False))
    3

    Raises:
        DeviceNotFoundError: ``"gpu"`` on a machine without a GPU.
        DistributedError: not a count from 1 to 4096, ``"auto"`` or ``"gpu"``.
    """
    count = arguments.process_count(nprocs)
    if isinstance(count, int):
        return count
    kinds = _per_device_kinds()
    gpus = next((found for found in map(inv.of_kind, kinds) if found), ())
    if count == "auto":
        return max(1, len(gpus))
    if not gpus:
        labels = " or ".join(backends.get(k).label for k in kinds)
        raise DeviceNotFoundError(
            f"nprocs='gpu' asks for one process per GPU, but no {labels} device is "
            "visible here. Pass nprocs=N for N CPU processes, or nprocs='auto'."
        )
    return len(gpus)


def _per_device_kinds() -> tuple[str, ...]:
    """The accelerator kinds a launch starts one process per device of: those whose DDP
    runs one device per process (CUDA, XPU)."""
    return tuple(k for k in backends.accelerators() if backends.get(k).ddp_device_ids)


def plan(
    nprocs: int,
    options: LaunchOptions | None = None,
    *,
    cores: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """The agent's configuration for ``nprocs`` processes per node launched with
    ``options`` (default: ``launch``'s defaults). Pure: ``options``' ``nprocs``,
    ``verbose``, ``local_addr`` and ``log_dir`` are not read; ``environ`` defaults to
    ``os.environ``, ``cores`` is the number of usable CPU cores.

    >>> p = plan(2)
    >>> p.standalone, p.rdzv_endpoint, p.local_addr
    (True, '127.0.0.1:0', '127.0.0.1')
    >>> plan(4, LaunchOptions(nnodes="1:2", rdzv_endpoint="10.0.0.1:29400")).env
    {'TORCH_DISABLE_SHARE_RDZV_TCP_STORE': '1'}

    Raises:
        DistributedError: ``nnodes > 1`` without ``rdzv_endpoint``, or an argument that
            :func:`~anydevice.launching.arguments.check` refuses (a malformed node range
            or endpoint, a ``start_method`` not one of spawn, forkserver, fork, ...).
    """
    env = os.environ if environ is None else environ
    o = options or LaunchOptions()
    arguments.check(nprocs=nprocs, **o.given("nprocs", "verbose", "local_addr", "log_dir"))
    min_nodes, max_nodes = arguments.node_range(o.nnodes)
    configs: dict[str, Any] = {"join_timeout": int(max(1, round(o.timeout)))}
    local_addr: str | None
    if max_nodes == 1 and o.rdzv_endpoint is None:
        endpoint, local_addr, name = "127.0.0.1:0", "127.0.0.1", o.run_id or uuid.uuid4().hex
        configs["is_host"] = True
    else:
        if not o.rdzv_endpoint:
            raise DistributedError(
                f"nnodes={o.nnodes!r} needs rdzv_endpoint='HOST:PORT': an address of the node "
                "with node_rank=0 that every node can reach, e.g. rdzv_endpoint="
                "'10.0.0.1:29400' (the same on every node)."
            )
        host = _endpoint_host(o.rdzv_endpoint)
        endpoint, name = o.rdzv_endpoint, o.run_id or "anydevice"
        # Nodes meeting on a loopback address are all on this machine: stay there.
        local_addr = host if host in LOOPBACK else None
        if o.node_rank is not None:
            configs["is_host"] = o.node_rank == 0
        elif max_nodes == 1:  # no other node to host it: a taken port is another job's
            configs["is_host"] = True
    extra: dict[str, str] = {}
    unshared = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    if (o.max_restarts > 0 or min_nodes != max_nodes) and unshared not in env:
        extra[unshared] = "1"
    if nprocs > 1 and cores and "OMP_NUM_THREADS" not in env:
        extra["OMP_NUM_THREADS"] = str(max(1, cores // nprocs))
    if o.start_method == "fork":
        from anydevice.launching.runner import FORKED

        extra[FORKED] = "1"  # one intra-op thread: see runner._one_thread_after_fork
    return LaunchPlan(
        nproc_per_node=nprocs,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        rdzv_endpoint=endpoint,
        rdzv_configs=configs,
        run_id=name,
        max_restarts=o.max_restarts,
        start_method=o.start_method,
        local_addr=local_addr,
        env=extra,
        grace=float(o.grace),
        hang_after=float(o.hang_after),
    )


def _plan_here(world: World, options: LaunchOptions) -> LaunchPlan:
    """:func:`plan` for this machine (its devices and cores) and the launcher around it,
    then the address the other nodes reach (:func:`~anydevice.launching.addressing.settle`)."""
    if world.launcher == "slurm":  # one task per node: SLURM says where the nodes meet
        options = dataclasses.replace(
            options,
            nnodes=world.nnodes,
            node_rank=world.node_rank,
            rdzv_endpoint=options.rdzv_endpoint or f"{world.master_addr}:{world.master_port}",
            run_id=options.run_id or world.job_id,
        )
    inv = _inventory()
    chosen = plan(resolve_nprocs(options.nprocs, inv), options, cores=inv.host.cores_usable)
    return addressing.settle(chosen, options.local_addr)


def _inventory() -> Inventory:
    from anydevice.hardware.inventory import inventory

    return inventory(telemetry=False, kinds=(*_per_device_kinds(), backends.host().name))


def _endpoint_host(endpoint: str) -> str:
    return endpoint.rpartition(":")[0]  # a well-formed HOST:PORT (arguments.check)


def _is_slurm_node_launcher(world: World, nprocs: int | str) -> bool:
    """Under ``srun`` with one task per node, each task launches the node's workers."""
    if world.launcher != "slurm" or world.local_world_size != 1:
        return False
    return resolve_nprocs(nprocs, _inventory()) > 1


def _run_in_place(
    fn: Callable[..., T], args: tuple[Any, ...], world: World, nprocs: object
) -> dict[int, T]:
    if isinstance(nprocs, int) and nprocs != world.local_world_size:
        logger.warning(
            "ad.launch(nprocs=%d): this process is already %s, started by %s with %d "
            "process(es) on this node; running the function here instead of launching.",
            nprocs,
            world.describe(),
            world.launcher,
            world.local_world_size,
        )
    else:
        logger.info("already %s: running the function in place", world.describe())
    if world.launcher == "torchelastic":
        # Leave the traceback in the outer agent's error file, as a launched worker would.
        from torch.distributed.elastic.multiprocessing.errors import record

        value = record(fn)(*args)
    else:
        value = fn(*args)
    return {world.rank: value}  # type: ignore[dict-item]  # record's Optional is for exit(0)
