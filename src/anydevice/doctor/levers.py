"""What each lever buys on a device, from interleaved A/B timings with a spread.

Each lever times its workload without and with the technique, alternating samples
(:func:`anydevice.doctor.budget.sized` with two variants), and turns the pairs into a
:class:`~anydevice.doctor.results.Lever`: a speed-up, its spread, and a verdict that says
"use" or "slower" only when the whole spread is on one side of 1x. The levers: pinned host
memory and a copy overlapped with compute (CUDA), reduced-precision fp32 matmuls
(``ad.fast_matmul``), mixed precision (``ad.precision``), and channels_last convolutions
(``ad.channels_last``; the inputs stay NCHW, as the API docs say they may).

Every branch runs on any device: on a CPU, "pinned" memory is plain memory and the side
stream is the current thread, so the GPU branches are exercised by the CPU test suite.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from anydevice.doctor.budget import Deadline, Timed, compare, sized
from anydevice.doctor.results import Lever
from anydevice.doctor.workloads import (
    Run,
    Step,
    copy_call,
    math_mode,
    matmul_call,
    mlp,
    powers,
    reached,
    threads_set,
    train_call,
)
from anydevice.feeding.streams import stream_device
from anydevice.hardware.backends import facts, runtime
from anydevice.hardware.facts import DeviceInfo, format_bytes
from anydevice.measure.clocks import clock_for
from anydevice.numerics.matmul import strict_fp32
from anydevice.numerics.precision import Precision

__all__ = ["lever_steps"]


def lever_steps(info: DeviceInfo, kind: str, run: Run) -> list[tuple[str, float, Step]]:
    """The lever steps of one device, each with its weight in the time budget."""
    steps: list[tuple[str, float, Step]] = [
        ("fast_matmul", 1.0, functools.partial(_fast_matmul_lever, info, kind, run))
    ]
    backend = runtime(kind)
    if backend.pins_surely:  # host-to-device copies that pinning and streams speed up
        steps.append(("pinned memory", 1.0, functools.partial(_pinned_lever, info, run)))
        steps.append(("non_blocking overlap", 1.0, functools.partial(_overlap_lever, info, run)))
    steps.append(("training step", 2.0, functools.partial(_step_comparison, info, kind, run)))
    if backend.is_host:
        steps.append(("threads", 2.0, functools.partial(_threads_lever, info, run)))
    else:  # on the CPU the comparison's step is already compute-bound
        steps.append(("autocast", 1.5, functools.partial(_autocast_lever, info, run)))
    steps.append(("channels_last", 2.0, functools.partial(_channels_last_lever, info, kind, run)))
    return steps


def _lever(info: DeviceInfo, name: str, title: str, workload: str, how: str,
           timed: Timed) -> Lever:  # fmt: skip
    c = compare(timed.times[0], timed.times[1])
    return Lever(
        info.spec,
        name,
        title,
        workload,
        how,
        timed.median(0),
        timed.median(1),
        low=c.low,
        high=c.high,
        noisy=c.noisy,
        pairs=c.pairs,
    )


def _fast_matmul_lever(info: DeviceInfo, kind: str, run: Run, slot: Deadline) -> None:
    backend = runtime(kind)
    largest = run.plan.cpu_matmul if backend.is_host else run.plan.gpu_matmul
    title = "reduced-precision fp32 matmuls"
    tf32 = facts(kind).tf32
    if tf32 and info.tf32:
        how = "with ad.fast_matmul(): ... (TF32 matmuls and convolutions: ~1e-3 relative error)."
        fast = "tf32"
    elif backend.is_host and info.bf16:
        how = 'with ad.fast_matmul("medium"): ... (fp32 matmuls computed in bf16: ~1e-2 error).'
        fast = "fp32-medium"
    else:
        cc = info.compute_capability
        note = (f"no TF32 on compute capability {cc[0]}.{cc[1]} (needs 8.0)"
                if tf32 and cc else
                f"no TF32 or bf16 matmul units for fp32 math on {info.spec}")  # fmt: skip
        run.levers.append(Lever(info.spec, "fast-matmul", title, "", "", note=note))
        return
    dev = info.torch_device

    timed = sized(
        lambda n: (matmul_call(dev, "fp32", n), matmul_call(dev, "fp32", n)),
        powers(64, largest),
        slot,
        device=dev,
        sample=run.plan.sample,
        work=lambda k: float(k) ** 3,
        settings=(functools.partial(math_mode, "fp32"), functools.partial(math_mode, fast)),
    )
    n = timed.size
    workload = reached(f"a {n}x{n} fp32 matmul", timed.capped)
    run.levers.append(_lever(info, "fast-matmul", title, workload, how, timed))


def _pinned_lever(info: DeviceInfo, run: Run, slot: Deadline) -> None:
    dev = info.torch_device
    sizes = [s * 2**20 for s in powers(1, run.plan.copy_mib)]
    timed = sized(
        lambda s: (copy_call(dev, "h2d", False, s), copy_call(dev, "h2d", True, s)),
        sizes,
        slot,
        device=dev,
        sample=run.plan.sample,
    )
    run.levers.append(
        _lever(
            info,
            "pinned-memory",
            "pinned host memory",
            reached(f"a {format_bytes(timed.size)} host -> device copy", timed.capped),
            "DataLoader(..., pin_memory=True), or ad.DeviceLoader (pins off the main thread).",
            timed,
        )
    )


class _Streams:
    """A side stream where the device has streams (its backend's); elsewhere the current
    thread, so the branch runs anywhere."""

    def __init__(self, dev: torch.device) -> None:
        where = stream_device(dev)
        self.backend = runtime(dev.type)
        self.main = None if where is None else self.backend.current_stream(where)
        self.side = None if where is None else self.backend.new_stream(where)

    def on_side(self) -> contextlib.AbstractContextManager[Any]:
        if self.side is None:
            return contextlib.nullcontext()
        return self.backend.use_stream(self.side)

    def fork(self) -> None:
        if self.side is not None and self.main is not None:
            self.side.wait_stream(self.main)

    def join(self) -> None:
        if self.side is not None and self.main is not None:
            self.main.wait_stream(self.side)


def _overlap_lever(info: DeviceInfo, run: Run, slot: Deadline) -> None:
    """A copy of the next batch alongside compute on this one, against one after the other.

    The compute is as many fp32 matmuls as take about as long as the copy, so perfect
    overlap would be 2x.
    """
    dev = info.torch_device
    streams = _Streams(dev)
    timer = clock_for(dev, None)
    mm = matmul_call(dev, "fp32", min(2048, run.plan.gpu_matmul))
    calls = {"k": 1}

    def make(size: int) -> tuple[Callable[[], None], Callable[[], None]]:
        copy_ = copy_call(dev, "h2d", True, size)
        mm(), copy_()  # warm
        k = round(timer.measure(copy_, 1) / max(timer.measure(mm, 1), 1e-9))
        calls["k"] = k = min(64, max(1, k))

        def compute() -> None:
            for _ in range(k):
                mm()

        def serial() -> None:
            copy_()
            compute()

        def overlapped() -> None:
            streams.fork()
            with streams.on_side():
                copy_()
            compute()
            streams.join()

        return serial, overlapped

    sizes = [s * 2**20 for s in powers(1, run.plan.copy_mib)]
    timed = sized(make, sizes, slot, device=dev, sample=run.plan.sample)
    run.levers.append(
        _lever(
            info,
            "overlap",
            "copy on a side stream while computing",
            reached(
                f"a {format_bytes(timed.size)} pinned copy and {calls['k']} fp32 matmul(s)",
                timed.capped,
            ),
            "ad.DeviceLoader copies the next batch on a side stream (non_blocking=True).",
            timed,
        )
    )


# ----------------------------------------------------------------------------- training steps


def _mlp_pair(info: DeviceInfo, size: tuple[int, int]) -> list[Callable[[], None]]:
    """The MLP step in strict fp32 and, where the device has one, in its precision mode."""
    batch, width = size
    dev = info.torch_device
    x = torch.randn(batch, width, device=dev)
    y = torch.randn(batch, width, device=dev)
    mse = nn.functional.mse_loss
    fp32 = mlp(width, dev)
    out = [train_call(fp32, x, y, mse, Precision(info, "fp32"))]
    best = Precision(info)
    if best.mode != "fp32":
        out.append(train_call(copy.deepcopy(fp32), x, y, mse, best))
    return out


def _step_comparison(info: DeviceInfo, kind: str, run: Run, slot: Deadline) -> None:
    """The same step on every device: sized on the first one measured, then kept."""
    largest, width = run.plan.step
    batches = powers(1, largest) if run.step_size is None else [run.step_size[0]]
    width = width if run.step_size is None else run.step_size[1]
    dev = info.torch_device
    with strict_fp32():
        timed = sized(lambda b: _mlp_pair(info, (b, width)), batches, slot, device=dev,
                      sample=run.plan.sample)  # fmt: skip
    if run.step_size is None:
        run.step_size = (timed.size, width)
    run.steps[info.spec] = {"fp32": (timed.median(0), "fp32")}
    p = Precision(info)
    if len(timed.times) > 1:
        run.steps[info.spec]["best"] = (timed.median(1), p.mode)
    if runtime(kind).is_host:  # the comparison's step is the autocast lever on the CPU
        _add_autocast(info, (timed.size, width), timed, p, run)


def _threads_lever(info: DeviceInfo, run: Run, slot: Deadline) -> None:
    """On a busy machine: the training step with torch's threads, and with the free cores."""
    title = "torch threads = free cores"
    threads, free = run.threads, run.free_cores
    if free is None or threads <= free:
        note = (f"torch's {threads} thread(s) fit the {free} core(s) free when the run "
                "started" if free else "the machine's load was not read")  # fmt: skip
        run.levers.append(Lever(info.spec, "threads", title, "", "", note=note))
        return
    largest, width = run.step_size or run.plan.step
    with strict_fp32():
        timed = sized(
            lambda b: 2 * _mlp_pair(info, (b, width))[:1],
            powers(1, largest),
            slot,
            device=info.torch_device,
            sample=run.plan.sample,
            settings=(
                functools.partial(threads_set, threads),
                functools.partial(threads_set, free),
            ),
        )
    batch = timed.size
    workload = (f"the MLP training step (4 x {width}, batch {batch}), {threads} thread(s) "
                f"against {free}, while other processes kept cores busy")  # fmt: skip
    how = f"torch.set_num_threads({free}) (or OMP_NUM_THREADS={free} before starting Python)"
    run.levers.append(_lever(info, "threads", title, workload, how, timed))


def _autocast_lever(info: DeviceInfo, run: Run, slot: Deadline) -> None:
    largest, width = run.plan.gpu_step
    dev = info.torch_device
    with strict_fp32():
        timed = sized(lambda b: _mlp_pair(info, (b, width)), powers(64, largest), slot,
                      device=dev, sample=run.plan.sample)  # fmt: skip
    _add_autocast(info, (timed.size, width), timed, Precision(info), run)


def _add_autocast(
    info: DeviceInfo, size: tuple[int, int], timed: Timed, p: Precision, run: Run
) -> None:
    batch, width = size
    title = f"mixed precision ({p.mode if len(timed.times) > 1 else 'none'})"
    workload = reached(f"an MLP training step (4 x {width}, batch {batch}) against strict fp32",
                       timed.capped)  # fmt: skip
    how = (f"p = ad.precision({info.spec!r}); with p.autocast(): ...; p.backward(loss); "
           "p.step(opt)")  # fmt: skip
    if len(timed.times) < 2:
        run.levers.append(Lever(info.spec, "autocast", title, workload, how, note=p.reason))
        return
    run.levers.append(_lever(info, "autocast", title, workload, how, timed))


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


def _conv_pair(info: DeviceInfo, batch: int, side: int) -> Sequence[Callable[[], None]]:
    """The conv step with NCHW weights, and with channels_last weights; NCHW inputs both."""
    dev = info.torch_device
    p = Precision(info)
    x = torch.randn(batch, 3, side, side, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    nchw = _convnet(dev)
    # Converted with torch's own call, not ad.channels_last, which converts only where it
    # expects a gain: here both layouts are timed on every device.
    nhwc = copy.deepcopy(nchw).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    ce = nn.functional.cross_entropy
    return train_call(nchw, x, y, ce, p), train_call(nhwc, x, y, ce, p)


def _channels_last_lever(info: DeviceInfo, kind: str, run: Run, slot: Deadline) -> None:
    largest, side = run.plan.conv if runtime(kind).is_host else run.plan.gpu_conv
    dev = info.torch_device
    # Smaller images first, then larger batches: an emulated dtype's first call stays small.
    shapes = [(1, s) for s in powers(8, side)[:-1]] + [(b, side) for b in powers(1, largest)]
    with strict_fp32():
        timed = sized(lambda i: _conv_pair(info, *shapes[i]), range(len(shapes)), slot,
                      device=dev, sample=run.plan.sample,
                      work=lambda i: float(shapes[i][0] * shapes[i][1] ** 2))  # fmt: skip
    batch, side = shapes[timed.size]
    workload = (f"a 3-conv training step on {batch} x 3 x {side} x {side} NCHW images, "
                f"{Precision(info).mode}")  # fmt: skip
    run.levers.append(
        _lever(
            info,
            "channels-last",
            "channels_last (NHWC) convolutions",
            reached(workload, timed.capped),
            "model = ad.channels_last(model) (inputs may stay NCHW: the first convolution's "
            "output follows its weight's layout).",
            timed,
        )
    )
