"""Where time goes: :func:`profile` (a trace and a table), :func:`find_syncs`, :func:`nvtx_range`.

>>> import io, torch
>>> out = io.StringIO()
>>> with profile(None, device="cpu", print_to=out) as p:
...     _ = torch.mm(torch.ones(32, 32), torch.ones(32, 32))
>>> "aten::mm" in p.table
True
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, TextIO, TypeVar

import torch

from anydevice.errors import MeasurementError
from anydevice.hardware.spec import DeviceLike

if TYPE_CHECKING:
    from anydevice.hardware.backends import Backend
    from anydevice.measure.idle import IdleTime

__all__ = ["Profile", "Sync", "SyncReport", "find_syncs", "nvtx_range", "profile"]

logger = logging.getLogger("anydevice")

T = TypeVar("T")
Output = IO[str] | logging.Logger | Literal["stdout"] | None

_SYNC_TEXT = "called a synchronizing CUDA operation"  # c10::cuda::warn_or_error_on_sync


# ----------------------------------------------------------------------------- profile


class Profile:
    """A running :func:`profile` block: call :meth:`step` once per iteration.

    After the block, :attr:`table` holds the top ops and :attr:`path` the trace (None
    when no trace was written). :attr:`prof` is torch's profiler, for anything else.
    """

    def __init__(self, prof: torch.profiler.profile, path: Path | None, steps: int | None):
        self.prof = prof
        self.path = path
        self.steps = steps  #: active steps recorded; None: the whole block
        self.steps_done = 0
        self.table = ""  #: the table of top ops, once recorded
        self.trace_written = False
        self.idle: IdleTime | None = None  #: where the device sat idle, read from the trace

    def step(self) -> None:
        """Mark the end of one iteration (advances the wait / warm-up / active schedule)."""
        self.steps_done += 1
        self.prof.step()

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from ``iterable``, calling :meth:`step` after each item."""
        for item in iterable:
            yield item
            self.step()

    def __repr__(self) -> str:
        where = str(self.path) if self.trace_written else "no trace written"
        return f"Profile({where}, {self.steps_done} steps)"


@contextlib.contextmanager
def profile(
    path: str | os.PathLike[str] | None = "trace.json",
    *,
    steps: int | None = None,
    wait: int = 1,
    warmup: int = 1,
    device: DeviceLike | None = "auto",
    record_memory: bool = False,
    record_shapes: bool = False,
    with_stack: bool = False,
    sort_by: str | None = None,
    row_limit: int = 15,
    print_to: Output = "stdout",
    **profiler_kwargs: Any,
) -> Iterator[Profile]:
    """Profile a block with torch.profiler: a Chrome/Perfetto trace and a table of top ops.

    With ``steps=None`` the whole block is recorded. With ``steps=N`` the block is a loop
    that calls ``p.step()`` once per iteration (or iterates ``p.iterate(loader)``): the
    first ``wait`` iterations are skipped, the next ``warmup`` run the profiler without
    keeping results (warm-up at least 1: the first profiled steps carry its start-up cost,
    torch warns), and the next ``N`` are recorded. Later iterations run unprofiled.

    The trace (``.json``, or ``.json.gz`` compressed) opens in https://ui.perfetto.dev or
    chrome://tracing. The table lists the ops that took the most device time (self time:
    an op's own kernels), or CPU time when no accelerator is profiled.

    >>> import io, torch
    >>> out = io.StringIO()
    >>> with profile(None, steps=2, device="cpu", print_to=out) as p:
    ...     for _ in range(5):
    ...         _ = torch.ones(8).sum()
    ...         p.step()
    >>> "aten::sum" in out.getvalue(), p.steps_done
    (True, 5)

    Args:
        path: where to write the trace; None writes none. Parent folders are created.
        steps: iterations to record; None records the whole block.
        wait: iterations skipped before the warm-up (with ``steps``).
        warmup: profiled iterations whose results are dropped (with ``steps``), >= 1.
        device: any device spec: which accelerator's activity to record besides the CPU's.
        record_memory: record allocations (memory columns in the table).
        record_shapes: record input shapes.
        with_stack: record Python stacks (source lines in the trace; slower).
        sort_by: the table's sort key (default: ``self_device_time_total`` with an
            accelerator, else ``self_cpu_time_total``).
        row_limit: rows in the table.
        print_to: where the table goes: ``"stdout"``, a file, a ``logging.Logger``
            (at INFO), or None for nowhere (it is still in ``p.table``).
        profiler_kwargs: passed to ``torch.profiler.profile`` (``with_flops=True``, ...).

    Yields:
        A :class:`Profile`.

    Raises:
        ValueError: ``steps < 1``, ``wait < 0`` or ``warmup < 1``.
    """
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1 recorded iteration, not {steps}")
    if wait < 0 or warmup < 1:
        raise ValueError(
            f"profile needs wait >= 0 and warmup >= 1 (got wait={wait}, warmup={warmup}): "
            "without a warm-up step the profiler's start-up cost lands in the recorded steps."
        )
    from torch.profiler import ProfilerActivity, schedule

    activities, kind = _activities(device)
    key = sort_by or ("self_device_time_total" if kind else "self_cpu_time_total")
    trace = None if path is None else Path(path)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
    holder: list[Profile] = []

    def on_ready(prof: torch.profiler.profile) -> None:
        p = holder[0]
        if trace is not None:
            prof.export_chrome_trace(str(trace))
            p.trace_written = True
        p.idle = _idle_from(prof, trace)
        p.table = prof.key_averages().table(sort_by=key, row_limit=row_limit)

    plan = None if steps is None else schedule(wait=wait, warmup=warmup, active=steps, repeat=1)
    prof = torch.profiler.profile(
        activities=[ProfilerActivity.CPU, *activities],
        schedule=plan,
        on_trace_ready=on_ready,
        profile_memory=record_memory,
        record_shapes=record_shapes,
        with_stack=with_stack,
        **profiler_kwargs,
    )
    p = Profile(prof, trace, steps)
    holder.append(p)
    with prof:  # on exit torch calls on_ready, unless the schedule never reached recording
        yield p
    if not p.table:
        if steps is None:
            why = "the block ran no torch operation."
        else:
            why = (
                f"the block made {p.steps_done} step() calls, but recording starts after "
                f"wait={wait} + warmup={warmup} of them; make at least {wait + warmup + 1} "
                "(or pass wait=0)."
            )
        warnings.warn(f"ad.profile recorded nothing: {why}", RuntimeWarning, stacklevel=3)
        return
    idle = "" if p.idle is None else f"\n{p.idle.summary()}"
    _emit(print_to, f"Top ops by {key} ({kind or 'cpu'}):\n{p.table}{idle}")


def _idle_from(prof: torch.profiler.profile, trace: Path | None) -> IdleTime | None:
    """Idle time read from the trace written, or from one exported to a temporary file."""
    import tempfile

    from anydevice.measure.idle import idle_time, read_trace

    if trace is not None:
        return idle_time(read_trace(trace))
    with tempfile.TemporaryDirectory(prefix="anydevice-trace-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return idle_time(read_trace(path))


def _activities(device: DeviceLike | None) -> tuple[list[Any], str | None]:
    """The accelerator activity to record for ``device`` (none for the CPU or MPS)."""
    from torch.profiler import ProfilerActivity

    from anydevice.hardware import backends
    from anydevice.hardware.selection import device as select_device

    if device is None:
        return [], None
    kind = select_device(device).type
    name = backends.facts(kind).profiler
    activity = None if name is None else getattr(ProfilerActivity, name, None)
    if activity is None:
        return [], None
    if activity not in torch.profiler.supported_activities():
        logger.warning("this torch cannot profile %s activity; recording the CPU only", kind)
        return [], None
    return [activity], kind


def _emit(output: Output, text: str) -> None:
    if output is None:
        return
    if isinstance(output, logging.Logger):
        output.info("%s", text)
    else:
        print(text, file=sys.stdout if output == "stdout" else output)


# ----------------------------------------------------------------------------- find_syncs


@dataclass(frozen=True)
class Sync:
    """One implicit host-device synchronisation: where in your code, and the torch call."""

    op: str  #: the torch function your code called, e.g. "torch.Tensor.item"
    filename: str
    lineno: int
    function: str  #: the function that contains the line
    code: str  #: the source line
    #: ``file:line in function`` of the user frames, outermost first
    stack: tuple[str, ...] = field(default=(), repr=False)

    @property
    def location(self) -> str:
        return f"{self.filename}:{self.lineno}"

    def __str__(self) -> str:
        return f"{_short(self.filename)}:{self.lineno} {self.op}: {self.code}"


@dataclass(frozen=True, repr=False)
class SyncReport:
    """What :func:`find_syncs` found.

    Without CUDA there is nothing to detect, which is not the same as "no syncs": then
    ``applicable`` is False, ``count`` is None, and reading ``syncs`` raises
    :class:`~anydevice.errors.MeasurementError` instead of returning an empty tuple.
    """

    applicable: bool
    reason: str  #: what was watched, or why nothing could be
    found: tuple[Sync, ...] = ()
    value: Any = field(default=None, compare=False)  #: what ``fn`` returned

    @property
    def syncs(self) -> tuple[Sync, ...]:
        """Every synchronisation, in the order they happened."""
        if not self.applicable:
            raise MeasurementError(
                f"find_syncs was not applicable ({self.reason}): nothing was detected because "
                "nothing could be; check report.applicable before reading report.syncs."
            )
        return self.found

    @property
    def count(self) -> int | None:
        """Synchronisations seen; None when not applicable."""
        return len(self.found) if self.applicable else None

    def by_location(self) -> list[tuple[Sync, int]]:
        """Each distinct (line, op) once, with how often it synchronised, most first."""
        syncs = self.syncs
        counts = Counter((s.filename, s.lineno, s.op) for s in syncs)
        first = {(s.filename, s.lineno, s.op): s for s in reversed(syncs)}
        return [(first[k], n) for k, n in counts.most_common()]

    def __repr__(self) -> str:
        if not self.applicable:
            return f"SyncReport(not applicable: {self.reason})"
        if not self.found:
            return f"SyncReport({self.reason}: no implicit synchronisation)"
        lines = [f"SyncReport({self.reason}: {len(self.found)} implicit synchronisation(s))"]
        lines += [f"  {n:>4}x {s}" for s, n in self.by_location()]
        return "\n".join(lines)


def find_syncs(fn: Callable[..., T], *args: Any, **kwargs: Any) -> SyncReport:
    """Run ``fn(*args, **kwargs)`` and report every implicit host-device synchronisation.

    An implicit sync (``.item()``, ``.cpu()``, ``print`` of a CUDA tensor, ``nonzero``,
    boolean-mask indexing, ``if cuda_tensor:``, a blocking copy) stalls the host until the
    GPU drains its queue. This runs ``fn`` under ``torch.cuda.set_sync_debug_mode("warn")``,
    collects the warnings it raises, and names for each one the line in your code (the
    innermost frame outside torch and the standard library) and the torch function that
    line called. The previous debug mode and warning settings are restored afterwards,
    also when ``fn`` raises.

    Limits (torch's): explicit ``torch.cuda.synchronize()`` is not reported, nor syncs
    inside ``torch.distributed`` and ``torch.sparse``. The debug mode is process-wide: do
    not run CUDA work in other threads meanwhile.

    Without CUDA there is nothing to detect: ``fn`` still runs, and the report says "not
    applicable" (``applicable`` is False, ``count`` None) rather than listing no syncs.

    >>> find_syncs(lambda: 1 + 1).value
    2

    Returns:
        A :class:`SyncReport`; ``value`` is what ``fn`` returned.
    """
    from anydevice.hardware.backends.base import current_if_initialized

    watcher = _sync_watcher()
    if isinstance(watcher, str):
        return SyncReport(False, watcher, (), fn(*args, **kwargs))
    found: list[Sync] = []
    calls = _CallStack()
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=_SYNC_TEXT, category=UserWarning)
        show = warnings.showwarning

        def record(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   file: TextIO | None = None, line: str | None = None) -> None:  # fmt: skip
            if _SYNC_TEXT in str(message):
                found.append(_sync_from_stack(traceback.extract_stack()[:-1], calls.current()))
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        with watcher.sync_debug(), calls:
            value = fn(*args, **kwargs)
    where = current_if_initialized(watcher.kind) or watcher.kind
    return SyncReport(True, f"watched {where}", tuple(found), value)


def _sync_watcher() -> Backend | str:
    """The backend whose sync debug mode watches this process (the first kind, in
    ``"auto"``'s order, whose facts say it has one: CUDA), or why none can."""
    from anydevice.hardware import backends

    reasons = []
    for kind in backends.accelerators():
        if backends.facts(kind).sync_debug:
            backend = backends.get(kind)
            reason = backend.sync_debug_unavailable()
            if reason is None:
                return backend
            reasons.append(reason)
    return reasons[0] if reasons else "no device kind torch knows here has a sync debug mode"


class _CallStack(torch.overrides.TorchFunctionMode):
    """Remembers the torch function user code is inside (the outermost one)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def current(self) -> str | None:
        return self.calls[-1] if self.calls else None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = torch.overrides.resolve_name(func) or getattr(func, "__qualname__", repr(func))
        self.calls.append(name)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.calls.pop()


def _library_test() -> Callable[[str], bool]:
    """Whether a frame's file is torch, anydevice or the standard library (not user code).

    Installed packages are user code here: they call torch like a script does, even where
    site-packages sits inside the standard library's folder (pyenv, system Pythons).
    """
    import sysconfig

    paths = sysconfig.get_paths()
    anydevice_folder = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = (
        os.path.join(os.path.dirname(torch.__file__ or ""), ""),
        os.path.join(anydevice_folder, ""),
    )
    std = tuple(os.path.join(paths[k], "") for k in ("stdlib", "platstdlib"))
    packages = tuple(os.path.join(paths[k], "") for k in ("purelib", "platlib"))

    def is_library(filename: str) -> bool:
        if filename.startswith(("<frozen", *ours)):
            return True
        return filename.startswith(std) and not filename.startswith(packages)

    return is_library


def _sync_from_stack(stack: list[traceback.FrameSummary], op: str | None) -> Sync:
    is_library = _library_test()
    user = [f for f in stack if not is_library(f.filename)]
    frames = user or list(stack)
    here = frames[-1]
    return Sync(
        op=op or "(unknown torch call)",
        filename=here.filename,
        lineno=here.lineno or 0,
        function=here.name,
        code=(here.line or "").strip(),
        stack=tuple(f"{f.filename}:{f.lineno} in {f.name}" for f in frames),
    )


def _short(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if rel.startswith("..") else rel


# ----------------------------------------------------------------------------- nvtx_range


class nvtx_range(contextlib.ContextDecorator):
    """An NVTX range for Nsight Systems, as a context manager or a decorator.

    Shows ``name`` on the timeline of ``nsys profile`` around the block (host-side: when
    the CPU issued the work). Where torch has no NVTX (a CPU-only build) it does nothing,
    so it can stay in code that also runs on other devices.

    Applying it never asks whether CUDA is available: that question runs ``cuInit``,
    after which ``ad.restrict_visible`` is refused and ``fork`` is unsafe, and a decorator
    is applied at import time. NVTX needs no GPU and no CUDA context (without a profiler
    attached a range costs a function call), so whether torch was built with it is all
    there is to decide, and that costs nothing.

    >>> @nvtx_range("forward")
    ... def forward(x):
    ...     return x * 2
    >>> forward(3)
    6
    >>> with nvtx_range("data"):
    ...     pass
    """

    def __init__(self, name: str) -> None:
        from anydevice.hardware.backends.cuda import nvtx  # NVTX is NVIDIA's

        self.name = name
        self._nvtx = nvtx()
        self.active = self._nvtx is not None  #: NVTX is in this torch

    def __enter__(self) -> nvtx_range:
        if self._nvtx is not None:
            self._nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._nvtx is not None:
            self._nvtx.range_pop()

    def __repr__(self) -> str:
        return (
            f"nvtx_range({self.name!r}{'' if self.active else ', inactive: no NVTX in this torch'})"
        )
