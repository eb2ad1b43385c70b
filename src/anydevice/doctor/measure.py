"""What this machine's devices do, measured: the numbers ``anydevice doctor`` reports.

For each device: matmul throughput per dtype, memory copy bandwidth and, for GPUs, host to
device and device to host bandwidth from pageable and from pinned memory, each set against
the device's peak where it is known (:mod:`anydevice.hardware.peaks`). Then the levers
(:mod:`anydevice.doctor.levers`): what pinned memory, non_blocking overlap, autocast,
``fast_matmul`` and ``channels_last`` buy *here*. Last, one small training step run on
every device, for a side-by-side table and a line of advice.

Bounded on any hardware: a :class:`Plan` gives the run a time budget (``quick`` 10 s,
``default`` 30 s, ``full`` 3 min) and the largest sizes. Each step takes a share of the
time left, and every timing grows its problem from small sizes while the next size is
predicted to fit (:func:`anydevice.doctor.budget.sized`), so a dtype the device only
emulates is measured small, not for minutes, and becomes advice. Other processes' use of
the cores is read around every step (:mod:`anydevice.doctor.load`); numbers taken while
they were busy are marked noisy. A measurement that fails (a GPU out of memory because
another process holds it) becomes a note; the others still run.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import torch

from anydevice.doctor.budget import Budget, Deadline, sized
from anydevice.doctor.levers import lever_steps
from anydevice.doctor.load import BUSY_CORES, CpuClock, Load, loadavg
from anydevice.doctor.results import (
    QUIET,
    DeviceSummary,
    Interrupted,
    Measured,
    Measurements,
)
from anydevice.doctor.targets import choose_devices, resolve_devices
from anydevice.doctor.workloads import (
    PLANS,
    Plan,
    Progress,
    Run,
    Step,
    copy_call,
    math_mode,
    matmul_call,
    mlp,
    powers,
    reached,
    threads_set,
)
from anydevice.hardware.backends import facts, runtime
from anydevice.hardware.backends.base import META
from anydevice.hardware.facts import DeviceInfo, format_bytes
from anydevice.hardware.inventory import Inventory
from anydevice.hardware.peaks import gpu_peak, pcie_peak
from anydevice.measure.samples import format_time

__all__ = ["measure", "run_plan"]


#: Share of the budget kept back for what follows the last step (tables, advice).
_RESERVE = 0.04


def measure(
    inv: Inventory,
    plan: str | Plan = "default",
    devices: Sequence[str] | None = None,
    progress: Progress | None = None,
    *,
    budget: float | None = None,
) -> Measurements:
    """Measure every device of ``inv`` (or the ``devices`` named) within ``plan``'s budget.

    >>> from anydevice.hardware.inventory import inventory
    >>> m = measure(inventory(kinds=("cpu",)), "quick", budget=3.0)
    >>> m.result("cpu", "matmul-fp32").unit, m.result("cpu", "matmul-fp32").value > 0
    ('GFLOP/s', True)

    Args:
        inv: the machine.
        plan: ``"quick"``, ``"default"``, ``"full"``, or a :class:`Plan`.
        devices: device specs to measure, in :func:`anydevice.device`'s grammar
            (``["cpu", "cuda:1"]``). Default: the CPU and one GPU of each model (every GPU
            with ``full``).
        progress: called before each step with (steps done, steps in all, title, seconds
            of the budget left).
        budget: seconds, instead of the plan's.

    Raises:
        ValueError: an unknown plan.
        DeviceSpecError: a malformed device spec.
        DeviceNotFoundError: a spec that names no device in ``inv``.
    """
    p = PLANS[plan] if isinstance(plan, str) and plan in PLANS else plan
    if not isinstance(p, Plan):
        raise ValueError(f"plan={plan!r}: use one of {', '.join(PLANS)}.")
    if budget is not None:
        p = dataclasses.replace(p, budget=budget)
    chosen = resolve_devices(inv, devices) if devices is not None else choose_devices(inv, p)
    return run_plan(inv, chosen, p, progress)


def run_plan(
    inv: Inventory,
    chosen: Sequence[DeviceInfo],
    plan: Plan,
    progress: Progress | None = None,
    branch: Callable[[DeviceInfo], str] | None = None,
) -> Measurements:
    """Measure ``chosen`` with ``plan``; ``branch`` picks each device's steps by kind
    (default: its own kind; a CPU given ``"cuda"`` runs the GPU steps, as a smoke test)."""
    # torch's first optimizer imports torch._dynamo (seconds on a slow machine): once, here,
    # not inside the first training step's share of the budget.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    budget = Budget(plan.budget)
    run = Run(plan)
    steps: list[tuple[str, float, Step]] = []
    for info in chosen:
        kind = branch(info) if branch else info.kind
        steps += [(f"{info.spec}: {t}", w, fn) for t, w, fn in _steps(info, kind, run)]
        steps += [(f"{info.spec}: {t}", w, fn) for t, w, fn in lever_steps(info, kind, run)]
    cpu = CpuClock()
    start = cpu.read()
    time.sleep(min(0.3, plan.budget / 50))  # what the machine does before we add to it
    usable = inv.host.cores_usable or inv.host.cores_logical
    run.threads = torch.get_num_threads()
    before = Load(usable, cpu.others_since(start), run.threads)
    run.free_cores = before.free
    # On a busy machine torch's threads beyond the free cores wait for each other at every
    # parallel region: every number would measure that. The run uses the free cores (the
    # "threads" lever measures what the default costs) and says so.
    measuring_threads = before.free if before.advice else run.threads
    done = [0]
    try:
        with threads_set(measuring_threads):
            _run_steps(steps, budget, run, cpu, progress, done)
    except KeyboardInterrupt:
        # Ctrl-C: what was measured so far is the report, and the interrupt goes on
        at = f" during {steps[done[0]][0]}" if done[0] < len(steps) else ""
        run.notes.append(
            f"interrupted (Ctrl-C){at}: {done[0]} of {len(steps)} steps measured, the rest not"
        )
        raise Interrupted(_measurements(inv, chosen, plan, run, budget, cpu, start,
                                        measuring_threads, before, True)) from None  # fmt: skip
    return _measurements(inv, chosen, plan, run, budget, cpu, start, measuring_threads, before)


def _measurements(
    inv: Inventory,
    chosen: Sequence[DeviceInfo],
    plan: Plan,
    run: Run,
    budget: Budget,
    cpu: CpuClock,
    start: tuple[float, float, float],
    measuring_threads: int,
    before: Load,
    interrupted: bool = False,
) -> Measurements:
    usable = before.usable
    load = Load(usable, round(cpu.others_since(start), 2), run.threads, loadavg(),
                measuring_threads, before.free)  # fmt: skip
    summaries = _summaries(chosen, run)
    batch, width = run.step_size or plan.step
    return Measurements(
        plan=plan.name,
        seconds=budget.spent(),
        results=tuple(run.results),
        levers=tuple(run.levers),
        devices=summaries,
        advice=_advice(inv, summaries, run, load),
        notes=tuple(run.notes),
        step=f"MLP training step: 4 layers of {width}, batch {batch}, SGD",
        budget=plan.budget,
        load=load,
        interrupted=interrupted,
    )


def _run_steps(
    steps: Sequence[tuple[str, float, Step]],
    budget: Budget,
    run: Run,
    cpu: CpuClock,
    progress: Progress | None,
    finished: list[int] | None = None,
) -> None:
    """Each step in its share of the time left; failures become notes. ``finished[0]``
    counts the steps done (what an interrupt leaves measured)."""
    plan = run.plan
    weights = sum(w for _, w, _ in steps) / (1 - _RESERVE)
    for done, (title, weight, fn) in enumerate(steps):
        if finished is not None:
            finished[0] = done
        if progress is not None:
            progress(done, len(steps), title, budget.left())
        slot = budget.slot(weight / weights)
        weights -= weight
        if budget.left() <= 0:
            run.notes.append(f"{title}: not measured (the {plan.budget:g} s budget was spent)")
            continue
        mark, before = cpu.read(), (len(run.results), len(run.levers))
        try:
            fn(slot)
        except Exception as e:  # one failed measurement must not cost the others
            run.notes.append(f"{title}: not measured ({type(e).__name__}: {_first_line(e)})")
        finally:
            _release()
        if time.perf_counter() - mark[0] >= 0.2 and cpu.others_since(mark) >= BUSY_CORES:
            _mark_noisy(run, before)
    if finished is not None:
        finished[0] = len(steps)
    if progress is not None:
        progress(len(steps), len(steps), "done", budget.left())


def _mark_noisy(run: Run, before: tuple[int, int]) -> None:
    """Other processes were busy during the step: its numbers are marked."""
    busy = " (other processes were busy meanwhile)"
    for i in range(before[0], len(run.results)):
        r = run.results[i]
        run.results[i] = dataclasses.replace(r, noisy=True, busy=True, detail=r.detail + busy)
    for i in range(before[1], len(run.levers)):
        if run.levers[i].speedup is not None:
            run.levers[i] = dataclasses.replace(run.levers[i], noisy=True)


def _steps(info: DeviceInfo, kind: str, run: Run) -> list[tuple[str, float, Step]]:
    backend = runtime(kind)
    n = run.plan.cpu_matmul if backend.is_host else run.plan.gpu_matmul
    steps: list[tuple[str, float, Step]] = [
        (f"matmul {dtype}", 1.0, functools.partial(_matmul, info, dtype, n, run))
        for dtype in _dtypes(info, kind)
    ]
    steps.append(("memory copy", 0.5, functools.partial(_memory_copy, info, run)))
    if not backend.is_host:
        for direction in ("h2d", "d2h"):
            for pinned in (False, True) if backend.pins_surely else (False,):
                title = f"{direction} {'pinned' if pinned else 'pageable'}"
                steps.append(
                    (title, 0.5, functools.partial(_transfer, info, direction, pinned, run))
                )
    return steps


def _dtypes(info: DeviceInfo, kind: str) -> list[str]:
    """fp32 and every reduced dtype; on a CPU bf16 is measured even without native units,
    small (it is sized like the rest), to say how much slower its emulation is."""
    backend = runtime(kind)
    if backend.is_host:
        return ["fp32", "bf16"]
    out = ["fp32"]
    tf32 = facts(kind).tf32
    if tf32 and info.tf32:
        out.append("tf32")
    if info.bf16 or not tf32:  # a GPU without TF32 units has no bf16 ones either
        out.append("bf16")
    return [*out, "fp16"]


def _matmul(info: DeviceInfo, dtype: str, n: int, run: Run, slot: Deadline) -> None:
    dev = info.torch_device
    with math_mode(dtype):
        timed = sized(
            lambda k: (matmul_call(dev, dtype, k),),
            powers(64, n),
            slot,
            device=dev,
            sample=run.plan.sample,
            work=lambda k: float(k) ** 3,
        )
    k, seconds = timed.size, timed.median()
    peaks = gpu_peak(info)
    peak = peaks.tflops.get(dtype) if peaks else None
    shape = f"{k}x{k} @ {k}x{k}"
    run.add(
        Measured(
            info.spec,
            f"matmul-{dtype}",
            f"matmul {dtype}"
            + (" (TF32 off)" if dtype == "fp32" and facts(info.kind).tf32 else ""),
            2 * k**3 / seconds / 1e9,
            "GFLOP/s",
            peak * 1000 if peak else None,
            f"{peaks.model} dense {dtype} peak" if peaks and peak else "",
            f"{reached(shape, timed.capped)}, {format_time(seconds)} per matmul",
            timed.noisy(),
            k,
        )
    )


def _memory_copy(info: DeviceInfo, run: Run, slot: Deadline) -> None:
    dev = info.torch_device

    def make(size: int) -> tuple[Callable[[], object]]:
        src = torch.ones(size // 4, device=dev)
        if runtime(dev.type).lazy:  # XLA's copy_ makes the target alias the source
            return (functools.partial(torch.add, src, 1.0, out=torch.empty_like(src)),)
        return (functools.partial(torch.empty_like(src).copy_, src),)

    mib = 2**20
    timed = sized(make, [s * mib for s in powers(1, run.plan.copy_mib)], slot, device=dev,
                  sample=run.plan.sample)  # fmt: skip
    size, seconds = timed.size, timed.median()
    peaks = gpu_peak(info)
    run.add(
        Measured(
            info.spec,
            "memory-copy",
            "memory copy (read + write)",
            2 * size / seconds / 1e9,
            "GB/s",
            peaks.memory_gbps if peaks else None,
            f"{peaks.model} memory bandwidth" if peaks else "",
            f"{reached(format_bytes(size) + ' copied', timed.capped)}, "
            f"{format_time(seconds)} per copy",
            timed.noisy(),
            size,
        )
    )


def _transfer(info: DeviceInfo, direction: str, pinned: bool, run: Run, slot: Deadline) -> None:
    dev = info.torch_device
    sizes = [s * 2**20 for s in powers(1, run.plan.copy_mib)]
    timed = sized(lambda s: (copy_call(dev, direction, pinned, s),), sizes, slot, device=dev,
                  sample=run.plan.sample)  # fmt: skip
    size, seconds = timed.size, timed.median()
    link = pcie_peak(info.pcie_generation, info.pcie_width)
    memory = "pinned" if pinned else "pageable"
    arrow = "host -> device" if direction == "h2d" else "device -> host"
    run.add(
        Measured(
            info.spec,
            f"{direction}-{memory}",
            f"{arrow}, {memory} memory",
            size / seconds / 1e9,
            "GB/s",
            link,
            f"PCIe Gen{info.pcie_generation} x{info.pcie_width} one-way peak" if link else "",
            f"{reached(format_bytes(size) + ' per copy', timed.capped)}, {format_time(seconds)}",
            timed.noisy(),
            size,
        )
    )


# ----------------------------------------------------------------------------- the table


def _summaries(chosen: Sequence[DeviceInfo], run: Run) -> tuple[DeviceSummary, ...]:
    def best_of(step: dict[str, tuple[float, str]]) -> tuple[float, str]:
        return min(step.values())

    cpu_step = next((best_of(run.steps[d.spec])[0] for d in chosen if not d.is_accelerator
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
        flops = _step_flops(run) if step else None
        mfu_fp32, src, bad = _mfu(d, run, flops, step["fp32"][0] if step else None, "fp32")
        mfu_best, src_best, bad_best = _mfu(d, run, flops, best, mode)
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
                flops,
                mfu_fp32,
                mfu_best if mode != "fp32" else mfu_fp32,
                "; ".join(dict.fromkeys(x for x in (src, src_best) if x)),
                " ".join(dict.fromkeys(x for x in (bad, bad_best) if x)),
                d.is_accelerator,
            )
        )
    return tuple(rows)


@functools.cache
def _mlp_step_flops(batch: int, width: int) -> float:
    """FLOPs of one MLP training step, counted on the meta device (nothing runs)."""
    from anydevice.measure.flops import flops

    meta = torch.device(META.name)
    model = mlp(width, meta)
    x, y = torch.randn(batch, width, device=meta), torch.randn(batch, width, device=meta)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return float(flops(step).total)


def _step_flops(run: Run) -> float | None:
    if run.step_size is None:
        return None
    try:
        return _mlp_step_flops(*run.step_size)
    except Exception:  # counting is advice on top of the timing, never a reason to fail it
        return None


def _mfu(
    info: DeviceInfo, run: Run, flops: float | None, seconds: float | None, dtype: str
) -> tuple[float | None, str, str]:
    """The step's model FLOPs utilisation against the datasheet peak of ``dtype`` where
    the GPU is in the table, else against the matmul the doctor measured here in that
    dtype (with the same threads, in the same run): (MFU, its source, why it is invalid).
    None where neither peak is known, or where the share would exceed 100 % — a peak
    measured while other processes took cores the step then had — with the reason."""
    if not flops or not seconds:
        return None, "", ""
    rate = flops / seconds
    table = gpu_peak(info) if info.is_accelerator else None
    if table is not None and dtype in table.tflops:
        peak, source, how = table.tflops[dtype] * 1e12, f"{table.model} datasheet", ""
    else:
        measured = run.get(info.spec, f"matmul-{dtype}")
        if measured is None or not measured.value:
            return None, "", ""
        peak, source = measured.value * 1e9, f"{dtype} matmul measured here"
        how = f" (measured with {measured.conditions})" if measured.conditions else ""
    if rate > peak:
        return (
            None,
            source,
            (
                f"{info.spec}: no {dtype} MFU: the step ran at {rate / 1e9:.3g} GFLOP/s, above "
                f"the {source}, {peak / 1e9:.3g} GFLOP/s{how}, so that peak is too low (other "
                "processes took cores while it was measured); measure on a quiet machine."
            ),
        )
    return rate / peak, source, ""


def _advice(inv: Inventory, rows: Sequence[DeviceSummary], run: Run, load: Load) -> tuple[str, ...]:
    out: list[str] = []
    threads = next((lv for lv in run.levers if lv.name == "threads" and lv.speedup), None)
    if load.busy:
        measured = (f"The numbers were measured with {load.measured_with} thread(s) and are "
                    "marked busy" if load.measured_with != load.torch_threads else
                    "The numbers taken meanwhile are marked busy")  # fmt: skip
        head = (f"Other processes kept {load.others:.1f} of {load.usable} cores busy while "
                f"measuring. {measured}.")  # fmt: skip
        if threads is not None and threads.verdict == "noisy":
            # the lever's pairs spread too widely to say either way
            out.append(f"{head} Fewer torch threads than its {load.torch_threads}: "
                       f"{threads.advice}")  # fmt: skip
        elif threads is not None and threads.verdict != "use":
            # the lever measured what fewer threads buy: advice follows its verdict
            out.append(
                f"{head} Fewer torch threads than its {load.torch_threads}: "
                f"{threads.advice} Keep torch's default; measure again when the machine "
                "is quiet."
            )
        elif threads is None and load.advice:
            out.append(
                f"{head} torch runs {load.torch_threads} threads: threads beyond the free "
                f"cores wait for each other. Set {load.advice}, or measure again when the "
                "machine is quiet."
            )
        else:
            out.append(f"{head} Measure again when the machine is quiet.")
    cpu = next((r for r in rows if not r.accelerator), None)
    others = [r for r in rows if r.accelerator and r.vs_cpu]
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
        use = (f"use all {cores} usable cores (torch does by default)" if not load.busy else
               f"torch uses all {cores} usable cores by default")  # fmt: skip
        out.append(
            f"Only the CPU here: a small training step takes {format_time(cpu.step_best)}. "
            f"Fine for small models, debugging and inference; {use}, and keep DataLoader "
            "workers few."
        )
    out += [r.mfu_invalid for r in rows if r.mfu_invalid]
    out += _emulated(inv, run)
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


def _emulated(inv: Inventory, run: Run) -> list[str]:
    """A reduced dtype slower than fp32 is emulated or unsupported: keep fp32 there."""
    out = []
    for d in inv.devices:
        fp32 = run.get(d.spec, "matmul-fp32")
        for dtype in ("bf16", "fp16"):
            low = run.get(d.spec, f"matmul-{dtype}")
            if fp32 is None or low is None or low.value >= fp32.value / 2:
                continue
            native = d.bf16 if dtype == "bf16" else None
            ratio = fp32.value / low.value
            numbers = f"{low.value:.3g} against {fp32.value:.3g} GFLOP/s"
            if fp32.noisy or low.noisy:  # one noisy reading each: no factor to quote
                if native is False:  # the CPU's flags say so, whatever the timings
                    out.append(
                        f"{dtype} is emulated on {d.spec} (no native {dtype} units): keep "
                        f"fp32 there; ad.precision({d.spec!r}) does. How much slower is "
                        f"noisy here ({numbers}): {QUIET}."
                    )
                else:
                    out.append(
                        f"{dtype} matmuls measured slower than fp32 on {d.spec} ({numbers}), "
                        f"but the readings are noisy: {QUIET}."
                    )
                continue
            head = (f"{dtype} is emulated on {d.spec}: {ratio:.0f}x slower than fp32 here"
                    if native is False else
                    f"{dtype} is {ratio:.0f}x slower than fp32 on {d.spec}")  # fmt: skip
            out.append(f"{head} ({numbers}): keep fp32 there; ad.precision({d.spec!r}) does.")
    return out


def _release() -> None:
    """Give back the allocator caches of the accelerators a step used: the next step
    starts from what the device has free, not from what the last one kept."""
    from anydevice.measure.clocks import in_use

    for device in in_use():
        runtime(device.type).empty_cache(device)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""
