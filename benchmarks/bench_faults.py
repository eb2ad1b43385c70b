"""Launches under faults, side by side with torchrun: time to a clean error, who is blamed,
what is left behind.

Each case runs real processes (gloo on the CPU) in a session of their own, with ``TMPDIR``
pointed at a fresh folder, so that what a launch leaves there is seen:

* **raise**: rank 1 raises while rank 0 waits in a barrier (``--runs`` times: is rank 1
  named every time?); seconds from the raise to the launcher's exit.
* **hang**: rank 1 of 3 never reaches the all_reduce ranks 0 and 2 wait in (timeout 10 s);
  seconds from the all_reduce to the exit; is rank 1 named, with its line?
* **unreachable** / **missing node**: node 1 of 2 with nothing at the endpoint, node 0 of 2
  alone (timeout 5 s); seconds to the exit.
* **SIGKILL / SIGTERM / SIGINT to the launcher**: seconds until every worker is gone (or
  still running after 30 s), the exit code, how many lines it printed.
* **listening**: the addresses the launcher and its workers listen on.
* **lines**: 2 ranks print 2000 lines each at once (``print``, and ``sys.stdout.write`` in
  pieces that now and then pause mid-line); how many of the 4000 arrive cut or merged.
* **daemons**: SIGKILL to the launcher while both workers keep starting daemons that
  double-fork with an empty environment; how many of them are still running 10 s later.
* **run ids**: two nodes on 127.0.0.1 started with different run ids (``--rdzv-id``,
  timeout 30 s); seconds to the exit, and whether each node's error names the other's id.

``python benchmarks/bench_faults.py [--runs 20] [--src DIR]``; ``--src`` runs another
checkout's ``src`` (e.g. the code before a change) for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from report import Result, save

RAISE = """\
import os, sys, time
import anydevice as ad
with ad.distributed(timeout=60) as d:
    d.barrier()
    if d.rank == 1:
        open(os.path.join(sys.argv[1], "fault"), "w").write(repr(time.time()))
        raise ZeroDivisionError("rank one divides by zero")
    d.barrier()
"""

API_RAISE = """\
import os, sys, time
import anydevice as ad

def train(folder):
    with ad.distributed(timeout=60) as d:
        d.barrier()
        if d.rank == 1:
            open(os.path.join(folder, "fault"), "w").write(repr(time.time()))
            raise ZeroDivisionError("rank one divides by zero")
        d.barrier()

if __name__ == "__main__":
    try:
        ad.launch(train, sys.argv[1], nprocs=2, timeout=60)
    except ad.WorkerFailedError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
"""

HANG = """\
import os, sys, time
import torch
import anydevice as ad
with ad.distributed(timeout=10) as d:
    d.barrier()
    if d.rank == 1:
        time.sleep(600)  # HANGS HERE
    if d.rank == 0:
        open(os.path.join(sys.argv[1], "fault"), "w").write(repr(time.time()))
    ad.all_reduce(torch.ones(1))
"""

SLEEP = """\
import os, sys, time
open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w").write(str(os.getpid()))
if "LISTEN" in os.environ:
    import anydevice as ad
    with ad.distributed(timeout=60) as d:
        d.barrier()
        if d.rank == 0:
            import psutil
            top = psutil.Process(os.getppid())
            found = sorted({c.laddr.ip for p in [top, *top.children(recursive=True)]
                            for c in p.net_connections("inet") if c.status == "LISTEN"})
            print("LISTENING", " ".join(found), flush=True)
        d.barrier()
    sys.exit(0)
time.sleep(600)
"""


LINES = """\
import os, sys, time
folder, rank = sys.argv[1], os.environ["RANK"]
open(os.path.join(folder, "ready" + rank), "w").close()
while len([n for n in os.listdir(folder) if n.startswith("ready")]) < 2:
    time.sleep(0.01)
for i in range(2000):
    if i % 2:
        print(f"rank {rank} line {i}")
    else:
        sys.stdout.write(f"rank {rank} ")
        if i % 10 == 0:
            time.sleep(0.001)
        sys.stdout.write(f"line {i}")
        sys.stdout.write("\\n")
"""

DAEMONS = """\
import os, sys, time
folder, rank = sys.argv[1], os.environ["RANK"]
open(os.path.join(folder, f"rank{rank}.pid"), "w").write(str(os.getpid()))
n = 0
while True:
    n += 1
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            open(os.path.join(folder, f"d{rank}-{n}.daemon"), "w").write(str(os.getpid()))
            os.execve("/bin/sleep", ["sleep", "60"], {})
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(0.02)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Case:
    """One launch in its own session and TMPDIR, with a folder for pids and fault times."""

    def __init__(self, argv: list[str], src: str | None, **extra: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="fault-tmp-"))
        self.notes = Path(tempfile.mkdtemp(prefix="fault-notes-"))
        env = {**os.environ, "TMPDIR": str(self.tmp), "ANYDEVICE_DEVICE": "cpu"}
        env.update(extra)
        if src:
            env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
        self.start = time.time()
        self.proc = subprocess.Popen(
            [a.replace("{notes}", str(self.notes)) for a in argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )

    def pids(self, count: int) -> list[int]:
        deadline = time.monotonic() + 180
        while len(list(self.notes.glob("*.pid"))) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        return [int(p.read_text()) for p in self.notes.glob("*.pid")]

    def finish(self, timeout: float = 240) -> dict[str, Any]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate()
        ended = time.time()
        fault = self.notes / "fault"
        return {
            "code": self.proc.returncode,
            "out": out,
            "err": err,
            "ended": ended,
            "seconds": ended - (float(fault.read_text()) if fault.exists() else self.start),
        }

    def left(self, pids: list[int], grace: float = 5.0) -> dict[str, Any]:
        """Workers still running and files in TMPDIR ``grace`` seconds after the exit."""
        time.sleep(grace)
        alive = [p for p in pids if _running(p)]
        files = sorted(p.name for p in self.tmp.iterdir())
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return {"alive": len(alive), "files": files}


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def launchers(script: Path, n: int, *extra: str) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "anydevice launch": [py, "-m", "anydevice", "launch", "-n", str(n), *extra, str(script)],
        "torchrun": [py, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                     *(extra or ["--standalone"]), str(script)],
    }  # fmt: skip


def blamed(err: str) -> str:
    """The rank a launcher's report blames first (anydevice's summary, torchrun's root cause)."""
    err = err[err.index("Root Cause") :] if "Root Cause" in err else err
    for line in err.splitlines():
        if line.startswith(("anydevice launch: Rank", "Rank")):
            head = line.split(":", 1)[1] if line.startswith("anydevice") else line
            return head.split()[1].rstrip("(s)")
        if line.strip().startswith("rank ") and ":" in line:  # torchrun's "rank : 1 (local...)"
            return line.split(":", 1)[1].split()[0]
    return "?"


def raise_runs(folder: Path, runs: int, src: str | None) -> dict[str, Any]:
    (folder / "raise.py").write_text(RAISE)
    (folder / "api_raise.py").write_text(API_RAISE)
    argvs = launchers(folder / "raise.py", 2)
    argvs["ad.launch"] = [sys.executable, str(folder / "api_raise.py")]
    out: dict[str, Any] = {}
    for name, argv in argvs.items():
        count = runs if name != "torchrun" else max(3, runs // 4)

        def one(_: int, argv: list[str] = argv) -> dict[str, Any]:
            case = Case([*argv, "{notes}"], src)
            res = case.finish()
            return {**res, **case.left([], grace=1.0), "blamed": blamed(res["err"])}

        with ThreadPoolExecutor(2) as pool:  # two at a time: 2 x 2 workers on 2 cores
            done = list(pool.map(one, range(count)))
        out[name] = {
            "runs": count,
            "named": sum(d["blamed"] == "1" for d in done),
            "seconds": sorted(d["seconds"] for d in done),
            "files": sorted({f for d in done for f in d["files"]}),
            "stderr_lines": sorted(len(d["err"].splitlines()) for d in done),
        }
        print(f"  raise  {name:<17} rank 1 named {out[name]['named']}/{count}", flush=True)
    return out


def hang(folder: Path, src: str | None) -> dict[str, Any]:
    (folder / "hang.py").write_text(HANG)
    out = {}
    for name, argv in launchers(folder / "hang.py", 3).items():
        case = Case([*argv, "{notes}"], src)
        res = case.finish()
        left = case.left([])
        out[name] = {
            "seconds": res["seconds"],
            "blamed": blamed(res["err"]),
            "stack": "HANGS HERE" in res["err"] or "line 7 in <module>" in res["err"],
            "stderr_lines": len(res["err"].splitlines()),
            **left,
        }
        print(f"  hang   {name:<17} {out[name]}", flush=True)
    return out


def unreachable(folder: Path, src: str | None) -> dict[str, Any]:
    (folder / "sleep.py").write_text(SLEEP)
    out = {}
    for node, label in ((1, "unreachable"), (0, "missing node")):
        port = free_port()
        extra_ad = ["--nnodes", "2", "--node-rank", str(node), "--timeout", "5",
                    "--rdzv-endpoint", f"127.0.0.1:{port}"]  # fmt: skip
        extra_tr = ["--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--rdzv-conf", "join_timeout=5"]  # fmt: skip
        for name in ("anydevice launch", "torchrun"):
            argv = launchers(
                folder / "sleep.py", 1, *(extra_ad if name != "torchrun" else extra_tr)
            )
            case = Case([*argv[name], "{notes}"], src)
            res = case.finish(timeout=300)
            out[f"{label} / {name}"] = {
                "seconds": res["seconds"],
                "code": res["code"],
                "stderr_lines": len(res["err"].splitlines()),
                **case.left([], grace=1.0),
            }
            print(f"  {label:<12} {name:<17} {out[f'{label} / {name}']}", flush=True)
    return out


def signals(folder: Path, src: str | None) -> dict[str, Any]:
    (folder / "sleep.py").write_text(SLEEP)
    out = {}
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
        for name, argv in launchers(folder / "sleep.py", 2).items():
            case = Case([*argv, "{notes}"], src)
            pids = case.pids(2)
            sent = time.time()
            os.kill(case.proc.pid, sig)
            exited = None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (
                exited is None or any(_running(p) for p in pids)
            ):
                if exited is None and case.proc.poll() is not None:
                    exited = time.time() - sent
                time.sleep(0.02)
            gone = time.time() - sent
            survivors = [p for p in pids if _running(p)]
            for pid in survivors:  # measured: now end them, or the pipes never close
                os.kill(pid, signal.SIGKILL)
            res = case.finish(timeout=60)
            out[f"{sig.name} / {name}"] = {
                "workers_gone_s": None if survivors else gone,
                "still_running_after_30s": len(survivors),
                "exit_s": exited,
                "code": res["code"],
                "stderr_lines": len(res["err"].splitlines()),
                "leaked_semaphore": "leaked semaphore" in res["err"],
                **case.left(pids),
            }
            print(f"  {sig.name:<7} {name:<17} {out[f'{sig.name} / {name}']}", flush=True)
    return out


def listening(folder: Path, src: str | None) -> dict[str, Any]:
    (folder / "sleep.py").write_text(SLEEP)
    out = {}
    for name, argv in launchers(folder / "sleep.py", 2).items():
        case = Case([*argv, "{notes}"], src, LISTEN="1")
        res = case.finish()
        line = next((x for x in res["out"].splitlines() if x.startswith("LISTENING")), "")
        out[name] = sorted(set(line.split()[1:]))
        print(f"  listen {name:<17} {out[name]}", flush=True)
    return out


def lines(folder: Path, src: str | None) -> dict[str, Any]:
    import re

    (folder / "lines.py").write_text(LINES)
    whole = re.compile(r"rank \d line \d+")
    out = {}
    for name, argv in launchers(folder / "lines.py", 2).items():
        case = Case([*argv, "{notes}"], src)
        res = case.finish()
        got = res["out"].splitlines()
        out[name] = {
            "lines": len(got),
            "cut_or_merged": sum(not whole.fullmatch(x) for x in got),
            **case.left([], grace=1.0),
        }
        print(f"  lines  {name:<17} {out[name]}", flush=True)
    return out


def daemons(folder: Path, src: str | None) -> dict[str, Any]:
    (folder / "daemons.py").write_text(DAEMONS)
    out = {}
    for name, argv in launchers(folder / "daemons.py", 2).items():
        case = Case([*argv, "{notes}"], src)
        workers = case.pids(2)
        deadline = time.monotonic() + 60
        while len(list(case.notes.glob("*.daemon"))) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(case.proc.pid, signal.SIGKILL)
        time.sleep(10)
        started = [int(p.read_text() or 0) for p in case.notes.glob("*.daemon")]
        alive = [p for p in started if p and _running(p)]
        running = [p for p in workers if _running(p)]
        for pid in running:  # measured: now end them and all they started
            os.kill(pid, signal.SIGKILL)
        for pid in [int(p.read_text() or 0) for p in case.notes.glob("*.daemon")]:
            if pid and _running(pid):
                os.kill(pid, signal.SIGKILL)
        case.finish(timeout=60)
        out[name] = {
            "daemons_started": len(started),
            "alive_10s_after": len(alive),
            "workers_alive_10s_after": len(running),
        }
        print(f"  daemons {name:<16} {out[name]}", flush=True)
    return out


def run_ids(folder: Path, src: str | None) -> dict[str, Any]:
    (folder / "sleep.py").write_text(SLEEP)
    out = {}
    for name in ("anydevice launch", "torchrun"):
        port = free_port()
        cases = []
        for node, run_id in ((0, "alpha"), (1, "beta")):
            if name == "torchrun":
                extra = ["--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                         "--rdzv-conf", "join_timeout=30"]  # fmt: skip
            else:
                extra = ["--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
                         f"127.0.0.1:{port}", "--rdzv-id", run_id, "--timeout", "30"]  # fmt: skip
            argv = launchers(folder / "sleep.py", 1, *extra)[name]
            cases.append(Case([*argv, "{notes}"], src))
        ends = [c.finish(timeout=300) for c in cases]
        for c in cases:
            c.left([], grace=1.0)
        out[name] = {
            "seconds": [round(e["seconds"], 1) for e in ends],
            "codes": [e["code"] for e in ends],
            "names_the_other_id": [
                other in e["err"].splitlines()[-1] if e["err"].strip() else False
                for e, other in zip(ends, ("'beta'", "'alpha'"), strict=True)
            ],
            "stderr_lines": [len(e["err"].splitlines()) for e in ends],
        }
        print(f"  run ids {name:<16} {out[name]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--src", default=None, help="another checkout's src/ to measure")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    parts = {
        "listening": lambda: listening(folder, args.src),
        "raise": lambda: raise_runs(folder, args.runs, args.src),
        "hang": lambda: hang(folder, args.src),
        "unreachable": lambda: unreachable(folder, args.src),
        "signals": lambda: signals(folder, args.src),
        "lines": lambda: lines(folder, args.src),
        "daemons": lambda: daemons(folder, args.src),
        "run_ids": lambda: run_ids(folder, args.src),
    }
    load = os.getloadavg()[0]
    found = {k: fn() for k, fn in parts.items() if not args.only or k in args.only}
    name = "launch-faults" + (f"-{'-'.join(args.only)}" if args.only else "")
    result = Result(name + ("-src" if args.src else ""), "s")
    for name, r in found.get("raise", {}).items():
        result.add(f"raise / {name}", r["seconds"])
    for name, r in found.get("hang", {}).items():
        result.add(f"hang / {name}", [r["seconds"]])
    for name, r in found.get("unreachable", {}).items():
        result.add(name, [r["seconds"]])
    for name, r in found.get("signals", {}).items():
        result.add(f"{name} (workers gone)", [r["workers_gone_s"] or float("inf")])
    for name, r in found.get("run_ids", {}).items():
        result.add(f"run ids / {name}", r["seconds"])
    result.notes.append("seconds from the fault to a clean error (or to the last worker gone)")
    result.notes.append(f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    result.extra = found
    save(result)
    print(json.dumps(found, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
