"""Which address of this node the other nodes reach: for the workers' ``MASTER_ADDR`` and
the interface their sockets (gloo's pairs, NCCL's bootstrap) listen on.

torch takes ``socket.getfqdn()`` for the node that hosts the workers' store, and lets gloo
bind to whatever the hostname resolves to. Where the hostname resolves to ``127.0.0.1``
(many containers and VMs, Kaggle and Colab included) the nodes meet at the rendezvous and
then hang: node 1's workers are told ``MASTER_ADDR=localhost``, and node 0's listen on
loopback only.

The address that reaches the rendezvous is known without a packet: ``connect()`` a UDP
socket to it and read the socket's own address, the source address of the route the
kernel chose. Its interface is the one the workers' sockets should use.

Meeting at the rendezvous does not prove that the workers reach each other: a node that
gave a loopback address (``--local-addr 127.0.0.1``, or a hostname that resolves to it), or
a firewall that lets only the rendezvous port through, leaves them waiting in
``init_process_group`` for its timeout (30 minutes by default). :func:`check_reach` tries
those paths after the rendezvous, before any worker starts, within the launch's timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anydevice.errors import DistributedError, DistributedTimeoutError

if TYPE_CHECKING:
    from anydevice.launching.options import LaunchPlan

__all__ = [
    "NodeAddress",
    "check_reach",
    "interface_of",
    "local_address",
    "node_address",
    "route_source",
    "settle",
]

#: The variables that pick the interface gloo and NCCL listen on.
SOCKET_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class NodeAddress:
    """This node's address for a multi-node launch and the variables it implies."""

    addr: str  #: the workers' MASTER_ADDR where this node hosts, and the rendezvous' name for it
    interface: str | None  #: the interface that holds ``addr``, where one was found
    env: dict[str, str] = field(default_factory=dict)  #: socket variables to set for workers
    chosen: str = "route"  #: "route" (worked out) or "given" (``--local-addr``)


def route_source(host: str, port: int = 29400) -> str | None:
    """The local address the kernel would send from to reach ``host`` (no packet is sent).

    >>> route_source("127.0.0.1")
    '127.0.0.1'

    Returns:
        The address, or ``None`` where ``host`` does not resolve or no route reaches it.
    """
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, target in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(target)  # UDP: picks a route and a source address, sends nothing
                source = str(s.getsockname()[0])
        except OSError:
            continue
        if source and not ipaddress.ip_address(source.split("%")[0]).is_unspecified:
            return source
    return None


def interface_of(addr: str) -> str | None:
    """The name of the network interface that holds ``addr`` (``None`` where none does).

    >>> interface_of("127.0.0.1") in ("lo", "lo0")
    True
    """
    import psutil

    try:
        wanted = ipaddress.ip_address(addr.strip("[]").split("%")[0])
    except ValueError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(a.address.split("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
    return None


def node_address(
    rdzv_endpoint: str,
    local_addr: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> NodeAddress | None:
    """This node's address for a launch that meets at ``rdzv_endpoint``: ``local_addr``
    where given, else the source address of the route to the rendezvous; with the socket
    interface variables for gloo and NCCL set to its interface unless ``environ`` (default
    ``os.environ``) sets them already.

    >>> a = node_address("127.0.0.1:29400", environ={})
    >>> a.addr, a.env["GLOO_SOCKET_IFNAME"] == a.interface
    ('127.0.0.1', True)
    >>> node_address("127.0.0.1:29400", environ={"GLOO_SOCKET_IFNAME": "eth0"}).env
    {'NCCL_SOCKET_IFNAME': 'lo'}

    Returns:
        ``None`` where no route reaches the rendezvous (torch then falls back on the
        hostname, and the rendezvous' own error says the endpoint is unreachable).

    Raises:
        DistributedError: ``local_addr`` is not an address of this machine.
    """
    env = os.environ if environ is None else environ
    host, _, port = rdzv_endpoint.rpartition(":")
    if local_addr:
        addr = local_addr.strip()
        interface = interface_of(addr)
        if interface is None and _resolved(addr) is None:
            raise DistributedError(
                f"local_addr={local_addr!r} (--local-addr) is not an address or name of this "
                "machine: give the address of the interface the other nodes reach, e.g. "
                "the one `ip -brief addr` lists for the network they share."
            )
        interface = interface or interface_of(_resolved(addr) or addr)
        chosen = "given"
    else:
        found = route_source(host, int(port) if port.isdigit() else 29400)
        if found is None:
            return None
        addr, interface, chosen = found, interface_of(found), "route"
    extra = {}
    if interface is not None:
        extra = {name: interface for name in SOCKET_IFNAMES if name not in env}
    return NodeAddress(addr=addr, interface=interface, env=extra, chosen=chosen)


def _resolved(name: str) -> str | None:
    """``name``'s first address where it is one of this machine's, else ``None``."""
    try:
        infos = socket.getaddrinfo(name.strip("[]"), None)
    except (OSError, UnicodeError):
        return None
    for *_, target in infos:
        if interface_of(str(target[0])) is not None:
            return str(target[0])
    return None


def settle(chosen: LaunchPlan, local_addr: str | None = None) -> LaunchPlan:
    """``chosen`` with this node's address where several nodes meet beyond loopback:
    ``local_addr`` where given, else the route's source address (see :func:`node_address`),
    and the socket interface variables for the workers. One node, or nodes meeting on a
    loopback address, keep loopback as :func:`~anydevice.launching.elastic.plan` chose.

    Raises:
        DistributedError: ``local_addr`` is not an address of this machine.
    """
    if chosen.standalone and not local_addr:
        return chosen
    if chosen.local_addr is not None and not local_addr:
        return chosen  # the nodes meet on loopback: plan() kept them there
    found = node_address(chosen.rdzv_endpoint, local_addr)
    if found is None:
        return chosen
    return dataclasses.replace(chosen, local_addr=found.addr, env={**chosen.env, **found.env})


def local_address(host: str) -> str | None:
    """``host``'s address (``host`` itself where it is one) where that address belongs to
    this machine, else ``None``: the address to listen on for peers that were told
    ``host``.

    >>> local_address("127.0.0.1")
    '127.0.0.1'
    >>> local_address("203.0.113.77") is None
    True
    """
    if interface_of(host) is not None:
        return host.strip("[]").split("%")[0]
    return _resolved(host)


# ----------------------------------------------------------------------------- the check

#: The keys of the check, under the rendezvous round's prefix (one set per round).
_KEY = "anydevice.reach"

#: Seconds a node waits, past its own deadline, for the others to report theirs.
_REPORT_GRACE = 5.0

#: What to do where the workers of one node cannot reach another's.
_FIX = (
    "give each node the address the others reach it at, on the network they share "
    "(--local-addr, local_addr=; `ip -brief addr` lists them), not a loopback one or a "
    "hostname that resolves to one; leave GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unset "
    "(the launcher sets them to that address's interface) or set them to that interface; "
    "and let the firewall pass TCP between the nodes on every port (the workers' store and "
    "gloo's and NCCL's sockets listen on ports the system picks)."
)


def check_reach(
    store: Any,
    *,
    node: int,
    nodes: int,
    master_addr: str,
    master_port: int | None,
    listen_addr: str | None,
    timeout: float,
) -> None:
    """Check, after the rendezvous and before the workers start, that the workers of each
    node will reach the others', and raise on every node what failed where.

    Each node listens for the check on ``listen_addr`` (the address its workers' sockets
    listen on: ``--local-addr``, or the route's source address) and says where in
    ``store`` (the rendezvous round's); then tries, within ``timeout`` seconds,
    ``master_addr:master_port`` (the workers' store, served already where the agents share
    it; else node 0's listener for the check, on the same address) and the next node's
    listener (a ring: each node's address is tried by one other); and reports the result
    in ``store``, where every node reads all of them.

    Raises:
        DistributedTimeoutError: a node could not reach ``MASTER_ADDR`` or the next node
            within ``timeout`` (the message names the address, the node and what to do),
            or a node did not report in time.
    """
    deadline = time.monotonic() + timeout
    me = socket.gethostname()
    with _listener(listen_addr) as port:
        spot = {"host": me, "addr": listen_addr, "port": port}
        store.set(f"{_KEY}/at/{node}", json.dumps(spot))
        failed = _try(
            store,
            node=node,
            nodes=nodes,
            master=(master_addr, master_port),
            deadline=deadline,
            timeout=timeout,
        )
        store.set(f"{_KEY}/said/{node}", failed or "")
        if failed:
            store.add(f"{_KEY}/failed", 1)
        store.add(f"{_KEY}/done", 1)
        # Stay listening until every node has tried this one, or its time is up.
        while store.add(f"{_KEY}/done", 0) < nodes:
            if time.monotonic() > deadline + _REPORT_GRACE:
                silent = [q for q in range(nodes) if not store.check([f"{_KEY}/said/{q}"])]
                raise DistributedTimeoutError(
                    "The nodes met at the rendezvous, but node(s) "
                    f"{', '.join(map(str, silent))} did not say within {timeout:g} s whether "
                    "their workers reach the others: they stopped or are stuck (their output "
                    "says why)."
                )
            time.sleep(0.1)
    if store.add(f"{_KEY}/failed", 0) == 0:  # one request where all went well
        return
    said = {q: store.get(f"{_KEY}/said/{q}").decode() for q in range(nodes)}
    failing = [q for q, text in said.items() if text]
    more = ""
    if len(failing) > 1:
        more = f" Node(s) {', '.join(map(str, failing[1:]))} failed too (their output says how)."
    raise DistributedTimeoutError(said[failing[0]] + more)


def _try(
    store: Any,
    *,
    node: int,
    nodes: int,
    master: tuple[str, int | None],
    deadline: float,
    timeout: float,
) -> str | None:
    """Try the paths this node's workers will take; ``None``, or what failed."""
    following = (node + 1) % nodes
    spots = {q: _spot(store, q, deadline) for q in {0, following}}
    addr, port = master
    first, ahead = spots[0] or {}, spots[following] or {}
    said = (
        "gave the rendezvous that address (nodes are numbered as the rendezvous ranked "
        "them: the workers' GROUP_RANK)"
    )
    targets: list[tuple[str, str, int, str]] = []
    if port is not None:  # the workers' store, served already
        what = f"MASTER_ADDR={_joined(addr, port)}"
        targets.append((what, addr, port, f"Node 0 ({first.get('host', '?')}) {said}."))
    elif first.get("port") is not None:  # not yet: node 0's listener, on the same address
        what = f"MASTER_ADDR={addr}"
        targets.append((what, addr, first["port"], f"Node 0 ({first['host']}) {said}."))
    if ahead.get("port") is not None and all(
        (ahead["addr"], ahead["port"]) != (host, at) for _, host, at, _ in targets
    ):
        what = f"node {following}'s address {_joined(ahead['addr'], ahead['port'])}"
        whose = f"Node {following} ({ahead['host']}) {said}; its workers listen there."
        targets.append((what, ahead["addr"], ahead["port"], whose))
    for what, host, at, whose in targets:
        error = _reach(host, at, deadline)
        if error is not None:
            return (
                f"The nodes met at the rendezvous; the workers could not reach {what} from "
                f"node {node} ({socket.gethostname()}) within {timeout:g} s ({error}). "
                f"{whose} To fix it, " + _FIX
            )
    return None


def _spot(store: Any, node: int, deadline: float) -> dict[str, Any] | None:
    """Where ``node`` listens for the check, as it said in ``store``; ``None`` where it
    did not say before ``deadline``."""
    key = f"{_KEY}/at/{node}"
    while not store.check([key]):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    spot: dict[str, Any] = json.loads(store.get(key))
    return spot


def _reach(host: str, port: int, deadline: float) -> str | None:
    """Connect to ``host:port`` until one connection is accepted (``None``) or
    ``deadline`` passes (the last error, in words)."""
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return last
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=min(left, 2.0)):
                return None
        except OSError as e:
            last = e.strerror or str(e) or type(e).__name__
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))


@contextlib.contextmanager
def _listener(addr: str | None) -> Iterator[int | None]:
    """A socket listening on ``addr`` (a port the system picks) for the block, and its
    port; ``None`` where ``addr`` is not given or is not this machine's."""
    local = local_address(addr) if addr else None
    try:
        sock = listening_socket(local, 0, backlog=64) if local is not None else None
    except OSError:
        sock = None
    if sock is None:
        yield None
        return
    with sock:
        yield int(sock.getsockname()[1])


def listening_socket(addr: str, port: int, *, backlog: int) -> socket.socket:
    """A TCP socket bound to ``addr:port`` (port 0: one the system picks) and listening,
    on that address only; ``OSError`` where it cannot be, with nothing left open."""
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _joined(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
