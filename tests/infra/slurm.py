"""A SLURM cluster of two nodes on this machine, for the infra tests: ``munged``,
``slurmctld -i`` and two ``slurmd -N <name>`` on their own ports, all in the foreground
as children of the test, configured in a private folder (``SLURM_CONF``). The node names
are added to ``/etc/hosts`` (they must resolve, and must not be ``localhost``) and removed
again; every daemon is stopped by its pid and the folder is removed."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infra.runs import need_commands, need_root

NODES = ("adnode1", "adnode2")
HOSTS = Path("/etc/hosts")
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class Cluster:
    """A running two-node cluster; ``env`` reaches it (``SLURM_CONF``)."""

    folder: Path
    env: dict[str, str]
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def run(self, *command: str, timeout: float = 30) -> str:
        done = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(command)} exited {done.returncode}: {done.stderr}")
        return done.stdout

    def sbatch(self, script: str, *options: str) -> int:
        path = self.folder / f"job{time.monotonic_ns()}.sh"
        path.write_text("#!/bin/bash\n" + script)
        out = self.run("sbatch", "--parsable", f"--output={self.folder}/job-%j.out", *options,
                       str(path))  # fmt: skip
        return int(out.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", "-o", str(job))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job: int, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job} still {info.get('JobState')} ({info.get('Reason')}) after "
                    f"{timeout} s; output:\n{self.output(job)}"
                )
            time.sleep(0.5)

    def output(self, job: int) -> str:
        path = self.folder / f"job-{job}.out"
        return path.read_text() if path.exists() else "(none)"


def _config(folder: Path, munge_socket: Path) -> str:
    ctld, n1, n2 = _free_ports(3)
    me = socket.gethostname().split(".")[0]
    return f"""\
ClusterName=anydevice
SlurmctldHost={me}(127.0.0.1)
SlurmctldPort={ctld}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
InactiveLimit=0
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={NODES[0]} NodeAddr=127.0.0.1 Port={n1} CPUs=2 State=UNKNOWN
NodeName={NODES[1]} NodeAddr=127.0.0.1 Port={n2} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={NODES[0]},{NODES[1]} Default=YES State=UP OverSubscribe=YES
"""


@contextlib.contextmanager
def _node_names() -> Iterator[None]:
    line = f"127.0.0.1 {' '.join(NODES)}  # anydevice test-infra {os.getpid()}\n"
    try:
        with HOSTS.open("a") as f:
            f.write(line)
    except OSError as e:
        pytest.skip(f"cannot add the node names to {HOSTS} ({e}): SLURM needs them resolvable")
    try:
        yield
    finally:
        text = HOSTS.read_text()
        HOSTS.write_text(text.replace(line, ""))


@contextlib.contextmanager
def cluster() -> Iterator[Cluster]:
    """Start the cluster, yield it once both nodes are idle, stop it and remove it all."""
    need_root("a SLURM cluster")
    need_commands(
        "munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel",
        hint="apt-get install slurmctld slurmd slurm-client munge; make test-infra does it as root",
    )  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="ad-slurm-"))
    folder.chmod(0o755)
    (folder / "state").mkdir()
    key, sock = folder / "munge.key", folder / "munge.sock"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, sock))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    up = Cluster(folder, env)
    try:
        with _node_names():
            munge = [
                "munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
                f"--seed-file={folder}/munged.seed",
            ]  # fmt: skip
            up.daemons.append(_start(munge, env, folder / "munged.out"))
            _until(lambda: sock.exists(), 15, "munged did not open its socket", folder)
            up.daemons.append(_start(["slurmctld", "-D", "-i"], env, folder / "slurmctld.out"))
            for node in NODES:
                up.daemons.append(
                    _start(["slurmd", "-D", "-N", node], env, folder / f"slurmd-{node}.out")
                )

            def idle() -> bool:
                done = subprocess.run(
                    ["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True,
                    text=True, timeout=10,
                )  # fmt: skip
                states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
                return all(states.get(n) == "idle" for n in NODES)

            _until(idle, 60, "the two nodes did not become idle", folder)
            yield up
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["scancel", "--full", "-u", "root"], env=env, timeout=10)
        for daemon in reversed(up.daemons):
            _stop(daemon)
        shutil.rmtree(folder, ignore_errors=True)


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT)


def _stop(daemon: subprocess.Popen[bytes]) -> None:
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=10)


def _until(ready: object, timeout: float, what: str, folder: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                for p in sorted(folder.glob("*.out")) + sorted(folder.glob("*.log"))
            )
            raise AssertionError(f"{what} within {timeout} s:\n{logs}")
        time.sleep(0.3)
