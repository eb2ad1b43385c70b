"""Whether every rank called a collective of ours: a bounded wait at its door.

``save_state`` and ``load_state`` are collectives: every rank writes or reads its own part.
Called on rank 0 alone (the ``if rank == 0: torch.save(...)`` habit), their first
collective would wait for rank 1 until the group's timeout while rank 1 waits for rank 0
in its next backward's all-reduce; both time out, and the error names rank 1's backward,
not the call. So before any collective, each rank signs in at the default group's store
(one counter per call: ``add`` is atomic, the last to come sets a key the others wait
for) and the wait is bounded a little below the group's timeout, so that this error, which
names the call, the ranks that did not come and the fix, comes before the one of the
collective the other ranks wait in. A warning says so earlier, after a quarter of it.

Why a store and not a barrier: a barrier is a collective too (it would pair with the
backward's all-reduce on the other rank, or time out as that does), and the store can say
who signed in. The keys of a call are removed by rank 0 once every rank has signed in to
the next one.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch.distributed as dist

from anydevice import heartbeat
from anydevice.errors import DistributedTimeoutError
from anydevice.hardware.backends import torch_private

__all__ = ["enter", "group_timeout"]

logger = logging.getLogger("anydevice")

#: torch's default collective timeout where a group does not say its own (gloo's).
_DEFAULT_TIMEOUT = 1800.0

#: (the default group the counts belong to, calls so far per name)
_calls: tuple[Any, dict[str, int]] | None = None


def group_timeout(group: Any) -> float | None:
    """The collectives' timeout of ``group`` in seconds (the one ``ad.distributed(timeout=)``
    set), or None where the backend does not say."""
    timeout = torch_private.collective_timeout(group)
    return float(timeout.total_seconds()) if timeout is not None else None


def enter(what: str, *, rank: int, size: int, call: str) -> None:
    """Sign in to the collective ``what`` (``"save_state"``) and wait until every rank has.

    Args:
        what: the function, as its error names it.
        rank: this rank.
        size: the world's size.
        call: the call as the error shows it (``"ad.save_state('ckpt')"``).

    Raises:
        DistributedTimeoutError: some rank did not sign in within the bound; the message
            names them, the call, and that it must be made on every rank.
    """
    store = torch_private.default_store()
    if store is None or size == 1:
        return
    global _calls
    world = dist.group.WORLD
    if _calls is None or _calls[0] is not world:
        _calls = (world, {})
    n = _calls[1].get(what, 0)
    _calls[1][what] = n + 1
    key = f"anydevice/{what}/{n}"
    store.append(f"{key}/ranks", f"{rank},")
    if store.add(key, 1) == size:
        store.set(f"{key}/all", "1")
    bound = _bound(group_timeout(world))
    patience = bound / 4
    if not _wait(store, f"{key}/all", patience):
        missing = _missing(store, key, size)
        logger.warning(
            "%s: waiting for rank(s) %s, which have not called %s (%.0f s so far). %s",
            call,
            missing,
            what,
            patience,
            _why(what, missing),
        )
        if not _wait(store, f"{key}/all", bound - patience):
            missing = _missing(store, key, size)
            raise DistributedTimeoutError(
                f"{call}: rank(s) {missing} did not call {what} within {bound:.0f} s "
                f"({size - len(missing)} of {size} ranks did). {_why(what, missing)}"
            )
    if rank == 0 and n > 0:  # every rank has left the wait of the call before
        _forget(store, f"anydevice/{what}/{n - 1}")


def _forget(store: Any, key: str) -> None:
    for suffix in ("", "/ranks", "/all"):
        try:
            store.delete_key(key + suffix)
        except (RuntimeError, NotImplementedError):  # a store that cannot delete keys
            return


def _bound(timeout: float | None) -> float:
    """A little below the group's timeout: this error comes before the collective's."""
    total = timeout if timeout and timeout > 0 else _DEFAULT_TIMEOUT
    return max(total - min(0.1 * total, 30.0), 0.5 * total)


def _wait(store: Any, key: str, seconds: float) -> bool:
    try:
        store.wait([key], datetime.timedelta(seconds=max(seconds, 0.01)))
    except RuntimeError:  # DistStoreError: the wait timed out
        return False
    return True


def _missing(store: Any, key: str, size: int) -> list[int]:
    try:
        text = store.get(f"{key}/ranks").decode()
    except RuntimeError:
        return []
    came = {int(r) for r in text.split(",") if r.strip().isdigit()}
    return [r for r in range(size) if r not in came]


def _why(what: str, missing: list[int]) -> str:
    """Why ranks ``missing`` have not come: their processes ended, where this machine's
    heartbeats of this job say so, else the call is not made on every rank."""
    ended = _ended(missing)
    if ended:
        said = ", ".join(f"rank {r} (pid {pid})" for r, pid in sorted(ended.items()))
        return (
            f"The process of {said} has ended: its own output says why; the launcher stops "
            "or restarts the others."
        )
    return (
        f"{what} is collective: call it on every rank (each writes or reads its own part), "
        "not under `if rank == 0:` as with torch.save; rank 0 alone writes the files that "
        "are shared. Or a rank's process has ended: its own output says why."
    )


def _ended(ranks: list[int]) -> dict[int, int]:
    """Of ``ranks``, those whose process on this machine has ended (rank -> pid), by the
    heartbeats of this job (the launcher's run id) that no live process writes any more."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if not job:
        return {}
    ended: dict[int, int] = {}
    live: set[int] = set()
    for beat in heartbeat.read_all(prune=False):
        if beat.rank not in ranks or beat.details.get("run_id") != job:
            continue
        if beat.alive:
            live.add(beat.rank)
        else:
            ended[beat.rank] = beat.pid
    return {r: pid for r, pid in ended.items() if r not in live}  # a restarted rank lives
