"""What this machine's devices do, measured: the numbers ``anydevice doctor`` reports.

For each device: matmul throughput per dtype, memory copy bandwidth and, for GPUs, host to
device and device to host bandwidth from pageable and from pinned memory, each set against
the device's peak where it is known (:mod:`anydevice.doctor.peaks`). Then the levers: what
pinned memory, non_blocking overlap, autocast, ``fast_matmul`` and ``channels_last`` buy
*here*, each a measured speed-up with a verdict and the line that turns it on. Last, one
small training step run on every device, for a side-by-side table and a line of advice.

Every timing is :func:`anydevice.timeit` (warm-up, autorange, CUDA events on GPUs) and
its median is used. Sizes come from a :class:`Plan`: ``quick``, ``default`` or ``full``.
A measurement that fails (a GPU out of memory because another process holds it) becomes a
note; the others still run.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from anydevice.doctor.peaks import gpu_peak, pcie_peak
from anydevice.inventory import DeviceInfo, Inventory, format_bytes
from anydevice.matmul import MathSettings, _legacy_on_purpose, fast_matmul
from anydevice.precision import Precision
from anydevice.timing import format_time, timeit

__all__ = ["PLANS", "DeviceSummary", "Lever", "Measured", "Measurements", "Plan", "measure"]

Verdict = Literal["use", "no-gain", "slower", "n/a"]
_USE = 1.10  #: a lever that saves at least 10 % is worth turning on
_SLOWER = 0.95  #: one that costs more than 5 % is worth leaving off


@dataclass(frozen=True)
class Plan:
    """How long and how big: the sizes each measurement uses."""

    name: str
    min_time: float  #: seconds of samples per timing
    copy_mib: int  #: MiB per host-device copy and per memory copy
    cpu_matmul: int  #: n of the n x n matmul on a CPU
    gpu_matmul: int  #: n of the n x n matmul on an accelerator
    step: tuple[int, int]  #: (batch, width) of the training step run on every device
    gpu_step: tuple[int, int]  #: (batch, width) of the autocast lever's step on accelerators
    conv: tuple[int, int]  #: (batch, image side) of the channels_last lever on a CPU
    gpu_conv: tuple[int, int]  #: the same on an accelerator
    every_gpu: bool = False  #: measure every GPU, not one of each model


PLANS: dict[str, Plan] = {
    "quick": Plan("quick", 0.05, 64, 512, 4096, (128, 512), (2048, 2048), (8, 32), (64, 64)),
    "default": Plan(
        "default", 0.5, 256, 2048, 8192, (256, 1024), (4096, 4096), (16, 64), (128, 128)
    ),
    "full": Plan(
        "full", 1.0, 1024, 2048, 16384, (512, 2048), (8192, 8192), (32, 128), (256, 224), True
    ),
}


@dataclass(frozen=True)
class Measured:
    """One number measured on one device, with its unit and, where known, its peak."""

    device: str  #: "cpu", "cuda:0"
    name: str  #: stable id: "matmul-bf16", "memory-copy", "h2d-pinned", ...
    title: str  #: what was measured, for people
    value: float
    unit: str  #: "GFLOP/s" or "GB/s"
    peak: float | None = None  #: the device's best, in ``unit``
    peak_source: str = ""  #: where ``peak`` comes from
    detail: str = ""  #: sizes and timing
    noisy: bool = False  #: the samples spread widely (another process was busy)

    @property
    def fraction(self) -> float | None:
        """``value`` as a share of ``peak``."""
        return self.value / self.peak if self.peak else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fraction": self.fraction}

    def __repr__(self) -> str:
        peak = f", {self.fraction:.0%} of {self.peak_source}" if self.fraction else ""
        return f"Measured({self.device} {self.name}: {self.value:.4g} {self.unit}{peak})"


@dataclass(frozen=True)
class Lever:
    """What one technique buys on one device: time per operation without it and with it."""

    device: str
    name: str  #: "pinned-memory", "overlap", "autocast", "fast-matmul", "channels-last"
    title: str
    workload: str  #: what was timed
    how: str  #: the code that turns it on
    baseline: float | None = None  #: seconds per operation without the lever
    lever: float | None = None  #: seconds per operation with it
    note: str = ""  #: why it does not apply here, when it does not

    @property
    def speedup(self) -> float | None:
        if self.baseline is None or not self.lever:
            return None
        return self.baseline / self.lever

    @property
    def verdict(self) -> Verdict:
        s = self.speedup
        if s is None:
            return "n/a"
        return "use" if s >= _USE else "slower" if s < _SLOWER else "no-gain"

    @property
    def advice(self) -> str:
        s = self.speedup
        if s is None:
            return self.note
        if self.verdict == "use":
            return f"{s:.2f}x faster here: {self.how}"
        if self.verdict == "slower":
            return f"{s:.2f}x, slower here: leave it off on {self.device}."
        return f"{s:.2f}x, no gain here: not worth the change on {self.device}."

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "unit": "s",
            "speedup": self.speedup,
            "verdict": self.verdict,
            "advice": self.advice,
        }


@dataclass(frozen=True)
class DeviceSummary:
    """One device's row of the side-by-side table."""

    device: str
    name: str
    step_fp32: float | None  #: seconds per training step in fp32
    step_best: float | None  #: seconds per step in the device's precision mode
    mode: str  #: that mode ("bf16", "fp16", "fp32")
    matmul_fp32: float | None  #: GFLOP/s
    matmul_best: float | None  #: GFLOP/s in the fastest dtype
    best_dtype: str
    memory: float | None  #: GB/s, memory copy
    h2d: float | None  #: GB/s, host to device from pinned memory
    vs_cpu: float | None  #: how many times faster its step is than the CPU's

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Measurements:
    """Everything the doctor measured: numbers, levers, the side-by-side table, advice."""

    plan: str
    seconds: float  #: wall time the measurements took
    results: tuple[Measured, ...] = ()
    levers: tuple[Lever, ...] = ()
    devices: tuple[DeviceSummary, ...] = ()
    advice: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  #: measurements that could not be made, and why
    step: str = ""  #: the training step every device ran

    def result(self, device: str, name: str) -> Measured | None:
        return _find(self.results, device, name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "seconds": self.seconds,
            "step": self.step,
            "results": [r.to_dict() for r in self.results],
            "levers": [lv.to_dict() for lv in self.levers],
            "devices": [d.to_dict() for d in self.devices],
            "advice": list(self.advice),
            "notes": list(self.notes),
        }


# ----------------------------------------------------------------------------- measuring

Progress = Callable[[int, int, str], None]  #: (steps done, steps in all, what runs next)


@dataclass
class _Run:
    """What the steps of one run collect."""

    plan: Plan
    results: list[Measured] = field(default_factory=list)
    levers: list[Lever] = field(default_factory=list)
    steps: dict[str, dict[str, tuple[float, str]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, m: Measured) -> Measured:
        self.results.append(m)
        return m

    def get(self, device: str, name: str) -> Measured | None:
        return _find(self.results, device, name)


def _find(results: Sequence[Measured], device: str, name: str) -> Measured | None:
    return next((r for r in results if r.device == device and r.name == name), None)


def measure(
    inv: Inventory,
    plan: str | Plan = "default",
    devices: Sequence[str] | None = None,
    progress: Progress | None = None,
) -> Measurements:
    """Measure every device of ``inv`` (or the ``devices`` named) with ``plan``'s sizes.

    >>> from anydevice.inventory import inventory
    >>> m = measure(inventory(kinds=("cpu",)), "quick")
    >>> m.result("cpu", "matmul-fp32").unit, m.result("cpu", "matmul-fp32").value > 0
    ('GFLOP/s', True)

    Args:
        inv: the machine.
        plan: ``"quick"``, ``"default"``, ``"full"``, or a :class:`Plan`.
        devices: device specs to measure (``["cpu", "cuda:1"]``). Default: the CPU and one
            GPU of each model (every GPU with ``full``).
        progress: called before each step with (steps done, steps in all, title).

    Raises:
        ValueError: an unknown plan, or a device spec that is not in ``inv``.
    """
    p = PLANS[plan] if isinstance(plan, str) and plan in PLANS else plan
    if not isinstance(p, Plan):
        raise ValueError(f"plan={plan!r}: use one of {', '.join(PLANS)}.")
    chosen = _choose(inv, devices, p)
    run = _Run(p)
    steps = [step for info in chosen for step in _steps(info, run)]
    start = time.perf_counter()
    for done, (title, fn) in enumerate(steps):
        if progress is not None:
            progress(done, len(steps), title)
        try:
            fn()
        except Exception as e:  # one failed measurement must not cost the others
            run.notes.append(f"{title}: not measured ({type(e).__name__}: {_first_line(e)})")
        finally:
            _release()
    if progress is not None:
        progress(len(steps), len(steps), "done")
    summaries = _summaries(chosen, run)
    batch, width = p.step
    return Measurements(
        plan=p.name,
        seconds=time.perf_counter() - start,
        results=tuple(run.results),
        levers=tuple(run.levers),
        devices=summaries,
        advice=_advice(inv, summaries, run),
        notes=tuple(run.notes),
        step=f"MLP training step: 4 layers of {width}, batch {batch}, SGD",
    )


def _choose(inv: Inventory, specs: Sequence[str] | None, plan: Plan) -> list[DeviceInfo]:
    if specs is not None:
        known = {d.spec: d for d in inv.devices}
        missing = [s for s in specs if s not in known]
        if missing:
            raise ValueError(
                f"No device {', '.join(map(repr, missing))} here; the devices are "
                f"{', '.join(known)}. Run `anydevice info` to see them."
            )
        return [known[s] for s in specs]
    chosen, models = [], set()
    for d in inv.devices:
        if d.kind != "cpu" and not plan.every_gpu:
            if (d.kind, d.name) in models:
                continue  # identical to one already measured
            models.add((d.kind, d.name))
        chosen.append(d)
    return chosen


def _steps(info: DeviceInfo, run: _Run) -> list[tuple[str, Callable[[], None]]]:
    spec, plan = info.spec, run.plan
    cuda = info.kind == "cuda"
    n = plan.cpu_matmul if info.kind == "cpu" else plan.gpu_matmul
    steps: list[tuple[str, Callable[[], None]]] = []

    def add(title: str, fn: Callable[[], None]) -> None:
        steps.append((f"{spec}: {title}", fn))

    for dtype in _dtypes(info):
        add(f"matmul {dtype}", functools.partial(_matmul, info, dtype, n, run))
    add("memory copy", lambda: _memory_copy(info, run))
    if info.kind != "cpu":
        for direction in ("h2d", "d2h"):
            for pinned in (False, True) if cuda else (False,):
                add(
                    f"{direction} {'pinned' if pinned else 'pageable'}",
                    functools.partial(_transfer, info, direction, pinned, run),
                )
    add("fast_matmul", lambda: _fast_matmul_lever(info, n, run))
    if cuda:
        add("pinned memory", lambda: _pinned_lever(info, run))
        add("non_blocking overlap", lambda: _overlap_lever(info, run))
    add("training step", lambda: _step_comparison(info, run))
    if info.kind != "cpu":  # on the CPU the comparison's step is already compute-bound
        add("autocast", lambda: _autocast_lever(info, plan.gpu_step, run))
    add("channels_last", lambda: _channels_last_lever(info, run))
    return steps


def _dtypes(info: DeviceInfo) -> list[str]:
    if info.kind == "cpu":
        return ["fp32", "bf16"]
    if info.kind == "cuda":
        out = ["fp32"]
        if info.tf32:
            out.append("tf32")
        if info.bf16:
            out.append("bf16")
        return [*out, "fp16"]
    return ["fp32", "fp16"] + (["bf16"] if info.bf16 else [])


_TORCH_DTYPE = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """fp32 matmuls in full fp32 (no TF32, no bf16) inside the block; settings restored.

    cuDNN's flag is left alone: writing it would lose torch's initial conv/RNN state, which
    no setter can put back (see :mod:`anydevice.matmul`), and no matmul reads it.
    """
    saved = MathSettings.capture()
    try:
        with _legacy_on_purpose():
            torch.set_float32_matmul_precision("highest")
        yield
    finally:
        saved.restore()


def _math(dtype: str) -> contextlib.AbstractContextManager[Any]:
    if dtype == "tf32":
        return fast_matmul("high")
    if dtype == "fp32-medium":
        return fast_matmul("medium")
    return strict_fp32() if dtype == "fp32" else contextlib.nullcontext()


def _matmul_time(info: DeviceInfo, dtype: str, n: int, min_time: float) -> tuple[float, bool]:
    dev = info.torch_device
    torch_dtype = _TORCH_DTYPE.get(dtype, torch.float32)
    a = torch.randn(n, n, device=dev, dtype=torch_dtype)
    b = torch.randn(n, n, device=dev, dtype=torch_dtype)
    out = torch.empty(n, n, device=dev, dtype=torch_dtype)
    with _math(dtype):
        mm = functools.partial(torch.mm, a, b, out=out)
        m = timeit(mm, min_time=min_time, device=dev, label=f"mm {dtype}")
    return m.median, m.noisy


def _matmul(info: DeviceInfo, dtype: str, n: int, run: _Run) -> None:
    seconds, noisy = _matmul_time(info, dtype, n, run.plan.min_time)
    peaks = gpu_peak(info)
    peak = peaks.tflops.get(dtype) if peaks else None
    run.add(
        Measured(
            info.spec,
            f"matmul-{dtype}",
            f"matmul {dtype}" + (" (TF32 off)" if dtype == "fp32" and info.kind == "cuda" else ""),
            2 * n**3 / seconds / 1e9,
            "GFLOP/s",
            peak * 1000 if peak else None,
            f"{peaks.model} dense {dtype} peak" if peaks and peak else "",
            f"{n}x{n} @ {n}x{n}, {format_time(seconds)} per matmul",
            noisy,
        )
    )


def _memory_copy(info: DeviceInfo, run: _Run) -> None:
    size = run.plan.copy_mib * 2**20
    dev = info.torch_device
    src = torch.ones(size // 4, device=dev)
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    m = timeit(copy, min_time=run.plan.min_time, device=dev, label="memory copy")
    peaks = gpu_peak(info)
    run.add(
        Measured(
            info.spec,
            "memory-copy",
            "memory copy (read + write)",
            2 * size / m.median / 1e9,
            "GB/s",
            peaks.memory_gbps if peaks else None,
            f"{peaks.model} memory bandwidth" if peaks else "",
            f"{format_bytes(size)} copied, {format_time(m.median)} per copy",
            m.noisy,
        )
    )


def _transfer(info: DeviceInfo, direction: str, pinned: bool, run: _Run) -> None:
    size = run.plan.copy_mib * 2**20
    dev = info.torch_device
    host = torch.ones(size, dtype=torch.uint8, pin_memory=pinned)
    on_device = torch.empty(size, dtype=torch.uint8, device=dev)
    if direction == "h2d":
        fn = functools.partial(on_device.copy_, host, non_blocking=pinned)
    else:
        fn = functools.partial(host.copy_, on_device, non_blocking=pinned)
    m = timeit(fn, min_time=run.plan.min_time, device=dev, label=f"{direction} copy")
    link = pcie_peak(info.pcie_generation, info.pcie_width)
    memory = "pinned" if pinned else "pageable"
    arrow = "host -> device" if direction == "h2d" else "device -> host"
    run.add(
        Measured(
            info.spec,
            f"{direction}-{memory}",
            f"{arrow}, {memory} memory",
            size / m.median / 1e9,
            "GB/s",
            link,
            f"PCIe Gen{info.pcie_generation} x{info.pcie_width} one-way peak" if link else "",
            f"{format_bytes(size)} per copy, {format_time(m.median)}",
            m.noisy,
        )
    )


# ----------------------------------------------------------------------------- levers


def _pinned_lever(info: DeviceInfo, run: _Run) -> None:
    pageable, pinned = run.get(info.spec, "h2d-pageable"), run.get(info.spec, "h2d-pinned")
    size = run.plan.copy_mib * 2**20
    run.levers.append(
        Lever(
            info.spec,
            "pinned-memory",
            "pinned host memory",
            f"a {format_bytes(size)} host -> device copy",
            "DataLoader(..., pin_memory=True), or ad.DeviceLoader (pins off the main thread).",
            size / pageable.value / 1e9 if pageable else None,
            size / pinned.value / 1e9 if pinned else None,
            "" if pageable and pinned else "the copies were not measured",
        )
    )


def _overlap_lever(info: DeviceInfo, run: _Run) -> None:
    """A copy of the next batch alongside compute on this one, against one after the other.

    The compute is as many 2048 x 2048 matmuls as take about as long as the copy, so
    perfect overlap would be 2x.
    """
    dev = info.torch_device
    size = run.plan.copy_mib * 2**20
    src = torch.ones(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    a = torch.randn(2048, 2048, device=dev)
    b = torch.randn(2048, 2048, device=dev)
    out = torch.empty_like(a)
    t = run.plan.min_time
    copy = timeit(functools.partial(dst.copy_, src, non_blocking=True), min_time=t, device=dev)
    mm = timeit(functools.partial(torch.mm, a, b, out=out), min_time=t, device=dev)
    k = max(1, round(copy.median / mm.median))
    main = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)

    def compute() -> None:
        for _ in range(k):
            torch.mm(a, b, out=out)

    def serial() -> None:
        dst.copy_(src, non_blocking=True)
        compute()

    def overlapped() -> None:
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        compute()
        main.wait_stream(side)

    run.levers.append(
        Lever(
            info.spec,
            "overlap",
            "copy on a side stream while computing",
            f"a {format_bytes(size)} pinned copy and {k} fp32 2048^3 matmul(s)",
            "ad.DeviceLoader copies the next batch on a side stream (non_blocking=True).",
            timeit(serial, min_time=t, device=dev).median,
            timeit(overlapped, min_time=t, device=dev).median,
        )
    )


def _fast_matmul_lever(info: DeviceInfo, n: int, run: _Run) -> None:
    how = "with ad.fast_matmul(): ... (TF32 matmuls and convolutions: ~1e-3 relative error)."
    fp32 = run.get(info.spec, "matmul-fp32")
    baseline = 2 * n**3 / fp32.value / 1e9 if fp32 else None
    lever: float | None = None
    note = ""
    if info.kind == "cuda":
        tf32 = run.get(info.spec, "matmul-tf32")
        if tf32:
            lever = 2 * n**3 / tf32.value / 1e9
        else:
            cc = info.compute_capability
            note = f"no TF32 on compute capability {cc[0]}.{cc[1]} (needs 8.0)" if cc else ""
    elif info.kind == "cpu" and info.bf16:
        how = 'with ad.fast_matmul("medium"): ... (fp32 matmuls computed in bf16: ~1e-2 error).'
        lever, _ = _matmul_time(info, "fp32-medium", n, run.plan.min_time)
    else:
        note = f"no TF32 or bf16 matmul units for fp32 math on {info.spec}"
    run.levers.append(
        Lever(
            info.spec,
            "fast-matmul",
            "reduced-precision fp32 matmuls",
            f"a {n}x{n} fp32 matmul",
            how,
            baseline if lever else None,
            lever,
            note,
        )
    )


def _mlp(width: int, device: torch.device) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(nn.LayerNorm(width), *layers).to(device)


def _train_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    p: Precision,
) -> float:
    """Seconds per SGD training step of ``model`` on ``(x, y)`` in ``p``'s precision."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with p.autocast():
            loss = loss_fn(model(x).float(), y)
        p.backward(loss)
        p.step(opt)

    return timeit(step, min_time=0.0, warmup=2, repeat=5, device=x.device).median


def _mlp_times(info: DeviceInfo, size: tuple[int, int]) -> tuple[float, float | None, Precision]:
    batch, width = size
    dev = info.torch_device
    model = _mlp(width, dev)
    x = torch.randn(batch, width, device=dev)
    y = torch.randn(batch, width, device=dev)
    best = Precision(info)
    mse = nn.functional.mse_loss
    with strict_fp32():
        fp32 = _train_step(model, x, y, mse, Precision(info, "fp32"))
    if best.mode == "fp32":
        return fp32, None, best
    return fp32, _train_step(model, x, y, mse, best), best


def _step_comparison(info: DeviceInfo, run: _Run) -> None:
    fp32, best, p = _mlp_times(info, run.plan.step)
    run.steps[info.spec] = {"fp32": (fp32, "fp32")}
    if best is not None:
        run.steps[info.spec]["best"] = (best, p.mode)
    if info.kind == "cpu":  # the comparison's step is the autocast lever on the CPU
        _add_autocast(info, run.plan.step, fp32, best, p, run)


def _autocast_lever(info: DeviceInfo, size: tuple[int, int], run: _Run) -> None:
    fp32, best, p = _mlp_times(info, size)
    _add_autocast(info, size, fp32, best, p, run)


def _add_autocast(
    info: DeviceInfo,
    size: tuple[int, int],
    fp32: float,
    best: float | None,
    p: Precision,
    run: _Run,
) -> None:
    batch, width = size
    run.levers.append(
        Lever(
            info.spec,
            "autocast",
            f"mixed precision ({p.mode if best is not None else 'none'})",
            f"an MLP training step (4 x {width}, batch {batch}) against strict fp32",
            f"p = ad.precision({info.spec!r}); with p.autocast(): ...; p.backward(loss); "
            "p.step(opt)",
            fp32 if best is not None else None,
            best,
            "" if best is not None else p.reason,
        )
    )


def _convnet(device: torch.device) -> nn.Module:
    def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 64, 1),
        *block(64, 128, 2),
        *block(128, 128, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    ).to(device)


def _channels_last_lever(info: DeviceInfo, run: _Run) -> None:
    batch, side = run.plan.conv if info.kind == "cpu" else run.plan.gpu_conv
    dev = info.torch_device
    p = Precision(info)
    x = torch.randn(batch, 3, side, side, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    times = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        # Converted by hand, not with ad.channels_last, which converts only where it
        # expects a gain: here both layouts are timed on every device.
        model = _convnet(dev).to(memory_format=fmt)  # type: ignore[call-overload]
        xs = x.contiguous(memory_format=fmt)
        times.append(_train_step(model, xs, y, nn.functional.cross_entropy, p))
    run.levers.append(
        Lever(
            info.spec,
            "channels-last",
            "channels_last (NHWC) convolutions",
            f"a 3-conv training step on {batch} x 3 x {side} x {side} images, {p.mode}",
            "model = ad.channels_last(model); feed x.contiguous(memory_format=torch.channels_last)",
            times[0],
            times[1],
        )
    )


# ----------------------------------------------------------------------------- the table


def _summaries(chosen: Sequence[DeviceInfo], run: _Run) -> tuple[DeviceSummary, ...]:
    def best_of(step: dict[str, tuple[float, str]]) -> tuple[float, str]:
        return min(step.values())

    cpu_step = next((best_of(run.steps[d.spec])[0] for d in chosen if d.kind == "cpu"
                     and d.spec in run.steps), None)  # fmt: skip
    rows = []
    for d in chosen:
        step = run.steps.get(d.spec)
        matmuls = [r for r in run.results if r.device == d.spec and r.name.startswith("matmul-")]
        fastest = max(matmuls, key=lambda r: r.value, default=None)
        fp32 = run.get(d.spec, "matmul-fp32")
        memory = run.get(d.spec, "memory-copy")
        h2d = run.get(d.spec, "h2d-pinned") or run.get(d.spec, "h2d-pageable")
        best, mode = best_of(step) if step else (None, "fp32")
        rows.append(
            DeviceSummary(
                d.spec,
                d.name,
                step["fp32"][0] if step else None,
                best,
                mode,
                fp32.value if fp32 else None,
                fastest.value if fastest else None,
                fastest.name.removeprefix("matmul-") if fastest else "",
                memory.value if memory else None,
                h2d.value if h2d else None,
                cpu_step / best if cpu_step and best else None,
            )
        )
    return tuple(rows)


def _advice(inv: Inventory, rows: Sequence[DeviceSummary], run: _Run) -> tuple[str, ...]:
    out: list[str] = []
    cpu = next((r for r in rows if r.device == "cpu"), None)
    others = [r for r in rows if r.device != "cpu" and r.vs_cpu]
    cores = inv.host.cores_usable or inv.host.cores_logical
    if others and cpu and cpu.step_best:
        top = max(others, key=lambda r: r.vs_cpu or 0.0)
        assert top.step_best is not None
        assert top.vs_cpu is not None
        if top.vs_cpu >= 1.5:
            out.append(
                f"Train on {top.device} ({top.name}): the same training step takes "
                f"{format_time(top.step_best)} there against {format_time(cpu.step_best)} on "
                f"the CPU ({top.vs_cpu:.0f}x faster). Keep the CPU for loading and "
                f"preprocessing data (DataLoader workers; {cores} cores here)."
            )
        else:
            out.append(
                f"{top.device} ({top.name}) runs this small step only {top.vs_cpu:.1f}x "
                "faster than the CPU: small models are launch-bound on accelerators; large "
                "models and batches gain far more."
            )
    elif cpu and cpu.step_best:
        out.append(
            f"Only the CPU here: a small training step takes {format_time(cpu.step_best)}. "
            f"Fine for small models, debugging and inference; use all {cores} usable cores "
            "(torch does by default) and keep DataLoader workers few."
        )
    for r in run.results:
        if r.name == "h2d-pinned" and r.fraction is not None and r.fraction < 0.5:
            out.append(
                f"{r.device}: host -> device copies reach {r.fraction:.0%} of the "
                f"{r.peak_source} ({r.value:.1f} of {r.peak:.1f} GB/s). Check the slot's "
                "width and the CPU socket the GPU hangs off (`nvidia-smi topo -m`; bind "
                "the process with numactl)."
            )
    for lever in run.levers:
        if lever.verdict == "use":
            out.append(f"{lever.device}: {lever.title}, {lever.advice}")
    return tuple(out)


def _release() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""
