"""The stream race detector's cost, and what it finds, on the simulated accelerator.

Three measurements, each in a child process (the simulator takes torch's privateuse1
slot for its whole process, and ``make bench`` runs every benchmark in one):

- **per operator**: small operators (``x + 1`` on 16 floats, an in-place add, a
  64x64 ``Linear`` training step) on the simulator with no detector (``races="off"``: no
  hook at all, measured before it starts), then with the detector on and paused (its hook
  present, doing nothing), those two interleaved in one process, against the same
  operators on the CPU. Target: the detector costs <= 5x per operator (the prototype cost
  42x).
- **this project's simulator test files** (``tests/sim_cases.py``, ``tests/race_cases.py``),
  run whole with the detector on, and without the cases that need it, off and on.
- **the detection table**: each bug class of ``tests/race_cases.py`` run N times at three
  link speeds (no delay, the default 2 GB/s, 10 MB/s), the detector's memory of reported
  races cleared between runs: reported in N of N runs; each correct twin: 0 reports and
  the right result.

``--build`` also times a cold build of the simulator into an empty cache (minutes on a
busy machine), with the CPU seconds it took, which do not depend on the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Result, machine, run_interleaved, save

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
LINKS = {"no delay": None, "2GB/s": "2GB/s", "10MB/s": "10MB/s"}


def per_op(rounds: int, n: int) -> Result:
    import torch

    from anydevice import testing
    from anydevice.testing import races

    dev = testing.enable(races="off")
    x = torch.ones(16, device=dev)
    host = torch.ones(16)
    model = torch.nn.Linear(64, 64).to(dev)
    data = torch.randn(32, 64, device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        model(data).square().mean().backward()
        opt.step()

    def timed(fn: object, count: int) -> float:
        torch.accelerator.synchronize()
        t = time.perf_counter()
        for _ in range(count):
            fn()  # type: ignore[operator]
        torch.accelerator.synchronize()
        return (time.perf_counter() - t) / count * 1e6

    bodies = {
        "x + 1": (lambda: x + 1, n),
        "x.add_(1)": (lambda: x.add_(1), n),
        "Linear training step": (step, max(1, n // 20)),
    }
    for fn, count in bodies.values():  # warm-up: meta kernels, caches
        timed(fn, count)
    cpu = run_interleaved({"x + 1": lambda: timed(lambda: host + 1, n)}, rounds)
    never = run_interleaved(
        {k: lambda f=f, c=c: timed(f, c) for k, (f, c) in bodies.items()}, rounds
    )
    testing.detect_races("raise")

    def mode(name: str, fn: object, count: int) -> float:
        races._set_mode(name)
        try:
            return timed(fn, count)
        finally:
            races._set_mode("raise")

    # The detector on and paused (its hook present, doing nothing), interleaved: the load
    # of a shared machine drifts between rounds, not between the two.
    both: dict[str, object] = {}
    for k, (f, c) in bodies.items():
        timed(f, c)
        both[f"{k}, detector on"] = lambda f=f, c=c: mode("raise", f, c)
        both[f"{k}, detector paused"] = lambda f=f, c=c: mode("off", f, c)
    measured = run_interleaved(both, rounds)  # type: ignore[arg-type]
    assert not races.race_reports(), races.race_reports()

    result = Result("races_per_op", "us/op", baseline="x + 1, no detector")
    result.add("x + 1 on the CPU", cpu["x + 1"])
    for label in bodies:
        result.add(f"{label}, no detector", never[label])
        result.add(f"{label}, detector paused", measured[f"{label}, detector paused"])
        result.add(f"{label}, detector on", measured[f"{label}, detector on"])
    for label in bodies:
        ratio = result.ratio(f"{label}, detector on", f"{label}, detector paused")
        result.notes.append(f"{label}: detector on / paused = {ratio:.2f}x (target <= 5x)")
    versus_cpu = result.ratio("x + 1, detector on", "x + 1 on the CPU")
    result.notes.append(f"x + 1, detector on / the CPU = {versus_cpu:.1f}x")
    result.notes.append(
        "'no detector' is measured before the detector starts, the other two interleaved "
        "after it: compare on with paused"
    )
    result.extra["rounds"], result.extra["ops"] = rounds, n
    save(result)
    return result


def _pytest(files: list[str], *extra: str, races: str | None = None) -> float:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if races is not None:
        env["ANYDEVICE_SIM_RACES"] = races
    argv = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider",
            "-p", "no:randomly", *extra]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT)
    elapsed = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return elapsed


def test_files(rounds: int) -> Result:
    files = [str(TESTS / "sim_cases.py")]
    # The cases that show a race need the detector on: left out of the off/on comparison.
    plain = ("-k", "not hazard and not removed")
    samples = run_interleaved(
        {
            "sim_cases.py, detector off": lambda: _pytest(files, *plain, races="off"),
            "sim_cases.py, detector on": lambda: _pytest(files, *plain, races="raise"),
        },
        rounds,
    )
    result = Result("races_test_files", "s", baseline="sim_cases.py, detector off")
    for label, values in samples.items():
        result.add(label, values)
    result.add("sim_cases.py whole, detector on", [_pytest(files)])
    result.add("race_cases.py whole, detector on", [_pytest([str(TESTS / "race_cases.py")])])
    ratio = result.ratio("sim_cases.py, detector on")
    result.notes.append(f"sim_cases.py without the race cases: detector on / off = {ratio:.2f}x")
    result.notes.append("each run includes starting Python, importing torch, loading the simulator")
    result.extra["rounds"] = rounds
    save(result)
    return result


def detection(runs: int) -> Result:
    """Each bug class ``runs`` times per link speed, its twin as often: counts."""
    import torch

    sys.path.insert(0, str(TESTS))
    import race_cases as cases
    from anydevice import testing
    from anydevice.testing import races

    dev = testing.enable()
    table: dict[str, dict[str, int]] = {}
    for case in cases.CASES:
        bug, twin = getattr(cases, f"bug_{case}"), getattr(cases, f"twin_{case}")
        line = cases.race_line(bug)
        row = {"runs": 0, "reported": 0, "at its line": 0, "twin runs": 0, "twin reports": 0,
               "twin right": 0}  # fmt: skip
        for link in LINKS.values():
            testing.set_bandwidth(link)
            for _ in range(runs):
                races.forget()  # a run as in a fresh process: nothing reported yet
                row["runs"] += 1
                try:
                    bug(dev)
                except testing.StreamRaceError as e:
                    row["reported"] += 1
                    row["at its line"] += e.report is not None and e.report.now.line == line
                torch.accelerator.synchronize()
                before = len(races.race_reports())
                row["twin runs"] += 1
                got, expected = twin(dev)
                torch.accelerator.synchronize()
                row["twin reports"] += len(races.race_reports()) - before
                row["twin right"] += got == expected
        testing.set_bandwidth("2GB/s")
        table[case] = row
    result = Result("races_detection", "runs")
    width = max(len(c) for c in table)
    for case, row in table.items():
        result.rows[f"{case}: reported"] = row["reported"]
        result.notes.append(
            f"{case:<{width}}  reported {row['reported']}/{row['runs']} (at its line "
            f"{row['at its line']}), twin: {row['twin reports']} reports, right "
            f"{row['twin right']}/{row['twin runs']}"
        )
    found = sum(r["reported"] == r["runs"] == r["at its line"] for r in table.values())
    clean = sum(
        r["twin reports"] == 0 and r["twin right"] == r["twin runs"] for r in table.values()
    )
    result.notes.append(f"bug classes reported in every run at their line: {found} of {len(table)}")
    result.notes.append(f"twins clean and right in every run: {clean} of {len(table)}")
    result.extra["table"] = table
    result.extra["links"] = list(LINKS)
    result.extra["runs_per_link"] = runs
    save(result)
    return result


def build() -> Result:
    """A cold build into an empty cache: wall seconds, the compiler's CPU seconds, and each
    file's wall seconds (ninja's log)."""
    with tempfile.TemporaryDirectory() as cache:
        code = (
            "import os, time\n"
            "t, c = time.perf_counter(), os.times()\n"
            "from anydevice.testing import simulator\n"
            "simulator.load()\n"
            "d = os.times()\n"
            "print(time.perf_counter() - t, d.children_user + d.children_system "
            "- c.children_user - c.children_system)\n"
        )
        load = os.getloadavg()[0]
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=1800, env=env)  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"the build failed:\n{proc.stderr[-4000:]}")
        after = os.getloadavg()[0]
        files = {}  # ninja's log: start and end in ms, then the output's name
        for log in Path(cache).glob("anydevice/extensions/*/.ninja_log"):
            for line in log.read_text().splitlines()[1:]:
                start, end, _, out, _ = line.split("\t")
                files[out] = (int(end) - int(start)) / 1000
    wall, cpu = map(float, proc.stdout.split())
    result = Result("sim_build", "s")
    result.rows["wall"] = wall
    result.rows["compiler CPU"] = cpu
    for out, seconds in sorted(files.items()):
        result.rows[f"{out} (wall)"] = seconds
    result.notes.append(
        f"load average {load:.1f} on {os.cpu_count()} cores when it started, {after:.1f} when "
        "it ended; the two files build in parallel, the library links after them"
    )
    result.notes.append(proc.stderr.strip().replace("\n", " / "))
    save(result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=2000, help="operators per timed sample")
    parser.add_argument("--runs", type=int, default=3, help="runs per bug class and link speed")
    parser.add_argument("--build", action="store_true", help="also time a cold build")
    parser.add_argument("--part", choices=("per_op", "files", "detection", "build"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.part == "build":
        build()
        return
    if args.part == "per_op":
        per_op(args.rounds, args.ops)
        return
    if args.part == "detection":
        detection(args.runs)
        return
    me = [sys.executable, __file__, f"--rounds={args.rounds}", f"--ops={args.ops}",
          f"--runs={args.runs}"]  # fmt: skip
    print(json.dumps({k: machine()[k] for k in ("cpu", "torch", "load")}, default=str))
    subprocess.run([*me, "--part=per_op"], check=True, timeout=1800)
    subprocess.run([*me, "--part=detection"], check=True, timeout=1800)
    test_files(args.rounds)
    if args.build:
        build()


if __name__ == "__main__":
    main()
