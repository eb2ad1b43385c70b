"""Two hosts on one machine: two network namespaces joined by a veth pair, with private
addresses that exist only inside them, each with its own hostname (``unshare --uts``) and
its own ``/etc/hosts`` (``/etc/netns/NAME/hosts``, which ``ip netns exec`` mounts).

What it proves: ``anydevice launch --nnodes 2 --rdzv-endpoint <node 0>:PORT`` on each host
meets, trains a DDP model over gloo across the link and reaches the weights one host reaches
on the whole batch; and it does so where each host's name resolves to 127.0.0.1 (many
containers, Kaggle, Colab), where the workers must be told the address that reaches the
rendezvous rather than the hostname's. While they train, nothing of the launch listens on
every interface of a host (``ss -ltn`` in its namespace): the stores and gloo's sockets
listen on its address on the link. And where a node gives an address the other cannot
reach (loopback), both stop within ``--timeout``, saying which address from which node,
where the workers waited out ``init_process_group``'s 30 minutes.

Everything is started here and stopped by pid; the namespaces, the veth pair and the
``/etc/netns`` entries are removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).resolve().parents[2] / "src"
PORT = 29400
STEPS = 5
TIMEOUT = 10  #: --timeout where a launch is to fail

TRAIN = textwrap.dedent(
    f"""
    import os
    import socket
    import subprocess
    import sys

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import anydevice as ad

    if __name__ == "__main__":
        with ad.distributed() as d:
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            g = torch.Generator().manual_seed(1)
            x = torch.randn(16, 4, generator=g)
            y = x.sum(1, keepdim=True) + 1.0
            ddp = DDP(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            xs, ys = x[d.rank :: d.world_size], y[d.rank :: d.world_size]
            for _ in range({STEPS}):
                opt.zero_grad()
                torch.nn.functional.mse_loss(ddp(xs), ys).backward()
                opt.step()
            print("RANK", d.rank, "OF", d.world_size, "ON", socket.gethostname(), flush=True)
            print("MASTER_ADDR", os.environ["MASTER_ADDR"], flush=True)
            print("MASTER_PORT", os.environ["MASTER_PORT"], flush=True)
            print("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME"), flush=True)
            d.barrier()  # every store and socket of the launch is up on both hosts
            # What listens on this host (its namespace holds this launch alone).
            listening = subprocess.run(
                ["ss", "-ltnH"], capture_output=True, text=True, check=True
            ).stdout
            for line in listening.splitlines():
                print("LISTENING", line.split()[3], flush=True)
            d.barrier()
            if d.rank == 0:
                torch.save(model.state_dict(), sys.argv[1])
    """
)


#: Rank 0 runs a 4th all_reduce while rank 1 runs a broadcast: the hang watch stops the
#: job with one verdict, printed by one host.
MISMATCH = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    import anydevice as ad

    if __name__ == "__main__":
        with ad.distributed(timeout=300) as d:
            t = torch.ones(4)
            for _ in range(3):
                dist.all_reduce(t)
            if d.rank == 0:
                dist.all_reduce(t)  # RANK 0
            else:
                dist.broadcast(t, 0)  # RANK 1
    """
)


def one_host_weights() -> dict[str, torch.Tensor]:
    """The same steps on the whole batch in this process: what DDP must reach."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=g)
    y = x.sum(1, keepdim=True) + 1.0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


@dataclass
class Hosts:
    names: tuple[str, str]  #: the namespaces
    veths: tuple[str, str]  #: each one's end of the veth pair
    addrs: tuple[str, str]
    hostnames: tuple[str, str]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)


def _needs() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root: run `make test-infra` as root")
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not installed (Debian: iproute2, util-linux, hostname)")


def _hosts(loopback_hostnames: bool) -> Iterator[Hosts]:
    _needs()
    tag = f"ad{os.getpid() % 100000}{'l' if loopback_hostnames else 'd'}"
    names = (f"{tag}n0", f"{tag}n1")
    net = 16 + os.getpid() % 200 + (1 if loopback_hostnames else 0)
    addrs = (f"10.231.{net}.1", f"10.231.{net}.2")
    hostnames = (f"{tag}-node0", f"{tag}-node1")
    made: list[str] = []
    try:
        for ns in names:
            r = _run("ip", "netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"`ip netns add` failed here ({r.stderr.strip()}): no namespaces")
            made.append(ns)
        veth = (f"{tag}a", f"{tag}b")
        steps = [
            ("ip", "link", "add", veth[0], "netns", names[0], "type", "veth", "peer", "name",
             veth[1], "netns", names[1]),
        ]  # fmt: skip
        for ns, dev, addr in zip(names, veth, addrs, strict=True):
            steps += [
                ("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                ("ip", "-n", ns, "link", "set", dev, "up"),
                ("ip", "-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            r = _run(*step)
            assert r.returncode == 0, f"{' '.join(step)}: {r.stderr}"
        for ns, hostname, addr in zip(names, hostnames, addrs, strict=True):
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            if loopback_hostnames:  # as in many containers: the hostname is loopback
                lines = [f"127.0.0.1 localhost {hostname}"]
            else:
                lines = ["127.0.0.1 localhost"] + [
                    f"{a} {h}" for a, h in zip(addrs, hostnames, strict=True)
                ]
            (etc / "hosts").write_text("\n".join(lines) + "\n")
            r = _run("ip", "netns", "exec", ns, "getent", "hosts", hostname)
            assert r.returncode == 0
            assert r.stdout.split()[0] == ("127.0.0.1" if loopback_hostnames else addr)
        yield Hosts(names, veth, addrs, hostnames)
    finally:
        for ns in made:
            r = _run("ip", "netns", "pids", ns)
            for pid in r.stdout.split():  # only what this test started lives there
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _run("ip", "netns", "del", ns)  # takes its end of the veth pair, and the pair
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


@pytest.fixture
def distinct_hostnames() -> Iterator[Hosts]:
    yield from _hosts(loopback_hostnames=False)


@pytest.fixture
def loopback_hostnames() -> Iterator[Hosts]:
    yield from _hosts(loopback_hostnames=True)


def _launch_both(
    hosts: Hosts,
    tmp_path: Path,
    extra: tuple[list[str], list[str]] = ([], []),
    timeout: int = 60,
    expect: int = 0,
    source: str = TRAIN,
) -> tuple[list[str], Path]:
    """``anydevice launch`` on both hosts (``extra``: each one's further options) of
    ``source``; their outputs, once both ended with ``expect``, and where rank 0 saves the
    weights."""
    script = tmp_path / "train.py"
    script.write_text(source)
    out = tmp_path / "weights.pt"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    procs = []
    for node, (ns, hostname) in enumerate(zip(hosts.names, hosts.hostnames, strict=True)):
        launch = [
            sys.executable, "-m", "anydevice", "launch", "--nnodes", "2", "--node-rank",
            str(node), "-n", "1", "--rdzv-endpoint", f"{hosts.addrs[0]}:{PORT}",
            "--timeout", str(timeout), *extra[node], str(script), str(out),
        ]  # fmt: skip
        inner = f"hostname {hostname} && exec " + " ".join(launch)
        procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", inner],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=tmp_path,
                start_new_session=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            # A launch meant to fail gets its timeout and time to start, not 30 minutes.
            outputs.append(p.communicate(timeout=150 if expect == 0 else timeout + 60)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == expect, f"node exited {p.returncode}:\n{text}"
    return outputs, out


def _check(hosts: Hosts, outputs: list[str], out: Path, restarts: bool = False) -> None:
    for node, text in enumerate(outputs):
        assert f"RANK {node} OF 2 ON {hosts.hostnames[node]}" in text, text
        # c10d's reverse lookups of peers without a name stay out of the launch's output.
        assert "hostname of the client socket cannot be retrieved" not in text, text
        # The workers meet at node 0's address on the link, over each node's end of it.
        assert f"MASTER_ADDR {hosts.addrs[0]}" in text, text
        assert f"GLOO_SOCKET_IFNAME {hosts.veths[node]}" in text, text
        # Nothing of the launch listens on every interface: only on the address the peer
        # reaches (the stores, gloo's sockets), or on loopback.
        listening = [line.split()[1] for line in text.splitlines() if line.startswith("LISTENING")]
        if restarts and node == 0:
            # Where the workers' store is not the agents' (restarts, node ranges), rank 0's
            # worker serves it as torch makes it, on every interface (docs/api.md).
            port = text.split("MASTER_PORT ", 1)[1].split()[0]
            wild = [f"{host}:{port}" for host in ("*", "0.0.0.0", "[::]")]
            assert len(set(wild) & set(listening)) == 1, listening
            listening = [at for at in listening if at not in wild]
        where = {at.rpartition(":")[0].strip("[]").split("%")[0] for at in listening}
        assert where <= {hosts.addrs[node], "127.0.0.1", "::1"}, listening
        assert hosts.addrs[node] in where, listening  # gloo's sockets, at least
        if node == 0:
            assert f"{hosts.addrs[0]}:{PORT}" in listening, listening  # the rendezvous store
    got = torch.load(out, weights_only=True)
    want = one_host_weights()
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_ddp_across_two_hosts(distinct_hostnames: Hosts, tmp_path: Path) -> None:
    outputs, out = _launch_both(distinct_hostnames, tmp_path)
    _check(distinct_hostnames, outputs, out)


def test_ddp_across_two_hosts_whose_hostnames_are_loopback(
    loopback_hostnames: Hosts, tmp_path: Path
) -> None:
    outputs, out = _launch_both(loopback_hostnames, tmp_path)
    _check(loopback_hostnames, outputs, out)


def test_workers_that_cannot_reach_master_addr_stop_within_the_timeout(
    distinct_hostnames: Hosts, tmp_path: Path
) -> None:
    """Node 0 gives a loopback address: the nodes meet at the rendezvous (on the link), and
    node 1's workers would be told ``MASTER_ADDR=127.0.0.1``, their own loopback, and wait
    out ``init_process_group``'s 30 minutes. Both nodes stop within the timeout instead,
    saying so. (Node 1 gives its name, which sorts after 127.0.0.1: node 0 is the
    rendezvous' node 0, whose address is ``MASTER_ADDR``.)"""
    hosts = distinct_hostnames
    start = time.monotonic()
    outputs, _ = _launch_both(
        hosts,
        tmp_path,
        extra=(["--local-addr", "127.0.0.1"], ["--local-addr", hosts.hostnames[1]]),
        timeout=TIMEOUT,
        expect=1,
    )
    took = time.monotonic() - start
    for text in outputs:
        assert "the nodes met at the rendezvous; the workers could not reach " in text.lower()
        assert "MASTER_ADDR=127.0.0.1:" in text, text
        assert f"from node 1 ({hosts.hostnames[1]}) within {TIMEOUT} s" in text, text
        assert "--local-addr" in text and "GLOO_SOCKET_IFNAME" in text, text
        assert "firewall" in text, text
        assert "cannot reach the rendezvous" not in text.lower(), text
        assert " OF 2 ON " not in text, text  # no worker started
    # The timeout, plus starting Python and torch twice on a shared machine.
    assert took < TIMEOUT + 60, took


def test_workers_that_cannot_reach_the_next_nodes_stop_within_the_timeout(
    distinct_hostnames: Hosts, tmp_path: Path
) -> None:
    """Node 0 gives a loopback address, node 1 the route's (its address on the link),
    which sorts first: node 1 is the rendezvous' node 0, whose address, ``MASTER_ADDR``,
    both reach; but node 0's workers would listen on its loopback, where node 1's cannot
    connect. Both nodes stop within the timeout, naming that address. (Gloo with these two
    nodes got through before, as node 0's side happens to open their connection; with
    NCCL, whose bootstrap ring connects each rank to the next one's listener, or a third
    node, the workers waited out init_process_group's 30 minutes.)"""
    hosts = distinct_hostnames
    start = time.monotonic()
    outputs, _ = _launch_both(
        hosts, tmp_path, extra=(["--local-addr", "127.0.0.1"], []), timeout=TIMEOUT, expect=1
    )
    took = time.monotonic() - start
    for text in outputs:
        assert (
            "The nodes met at the rendezvous; the workers could not reach node 1's address "
            "127.0.0.1:"
        ) in text, text
        assert f"from node 0 ({hosts.hostnames[1]}) within {TIMEOUT} s" in text, text
        assert " OF 2 ON " not in text, text
    assert took < TIMEOUT + 60, took


def test_ddp_across_two_hosts_with_restarts(distinct_hostnames: Hosts, tmp_path: Path) -> None:
    """With restarts the workers' store is not the agents' but rank 0's worker's, served
    once it starts: the check tries node 0's address in its stead."""
    restarts = ["--max-restarts", "1"]
    outputs, out = _launch_both(distinct_hostnames, tmp_path, extra=(restarts, restarts))
    _check(distinct_hostnames, outputs, out, restarts=True)


def test_a_mismatched_collective_across_two_hosts_stops_both_with_one_verdict(
    distinct_hostnames: Hosts, tmp_path: Path
) -> None:
    """Rank 0 (one host) runs all_reduce #4 while rank 1 (the other) runs broadcast #4:
    each host's launcher sees its own rank wait, the two share their states through the
    rendezvous store, and one of them prints the verdict naming both lines; both stop,
    exit 1, well within 60 s of the hang (not gloo's 30 minutes)."""
    start = time.monotonic()
    extra = ["--hang-after", "5"]
    outputs, _ = _launch_both(
        distinct_hostnames, tmp_path, extra=(extra, extra), timeout=60, expect=1, source=MISMATCH
    )
    took = time.monotonic() - start
    script = "train.py"  # the launches run in tmp_path: paths are shown relative to it
    lines = MISMATCH.splitlines()
    a = 1 + next(i for i, line in enumerate(lines) if line.endswith("# RANK 0"))
    b = 1 + next(i for i, line in enumerate(lines) if line.endswith("# RANK 1"))
    verdict = (
        f"rank 1 runs broadcast #4 at {script}:{b} while rank 0 runs all_reduce #4 at "
        f"{script}:{a}: the ranks call different collectives. The job was stopped"
    )
    said = [text for text in outputs if verdict in text]
    assert len(said) == 1, outputs  # printed once, by one host
    other = next(text for text in outputs if text is not said[0])
    assert "The job was stopped by the hang watch of node" in other, other
    assert "rank 0: in all_reduce #4 on float32[4]" in said[0]
    assert "rank 1: in broadcast #4 on float32[4]" in said[0]
    assert took < 150, took  # two launches' start on a shared machine, then seconds
