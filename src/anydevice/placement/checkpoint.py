"""Checkpoints that survive a crash and load onto any device: :func:`save`, :func:`load`.

:func:`save` never leaves a half-written file where the checkpoint was: it writes a
temporary file in the same folder, flushes and ``fsync``\\ s it, renames it over the target
(``os.replace``, atomic on POSIX and Windows) and ``fsync``\\ s the folder, so the rename
itself survives a power cut. If anything fails before the rename (an object that cannot be
pickled, a full disk), the previous checkpoint is untouched and the temporary file is gone.
A writer killed outright (``SIGKILL``, a power cut) cannot clean up: its temporary file,
``.NAME.PID@HOST.HEX.tmp``, names the writer, and the next save to the same path removes it
once that process is gone (same host only; a process that reused the pid is told apart by
its start time).

:func:`load` maps every storage onto the target device (``map_location``), with
``weights_only=True`` as torch does. torch's zip format stores a CRC-32 for every record
but ``torch.load`` does not check them, so a flipped bit in tensor data loads silently;
:func:`load` checks them first (2.4 GB/s measured on a 2-core VM, about half a load;
``verify=False`` skips it). A file that fails gets an error that names it and says what
looks wrong: empty, truncated, a record that fails its CRC, not a checkpoint at all.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import pickle
import re
import shutil
import socket
import stat
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

from anydevice.errors import CheckpointError
from anydevice.hardware.facts import format_bytes
from anydevice.hardware.selection import device as _select_device
from anydevice.hardware.spec import DeviceLike

__all__ = ["checked_path", "damage", "disk_space", "full_disk", "load", "save"]

PathLike = str | os.PathLike[str]

logger = logging.getLogger("anydevice")

_ZIP_MAGIC = b"PK\x03\x04"
_ZIP_END = b"PK\x05\x06"
_CHUNK = 1 << 24


def save(obj: object, path: PathLike) -> Path:
    """Write ``obj`` to ``path`` with ``torch.save``, atomically.

    >>> import tempfile, torch, anydevice as ad
    >>> folder = tempfile.mkdtemp()
    >>> path = ad.save({"w": torch.ones(2), "step": 3}, f"{folder}/ckpt.pt")
    >>> ad.load(path, "cpu")["step"]
    3

    The file appears complete or not at all: the previous file at ``path`` stays intact
    until the new one is fully on disk. A new file gets the permissions ``open()`` would
    give it; a replaced one keeps its own.

    Args:
        obj: anything ``torch.save`` takes (a ``state_dict``, a dict of them, tensors).
        path: the checkpoint file; its folder must exist.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        CheckpointError: writing failed (an object that cannot be pickled, a full disk, a
            folder that does not exist or cannot be written); the original is the
            ``__cause__``, and the message says the previous file was kept. Also for a
            ``path`` that is empty or names a folder.
    """
    target = checked_path(path, "save")
    if target.is_dir():
        raise CheckpointError(
            f"ad.save({str(target)!r}): that is a folder; name a file inside it, e.g. "
            f"{str(target / 'checkpoint.pt')!r}.",
            path=str(target),
        )
    folder = target.parent
    _remove_stale_temps(target)
    tmp = folder / temp_name(target, "tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as e:
        raise CheckpointError(_save_failed(target, e, wrote=False), path=str(target)) from e
    try:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))  # keep a replaced file's mode
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        written = 0
        with contextlib.suppress(OSError):
            written = os.stat(tmp).st_size
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if not isinstance(e, Exception):
            raise  # KeyboardInterrupt and friends: cleaned up, passed on as they are
        message = _save_failed(target, e, wrote=True, written=written)
        raise CheckpointError(message, path=str(target)) from e
    _fsync_folder(folder)
    return target


def checked_path(
    path: PathLike, verb: str, example: str = "a file such as 'checkpoints/last.pt'"
) -> Path:
    """``path`` as a ``Path`` for ``ad.<verb>``, refusing the empty path (``example`` says
    what to give instead) and, for ``ad.save``, a trailing separator."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"ad.{verb}: the path is a str or os.PathLike, not {type(path).__name__}")
    if not text.strip():
        raise CheckpointError(
            f"ad.{verb}({text!r}): the path is empty; give {example}.",
            path=text,
        )
    if text.endswith(("/", os.sep)) and verb == "save":
        raise CheckpointError(
            f"ad.save({text!r}): the path ends with a separator, so it names a folder; add a "
            f"file name, e.g. {text + 'checkpoint.pt'!r}.",
            path=text,
        )
    return Path(text)


def _host() -> str:
    """This machine's name as it appears in temporary file names (no '.' or '@')."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:63] or "host"


def _stem(name: str, room: int) -> str:
    """``name``, or where it does not fit in ``room`` bytes, its start and a hash of it."""
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) <= room:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    head = raw[: max(room - len(digest) - 1, 0)].decode("utf-8", "ignore")
    return f"{head}~{digest}"


def _name_max(folder: Path) -> int:
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (AttributeError, OSError, ValueError):
        return 255  # Windows and most file systems


def temp_name(target: Path, kind: str) -> str:
    """A hidden name beside ``target`` for a save in progress (``kind`` ``"tmp"``) or a
    replaced checkpoint (``"old"``): ``.NAME.PID@HOST.HEX.KIND``, naming its writer so that
    a later call can tell whether the writer is gone. ``NAME`` is shortened (its start and
    a hash) where the whole would not fit the file system's name limit, so any name legal
    for ``target`` works."""
    suffix = f".{os.getpid()}@{_host()}.{os.urandom(4).hex()}.{kind}"
    room = _name_max(target.parent) - 1 - len(suffix)
    return f".{_stem(target.name, room)}{suffix}"


def temps(target: Path, kind: str) -> list[tuple[os.DirEntry[str], re.Match[str]]]:
    """Every :func:`temp_name` entry of ``kind`` beside ``target``, with its name parsed."""
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return []  # the caller will say what is wrong with the folder
    name_max = _name_max(target.parent)
    stems = {target.name}
    found = []
    for entry in entries:
        m = _TEMP.fullmatch(entry.name)
        if m is None or m.group("kind") != kind:
            continue
        if m.group("stem") not in stems:
            suffix_len = len(entry.name) - 1 - len(m.group("stem"))
            stems.add(_stem(target.name, name_max - 1 - suffix_len))
            if m.group("stem") not in stems:
                continue  # another target's
        found.append((entry, m))
    return found


def stale_temps(target: Path, kind: str) -> list[os.DirEntry[str]]:
    """The :func:`temp_name` entries of ``kind`` beside ``target`` whose writer has died
    (this host's only: another machine's processes cannot be seen)."""
    host = _host()
    stale = []
    for entry, m in temps(target, kind):
        if m.group("host") != host:
            continue  # written from another machine: its writer cannot be seen
        try:
            modified = entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue  # gone already
        if not _writer_alive(int(m.group("pid")), modified):
            stale.append(entry)
    return stale


_TEMP = re.compile(
    r"\.(?P<stem>.+)\.(?P<pid>\d+)@(?P<host>[A-Za-z0-9-]+)\.[0-9a-f]{8}\.(?P<kind>tmp|old)"
)


def _remove_stale_temps(target: Path) -> None:
    """Remove the temporary files of earlier saves to ``target`` whose writer has died."""
    removed: list[str] = []
    for entry in stale_temps(target, "tmp"):
        if entry.is_dir(follow_symlinks=False):
            continue  # a save_state folder: save_state sweeps those
        try:
            os.unlink(entry.path)
        except OSError:
            continue  # gone already, or not ours to remove
        removed.append(entry.name)
    if removed:
        logger.info(
            "ad.save(%r): removed %d temporary file(s) left by saves that were killed: %s",
            str(target),
            len(removed),
            ", ".join(removed),
        )


def _writer_alive(pid: int, modified: float) -> bool:
    """Whether process ``pid`` may still be writing a file last modified at ``modified``."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False  # exited, not yet reaped: its file is closed for good
        started = proc.create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell (access denied): leave its file alone
    # A process started after the file was last written reused the pid of a dead writer.
    return started <= modified + 1.0


def full_disk(e: BaseException | None, folder: Path) -> str | None:
    """What an error says about the disk, where it is that the disk (or a quota, or a
    file-size limit) ran out: the errno anywhere in its chain of causes, in plain words
    with the folder and its free space; None for any other error."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return f"{_FULL[e.errno]} ({disk_space(folder)})"
        e = e.__cause__ or e.__context__
    return None


#: errno -> what it means for a checkpoint being written
_FULL = {
    errno.ENOSPC: "no space left on the disk",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file-size limit (ulimit -f) stopped the write",
}


def disk_space(folder: Path) -> str:
    """``"1.2 MiB free of 64 MiB in /x"``, or just the folder where that cannot be read."""
    for where in (folder, *folder.parents):
        with contextlib.suppress(OSError):
            usage = shutil.disk_usage(where)
            return f"{format_bytes(usage.free)} free of {format_bytes(usage.total)} in {folder}"
    return f"in {folder}"


def _save_failed(target: Path, e: BaseException, *, wrote: bool, written: int = 0) -> str:
    kept = (
        f"the previous {target.name} is intact"
        if target.exists()
        else f"{target.name} was not created"
    )
    full = full_disk(e, target.parent)
    if full is not None:
        reached = (
            f"; the file had reached {format_bytes(written)} when it failed" if written else ""
        )
        return (
            f"ad.save({str(target)!r}): {full}{reached}; {kept} and no temporary file was left. "
            "Free space there (or raise the limit), or save to another disk."
        )
    if isinstance(e, OSError) and e.errno is not None and not wrote:
        what = f"cannot create a file in {target.parent} ({e.strerror})"
        todo = "Check that the folder exists and is writable."
    elif isinstance(e, (OSError, RuntimeError)) and "pickl" not in str(e).lower():
        what = f"writing failed ({type(e).__name__}: {e})"
        todo = "A full disk or a file-size limit are the usual causes: free space and save again."
    else:
        what = f"the object cannot be saved ({type(e).__name__}: {e})"
        todo = (
            "Save state_dict()s, tensors and plain containers; a lambda, a local class or an "
            "open handle cannot be pickled."
        )
    return f"ad.save({str(target)!r}): {what}; {kept} and no temporary file was left. {todo}"


def _fsync_folder(folder: Path) -> None:
    if sys.platform.startswith("win"):
        return  # Windows cannot open a folder for fsync; the rename is already durable
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(
    path: PathLike,
    device: DeviceLike | None = "auto",
    *,
    weights_only: bool = True,
    mmap: bool = False,
    verify: bool = True,
) -> Any:
    """Read a checkpoint with every tensor on ``device``.

    >>> import tempfile, torch, anydevice as ad
    >>> path = ad.save({"w": torch.ones(2)}, f"{tempfile.mkdtemp()}/ckpt.pt")
    >>> ad.load(path, "meta")["w"].device
    device(type='meta')

    A checkpoint saved on a GPU loads on a machine without one: ``device="auto"`` is this
    machine's best device, ``"cpu"`` the CPU.

    Args:
        path: a file written by :func:`save` or ``torch.save``.
        device: any spec of :func:`anydevice.device`; ``None`` keeps each tensor on the
            device it was saved from.
        weights_only: as ``torch.load``: only tensors, containers and plain types, never
            arbitrary code. Pass ``False`` only for files you trust.
        mmap: as ``torch.load``: map the file instead of reading it (large checkpoints).
            Pair it with ``verify=False`` to keep the loading lazy.
        verify: check each record's CRC-32 before loading (torch does not).

    Returns:
        What was saved.

    Raises:
        CheckpointError: the file is empty, truncated, corrupt, or not a checkpoint; the
            message says which, with the path and size. A folder gets a message listing
            the checkpoints in it (or pointing to :func:`anydevice.load_state` for DCP).
        FileNotFoundError: there is no such file.
        pickle.UnpicklingError: ``weights_only=True`` refused an object (torch's message
            says how to allow it); not a sign of a damaged file.
    """
    file = checked_path(path, "load")
    if file.is_dir():
        raise CheckpointError(_folder_message(file), path=str(file))
    map_location = None if device is None else _select_device(device)
    if verify:
        _verify_or_raise(file)
    try:
        return torch.load(file, map_location=map_location, weights_only=weights_only, mmap=mmap)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:
        if str(e).startswith("Weights only load failed") and _damage(file) is None:
            raise  # a refused object, not a damaged file: torch says what to do
        raise CheckpointError(_load_failed(file, e), path=str(file)) from e
    except (RuntimeError, EOFError, ValueError, KeyError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(_load_failed(file, e), path=str(file)) from e


def _folder_message(folder: Path) -> str:
    start = f"ad.load({str(folder)!r}): that is a folder, not a checkpoint file"
    if (folder / ".metadata").is_file():
        return (
            f"{start}; it holds a distributed (DCP) checkpoint, which "
            "ad.load_state(path, model=..., optimizer=...) reads."
        )
    try:
        files = sorted(
            p.name
            for p in folder.iterdir()
            if p.suffix in (".pt", ".pth", ".ckpt", ".bin", ".tar") and p.is_file()
        )
    except OSError:
        files = []
    if files:
        shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        return f"{start}. Checkpoints in it: {shown}; pass one of them."
    return f"{start}, and it holds no .pt/.pth/.ckpt file. Pass the checkpoint file's path."


def damage(file: Path) -> str | None:
    """What is wrong with the checkpoint file ``file`` (its size, zip directory and every
    record's CRC-32, read once), or None if nothing is."""
    try:
        problem = _damage(file, check_crc=True)
    except FileNotFoundError:
        return f"{file.name} is missing"
    except OSError as e:
        return f"{file.name} cannot be read ({e.strerror})"
    return None if problem is None else problem.split(" Use an earlier checkpoint")[0]


def _verify_or_raise(file: Path) -> None:
    problem = _damage(file, check_crc=True)
    if problem is not None:
        raise CheckpointError(f"ad.load({str(file)!r}): {problem}", path=str(file))


def _damage(file: Path, *, check_crc: bool = False) -> str | None:
    """What is wrong with a checkpoint file, or ``None`` if nothing shows."""
    size = file.stat().st_size
    if size == 0:
        return "the file is empty (0 bytes): the save was interrupted or the disk was full."
    with open(file, "rb") as f:
        head = f.read(4)
        f.seek(max(0, size - (1 << 16) - 22))
        tail = f.read()
    if head != _ZIP_MAGIC:
        if head[:1] == b"\x80":  # a pickle: torch's legacy format, which has no checksums
            return None
        return (
            f"not a torch checkpoint: it starts with {head!r}, not a zip record or a pickle "
            f"({format_bytes(size)})."
        )
    if _ZIP_END not in tail:
        return (
            f"truncated: {format_bytes(size)} ({size} bytes) starting like a checkpoint, but "
            "the zip directory at its end is missing, so the write stopped early (a crash, "
            "a full disk, an interrupted copy). Use an earlier checkpoint; ad.save writes "
            "atomically, so its files are never partial."
        )
    try:
        with zipfile.ZipFile(file) as archive:
            if not check_crc:
                return None
            for info in archive.infolist():
                with archive.open(info) as member:
                    while member.read(_CHUNK):
                        pass
    except zipfile.BadZipFile as e:
        text = str(e)
        if "CRC" in text:
            record = text.split("'")[1] if "'" in text else "a record"
            return (
                f"corrupt: record {record!r} fails its CRC-32 check, so its bytes changed "
                "after it was written (disk, memory or transfer error). Use an earlier "
                "checkpoint or copy it again."
            )
        return (
            f"corrupt: its zip structure is damaged ({text}; {format_bytes(size)}). Use an "
            "earlier checkpoint or copy it again."
        )
    except (OSError, EOFError, ValueError) as e:
        return f"corrupt or truncated: reading its records failed ({type(e).__name__}: {e})."
    return None


def _load_failed(file: Path, e: BaseException) -> str:
    problem = _damage(file, check_crc=True)
    if problem is not None:
        return f"ad.load({str(file)!r}): {problem}"
    text = str(e)
    if "CUDA" in text and "is_available() is False" in text:
        return (
            f"ad.load({str(file)!r}): it was saved on a GPU and this machine has none; "
            'pass device="cpu" (or "auto") to load it here.'
        )
    return f"ad.load({str(file)!r}) failed: {type(e).__name__}: {text}"
