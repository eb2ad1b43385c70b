"""The ``anydevice`` command: ``info``, ``doctor``, ``launch``.

Each sub-command registers itself in :data:`COMMANDS` with a function that adds its
arguments and one that runs it; ``main`` parses and dispatches.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from anydevice._version import __version__

__all__ = ["main"]


@dataclass(frozen=True)
class Command:
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ----------------------------------------------------------------------------- info


def _info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the inventory as JSON")


def _info(args: argparse.Namespace) -> int:
    from anydevice.inventory import inventory

    inv = inventory()
    if args.json:
        print(inv.to_json())
        return 0
    from rich.console import Console

    from anydevice.console import render_inventory

    render_inventory(inv, Console())
    return 0


# ----------------------------------------------------------------------------- doctor


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", dest="plan", action="store_const", const="quick", help="measure briefly"
    )
    size.add_argument(
        "--full",
        dest="plan",
        action="store_const",
        const="full",
        help="measure longer, with larger sizes, on every GPU",
    )
    size.add_argument(
        "--no-measure",
        dest="plan",
        action="store_const",
        const="none",
        help="run the configuration checks only",
    )
    p.set_defaults(plan="default")
    p.add_argument(
        "--device",
        action="append",
        metavar="SPEC",
        help="measure only this device (repeatable), e.g. --device cpu --device cuda:1",
    )
    p.add_argument(
        "--plot", metavar="FILE", help="draw bandwidth and throughput to FILE (PNG; matplotlib)"
    )


def _doctor(args: argparse.Namespace) -> int:
    from rich.console import Console

    from anydevice.doctor import examine

    if args.plot and args.plan == "none":
        print("anydevice doctor: --plot needs measurements; drop --no-measure.", file=sys.stderr)
        return 2
    if args.plot:
        from anydevice.doctor.plot import require_matplotlib

        try:
            require_matplotlib()  # before the measuring, not after it
        except ImportError as e:
            print(f"anydevice doctor: {e}", file=sys.stderr)
            return 2
    err = Console(stderr=True)
    if args.plan == "none":
        report = examine()
    else:
        from anydevice.console import measuring

        with measuring(err) as progress:
            try:
                report = examine(measure=args.plan, devices=args.device, progress=progress)
            except ValueError as e:
                err.print(f"anydevice doctor: {e}", style="bold red", highlight=False)
                return 2
    if args.plot and report.measurements is not None:
        from anydevice.doctor.plot import plot

        plot(report.measurements, args.plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from anydevice.console import render_report

        render_report(report, Console())
    if args.plot:
        err.print(f"wrote {args.plot}", highlight=False)
    return report.exit_code


# ----------------------------------------------------------------------------- launch


def _launch_args(p: argparse.ArgumentParser) -> None:
    p.usage = "anydevice launch [-n N] [options] SCRIPT [ARGS...]  |  ... -m MODULE [ARGS...]"
    p.epilog = (
        "Like torchrun, on torch's elastic agent (torchrun's spellings of the options work "
        "too). Under srun with one task per node, the nodes, node rank and rendezvous come "
        "from SLURM's variables; with one task per GPU, or under torchrun or mpirun, the "
        "script runs in place as the rank it already is."
    )
    p.add_argument(
        "-n",
        "--nprocs",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nprocs",
        default="auto",
        metavar="N",
        help="processes on this node: a number, 'gpu' (one per GPU) or 'auto' (default: "
        "one per GPU, else 1)",
    )
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX", help="nodes (default 1)")
    p.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=int,
        default=None,
        metavar="R",
        help="0 on the node at --rdzv-endpoint, which hosts the rendezvous",
    )
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        default=None,
        metavar="HOST:PORT",
        help="where the nodes meet (needed with --nnodes > 1)",
    )
    p.add_argument(
        "--rdzv-id",
        "--rdzv_id",
        dest="rdzv_id",
        default=None,
        metavar="ID",
        help="job name, the same on every node",
    )
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=0,
        metavar="K",
        help="restarts after a failure",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds any wait may last: reaching the rendezvous, all nodes joining (default 300)",
    )
    p.add_argument(
        "--log-dir",
        "--log_dir",
        dest="log_dir",
        default=None,
        metavar="DIR",
        help="keep each worker's logs here",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="accepted for torchrun's sake: one node is the default",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show torch elastic's own log lines and every failing worker's traceback",
    )
    p.add_argument("-m", "--module", action="store_true", help="run TARGET as a module")
    p.add_argument("target", metavar="SCRIPT", help="the script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script")


def _launch(args: argparse.Namespace) -> int:
    import signal

    from anydevice.distributed.elastic import launch_script
    from anydevice.errors import DistributedError, WorkerFailedError

    def stop(signum: int, frame: object) -> None:  # before and after the agent's own
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, stop)
    try:
        return launch_script(
            args.target,
            args.args,
            module=args.module,
            nprocs=args.nprocs,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            run_id=args.rdzv_id,
            max_restarts=args.max_restarts,
            timeout=args.timeout,
            log_dir=args.log_dir,
            verbose=args.verbose,
        )
    except WorkerFailedError as e:
        print(f"anydevice launch: {e}", file=sys.stderr)
        return e.exitcode if e.exitcode > 0 else 128 - e.exitcode if e.exitcode < 0 else 1
    except (DistributedError, ValueError, LookupError, OSError) as e:
        print(f"anydevice launch: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("anydevice launch: interrupted (SIGINT); the workers were stopped.", file=sys.stderr)
        return 128 + signal.SIGINT
    except SystemExit as e:  # SIGTERM, SIGHUP, SIGQUIT: 128 + the signal
        code = e.code if isinstance(e.code, int) else 1
        if code > 128:
            name = signal.Signals(code - 128).name
            print(
                f"anydevice launch: stopped by {name}; the workers were stopped.", file=sys.stderr
            )
        return code


COMMANDS: dict[str, Command] = {
    "info": Command(
        "what devices this machine has (no CUDA context is created)", _info_args, _info
    ),
    "doctor": Command("check this machine's set-up and say what to fix", _doctor_args, _doctor),
    "launch": Command(
        "run a script in one process per device, on one or several machines",
        _launch_args,
        _launch,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anydevice",
        description="Run PyTorch on any device, fast and correctly.",
    )
    parser.add_argument("--version", action="version", version=f"anydevice {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``anydevice`` command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return 2
    code: int = args._run(args)
    return code
