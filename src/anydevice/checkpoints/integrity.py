"""Whether a checkpoint is still what was written: the size and CRC-32 of every file,
taken while it is written, checked before it is loaded.

DCP writes no checksum: a truncated shard fails deep inside its reader, and flipped bytes
in tensor data load silently. So every file of a sharded checkpoint is listed in its
manifest (``anydevice.json``) with its size and CRC-32:

* the shards and ``.metadata`` are hashed **while DCP writes them**
  (:func:`hashing_writer`: DCP's own ``FileSystemWriter`` whose file streams pass every
  write through ``zlib.crc32``, which releases the GIL), so nothing is read back; the
  small per-rank files are read back once;
* the manifest carries a CRC-32 of its own content, so its damage is seen too;
* :func:`listed_damage` checks the sizes first (a stat each: truncation, an empty file, a missing
  one), then the CRC-32s, reading each file once, several at a time (the reads and the
  hashing release the GIL). With several ranks each checks a share of the files.

CRC-32 finds any damage of up to 32 consecutive bits and misses random damage with a chance
of 2⁻³²; it is meant for disks, copies and truncation, not against a forger. A single-file
checkpoint needs none of this: torch's zip format keeps a CRC-32 per record, which
:func:`anydevice.load` checks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from anydevice.errors import CheckpointError
from anydevice.hardware.facts import format_bytes

__all__ = [
    "MANIFEST",
    "digest",
    "hashing_writer",
    "listed_damage",
    "read_manifest",
    "write_manifest",
]

MANIFEST = "anydevice.json"
_CHUNK = 1 << 22

#: name -> (size in bytes, CRC-32)
Digests = dict[str, tuple[int, int]]


def hashing_writer(path: str) -> Any:
    """DCP's ``FileSystemWriter`` for ``path`` whose files are hashed as they are written:
    its ``digests`` map each file's name to ``(size, crc32)`` once it is closed, and its
    ``errors`` keep the ``OSError`` of a write that failed (torch's zip writer reports a
    failed write as a ``RuntimeError`` without it: the full disk would go unnamed)."""
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

    digests: Digests = {}
    errors: list[OSError] = []

    class _HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                hashing = _HashingStream(stream, errors)
                yield hashing
                digests[Path(path).name] = (hashing.size, hashing.crc)

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            super().rename(path, new_path)
            if Path(path).name in digests:  # .metadata is written as .metadata.tmp first
                digests[Path(new_path).name] = digests.pop(Path(path).name)

    writer = FileSystemWriter(path)
    writer.fs = _HashingFileSystem()
    writer.digests = digests  # type: ignore[attr-defined]
    writer.errors = errors  # type: ignore[attr-defined]
    return writer


class _HashingStream(io.RawIOBase):
    """A write-only file stream that keeps the CRC-32 and size of what went through it."""

    def __init__(self, raw: Any, errors: list[OSError]) -> None:
        super().__init__()
        self._raw = raw
        self._errors = errors
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        try:
            n = int(self._raw.write(b))
        except OSError as e:
            self._errors.append(e)
            raise
        view = memoryview(b).cast("B")[:n]
        self.crc = zlib.crc32(view, self.crc)
        self.size += n
        return n

    def tell(self) -> int:
        return int(self._raw.tell())

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def close(self) -> None:
        if not self.closed:
            self._raw.flush()
        super().close()  # the file itself is closed by the writer's ``with``


def digest(file: Path) -> tuple[int, int]:
    """``(size, crc32)`` of ``file``, read once."""
    crc, size = 0, 0
    with open(file, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


# ----------------------------------------------------------------------------- manifest


def write_manifest(folder: Path, manifest: dict[str, Any], files: Digests) -> None:
    """Write ``manifest`` with the digests of ``files`` and a CRC-32 of itself."""
    body = {**manifest, "files": {n: [s, f"{c:08x}"] for n, (s, c) in sorted(files.items())}}
    body["checksum"] = _checksum(body)
    tmp = folder / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def _checksum(body: dict[str, Any]) -> str:
    rest = {k: v for k, v in body.items() if k != "checksum"}
    return f"{zlib.crc32(json.dumps(rest, sort_keys=True).encode()):08x}"


def read_manifest(folder: Path, *, call: str) -> dict[str, Any]:
    """The folder's manifest, checked against its own CRC-32 (where it has one).

    Raises:
        CheckpointError: it cannot be read, is not JSON, or fails its checksum.
    """
    file = folder / MANIFEST
    said = f"{call}: " if call else ""
    try:
        body = json.loads(file.read_bytes())
        if not isinstance(body, dict) or "world_size" not in body:
            raise ValueError("not a manifest of ad.save_state")
        int(body["world_size"])
    except (OSError, ValueError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{said}{MANIFEST} is damaged ({type(e).__name__}: {e}), so the checkpoint "
            "cannot be checked",
            path=str(folder),
        ) from e
    if "checksum" in body and body["checksum"] != _checksum(body):
        raise CheckpointError(
            f"{said}{MANIFEST} fails its own CRC-32 check (its bytes changed after it was "
            "written), so the checkpoint cannot be trusted",
            path=str(folder),
        )
    return body


def listed_damage(
    folder: Path, manifest: dict[str, Any], *, share: tuple[int, int] = (0, 1)
) -> list[str]:
    """What is wrong with the files the manifest lists (empty: nothing), each said with
    the file's name; ``share=(rank, size)`` checks every ``size``-th file from ``rank``.

    Sizes are checked for every file first (cheap), checksums only where the sizes hold.
    """
    listed = sorted(manifest.get("files", {}).items())
    mine = listed[share[0] :: share[1]]
    problems = [p for name, (size, _) in mine if (p := _size_damage(folder / name, size))]
    if problems:
        return problems
    with ThreadPoolExecutor(max_workers=min(4, max(len(mine), 1))) as pool:
        found = pool.map(lambda item: _crc_damage(folder / item[0], *item[1]), mine)
        return [p for p in found if p]


def _size_damage(file: Path, size: int) -> str | None:
    try:
        st = file.stat()
    except FileNotFoundError:
        return f"{file.name} is missing ({format_bytes(size)} were written)"
    except OSError as e:
        return f"{file.name} cannot be read ({e.strerror})"
    if not file.is_file():
        return f"{file.name} is not a file"
    if st.st_size == size:
        return None
    if st.st_size == 0:
        return f"{file.name} is empty (0 bytes; {size} were written)"
    how = "truncated" if st.st_size < size else "longer than written"
    return f"{file.name} is {how}: {st.st_size} bytes, {size} were written"


def _crc_damage(file: Path, size: int, crc: str) -> str | None:
    try:
        _, found = digest(file)
    except OSError as e:
        return f"{file.name} cannot be read ({e.strerror})"
    if f"{found:08x}" == crc:
        return None
    return (
        f"{file.name} fails its CRC-32 check ({found:08x}, {crc} when written; "
        f"{format_bytes(size)}): its bytes changed after the save (disk, memory or a copy)"
    )
