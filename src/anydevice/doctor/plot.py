"""``anydevice doctor --plot FILE``: the measurements as one picture (matplotlib, optional).

Three panels: bandwidth per device (memory copy, host <-> device from pageable and pinned
memory), matmul throughput per dtype (log scale when a CPU stands beside a GPU), and each
lever's speed-up. A black tick marks the peak where it is known, so the distance to it shows
at a glance.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anydevice.doctor.measure import _find

if TYPE_CHECKING:
    from anydevice.doctor.measure import Measured, Measurements

__all__ = ["plot", "require_matplotlib"]

_BANDWIDTH = ("memory-copy", "h2d-pageable", "h2d-pinned", "d2h-pageable", "d2h-pinned")
_MATMUL = ("matmul-fp32", "matmul-tf32", "matmul-bf16", "matmul-fp16")


def require_matplotlib() -> None:
    """Raise ImportError, saying how to install it, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "--plot needs matplotlib, which is not installed: pip install 'anydevice[plot]' "
            "(or pip install matplotlib)."
        ) from e


def plot(m: Measurements, path: str | Path) -> Path:
    """Draw ``m`` to ``path`` (the format follows the suffix: .png, .svg, .pdf)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5), constrained_layout=True)
    try:
        _bars(axes[0], m.results, _BANDWIDTH, "bandwidth (GB/s)", log=False)
        _bars(axes[1], m.results, _MATMUL, "matmul throughput (GFLOP/s)", log=True)
        _levers(axes[2], m)
        fig.suptitle(f"anydevice doctor ({m.plan} plan): {m.step}")
        out = Path(path)
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def _bars(
    ax: Any, results: Sequence[Measured], names: Sequence[str], title: str, log: bool
) -> None:
    devices = list(dict.fromkeys(r.device for r in results if r.name in names))
    present = [n for n in names if any(r.name == n for r in results)]
    width = 0.8 / max(1, len(present))
    for j, name in enumerate(present):
        for i, dev in enumerate(devices):
            r = _find(results, dev, name)
            if r is None:
                continue
            x = i + (j - (len(present) - 1) / 2) * width
            ax.bar(x, r.value, width, color=f"C{j}", label=name)
            if r.peak:
                ax.hlines(r.peak, x - width / 2, x + width / 2, colors="black", linewidth=2)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=False))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_xticks(range(len(devices)), devices)
    ax.set_title(title + ("; ticks: peak" if any(r.peak for r in results) else ""))
    values = [r.value for r in results if r.name in names and r.value > 0]
    if log and values and max(values) / min(values) > 20:  # a CPU beside a GPU
        ax.set_yscale("log")


def _levers(ax: Any, m: Measurements) -> None:
    shown = [lv for lv in m.levers if lv.speedup is not None]
    labels = [f"{lv.device} {lv.name}" for lv in shown]
    speedups = [lv.speedup or 0.0 for lv in shown]
    colors = ["C2" if lv.verdict == "use" else "C7" if lv.verdict == "no-gain" else "C3"
              for lv in shown]  # fmt: skip
    ax.barh(range(len(shown)), speedups, color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(shown)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_title("what each lever buys (speed-up, 1 = none)")
