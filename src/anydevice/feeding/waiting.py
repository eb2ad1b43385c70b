"""The waiting share of a loader's pass, chunk by chunk, and its spread.

A pass on a machine whose other jobs come and go waits for data in some stretches and
not in others: one share for the whole pass (say 25 %) then flips between "input-bound"
and "compute-bound" from one run to the next. :class:`Shares` keeps the share of each
stretch, so the verdict can say when it lies on both sides of its line.

>>> s = Shares()
>>> for _ in range(8):
...     s.add(0.01, 0.1)    # 10 ms of each 100 ms step spent waiting
>>> round(s.share(), 2), [round(x, 2) for x in s.spread()]
(0.1, [0.1, 0.1])
"""

from __future__ import annotations

__all__ = ["Shares"]


class Shares:
    """The waiting share of a pass, chunk by chunk: at most :data:`CHUNKS` chunks of
    consecutive batches, pairs merged (each chunk twice as long) as the pass grows, so the
    memory stays the same for any pass. Their spread says whether the share held over the
    pass, or the machine's other jobs came and went."""

    CHUNKS = 16

    def __init__(self) -> None:
        self.chunks: list[list[float]] = []  # [wait s, step s, batches]
        self.size = 1  #: batches per chunk

    def add(self, wait: float, step: float) -> None:
        if self.chunks and self.chunks[-1][2] < self.size:
            last = self.chunks[-1]
            last[0], last[1], last[2] = last[0] + wait, last[1] + step, last[2] + 1
            return
        self.chunks.append([wait, step, 1])
        if len(self.chunks) > self.CHUNKS:
            pairs = zip(self.chunks[::2], self.chunks[1::2], strict=False)
            merged = [[a[0] + b[0], a[1] + b[1], a[2] + b[2]] for a, b in pairs]
            if len(self.chunks) % 2:
                merged.append(self.chunks[-1])
            self.chunks, self.size = merged, 2 * self.size

    def share(self) -> float | None:
        """Waiting over step time, all chunks together; None before any."""
        step = sum(c[1] for c in self.chunks)
        return sum(c[0] for c in self.chunks) / step if step > 0 else None

    def spread(self) -> tuple[float, float] | None:
        """The chunks' shares from the 10th to the 90th percentile (lowest to highest with
        fewer than five chunks); None with fewer than two."""
        shares = sorted(c[0] / c[1] for c in self.chunks if c[1] > 0)
        if len(shares) < 2:
            return None
        if len(shares) < 5:
            return shares[0], shares[-1]
        return _quantile(shares, 0.1), _quantile(shares, 0.9)


def _quantile(ordered: list[float], q: float) -> float:
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
