"""What the elastic agent is given for a launch: :class:`LaunchPlan`, pure data.

:func:`~anydevice.launching.elastic.plan` works it out from ``launch``'s arguments; the
agent (:mod:`.agent`), the rendezvous (:mod:`.rendezvous`, :mod:`.tenants`) and the
addressing (:mod:`.addressing`) read it. It sits below all of them, importing nothing of
the package, so that each may name it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LaunchPlan"]


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the elastic agent needs, worked out from ``launch``'s arguments (pure data)."""

    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    rdzv_endpoint: str
    rdzv_configs: dict[str, Any]
    run_id: str
    max_restarts: int
    start_method: str
    local_addr: str | None
    env: dict[str, str] = field(default_factory=dict)  #: set in the launcher for the run
    grace: float = 30.0  #: seconds the workers get to exit after a signal to the launcher
    hang_after: float = 30.0  #: seconds in one collective before the hang watch judges; 0: off

    @property
    def standalone(self) -> bool:
        """True when this is the only node."""
        return self.max_nodes == 1

    def describe(self) -> str:
        nodes = (
            str(self.min_nodes)
            if self.min_nodes == self.max_nodes
            else f"{self.min_nodes}:{self.max_nodes}"
        )
        return (
            f"{self.nproc_per_node} process(es) per node on {nodes} node(s), rendezvous "
            f"{self.rdzv_endpoint} (run id {self.run_id!r})"
        )
