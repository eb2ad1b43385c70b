"""The runs that share a rendezvous store: nodes that came under another run id are named.

torch's c10d rendezvous keeps each run's state under its own key of the store
(``torch.rendezvous.<run id>``). Nodes started with different run ids (``--rdzv-id`` on
one node and not on another, or a typo) reach the same store and each waits for peers
that are waiting under the other key, until the join times out — five minutes by
default, with a message that never says why. While this node joins, a :class:`Watch`
looks at the store about once a second (each time torch's join reads its own state):

* it finds the other runs by the store's keys (``list_keys``, torch 2.10 and later) and by
  a list each anydevice node adds its run id to (``anydevice.rendezvous.run_ids``);
* a node that is the store's client and sees another run **waiting** there (not
  complete, not closed, a participant alive) leaves a notice for both runs
  (``anydevice.rendezvous.mismatch.<run id>``) and stops, naming both run ids and the fix;
* a node that finds a notice for its run stops with the same message. The node that
  hosts the store stops 2 s after it first sees the notice, so that the other nodes, which
  look once a second, read it before the store goes away with it.

A run that is complete (another job at work on a store shared on purpose) or closed is
left alone, as is one whose participants have all gone silent.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import socket
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from anydevice.errors import DistributedError

if TYPE_CHECKING:
    from anydevice.launching.options import LaunchPlan

__all__ = ["Watch", "alive", "state_of"]

#: How long torch's rendezvous keeps a silent node (its keep-alive interval, times the
#: beats it may miss): a participant heard from within this is alive.
ALIVE = timedelta(seconds=5 * 3)

#: Where torch's c10d backend keeps each run's state (the run id follows).
_STATE = "torch.rendezvous."

#: The run ids of the anydevice nodes that came to this store, one per line.
_RUN_IDS = "anydevice.rendezvous.run_ids"

#: A notice to the nodes of a run (the run id follows) that another run waits here.
_NOTICE = "anydevice.rendezvous.mismatch."

#: Seconds between two looks at the store.
_EVERY = 1.0

#: Seconds the store's host keeps serving after it first sees a notice, before it stops.
_LINGER = 2.0


class Watch:
    """Looks, while this node joins ``chosen``'s rendezvous on ``store``, for nodes that
    came under another run id (see the module docstring). ``client`` says whether this
    node reaches the store as a client (True) or hosts it; ``clock`` gives the seconds."""

    def __init__(
        self,
        store: Any,
        chosen: LaunchPlan,
        *,
        client: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.chosen = chosen
        self.client = client
        self.clock = clock
        self.joining = False  #: set while torch's join runs (its thread reads the state)
        self._next = 0.0
        self._noticed: float | None = None
        with contextlib.suppress(Exception):  # a store without these: nothing is told
            store.delete_key(_NOTICE + chosen.run_id)  # a notice of an earlier launch
            store.append(_RUN_IDS, chosen.run_id + "\n")

    def look(self) -> None:
        """Stop (raise) where another run waits here, or a notice for this run says so;
        return at once where the last look was less than a second ago."""
        now = self.clock()
        if not self.joining or now < self._next:
            return
        self._next = now + _EVERY
        try:
            notice = self._notice()
            if notice is not None:
                if self.client or self._lingered(now):
                    raise self._error(*notice)
                return
            for other in self._others():
                waiting = _waiting(state_of(self.store, other))
                if waiting is not None and self.client:
                    self._tell(other, waiting)
                    raise self._error(other, waiting)
        except DistributedError:
            raise
        except Exception:  # the store itself failing is for torch's join to say
            return

    # ------------------------------------------------------------------------- internals

    def _others(self) -> list[str]:
        found: set[str] = set()
        with contextlib.suppress(Exception):
            keys = self.store.list_keys()  # torch 2.10 and later
            found |= {k[len(_STATE) :] for k in keys if k.startswith(_STATE) and "/" not in k}
        with contextlib.suppress(Exception):
            if self.store.check([_RUN_IDS]):
                found |= set(self.store.get(_RUN_IDS).decode(errors="replace").split())
        found.discard(self.chosen.run_id)
        return sorted(found)

    def _notice(self) -> tuple[str, str] | None:
        """(the other run id, where its nodes are) from a notice for this run."""
        key = _NOTICE + self.chosen.run_id
        if not self.store.check([key]):
            return None
        told = json.loads(self.store.get(key))
        if told["run_id"] == self.chosen.run_id:  # from a node of this run: the other's nodes
            return str(told["other"]), str(told["nodes"])
        return str(told["run_id"]), str(told["by"])  # from a node of the other run

    def _tell(self, other: str, nodes: str) -> None:
        """Leave a notice for the nodes of both runs: this node saw ``other`` waiting, its
        ``nodes`` there."""
        by = f"{socket.gethostname()} pid {os.getpid()}"
        notice = json.dumps(
            {"run_id": self.chosen.run_id, "other": other, "by": by, "nodes": nodes}
        )
        for run in (other, self.chosen.run_id):
            self.store.set(_NOTICE + run, notice)

    def _lingered(self, now: float) -> bool:
        if self._noticed is None:
            self._noticed = now
        return now - self._noticed >= _LINGER

    def _error(self, other: str, where: str) -> DistributedError:
        chosen = self.chosen
        return DistributedError(
            f"Nodes came to the rendezvous at {chosen.rdzv_endpoint} under two run ids: "
            f"{chosen.run_id!r} (this node) and {other!r} ({where}). The nodes of one job "
            "must give the same run id, or each waits for peers that wait under the other "
            "until the timeout: give every node the same --rdzv-id (run_id=), or none (all "
            "then use 'anydevice')."
        )


def state_of(store: Any, run_id: str) -> Any | None:
    """The state torch's c10d rendezvous keeps for ``run_id`` in ``store``, or None where
    there is none (or it cannot be read)."""
    key = _STATE + run_id
    try:
        if not store.check([key]):
            return None
        return pickle.loads(base64.b64decode(store.get(key)))  # what torch itself reads there
    except Exception:  # the null sentinel before the first write, or another format
        return None


def alive(state: Any, node: Any) -> bool:
    """Whether ``node``, a participant of the rendezvous ``state``, was heard from lately
    (one without a heartbeat on record counts as alive)."""
    beat = getattr(state, "last_heartbeats", {}).get(node)
    if not isinstance(beat, datetime):
        return True
    now = datetime.now(timezone.utc)
    if beat.tzinfo is None:
        now = now.replace(tzinfo=None)
    return now - beat < ALIVE


def _waiting(state: Any) -> str | None:
    """Where a run whose rendezvous ``state`` waits for nodes has its nodes (``host pid
    N``, ...); None where it does not wait (complete, closed, or all silent)."""
    if state is None or getattr(state, "closed", True) or getattr(state, "complete", True):
        return None
    nodes = [n for n in getattr(state, "participants", {}) if alive(state, n)]
    if not nodes:
        return None
    return ", ".join(f"{getattr(n, 'addr', n)} pid {getattr(n, 'pid', '?')}" for n in nodes)
