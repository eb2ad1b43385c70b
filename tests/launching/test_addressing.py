"""This node's address for a multi-node launch: the source address of the route to the
rendezvous, its interface for gloo and NCCL, ``--local-addr`` over both. Real sockets and
this machine's real interfaces (the two-host proof is tests/infra/test_two_hosts.py)."""

from __future__ import annotations

import dataclasses
import re
import socket

import psutil
import pytest

import anydevice as ad
from anydevice.launching import addressing
from anydevice.launching.addressing import interface_of, node_address, route_source
from anydevice.launching.elastic import _plan_here, plan
from anydevice.launching.environment import detect
from anydevice.launching.options import LaunchOptions


def _outward() -> tuple[str, str]:
    """An IPv4 address of this machine beyond loopback, and its interface."""
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address, name
    pytest.skip("this machine has no IPv4 address beyond loopback to route to")


def test_route_to_loopback_leaves_from_loopback():
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == addressing.interface_of(route_source("localhost") or "")


def test_route_to_an_own_address_leaves_from_it_on_its_interface():
    addr, name = _outward()
    assert route_source(addr) == addr
    assert interface_of(addr) == name


def test_unresolvable_host_has_no_route():
    assert route_source("no-such-host.invalid") is None
    assert interface_of("203.0.113.77") is None
    assert interface_of("not an address") is None


def test_socket_variables_follow_the_route_unless_the_user_set_them():
    addr, name = _outward()
    found = node_address(f"{addr}:29400", environ={})
    assert found is not None
    assert (found.addr, found.interface, found.chosen) == (addr, name, "route")
    assert found.env == {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}
    mine = node_address(f"{addr}:29400", environ={"NCCL_SOCKET_IFNAME": "ib0"})
    assert mine is not None and mine.env == {"GLOO_SOCKET_IFNAME": name}


def test_local_addr_wins_over_the_route():
    addr, _ = _outward()
    found = node_address(f"{addr}:29400", local_addr="127.0.0.1", environ={})
    assert found is not None
    assert (found.addr, found.chosen) == ("127.0.0.1", "given")
    assert found.env["GLOO_SOCKET_IFNAME"] == interface_of("127.0.0.1")


def test_local_addr_not_of_this_machine_is_refused_with_the_fix():
    with pytest.raises(
        ad.DistributedError, match=r"local_addr='203\.0\.113\.77'.*--local-addr.*ip -brief"
    ):
        node_address("127.0.0.1:29400", local_addr="203.0.113.77", environ={})


def test_several_nodes_beyond_loopback_get_the_routes_address_not_the_hostname(monkeypatch):
    # Where the hostname resolves to 127.0.0.1 torch's default (getfqdn) told the other
    # nodes' workers MASTER_ADDR=<hostname>, and gloo listened on loopback only.
    addr, name = _outward()
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    options = LaunchOptions(nprocs=2, nnodes=2, node_rank=0, rdzv_endpoint=f"{addr}:29400")
    chosen = _plan_here(detect({}), dataclasses.replace(options, timeout=30.0))
    assert chosen.local_addr == addr
    assert chosen.env["GLOO_SOCKET_IFNAME"] == name == chosen.env["NCCL_SOCKET_IFNAME"]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    chosen = _plan_here(detect({}), dataclasses.replace(options, node_rank=1, timeout=30.0))
    assert "GLOO_SOCKET_IFNAME" not in chosen.env


def test_one_node_and_loopback_meetings_stay_on_loopback():
    one = addressing.settle(plan(2))
    assert (one.local_addr, one.env) == ("127.0.0.1", plan(2).env)
    both = plan(2, LaunchOptions(nnodes=2, rdzv_endpoint="127.0.0.1:29400"))
    assert addressing.settle(both) == both


PROBE = """
import os, sys
from datetime import timedelta
from anydevice.cli.commands import quiet_lookup_warnings
quieted = quiet_lookup_warnings() if sys.argv[1] == "quiet" else None
from torch.distributed import TCPStore
try:  # nobody listens on port 1: c10d warns (W) that it retries, then gives up
    TCPStore("127.0.0.1", 1, is_master=False, timeout=timedelta(seconds=1))
except Exception:
    pass
print("QUIETED", quieted, "TORCH_CPP_LOG_LEVEL" in os.environ, flush=True)
"""


@pytest.mark.parametrize("mode", ["quiet", "loud"])
def test_the_launcher_keeps_c10d_warnings_out_and_its_workers_keep_theirs(mode):
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(addressing.__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    warned = re.search(r"^\[W\d.*\[c10d\].*retrying", done.stderr, re.M) is not None
    if mode == "quiet":
        assert "QUIETED True False" in done.stdout  # the workers it starts see no level
        assert not warned, done.stderr
    else:
        assert warned, done.stderr


# ----------------------------------------------------------------------------- the check


def _closed_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_on_two_nodes(masters: list[tuple[str, int | None]], listen: list[str | None]):
    """check_reach for nodes 0 and 1 on threads, sharing a real TCPStore: what each raised
    (or None), and the seconds each took."""
    import threading
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    got: dict[int, BaseException | None] = {}
    took: dict[int, float] = {}

    def node(rank: int) -> None:
        store = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
        start = time.monotonic()
        try:
            addressing.check_reach(
                store,
                node=rank,
                nodes=2,
                master_addr=masters[rank][0],
                master_port=masters[rank][1],
                listen_addr=listen[rank],
                timeout=2,
            )
            got[rank] = None
        except BaseException as e:
            got[rank] = e
        took[rank] = time.monotonic() - start

    threads = [threading.Thread(target=node, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return got, took


def test_nodes_that_reach_master_addr_and_each_other_pass_the_check():
    with socket.socket() as store:  # the workers' store, served by node 0's agent
        store.bind(("127.0.0.1", 0))
        store.listen()
        master = ("127.0.0.1", int(store.getsockname()[1]))
        got, _ = _check_on_two_nodes([master, master], ["127.0.0.1", "127.0.0.1"])
    assert got == {0: None, 1: None}


def test_a_node_that_cannot_reach_master_addr_stops_every_node_saying_where():
    from anydevice.errors import DistributedTimeoutError

    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen()
        port = int(store.getsockname()[1])
        closed = _closed_port()
        # Node 1 is told an address where nothing serves the store: its own loopback.
        got, took = _check_on_two_nodes(
            [("127.0.0.1", port), ("127.0.0.1", closed)], ["127.0.0.1", "127.0.0.1"]
        )
    for rank in (0, 1):
        error = got[rank]
        assert isinstance(error, DistributedTimeoutError), error
        text = str(error)
        assert text.startswith(
            f"The nodes met at the rendezvous; the workers could not reach "
            f"MASTER_ADDR=127.0.0.1:{closed} from node 1 ({socket.gethostname()}) within 2 s"
        ), text
        assert "Connection refused" in text and "--local-addr" in text and "firewall" in text
        assert took[rank] >= 2  # node 1 tried for the whole timeout


def test_a_node_whose_workers_listen_where_the_next_cannot_reach_is_named():
    """The workers' store is reached, but the next node's address is not: node 1 says (in
    the store, as its check does) that it listens where nothing accepts, as a node whose
    workers listen on its own loopback would be, seen from another host."""
    import json
    from datetime import timedelta

    from torch.distributed import TCPStore

    from anydevice.errors import DistributedTimeoutError

    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    closed = _closed_port()
    server.set(
        "anydevice.reach/at/1", json.dumps({"host": "n1", "addr": "127.0.0.1", "port": closed})
    )
    server.set("anydevice.reach/said/1", "")
    server.add("anydevice.reach/done", 1)
    # No store served yet (torch's unshared store, which a worker serves later): node 0's
    # own listener stands for MASTER_ADDR, and is reached.
    with pytest.raises(DistributedTimeoutError) as info:
        addressing.check_reach(
            server,
            node=0,
            nodes=2,
            master_addr="127.0.0.1",
            master_port=None,
            listen_addr="127.0.0.1",
            timeout=1,
        )
    text = str(info.value)
    assert "MASTER_ADDR" not in text.split("(")[0], text
    assert text.startswith(
        f"The nodes met at the rendezvous; the workers could not reach node 1's address "
        f"127.0.0.1:{closed} from node 0"
    ), text


# ----------------------------------------------------------------------------- listening


def _listening() -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_the_stores_of_several_nodes_listen_on_this_nodes_address_only():
    """The rendezvous store that node 0 serves, and the workers' store that the
    rendezvous' node 0 serves (torch's handler makes it), listen on the address the peers
    were told, not on every interface as torch's do."""
    from anydevice.launching import rendezvous

    addr, _ = _outward()
    with socket.socket() as s:
        s.bind((addr, 0))
        port = int(s.getsockname()[1])
    chosen = addressing.settle(
        plan(1, LaunchOptions(nnodes=2, node_rank=0, rdzv_endpoint=f"{addr}:{port}"))
    )
    assert chosen.local_addr == addr
    with rendezvous.open_rendezvous(chosen, 10) as handler:
        workers = handler._create_tcp_store_server(chosen.local_addr, 0)
        listening = _listening()
        for at in (port, workers.port):
            assert (addr, at) in listening, listening
            assert not {("0.0.0.0", at), ("::", at)} & listening, listening
        del workers


def test_a_name_that_resolves_to_loopback_here_keeps_torchs_listener():
    from anydevice.launching.rendezvous import _listen_address

    addr, _ = _outward()
    assert _listen_address(addr) == addr
    assert _listen_address("localhost") == "127.0.0.1"
    assert _listen_address("[::1]") == "::1"
    assert _listen_address("203.0.113.77") is None  # not this machine's: torch's store
    name = socket.gethostname()
    resolved = addressing.local_address(name)
    if resolved is None or not resolved.startswith("127."):
        pytest.skip(f"{name!r} does not resolve to loopback here (it does in many containers)")
    # The peers may resolve it to this node's address: listening on loopback would lose them.
    assert _listen_address(name) is None


@pytest.mark.parametrize("libuv", [True, False], ids=["libuv", "before-torch-2.8"])
def test_a_store_served_on_a_bound_socket_answers_on_either_backend(monkeypatch, libuv):
    """Before torch 2.8 the libuv store refused a socket it was handed (torch 2.6 and 2.7
    raised NotImplementedError): the older store serves on it there."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from anydevice.launching import rendezvous

    monkeypatch.setattr(rendezvous, "_libuv_takes_a_socket", lambda: libuv)
    server = rendezvous._served_on("127.0.0.1", 0, timedelta(seconds=10))
    assert server.libuvBackend is libuv
    assert ("127.0.0.1", server.port) in _listening()
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert server.get("key") == b"value"
