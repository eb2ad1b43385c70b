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
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from anydevice.distributed.elastic import LaunchPlan

__all__ = [
    "NodeAddress",
    "interface_of",
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
        ValueError: ``local_addr`` is not an address of this machine.
    """
    env = os.environ if environ is None else environ
    host, _, port = rdzv_endpoint.rpartition(":")
    if local_addr:
        addr = local_addr.strip()
        interface = interface_of(addr)
        if interface is None and _resolved(addr) is None:
            raise ValueError(
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
    loopback address, keep loopback as :func:`~anydevice.distributed.elastic.plan` chose.

    Raises:
        ValueError: ``local_addr`` is not an address of this machine.
    """
    if chosen.standalone and not local_addr:
        return chosen
    if chosen.local_addr is not None and not local_addr:
        return chosen  # the nodes meet on loopback: plan() kept them there
    found = node_address(chosen.rdzv_endpoint, local_addr)
    if found is None:
        return chosen
    return dataclasses.replace(chosen, local_addr=found.addr, env={**chosen.env, **found.env})
