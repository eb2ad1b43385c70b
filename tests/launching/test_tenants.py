"""Nodes under different run ids at one rendezvous store are named, not waited for: the
watch on a real ``TCPStore`` holding torch's own rendezvous states, and two real
launchers on 127.0.0.1 started with different ``--rdzv-id``."""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

import anydevice as ad
from anydevice.launching import tenants
from ranks import free_port, process_tree_guard


@dataclass
class _Plan:  # what the watch reads of a LaunchPlan
    run_id: str
    rdzv_endpoint: str = "127.0.0.1:29400"


@pytest.fixture
def store():
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    yield TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    del server


def _put(store: Any, run_id: str, *, complete=False, closed=False, silent=False) -> None:
    """torch's rendezvous state for ``run_id``, with one participant, into ``store``."""
    state = _RendezvousState()
    node = _NodeDesc("10.0.0.7", 4242, 0)
    state.participants[node] = 0
    state.complete, state.closed = complete, closed
    beat = datetime.now(timezone.utc) - (timedelta(minutes=5) if silent else timedelta(0))
    state.last_heartbeats[node] = beat
    store.set(f"torch.rendezvous.{run_id}", base64.b64encode(pickle.dumps(state)))


def _watch(store: Any, run_id: str, *, client: bool, clock: Any = None) -> tenants.Watch:
    plan: Any = _Plan(run_id)
    watch = tenants.Watch(store, plan, client=client, clock=clock or _Clock())
    watch.joining = True
    return watch


class _Clock:
    """Seconds that pass only when told to (each look is a second after the last)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += tenants._EVERY
        return self.now


def test_a_client_that_sees_another_run_waiting_stops_naming_both_and_tells_both(store):
    _put(store, "alpha")
    watch = _watch(store, "beta", client=True)
    with pytest.raises(ad.DistributedError) as info:
        watch.look()
    message = str(info.value)
    assert "'beta' (this node) and 'alpha' (10.0.0.7 pid 4242)" in message, message
    assert "give every node the same --rdzv-id (run_id=)" in message
    for run in ("alpha", "beta"):  # the nodes of both runs are told
        told = json.loads(store.get(f"anydevice.rendezvous.mismatch.{run}"))
        assert (told["run_id"], told["other"]) == ("beta", "alpha")


def test_the_host_that_is_told_keeps_serving_a_moment_then_stops_naming_the_other(store):
    host = _watch(store, "alpha", client=False)
    _put(store, "beta")
    host.look()  # the host itself never stops on what it sees: its store would go with it
    client = _watch(store, "beta", client=True)
    _put(store, "alpha")
    with pytest.raises(ad.DistributedError):
        client.look()
    looks = 0
    with pytest.raises(ad.DistributedError) as info:
        while looks < 10:
            host.look()  # told: it lingers, so that the others read the notice too
            looks += 1
    assert looks == tenants._LINGER / tenants._EVERY  # it went on serving, then stopped
    assert "'alpha' (this node) and 'beta' (" in str(info.value)


@pytest.mark.parametrize("other", [{"complete": True}, {"closed": True}, {"silent": True}], ids=str)
def test_a_run_that_does_not_wait_is_left_alone(store, other):
    _put(store, "alpha", **other)  # another job at work, finished, or gone silent
    _watch(store, "beta", client=True).look()


def test_nothing_is_looked_at_outside_a_join(store):
    _put(store, "alpha")
    plan: Any = _Plan("beta")
    watch = tenants.Watch(store, plan, client=True, clock=_Clock())
    watch.look()  # not joining: the keep-alive's reads, the check before the join


def test_a_run_id_is_found_through_the_list_the_nodes_add_to(store, monkeypatch):
    """Where the store cannot list its keys (torch before 2.10), the run ids anydevice's
    nodes add to a list of their own name the other run."""
    plan: Any = _Plan("alpha")
    tenants.Watch(store, plan, client=False)
    _put(store, "alpha")
    watch = _watch(store, "beta", client=True)
    monkeypatch.setattr(watch, "store", _Unlisted(store))
    with pytest.raises(ad.DistributedError, match="'beta' \\(this node\\) and 'alpha'"):
        watch.look()


class _Unlisted:
    """A store as torch before 2.10 has it: no ``list_keys``."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        if name == "list_keys":
            raise AttributeError(name)
        return getattr(self._store, name)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_nodes_with_different_run_ids_are_told_so_not_left_to_time_out():
    """`--rdzv-id alpha` on node 0 and `beta` on node 1: both waited the whole timeout,
    then said "Not all nodes joined" (node 0) and "closed the connection" (node 1)."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "ANYDEVICE_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    ended = []
    with process_tree_guard():
        nodes = []
        for rank, run_id in ((0, "alpha"), (1, "beta")):
            flags = ["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint]
            flags += ["--rdzv-id", run_id, "--timeout", "90", "-m", "json.tool", "--help"]
            argv = [sys.executable, "-m", "anydevice", "launch", "-n", "1", *flags]
            nodes.append(
                subprocess.Popen(
                    argv,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                    env=env,
                )
            )
        for node in nodes:
            try:
                _, err = node.communicate(timeout=300)
            finally:
                if node.poll() is None:
                    os.killpg(node.pid, signal.SIGKILL)
                    node.communicate()
            ended.append((node.returncode, err))
    for (code, err), (ours, other) in zip(
        ended, (("alpha", "beta"), ("beta", "alpha")), strict=True
    ):
        assert code == 1, err
        last = err.strip().splitlines()[-1]
        assert last.startswith(
            f"anydevice launch: Nodes came to the rendezvous at {endpoint} under two run ids: "
            f"'{ours}' (this node) and '{other}' ("
        ), err
        assert "give every node the same --rdzv-id (run_id=)" in last
        assert "Not all nodes joined" not in err
