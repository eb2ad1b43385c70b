"""What a launch is asked (:class:`LaunchOptions`) and what the elastic agent is given
(:class:`LaunchPlan`): pure data.

``ad.launch`` and ``anydevice launch`` take the options as arguments and flags;
:func:`~anydevice.launching.elastic.plan` works the plan out from them; the agent
(:mod:`.agent`), the rendezvous (:mod:`.rendezvous`, :mod:`.tenants`) and the addressing
(:mod:`.addressing`) read the plan. This module sits below all of them, importing nothing
of the package, so that each may name both.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LaunchOptions", "LaunchPlan"]


@dataclass(frozen=True)
class LaunchOptions:
    """How to launch, as ``ad.launch`` takes it (its keyword arguments, same names and
    defaults, documented there): one record that ``launch``, ``anydevice launch`` and
    :func:`~anydevice.launching.elastic.plan` pass on. Unchecked:
    :func:`~anydevice.launching.arguments.check` judges them (:meth:`given`).

    >>> LaunchOptions(nprocs=2).given("log_dir", "verbose", "local_addr")["nprocs"]
    2
    """

    nprocs: int | str = "auto"
    nnodes: int | str = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    run_id: str | None = None
    max_restarts: int = 0
    start_method: str = "spawn"
    timeout: float = 300.0
    grace: float = 30.0
    hang_after: float = 30.0
    verbose: bool = False
    local_addr: str | None = None
    #: last, as :meth:`given` lists them: checking it makes the folder
    log_dir: str | os.PathLike[str] | None = None

    def given(self, *leave_out: str) -> dict[str, Any]:
        """The options by name, but ``leave_out``, in the order they are checked (``log_dir``
        last: a check makes the folder, so it comes after every refusal)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in leave_out
        }


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
