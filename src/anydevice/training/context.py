"""``with ad.distributed() as d:`` — this process's place in a world, and its process group.

The same script runs under ``python train.py`` (a world of one, no process group) and under
``anydevice launch -n 4 train.py``, ``torchrun``, ``srun`` or ``mpirun`` (a group of four).
Inside a launcher the context:

1. reads the world from the environment (:mod:`anydevice.launching.environment`);
2. picks this rank's device — the ``LOCAL_RANK``-th GPU, else the CPU — from anydevice's
   inventory (NVML, so no CUDA context is created on the wrong GPU), and makes it the
   current device *before* any CUDA work;
3. initialises the process group: NCCL for CUDA, XCCL for XPU where torch has it, gloo for
   the CPU; a missing rank raises :class:`~anydevice.errors.DistributedTimeoutError` after
   ``timeout`` instead of hanging;
4. on exit — also on error — collects garbage and then destroys the group, keeping a
   reference to it until the next block or the program's end (:func:`_teardown`): a DDP
   model dropped after the block would otherwise free the group from its reducer, with
   the GIL held while gloo's threads are joined — a rank that hangs as it exits. On error
   under a launcher, the traceback goes to the worker's error file first, so the launcher
   names this rank, not a peer that failed because this one closed the group.

When the environment says ``WORLD_SIZE > 1`` but no group can be formed, it raises: it
never lets ranks silently train independent copies.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from anydevice.errors import DistributedError, DistributedTimeoutError
from anydevice.feeding.streams import stream_device
from anydevice.hardware import backends, pulse, selection
from anydevice.hardware.backends import runtime
from anydevice.hardware.spec import DeviceLike, parse_spec, unindexed
from anydevice.launching import environment, progress
from anydevice.launching.environment import World
from anydevice.training import accumulation, preemption
from anydevice.training.accumulation import Accumulation
from anydevice.training.preemption import Preemption

__all__ = ["Distributed", "backend_for", "distributed", "rank_device"]

logger = logging.getLogger("anydevice")

#: The collective backend torch recommends for each device kind.

T = TypeVar("T")


@dataclass(frozen=True)
class Distributed:
    """This process's place in the world, as ``with ad.distributed() as d:`` gives it.

    >>> import anydevice as ad
    >>> with distributed() as d:
    ...     print(d.rank, d.world_size, d.is_main, d.device == ad.device())
    0 1 True True
    """

    rank: int  #: global rank, 0 .. world_size - 1
    local_rank: int  #: rank on this machine
    world_size: int
    local_world_size: int  #: ranks on this machine
    node_rank: int
    device: torch.device  #: this rank's device, already the current one
    backend: str | None  #: nccl, gloo, ...; None in a world of one without a group
    launcher: str  #: torchelastic, env, slurm, mpi or single
    world: World = field(repr=False)
    #: the signals caught for ``on_preempt`` (:mod:`~anydevice.training.preemption`)
    preemption: Preemption | None = field(default=None, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (log, save checkpoints, print here)."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0 (download, unpack, cache here: once per machine)."""
        return self.local_rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when a process group exists (a launcher started this process)."""
        return self.backend is not None

    def check_preemption(self) -> None:
        """Call once per training step, where the state is whole: if a preemption signal
        reached any rank, ``on_preempt`` runs on every rank and the process exits
        (``SystemExit(128 + signal)``). Every rank must call it; without ``on_preempt``
        it does nothing."""
        if self.preemption is not None:
            self.preemption.check()

    def accumulate(
        self,
        model: nn.Module,
        loader: Iterable[T] | None = None,
        *,
        micro_batches: int | None = None,
        global_batch: int | None = None,
    ) -> Accumulation[T]:
        """Make every ``micro_batches`` batches of ``loader`` one optimizer step, with one
        gradient reduction per step (DDP, FSDP2) instead of one per micro-batch.

        >>> import anydevice as ad
        >>> net = torch.nn.Linear(2, 1)
        >>> with ad.distributed() as d:
        ...     for step in d.accumulate(net, [torch.ones(4, 2)] * 6, micro_batches=3):
        ...         for x in step:
        ...             step.scale(net(x).sum()).backward()   # loss / 3
        ...         print(step.index, step.size)
        0 3
        1 3

        ``global_batch=`` (samples per step over all ranks) derives ``micro_batches``
        from the loader's batch size and this world's size. See
        :func:`~anydevice.training.accumulation.accumulate` for the whole loop.

        Raises:
            ValueError: neither or both of ``micro_batches`` and ``global_batch``, or a
                ``global_batch`` that is not a whole number of micro-batches.
        """
        return accumulation.accumulate(
            model,
            loader,
            micro_batches=micro_batches,
            global_batch=global_batch,
            world_size=self.world_size,
        )

    def micro_batch_size(self, global_batch: int, fits: int) -> int:
        """The largest micro-batch ``<= fits`` (what ``ad.fit_batch_size`` found) that
        makes a step of ``global_batch`` samples over this world's ranks exactly.

        >>> import anydevice as ad
        >>> with ad.distributed() as d:
        ...     d.micro_batch_size(512, fits=100)   # 512 = 8 x 64
        64
        """
        return accumulation.micro_batch_size(global_batch, fits, self.world_size)

    def barrier(self) -> None:
        """Wait until every rank gets here; returns at once in a world of one."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        if not runtime(backends.collective_device().type).is_host:
            dist.barrier(device_ids=[_index(self.device)])  # NCCL's barrier names its GPU
        else:
            dist.barrier()


@contextlib.contextmanager
def distributed(
    backend: str = "auto",
    *,
    timeout: float | timedelta | None = None,
    device: DeviceLike = "auto",
    init_method: str | None = None,
    on_preempt: Callable[[], object] | None = None,
) -> Iterator[Distributed]:
    """Join the world a launcher started, or be a world of one; leave it cleanly.

    >>> import anydevice as ad
    >>> with ad.distributed() as d:
    ...     d.barrier()              # no-op in a world of one
    ...     print(d.launcher, d.backend)
    single None

    Args:
        backend: ``"auto"`` (NCCL on CUDA, XCCL on XPU, gloo on the CPU), or any name
            ``torch.distributed.init_process_group`` takes, e.g. ``"gloo"`` or
            ``"cpu:gloo,cuda:nccl"``.
        timeout: seconds (or a ``timedelta``) to wait for the other ranks to join and for
            each collective; default torch's (10 minutes for NCCL, 30 for gloo). A missing
            rank raises after this long.
        device: the device spec to pick this rank's device from. ``"auto"`` gives the
            ``local_rank``-th device of the best accelerator, else the CPU, and honours
            ``ANYDEVICE_DEVICE``.
        init_method: where the ranks meet, instead of what the launcher says: e.g.
            ``"file:///shared/job42"`` on a shared file system where ports are closed, or
            ``"tcp://10.0.0.1:23456"``. Ranks and world size still come from the launcher;
            outside one, it makes a group of one.
        on_preempt: a function of no arguments (typically ``ad.save_state``) to run on
            every rank when ``SIGTERM`` (or, under SLURM, ``SIGUSR1``) reaches the job:
            the ranks agree at the next ``d.check_preemption()`` — called once per step —
            then it runs and the job exits, requeued under SLURM after ``SIGUSR1``
            (:mod:`~anydevice.training.preemption`).

    Returns:
        A context manager whose value is a :class:`Distributed`.

    Raises:
        DistributedError: the environment names a world that cannot be joined (no group
            can be formed, the backend is missing from this torch build, two ranks would
            share one GPU under NCCL), or a process group already exists with another
            backend.
        DistributedTimeoutError: the other ranks did not join within ``timeout``.
    """
    if on_preempt is not None:
        joined = distributed(backend, timeout=timeout, device=device, init_method=init_method)
        with joined as d, preemption.watch(on_preempt) as watcher:
            yield dataclasses.replace(d, preemption=watcher)
        return
    world = environment.detect()
    if dist.is_available() and dist.is_initialized():
        if init_method is not None:
            raise DistributedError(
                f"A process group already exists, so ad.distributed(init_method="
                f"{init_method!r}) cannot make another. Drop the argument."
            )
        yield _announced(_existing(world, backend, timeout, device))
        return
    if not world.is_launched and init_method is None:
        single = Distributed(0, 0, 1, 1, 0, rank_device(device, 0), None, "single", world)
        yield _announced(single)
        return
    if not dist.is_available():
        raise DistributedError(
            f"This process is {world.describe()}, but this torch build has no "
            "torch.distributed. Install a torch build with distributed support."
        )
    _release_retired()  # the last block's groups, where no model holds them any more
    dev = rank_device(device, world.local_rank)
    name = backend_for(dev) if backend == "auto" else backend
    _check_backend(name, dev, world)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_current_device(dev))
        _init(world, name, dev, timeout, init_method)
        progress.watch()  # its collectives, for the launcher's hang watch and `top`
        ended = _Ending()
        stack.callback(lambda: _teardown(keep=ended.agreed))
        stack.enter_context(ended)  # left first: says how the block ended to the teardown
        _announce(world, dev, str(dist.get_backend()))
        try:
            yield Distributed(
                rank=world.rank,
                local_rank=world.local_rank,
                world_size=world.world_size,
                local_world_size=world.local_world_size,
                node_rank=world.node_rank,
                device=dev,
                backend=str(dist.get_backend()),
                launcher=world.launcher,
                world=world,
            )
        except Exception as e:
            _record_for_launcher(e)
            raise


def rank_device(spec: DeviceLike, local_rank: int) -> torch.device:
    """The device of the rank with this local rank: the ``local_rank``-th device ``spec``
    covers (``"auto"``: the best accelerator's devices, else the CPU), wrapping around.

    >>> rank_device("auto", 3).type in ("cpu", "cuda", "mps", "xpu", "xla")
    True
    >>> rank_device("cpu", 5)
    device(type='cpu')
    """
    parsed = parse_spec(spec)
    if unindexed(parsed.kind):
        return torch.device(parsed.kind)
    if parsed.index is not None:
        return selection.device(spec)
    found = selection.devices(spec)
    return found[local_rank % len(found)]


def backend_for(device: torch.device) -> str:
    """The collective backend for a device kind, as torch maps it
    (``torch.distributed.Backend.default_device_backend_map``: NCCL on CUDA, XCCL on XPU,
    what a privateuse1 backend registered for its devices), gloo otherwise. A mapped
    backend this torch lacks gives gloo, apart from NCCL: a CUDA job is told NCCL is
    missing rather than silently slowed.

    >>> backend_for(torch.device("cpu"))
    'gloo'
    """
    return backends.collective_backend(device.type)


# ----------------------------------------------------------------------------- internals


def _announce(world: World, device: torch.device, backend: str | None) -> None:
    """Say who this process is in its heartbeat (``anydevice top``'s rank, job and device
    columns; the launcher's hang watch)."""
    pulse.identify(
        rank=world.rank,
        local_rank=world.local_rank,
        world_size=world.world_size,
        local_world_size=world.local_world_size,
        device=device,
        launcher=world.launcher,
        node_rank=world.node_rank,
        collective_backend=backend,
    )


def _announced(d: Distributed) -> Distributed:
    """``d``, announced (:func:`_announce`): a group made elsewhere may not be the
    environment's world."""
    world = dataclasses.replace(
        d.world,
        rank=d.rank,
        local_rank=d.local_rank,
        world_size=d.world_size,
        local_world_size=d.local_world_size,
    )
    _announce(world, d.device, d.backend)
    return d


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else 0


def _seconds(timeout: float | timedelta) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def _existing(
    world: World, backend: str, timeout: float | timedelta | None, device: DeviceLike
) -> Distributed:
    """A group made elsewhere (by the user, or an outer ``ad.distributed``): use it as is,
    never destroy it, and refuse arguments that would have made a different one."""
    current = str(dist.get_backend())
    if backend != "auto" and backend != current:
        raise DistributedError(
            f"A process group with backend {current!r} already exists, so "
            f"ad.distributed(backend={backend!r}) cannot make its own. Drop the argument, "
            "or destroy the existing group first."
        )
    if timeout is not None:
        raise DistributedError(
            "A process group already exists, and its timeout was fixed when it was made; "
            f"ad.distributed(timeout={timeout!r}) cannot change it. Drop the argument."
        )
    rank, size = dist.get_rank(), dist.get_world_size()
    local = world.local_rank if world.world_size == size else 0
    dev = backends.collective_device(current)  # NCCL's: this rank's GPU
    if runtime(dev.type).is_host:
        dev = rank_device(device, local)
    local_size = world.local_world_size if world.world_size == size else 1
    node = world.node_rank if world.world_size == size else 0
    return Distributed(rank, local, size, local_size, node, dev, current, world.launcher, world)


def _check_backend(name: str, dev: torch.device, world: World) -> None:
    # The device's own refusal first: it says why no build of torch would do (XLA's gloo,
    # a simulated GPU's NCCL), where a missing backend would only blame this build.
    refusal = runtime(dev.type).collective_refusal(name)
    if refusal is not None:
        raise DistributedError(refusal)
    host = backends.host()
    for backend in sorted(backends.group_backends(name)):
        available = getattr(dist, f"is_{backend}_available", None)  # torch's own backends
        if available is not None and not available():
            owner = next((k for k in backends.kinds() if k.collective == backend), host)
            label = runtime(owner.name).label
            hint = (
                f" {backend.upper()} needs a torch built for {label}, and {label} devices; "
                f"on the CPU use {host.collective}."
                if owner is not host
                else ""
            )
            raise DistributedError(
                f"Backend {backend!r} is not built into this torch ({torch.__version__}), so "
                f"{world.describe()} cannot form its process group.{hint} Use "
                f"backend='auto' (here: {backend_for(dev)!r})."
            )
    # With every GPU visible to every rank, more local ranks than GPUs means sharing one.
    # (A scheduler that gives each task its own CUDA_VISIBLE_DEVICES is another matter.)
    own, kind = backends.facts(dev.type), runtime(dev.type)
    variable = kind.visibility_variable
    if (
        own.one_rank_per_device
        and own.collective in backends.group_backends(name)
        and (variable is None or variable not in os.environ)
    ):
        count = len(selection.devices(dev.type))
        if world.local_world_size > count:
            raise DistributedError(
                f"{world.local_world_size} ranks run on this machine but {count} {kind.label} "
                f"device(s) are visible, so ranks would share one: {own.one_rank_per_device}. "
                f"Launch at most {count} process(es) per machine (anydevice launch -n gpu), "
                f"or use backend='{host.collective}' to share."
            )


@contextlib.contextmanager
def _current_device(dev: torch.device) -> Iterator[None]:
    """Make ``dev`` the current device for the block and restore the previous one after
    (a device with streams, through ``torch.accelerator``; elsewhere nothing to make
    current)."""
    where = stream_device(dev)
    if where is None:
        yield
        return
    before = torch.accelerator.current_device_index()
    torch.accelerator.set_device_index(where.index)
    try:
        yield
    finally:
        torch.accelerator.set_device_index(before)


def _init(
    world: World,
    backend: str,
    dev: torch.device,
    timeout: float | timedelta | None,
    init_method: str | None,
) -> None:
    init_method = init_method or world.init_method
    if init_method is None or (init_method == "env://" and not world.master_port):
        raise DistributedError(
            f"This process is {world.describe()}, but the address of rank 0 is unknown "
            f"(MASTER_ADDR={world.master_addr!r}, MASTER_PORT={world.master_port!r}). Set "
            "MASTER_ADDR and MASTER_PORT for every rank (mpirun -x MASTER_ADDR -x "
            "MASTER_PORT ...), or start the job with `anydevice launch`."
        )
    options: dict[str, object] = {}
    if timeout is not None:
        options["timeout"] = _seconds(timeout)
    own = backends.facts(dev.type)
    if not own.host and backend == own.collective and backend == backend_for(dev):
        options["device_id"] = dev  # binds the group to this GPU (NCCL): eager, correct barriers
    logger.info("init_process_group(%s, %s) as %s", backend, init_method, world.describe())
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=world.rank,
            world_size=world.world_size,
            **options,  # type: ignore[arg-type]
        )
    except RuntimeError as e:  # torch's DistError family, or a bare one from file://
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = _meeting(world, init_method)
        if isinstance(e, dist.DistStoreError) or "time" in first.lower():
            waited = f"{_seconds(timeout).total_seconds():g} s" if timeout is not None else "the"
            raise DistributedTimeoutError(
                f"The other ranks did not join within {waited} timeout: this process is "
                f"{world.describe()}, meeting at {where} ({first}). Check that every rank was "
                "started with the same address and WORLD_SIZE and that none crashed before "
                "joining, or wait longer (timeout=)."
            ) from e
        if isinstance(e, dist.DistNetworkError):
            raise DistributedError(
                f"Could not reach rank 0 at {where} as {world.describe()}: {first}. Check "
                "MASTER_ADDR/MASTER_PORT and the firewall."
            ) from e
        raise


def _meeting(world: World, init_method: str) -> str:
    if init_method == "env://":
        return f"{world.master_addr}:{world.master_port}"
    return init_method


def _record_for_launcher(e: Exception) -> None:
    """Write the error to this worker's error file now, before the teardown closes the
    group: the peers fail at once on the closed connection, and the launcher must find
    this worker's own error, with the time it happened, when it looks. The first record
    of a process is kept (:func:`anydevice.launching.failures.record`)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from anydevice.launching.failures import record

        record(e)


#: The process groups the last block destroyed, held here (see :func:`_teardown`).
_retired: list[object] = []


class _Ending(contextlib.AbstractContextManager["_Ending"]):
    """How the block ended: ``agreed`` where every rank ends it (it ran to its end, or a
    preemption all ranks agreed on raised ``SystemExit``), not where this rank failed
    alone."""

    agreed = True

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.agreed = kind is None or issubclass(kind, SystemExit)


def _teardown(*, keep: bool = True) -> None:
    """Free what still holds the group (a dropped DDP model, its reducer, pending work)
    while the group is alive, then destroy it; a background ``save_state`` still writing
    needs the groups, so it is waited for first (its error logged).

    A DDP model the program still holds keeps the groups past this point through its
    reducer. Were the reducer their last holder, dropping the model later would free a
    gloo group with the GIL held (torch frees a ``Reducer`` so), joining gloo's worker
    threads while one of them may wait for the GIL to release the last collective's
    tensors: the rank would hang as it exits. So the groups are also held here, from
    Python, and let go of where torch releases the GIL for it (its holder of a process
    group does): when the next block starts, and at exit (:func:`_release_retired`).
    Not when this rank fails alone (``keep=False``): held, the group's connections would
    stay open, and its peers would wait out their timeout instead of failing at once on
    the closed connection, which is how they learn that this rank is gone.
    """
    from anydevice.checkpoints.state import finish_for_teardown
    from anydevice.hardware.backends.torch_private import process_groups

    finish_for_teardown()
    gc.collect()
    if dist.is_initialized():
        _retired[:] = process_groups() if keep else []
        dist.destroy_process_group()
        _release_at_exit()


@functools.cache
def _release_at_exit() -> None:
    """Register :func:`_release_retired` to run at exit, once: after the program, before
    the interpreter's finalisation (and before torch's own exit handlers, registered
    earlier), while every thread can still take the GIL."""
    atexit.register(_release_retired, at_exit=True)


def _release_retired(*, at_exit: bool = False) -> None:
    """Let go of the groups past blocks destroyed. At exit, a DDP model the program still
    holds (a module-level one) is first made to drop its reducer and logger, which hold
    its group, so that this list's release is the group's last."""
    if not _retired:
        return
    if at_exit:
        from torch.nn.parallel import DistributedDataParallel

        retired = {id(g) for g in _retired}
        for obj in gc.get_objects():
            # type(), not isinstance(): an object may answer __class__ with a warning
            if (
                issubclass(type(obj), DistributedDataParallel)
                and id(obj.__dict__.get("process_group")) in retired
            ):
                obj.__dict__.pop("reducer", None)
                obj.__dict__.pop("logger", None)
    _retired.clear()
    gc.collect()
