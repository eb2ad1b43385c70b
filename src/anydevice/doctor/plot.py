"""``anydevice doctor --plot FILE``: the measurements as one picture (matplotlib, optional).

Up to four panels, one under the other, each as tall as its bars and each bar labelled
with its value: matmul throughput per device and dtype, and memory and host <-> device
bandwidth, each with the datasheet peak as a mark, the share of it reached and the threads
it was measured with (and "busy" where other processes took cores meanwhile); every lever
sorted by its speed-up, with its spread, a line at 1x and its verdict (levers that do not
apply are listed with the reason); and the same training step on every device side by
side. A panel with nothing measured is left out. The title names the machine and the plan.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from anydevice.doctor.results import Lever, Measured, Measurements
    from anydevice.hardware.inventory import Inventory

__all__ = ["check_target", "plot", "require_matplotlib"]

_BANDWIDTH = ("memory-copy", "h2d-pageable", "h2d-pinned", "d2h-pageable", "d2h-pinned")
_MATMUL = ("matmul-fp32", "matmul-tf32", "matmul-bf16", "matmul-fp16")
_VERDICT_COLOR = {"use": "#2e7d32", "no-gain": "#9e9e9e", "slower": "#c62828",
                  "noisy": "#f9a825", "n/a": "#bdbdbd"}  # fmt: skip
_DEVICE_COLORS = ("#1565c0", "#ef6c00", "#6a1b9a", "#00838f", "#558b2f")


def require_matplotlib() -> None:
    """Raise ImportError, saying how to install it, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "--plot needs matplotlib, which is not installed: pip install 'anydevice[plot]' "
            "(or pip install matplotlib)."
        ) from e


def check_target(path: str | Path) -> None:
    """Refuse, before any measuring, a picture that could not be written to ``path``.

    >>> check_target("/no/such/folder/d.png")
    Traceback (most recent call last):
    ...
    ValueError: --plot /no/such/folder/d.png: the folder /no/such/folder does not exist.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
        ValueError: the folder is missing or not writable, the path is a folder, or the
            suffix is not a format matplotlib writes.
    """
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise ValueError(f"--plot {path}: that is a folder; give a file name such as d.png.")
    if not folder.is_dir():
        raise ValueError(f"--plot {path}: the folder {folder} does not exist.")
    if not os.access(folder, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"--plot {path}: cannot write there (permission denied).")
    require_matplotlib()
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise ValueError(
            f"--plot {path}: {suffix or 'no suffix'} is not a picture format; use "
            f"{', '.join('.' + f for f in ('png', 'svg', 'pdf') if f in formats)}."
        )


def plot(m: Measurements, path: str | Path, inv: Inventory | None = None) -> Path:
    """Draw ``m`` to ``path`` (the format follows the suffix: .png, .svg, .pdf)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    devices = list(dict.fromkeys([*(d.device for d in m.devices),
                                  *(r.device for r in m.results)]))  # fmt: skip
    # One column of the panels that have something to show, each as tall as its bars: no
    # panel left mostly empty on a machine with one device and few levers.
    panels: list[tuple[int, Any]] = [
        (n, draw)
        for n, draw in (
            (_count(m.results, _MATMUL), lambda ax: _rates(
                ax, m.results, _MATMUL, devices, "matmul throughput", "FLOP/s")),
            (_count(m.results, _BANDWIDTH), lambda ax: _rates(
                ax, m.results, _BANDWIDTH, devices, "bandwidth", "B/s")),
            (len(m.levers), lambda ax: _levers(ax, m.levers)),
            (len(_step_bars(m)), lambda ax: _steps(ax, m)),
        )
        if n
    ]  # fmt: skip
    heights = [n + 2.2 for n, _ in panels] or [1.0]
    fig, axes = plt.subplots(
        len(heights),
        1,
        figsize=(14, 1.6 + 0.42 * sum(heights)),
        height_ratios=heights,
        constrained_layout=True,
        squeeze=False,
    )
    try:
        for (_, draw), ax in zip(panels, axes[:, 0], strict=False):
            draw(ax)
        if not panels:
            axes[0][0].text(0.5, 0.5, "nothing was measured", ha="center", va="center")
            axes[0][0].set_axis_off()
        fig.suptitle(_title(m, inv), fontsize=13, fontweight="bold")
        out = Path(path)
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out


def _title(m: Measurements, inv: Inventory | None) -> str:
    head = "anydevice doctor"
    if inv is not None:
        h = inv.host
        gpus = [d for d in inv.devices if d.is_accelerator]
        names = list(dict.fromkeys(d.name for d in gpus))
        accel = f" + {len(gpus)}x {', '.join(names)}" if gpus else ", no GPU"
        head += f": {h.cpu_model} ({h.cores_usable} cores){accel}; torch {h.torch}"
    line = f"{m.plan} plan, measured in {m.seconds:.1f} s of a {m.budget:g} s budget"
    if m.load is not None and m.load.busy:
        line += (f"; BUSY: other processes used {m.load.others:.1f} of {m.load.usable} cores "
                 "(numbers marked *)")  # fmt: skip
    return f"{head}\n{line}"


def _human(value: float, unit: str) -> str:
    """``2.3e13`` FLOP/s reads ``23 TFLOP/s``."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _count(results: Sequence[Measured], names: Sequence[str]) -> int:
    return sum(1 for r in results if r.name in names)


def _zero_or(fmt: Any) -> Any:
    """A tick formatter that writes the origin as "0", not "0 ns" or "0 FLOP/s"."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _: "0" if x == 0 else fmt(x))


def _rates(ax: Any, results: Sequence[Measured], names: Sequence[str], devices: Sequence[str],
           title: str, unit: str) -> None:  # fmt: skip
    """Horizontal bars, one per (device, name), with value labels and peak marks."""
    rows = [r for d in devices for n in names for r in results if r.device == d and r.name == n]
    if not rows:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    scale = 1e9  # results are in GFLOP/s and GB/s
    values = [r.value * scale for r in rows]
    peaks = [r.peak * scale if r.peak else None for r in rows]
    top = max([*values, *(p for p in peaks if p)])
    log = top / max(min(values), 1e-30) > 50
    for i, (r, v, p) in enumerate(zip(rows, values, peaks, strict=True)):
        color = _DEVICE_COLORS[devices.index(r.device) % len(_DEVICE_COLORS)]
        ax.barh(i, v, color=color, alpha=0.45 if r.noisy else 0.9, height=0.7)
        label = _human(v, unit) + (" *" if r.noisy else "")
        fp32 = next((x for x in rows if x.device == r.device and x.name == "matmul-fp32"), None)
        if (
            fp32 is not None
            and r.name in ("matmul-bf16", "matmul-fp16")
            and r.value < fp32.value / 2
        ):
            label += f"  {fp32.value / r.value:.0f}x slower than fp32: emulated, keep fp32"
        if p:
            ax.plot([p, p], [i - 0.42, i + 0.42], color="black", linewidth=2.5)
            label += f"  ({v / p:.0%} of {_human(p, unit)} peak)"
        if r.conditions:  # the threads it ran with, and whether others were busy
            label += f"  [{r.conditions}]"
        ax.text(v, i, "  " + label, va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), [f"{r.device}  {_short(r.title)}" for r in rows], fontsize=9)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(min(values) / 2, top * 40)
    else:
        ax.set_xlim(0, top * 1.9)
    ax.xaxis.set_major_formatter(_zero_or(lambda x: _human(x, unit)))
    marks = "; black mark: datasheet peak" if any(peaks) else ""
    ax.set_title(f"{title} ({'log scale' if log else 'linear'}{marks}; * noisy)", loc="left")
    ax.grid(axis="x", alpha=0.3)


def _levers(ax: Any, levers: Sequence[Lever]) -> None:
    """Each lever's speed-up, sorted, with its spread, a line at 1x and its verdict."""
    measured = sorted((lv for lv in levers if lv.speedup is not None),
                      key=lambda lv: lv.speedup or 0.0, reverse=True)  # fmt: skip
    absent = [lv for lv in levers if lv.speedup is None]
    ax.axvline(1.0, color="black", linewidth=1.2)
    for i, lv in enumerate(measured):
        s = lv.speedup or 1.0
        verdict = lv.verdict if lv.clear or lv.verdict == "noisy" else "no-gain"
        ax.barh(i, s - 1.0, left=1.0, color=_VERDICT_COLOR[verdict], height=0.6,
                alpha=0.5 if lv.noisy else 0.9)  # fmt: skip
        if lv.low is not None and lv.high is not None:
            ax.plot([lv.low, lv.high], [i, i], color="black", linewidth=1.5)
        words = {"use": "use", "slower": "slower: leave off", "no-gain": "no gain",
                 "noisy": "noisy: measure again"}[verdict]  # fmt: skip
        if not lv.clear and verdict != "noisy":
            words = "no clear difference" if lv.pairs >= 3 else f"{lv.pairs} pair(s): no verdict"
        spread = f" ±{lv.spread:.0%}" if lv.spread is not None else ""
        text = f"{s:.2f}x{spread}  {words}" + (" *" if lv.noisy else "")
        ax.text(max(s, lv.high or s), i, "  " + text, va="center", fontsize=9)
    labels = [f"{lv.device}  {lv.title}" for lv in measured]
    ax.set_yticks(range(len(measured)), labels, fontsize=9)
    ax.set_ylim(len(measured) - 0.5 + 0.9 * len(absent), -0.5)
    ax.set_xscale("log")
    span = [v for lv in measured for v in (lv.low or lv.speedup or 1.0, lv.high or 1.0)]
    lo, hi = min([0.8, *span]), max([1.25, *span])
    ax.set_xlim(lo / 1.3, hi * 6)
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_minor_locator(LogLocator(base=10, subs=()))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
    ax.set_title("what each lever buys here (interleaved A/B; line: spread; * noisy)",
                 loc="left")  # fmt: skip
    ax.grid(axis="x", alpha=0.3)
    if absent:
        lines = [f"{lv.device} {lv.name}: n/a, {lv.note}" for lv in absent]
        ax.text(0.01, 0.01, "\n".join(_clip(line, 100) for line in lines), transform=ax.transAxes,
                fontsize=8, color="#616161", va="bottom",
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.9})  # fmt: skip


def _short(title: str) -> str:
    """ "host -> device, pinned memory" reads "host→device pinned"."""
    return (title.replace(" -> ", "→").replace(", ", " ").replace(" memory", "")
            .replace(" (read + write)", "").replace(" (TF32 off)", ", TF32 off"))  # fmt: skip


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _step_bars(m: Measurements) -> list[tuple[str, float, str, str]]:
    """(label, seconds, colour, note) of each training-step bar: fp32 and the best mode."""
    bars: list[tuple[str, float, str, str]] = []
    for d in m.devices:
        if d.step_fp32 is None:
            continue
        color = _DEVICE_COLORS[len(bars) % len(_DEVICE_COLORS)]
        vs = f", {d.vs_cpu:.3g}x the CPU" if d.vs_cpu and d.accelerator else ""
        invalid = ", MFU invalid (see the advice)" if d.mfu_invalid else ""
        fp32_mfu = invalid if d.mfu_fp32 is None else f", {d.mfu_fp32:.0%} MFU"
        best_mfu = invalid if d.mfu_best is None else f", {d.mfu_best:.0%} MFU"
        first = fp32_mfu + (vs if d.mode == "fp32" else "")
        bars.append((f"{d.device}  fp32", d.step_fp32, color, first))
        if d.mode != "fp32" and d.step_best is not None:
            bars.append((f"{d.device}  {d.mode}", d.step_best, color, best_mfu + vs))
    return bars


def _steps(ax: Any, m: Measurements) -> None:
    """The same training step on every device: seconds per step, fp32 and best mode."""
    from anydevice.measure.samples import format_time

    bars = _step_bars(m)
    rows = [d for d in m.devices if d.step_fp32 is not None]
    top = max(b[1] for b in bars)
    log = top / min(b[1] for b in bars) > 50
    for i, (_, seconds, color, extra) in enumerate(bars):
        ax.barh(i, seconds, color=color, height=0.6)
        ax.text(seconds, i, f"  {format_time(seconds)} per step{extra}", va="center", fontsize=9)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=9)
    ax.set_ylim(len(bars) - 0.5, -0.5)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(min(b[1] for b in bars) / 2, top * 40)
    else:
        ax.set_xlim(0, top * 1.9)
    ax.xaxis.set_major_formatter(_zero_or(format_time))
    threads = ""
    if m.load is not None and m.load.measured_with not in (None, m.load.torch_threads):
        threads = f"\nwith {m.load.measured_with} thread(s): the cores other processes left free"
    sources = sorted({d.mfu_source for d in rows if d.mfu_source})
    mfu = f"\nMFU against the {'; '.join(sources)}" if sources else ""
    ax.set_title(f"the same training step on every device (shorter is faster)\n{m.step}{threads}"
                 f"{mfu}", loc="left")  # fmt: skip
    ax.grid(axis="x", alpha=0.3)
