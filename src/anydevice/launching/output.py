"""A launched worker's output in whole lines: ranks that share a terminal or a pipe never
cut into each other's lines.

The workers of a launch write to the launcher's stdout and stderr. Python cuts a line on
its way there: unbuffered (``python -u``) ``print("x")`` is two writes, ``x`` and then the
newline; buffered to a pipe, it writes 8 KiB blocks that end mid-line. Between two such
writes another rank's text lands, and ``rank 1 line 0`` and ``rank 0 line 51`` arrive as
``rank 1 line 0rank 0 line 51``. In a launched worker :func:`install` puts
:class:`WholeLines` under ``sys.stdout`` and ``sys.stderr``: each write to the descriptor
carries whole lines only, so it lands in one piece.

Why it works: a write of at most ``PIPE_BUF`` bytes (4096 on Linux) to a pipe is atomic —
no other writer's bytes come between its bytes — and one write to a terminal or a file
is not split either. The lines ready at once are sent together, in writes of up to
``PIPE_BUF`` bytes that end at a line's end; a line longer than that goes alone, in one
write. A line not yet ended waits for its newline, for an explicit ``flush()`` (as
``print(..., flush=True)`` and a progress bar's ``\\r`` updates do: the writer asked for it
to show now) or for the process's exit, when Python flushes both streams.
"""

from __future__ import annotations

import io
import os
import select
import sys
import threading

__all__ = ["PIPE_BUF", "WholeLines", "install"]

#: The largest write a pipe takes in one piece (POSIX guarantees at least 512).
PIPE_BUF = getattr(select, "PIPE_BUF", 512)

#: A line not ended after this many bytes is written as it is, so memory stays bounded.
_LONGEST_HELD = 1 << 20


class WholeLines(io.BufferedIOBase):
    """A binary stream over file descriptor ``fd`` that writes whole lines only (see the
    module docstring); the descriptor stays open when it is closed.

    >>> r, w = os.pipe()
    >>> out = WholeLines(w)
    >>> _ = out.write(b"rank 0 "), out.write(b"line 1"), out.write(b"\\nrank 0 l")
    >>> os.read(r, 100)         # the line, at its end; the rest waits
    b'rank 0 line 1\\n'
    >>> out.flush()             # asked for: written as it is
    >>> os.read(r, 100)
    b'rank 0 l'
    >>> out.close(); os.close(r); os.close(w)
    """

    def __init__(self, fd: int, name: str = "") -> None:
        super().__init__()
        self._fd = fd
        self.name = name or fd
        self._held = bytearray()
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._after_fork)

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        if self.closed:
            raise ValueError("write to closed file")
        view = memoryview(data).cast("B")
        with self._lock:
            self._held += view
            end = self._held.rfind(b"\n") + 1
            if end == 0 and len(self._held) > _LONGEST_HELD:
                end = len(self._held)
            if end:
                ready = bytes(self._held[:end])
                del self._held[:end]
                self._send(ready)
        return len(view)

    def flush(self) -> None:
        if self.closed:
            return
        with self._lock:
            if self._held:
                ready = bytes(self._held)
                self._held.clear()
                self._send(ready)

    def close(self) -> None:
        if not self.closed:
            try:
                self.flush()
            finally:
                super().close()

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def _send(self, data: bytes) -> None:
        """Write ``data`` (whole lines, but for a flush) in pieces that end at a line's end,
        each at most ``PIPE_BUF`` bytes unless one line is longer."""
        while data:
            cut = len(data)
            if cut > PIPE_BUF:
                cut = data.rfind(b"\n", 0, PIPE_BUF) + 1 or data.find(b"\n") + 1 or len(data)
            self._write_all(data[:cut])
            data = data[cut:]

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view) :]
            except BlockingIOError:  # a non-blocking descriptor: wait until it takes more
                select.select([], [self._fd], [])

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork


def install() -> None:
    """Write this process's ``sys.stdout`` and ``sys.stderr`` through :class:`WholeLines`,
    with their encodings and error handlers; each line goes out as soon as it ends.

    Only the interpreter's own streams are replaced: one the program (or a notebook's
    kernel) put there already is left as it is.
    """
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, io.TextIOWrapper) or stream is not getattr(sys, f"__{name}__"):
            continue
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        stream.flush()
        lines = io.TextIOWrapper(
            WholeLines(fd, name=getattr(stream, "name", "") or f"<{name}>"),
            encoding=stream.encoding,
            errors=stream.errors,
            write_through=True,  # each text write reaches WholeLines, which holds partial lines
        )
        setattr(sys, name, lines)
