"""Where the nodes of a launch meet: torch's c10d rendezvous store, every wait bounded.

torch's ``TCPStore`` client reads without a time limit: an endpoint that accepts the
connection and then says nothing (another program on that port, a node 0 that hangs or
was stopped) held a launch with ``--timeout 5`` for as long as it lived, deaf to SIGTERM.
Here each wait is bounded by the launch's ``timeout``, and the error says what answered:

* **connecting**: nothing accepted a connection (:func:`wait_until_reachable`);
* **the handshake**: something accepted but did not answer torch's store handshake — the
  client is made on a helper thread (so signals still reach the launcher) and its socket is
  shut down when the time is up;
* **each request** (get, set, compare-and-set, add) after that: the store's socket reads
  and writes with ``SO_RCVTIMEO``/``SO_SNDTIMEO`` set to ``timeout``, so a store that stops
  answering mid-way fails the request instead of hanging it.

**Nothing listens beyond the address the peers were told**: the rendezvous store listens
on the endpoint's address, and the workers' store (the one ``MASTER_ADDR`` names, which the
agent of the rendezvous' node 0 serves) on that node's address (``--local-addr``, or the
route's source address), each on a socket bound beforehand and handed to torch
(``TCPStore(master_listen_fd=...)``); torch's own listen on every interface. Where that
address is not this machine's, or is a name that resolves to loopback here (the peers may
resolve it otherwise), torch's are kept.

An endpoint that **another job** holds is named as such, rather than joined: node 0 whose
port is taken is told what holds it (a torch store, or which program), and a node that
reaches a rendezvous that is closed, or complete with all its nodes alive, is told that
another job holds the endpoint. One node with an endpoint always hosts it.

The helper thread and the socket look-up need ``/proc/self/fd`` or ``/dev/fd`` (Linux,
macOS); elsewhere the client is made as torch makes it.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import pickle
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from anydevice.errors import DistributedError, DistributedTimeoutError
from anydevice.hardware.backends import torch_private
from anydevice.launching import addressing, tenants

if TYPE_CHECKING:
    from anydevice.launching.options import LaunchPlan

__all__ = ["LOOPBACK", "closed", "open_rendezvous", "unreachable", "wait_until_reachable"]

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@contextlib.contextmanager
def open_rendezvous(chosen: LaunchPlan, timeout: int) -> Iterator[Any]:
    """torch's c10d rendezvous handler for the plan, its stores listening only on the
    addresses the peers were told (see the module's docstring); shut down afterwards.

    Raises:
        DistributedError: another job holds the endpoint (its port, or its rendezvous).
        DistributedTimeoutError: something at the endpoint accepted the connection but
            did not answer within ``timeout``.
        RendezvousConnectionError: (torch's) nothing accepted a connection in time, or a
            request to the store failed; :func:`unreachable` words it.
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    host, _, port_text = chosen.rdzv_endpoint.rpartition(":")
    port = int(port_text)
    is_host = chosen.rdzv_configs.get("is_host")
    if host in LOOPBACK:
        store, sockets = _loopback_store(chosen, host, port, is_host, timeout)
    else:
        store, sockets = _store(chosen, host, port, is_host, timeout)
    watch = tenants.Watch(store, chosen, client=sockets is not None)
    backend = _backend(store, chosen.run_id, sockets, watch)
    if sockets is not None:  # a client: the rendezvous there may be another job's
        _check_not_taken(backend, chosen)
    handler = _handler_type(watch).from_backend(
        chosen.run_id,
        store,
        backend,
        chosen.min_nodes,
        chosen.max_nodes,
        chosen.local_addr,
        timeout=RendezvousTimeout(join=timedelta(seconds=timeout)),
    )
    try:
        yield handler
    finally:
        with contextlib.suppress(Exception):
            handler.shutdown()


def wait_until_reachable(host: str, port: int, timeout: float) -> None:
    """Return once ``host:port`` accepts a connection; raise torch's
    ``RendezvousConnectionError`` after ``timeout`` seconds. (torch's store client waits
    its timeout per try, and tries twice with a pause between: about twice as long.)"""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousConnectionError(f"nothing accepted a connection: {last}")
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=min(left, 2.0)):
                return
        except OSError as e:
            last = e
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))


def unreachable(chosen: LaunchPlan, timeout: int, e: BaseException) -> DistributedError:
    """The error for torch's ``RendezvousConnectionError`` ``e``: what answered, and what
    did not."""
    cause: BaseException = e
    while cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(cause).strip()
    first = text.splitlines()[0] if text else type(cause).__name__
    where = chosen.rdzv_endpoint
    if "Socket Timeout" in text:
        return DistributedTimeoutError(
            f"The rendezvous store at {where} answered, then a request to it got no reply "
            f"within {timeout} s: the node that hosts it (node_rank=0) is stuck or stopped. "
            "Restart the launch on every node (timeout=, --timeout waits longer)."
        )
    if any(s in text for s in ("got 0 bytes", "Connection reset", "Broken pipe")):
        return DistributedError(
            f"The rendezvous store at {where} closed the connection ({first}): the node "
            "that hosts it (node_rank=0) has stopped. Its output says why; restart the "
            "launch on every node."
        )
    return DistributedTimeoutError(
        f"Cannot reach the rendezvous at {where} within {timeout} s ({first}). Start "
        "node_rank=0 on that host first, or fix the address and port (timeout=, --timeout "
        "waits longer)."
    )


def closed(chosen: LaunchPlan) -> DistributedError:
    """The error for a rendezvous that was closed under this node (torch's agent then
    returns no result)."""
    return DistributedError(
        f"The rendezvous {chosen.run_id!r} at {chosen.rdzv_endpoint} was closed while this "
        "node was in it: another node of this launch stopped (its output says why), or "
        f"{_ANOTHER_JOB} with the same run id finished. If another job uses that endpoint, "
        "choose another port for rdzv_endpoint (--rdzv-endpoint) or another run_id "
        "(--rdzv-id)."
    )


_ANOTHER_JOB = "another job on that endpoint"


# ----------------------------------------------------------------------------- the store


def _loopback_store(
    chosen: LaunchPlan, host: str, port: int, is_host: bool | None, timeout: int
) -> tuple[Any, set[int] | None]:
    """The rendezvous store at ``host:port`` on loopback, served here on a socket bound to
    loopback (``is_host``), or reached as a client within ``timeout``; and the client's
    sockets (None when served here). With ``is_host=None`` whoever binds the port first
    hosts, as torch does."""
    if is_host is not False:
        try:
            return _served_on_loopback(host, port, timedelta(seconds=max(timeout, 60))), None
        except OSError as e:
            if is_host:
                raise _port_taken(chosen, host, port, e, timeout) from e
    address = "::1" if host in ("::1", "[::1]") else "127.0.0.1"
    return _client(chosen, address, port, timeout)


def _store(
    chosen: LaunchPlan, host: str, port: int, is_host: bool | None, timeout: int
) -> tuple[Any, set[int] | None]:
    """The rendezvous store at a host beyond loopback, as torch's c10d backend makes it
    (hosting where ``is_host``, or where ``host`` names this machine and the port is free),
    with the client's waits bounded."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not re-exported
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    hosting = _matches_machine_hostname(host) if is_host is None else is_host
    if hosting:
        limit = timedelta(seconds=timeout)
        bind = _listen_address(host)
        try:
            if bind is not None:  # the peers reach this node there: listen there only
                return _served_on(bind, port, max(limit, timedelta(seconds=60))), None
            store = TCPStore(host, port, is_master=True, multi_tenant=True, timeout=limit)
            return store, None
        except (OSError, RuntimeError, ValueError, TimeoutError) as e:
            if is_host:
                raise _port_taken(chosen, host, port, e, timeout) from e
    return _client(chosen, host, port, timeout)


def _listen_address(host: str) -> str | None:
    """The address of this machine to serve ``host``'s peers on: ``host`` where it is one
    of this machine's addresses, or a name that resolves to one beyond loopback here;
    ``None`` otherwise (torch's store then listens on every interface)."""
    if host in LOOPBACK:
        return "::1" if host in ("::1", "[::1]") else "127.0.0.1"
    local = addressing.local_address(host)
    if local is None:
        return None
    try:
        ipaddress.ip_address(host.strip("[]").split("%")[0])
        return local  # an address of this machine, as the peers were told
    except ValueError:  # a name: the peers may resolve it otherwise if it is loopback here
        return None if ipaddress.ip_address(local.split("%")[0]).is_loopback else local


def _served_on_loopback(host: str, port: int, timeout: timedelta) -> Any:
    """A ``TCPStore`` server listening on ``host:port`` (port 0: one the OS picks), bound
    to loopback only."""
    return _served_on("::1" if host in ("::1", "[::1]") else "127.0.0.1", port, timeout)


def _served_on(addr: str, port: int, timeout: timedelta) -> Any:
    """A ``TCPStore`` server listening on address ``addr`` only, port ``port`` (0: one
    the OS picks)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not re-exported

    sock = addressing.listening_socket(addr, port, backlog=512)
    bound = int(sock.getsockname()[1])
    fd = sock.detach()  # the store owns the socket from here on and closes it
    return TCPStore(
        addr,
        bound,
        is_master=True,
        master_listen_fd=fd,
        timeout=timeout,
        wait_for_workers=False,
        **({} if _libuv_takes_a_socket() else {"use_libuv": False}),
    )


def _libuv_takes_a_socket() -> bool:
    """Whether torch's libuv store serves on a socket it is handed: from torch 2.8
    (pytorch#150215). From 2.4, where it became the default, it refused one
    (``NotImplementedError``); torch's older store (``use_libuv=False``) always took one."""
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 8)


def _handler_type(watch: tenants.Watch) -> type[Any]:
    """torch's rendezvous handler whose shared worker store (the one ``MASTER_ADDR`` and
    ``MASTER_PORT`` name, which the workers' process group uses) listens only on this
    node's address (:func:`_listen_address`), and whose joins ``watch`` looks over for
    nodes under another run id."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    class BoundRendezvousHandler(DynamicRendezvousHandler):
        def next_rendezvous(self) -> Any:
            watch.joining = True
            try:
                return super().next_rendezvous()
            finally:
                watch.joining = False

        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
            bind = _listen_address(master_addr)
            if bind is None:
                return super()._create_tcp_store_server(master_addr, master_port)
            return _served_on(bind, master_port, timedelta(minutes=30))

    torch_private.warn_missing_overrides(DynamicRendezvousHandler)
    return BoundRendezvousHandler


def _client(chosen: LaunchPlan, host: str, port: int, timeout: int) -> tuple[Any, set[int]]:
    """A ``TCPStore`` client of ``host:port`` whose connection, handshake and every later
    request each take at most ``timeout`` seconds, and its sockets.

    Raises:
        RendezvousConnectionError: (torch's) nothing accepted a connection, or the store
            refused the client.
        DistributedTimeoutError: something accepted the connection but did not answer.
    """
    wait_until_reachable(host, port, timeout)
    try:
        made = _handshake(host, port, timeout)
    except _Silent:
        raise DistributedTimeoutError(
            f"Something at {chosen.rdzv_endpoint} accepted the connection but did not "
            f"answer torch's store handshake within {timeout} s{_holder(port)}: it is not "
            "this launch's rendezvous store (another program on that port?), or the node "
            "that hosts it (node_rank=0) is stuck. Check the port in rdzv_endpoint "
            "(--rdzv-endpoint)."
        ) from None
    return made


class _Silent(Exception):
    """The endpoint accepted the connection but did not answer the handshake in time."""


def _handshake(host: str, port: int, timeout: int) -> tuple[Any, set[int]]:
    """torch's ``TCPStore`` client, made on a helper thread given ``timeout`` seconds, and
    its sockets, which then read and write with that timeout."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not re-exported
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def make() -> Any:
        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))

    before = _sockets_to(port)
    if before is None:  # no way to find the client's socket here: torch's own waits
        return make(), set()
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["store"] = make()
        except BaseException as e:  # handed to the launcher's thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="anydevice-rendezvous-connect", daemon=True).start()
    answered = False
    try:
        # A little past torch's own deadline, so that a cut connection is not retried.
        answered = done.wait(timeout + 0.5)
    finally:
        if not answered:
            _cut_new(port, before, done)
    if not answered:
        raise _Silent
    if "error" in box:
        error = box["error"]
        raise RendezvousConnectionError(str(error).strip().splitlines()[0]) from error
    sockets = (_sockets_to(port) or set()) - before
    for fd in sockets:
        _bound_io(fd, timeout)
    return box["store"], sockets


def _backend(store: Any, run_id: str, sockets: set[int] | None, watch: tenants.Watch) -> Any:
    """torch's c10d rendezvous backend on ``store``. Once a request through it fails, the
    client's ``sockets`` are shut down: the requests that follow (torch's agent and this
    module close the rendezvous on the way out) then fail at once, where each would wait
    its own timeout on a store that stopped answering. Each read of the state (about once
    a second while joining) lets ``watch`` look for nodes under another run id."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    class Backend(C10dRendezvousBackend):
        def get_state(self) -> Any:
            try:
                got = super().get_state()
            except RendezvousConnectionError:
                _shut(sockets or set())
                raise
            watch.look()
            return got

        def set_state(self, state: bytes, token: Any | None = None) -> Any:
            try:
                return super().set_state(state, token)
            except RendezvousConnectionError:
                _shut(sockets or set())
                raise

    return Backend(store, run_id)


def _shut(sockets: set[int]) -> None:
    for fd in sockets:
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as s:
            s.shutdown(socket.SHUT_RDWR)


def _cut_new(port: int, before: set[int], done: threading.Event) -> None:
    """Shut down the sockets to ``port`` opened since ``before`` until ``done`` (the
    client gave up), for at most 10 s."""
    deadline = time.monotonic() + 10
    with _quiet_fd2():
        while not done.is_set() and time.monotonic() < deadline:
            _shut((_sockets_to(port) or set()) - before)
            done.wait(0.05)


@contextlib.contextmanager
def _quiet_fd2() -> Iterator[None]:
    """Send file descriptor 2 to the null device for the block, then put it back.

    torch's C++ client logs each connection it loses with a page of native frames; the
    connection cut here is expected, and the error raised after says what happened.
    """
    sys.stderr.flush()
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _sockets_to(port: int) -> set[int] | None:
    """This process's file descriptors of TCP sockets connected to ``port`` (on any
    host), or None where they cannot be listed."""
    folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    found = set()
    for name in names:
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.type == socket.SOCK_STREAM and s.getpeername()[1] == port:
                    found.add(fd)
        except (OSError, ValueError, IndexError, TypeError):
            continue
    return found


def _bound_io(fd: int, seconds: float) -> None:
    """Make every read and write on socket ``fd`` fail after ``seconds`` of silence."""
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


# ----------------------------------------------------------------------------- another job


def _port_taken(
    chosen: LaunchPlan, host: str, port: int, e: BaseException, timeout: int
) -> Exception:
    """The error for a node that should host the rendezvous but cannot listen on its port."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    text = str(e)
    in_use = getattr(e, "errno", None) == errno.EADDRINUSE or "EADDRINUSE" in text
    if not in_use:
        return RendezvousConnectionError(f"cannot listen on {host}:{port}: {text}")
    holder = _holder(port)
    probe = "127.0.0.1" if host in LOOPBACK else host
    try:
        _handshake(probe, port, min(timeout, 3))
        answered = True  # a torch store: another job's rendezvous
    except Exception:
        answered = False
    if answered:
        return DistributedError(
            f"Another job holds the rendezvous endpoint {chosen.rdzv_endpoint}: a torch store "
            f"answers there{holder}. Choose another port for rdzv_endpoint "
            "(--rdzv-endpoint), the same on every node of this job, or another run_id "
            "(--rdzv-id) where jobs share that store on purpose."
        )
    return DistributedError(
        f"Port {port} of {host} is in use{holder or ' by another program'}, so this node "
        "cannot host the rendezvous there. Choose another port for rdzv_endpoint "
        "(--rdzv-endpoint), the same on every node."
    )


def _holder(port: int) -> str:
    """`` (pid N: command line)`` of the process listening on ``port`` here, if known."""
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr[1] == port and c.pid:
                command = " ".join(psutil.Process(c.pid).cmdline())
                if len(command) > 80:
                    command = command[:77] + "..."
                return f" (pid {c.pid}: {command})" if command else f" (pid {c.pid})"
    except Exception:  # not permitted, or gone: the pid is a courtesy
        pass
    return ""


def _check_not_taken(backend: Any, chosen: LaunchPlan) -> None:
    """Refuse to join a rendezvous that another job holds, since joining would disturb it
    (its agents restart their workers to let a new node in, and this node's exit closes
    the rendezvous under them): one that is closed (its job has finished), or, for a
    fixed number of nodes, one whose round is complete with another number of nodes, or
    with all of them alive. A round with as many nodes, some of them silent past torch's
    keep-alive, is joined: this node replaces a dead one, as torch intends. For a range
    of nodes only a round larger than its top is known to be another job's."""
    got = backend.get_state()
    if got is None:
        return
    try:
        state = pickle.loads(got[0])  # what torch's rendezvous itself reads there
    except Exception:
        return
    port = int(chosen.rdzv_endpoint.rpartition(":")[2])
    fix = "Choose another port for rdzv_endpoint (--rdzv-endpoint) or another run_id (--rdzv-id)."
    if getattr(state, "closed", False):
        raise DistributedError(
            f"The rendezvous {chosen.run_id!r} at {chosen.rdzv_endpoint} is closed: "
            f"{_ANOTHER_JOB} with the same run id has finished, and its store still answers"
            f"{_holder(port)}. {fix}"
        )
    if not getattr(state, "complete", False):
        return
    nodes = list(getattr(state, "participants", {}))
    alive = [n for n in nodes if tenants.alive(state, n)]
    if chosen.min_nodes != chosen.max_nodes:  # a range: only a larger round is another's
        other = len(nodes) > chosen.max_nodes
    else:
        other = len(nodes) != chosen.max_nodes or len(alive) >= chosen.max_nodes
    if other:
        raise DistributedError(
            f"Another job holds the rendezvous endpoint {chosen.rdzv_endpoint}: its "
            f"rendezvous {chosen.run_id!r} is under way with {len(nodes)} node(s), "
            f"{len(alive)} alive, where this launch has {chosen.max_nodes}{_holder(port)}. " + fix
        )
