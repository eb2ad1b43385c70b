"""The ``anydevice`` command: ``info``, ``top``, ``select``, ``doctor``, ``launch``.

Each sub-command registers itself in :data:`COMMANDS` with a function that adds its
arguments and one that runs it; ``main`` parses and dispatches.

This module imports nothing heavy at the top: ``--help``, ``info``, ``top`` and ``select``
never import torch (``info --torch`` does, and so does a backend that cannot be seen
without it, which ``info`` then says). Each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, MutableMapping, Sequence
from typing import NamedTuple

from anydevice._version import __version__

__all__ = ["main"]


class Command(NamedTuple):
    # A NamedTuple, not a dataclass: ``dataclasses`` costs ``--help`` a tenth of its time.
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ----------------------------------------------------------------------------- info


def _info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the inventory as JSON")
    p.add_argument(
        "--torch",
        action="store_true",
        help="also ask torch (its thread count, cuDNN and NCCL as it loads them); slower, "
        "as it imports torch",
    )


def _info(args: argparse.Namespace) -> int:
    from anydevice.hardware.inventory import inventory, inventory_without_torch

    inv = inventory() if args.torch else inventory_without_torch()
    if args.json:
        print(inv.to_json())
        return 0
    from rich.console import Console

    Console().print(inv)
    return 0


# ----------------------------------------------------------------------------- top


def _top_args(p: argparse.ArgumentParser) -> None:
    from anydevice.cli import top

    top.configure(p, seconds=_positive_seconds, count=_positive_int)


def _top(args: argparse.Namespace) -> int:
    from anydevice.cli import top

    return top.run(args)


# ----------------------------------------------------------------------------- select


def _select_args(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "Prints a CUDA_VISIBLE_DEVICES value for the N freest GPUs by ad.device('free')'s "
        "rule (most free memory, then least busy), e.g. gpus=$(anydevice select -n 2) && "
        "export CUDA_VISIBLE_DEVICES=$gpus. Exits 1, saying why, when fewer GPUs qualify "
        "(and prints nothing, which as CUDA_VISIBLE_DEVICES would hide every GPU)."
    )
    p.add_argument(
        "-n", dest="n", type=_positive_int, default=1, metavar="N", help="GPUs (default 1)"
    )
    p.add_argument(
        "--min-free",
        type=_size,
        default=None,
        metavar="SIZE",
        help="only GPUs with this much memory free, e.g. 8GiB",
    )
    p.add_argument(
        "--max-util",
        type=_percent,
        default=None,
        metavar="PCT",
        help="only GPUs at most this busy, in percent",
    )
    p.add_argument(
        "--format",
        choices=("uuid", "index"),
        default="uuid",
        help="UUIDs (default: right whatever CUDA_DEVICE_ORDER says) or CUDA indices",
    )


def _select(args: argparse.Namespace) -> int:
    from anydevice.errors import AnydeviceError
    from anydevice.hardware.freest import select_visible

    try:
        print(select_visible(args.n, args.min_free, args.max_util, args.format))
    except AnydeviceError as e:
        print(f"anydevice select: {e}", file=sys.stderr)
        return 1
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _positive_seconds(text: str) -> float:
    value = _finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _seconds(text: str) -> float:
    value = _finite(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds, 0 or more")
    return value


def _finite(text: str) -> float:
    """``text`` as a finite number; NaN (which no comparison passes) where it is none."""
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def _percent(text: str) -> float:
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        value = -1.0
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage from 0 to 100")
    return value


def _size(text: str) -> int:
    from anydevice.hardware.facts import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ----------------------------------------------------------------------------- doctor


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        dest="plan",
        action="store_const",
        const="quick",
        help="measure within 10 s (default: within 30 s)",
    )
    size.add_argument(
        "--full",
        dest="plan",
        action="store_const",
        const="full",
        help="measure within 3 minutes, with larger sizes, on every GPU",
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
        help="measure only this device (repeatable), in ad.device's grammar: cpu, 0, gpu:1, "
        "cuda:1, free, auto",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="draw the measurements to FILE (.png, .svg, .pdf; needs matplotlib)",
    )


def _doctor(args: argparse.Namespace) -> int:
    from rich.console import Console

    from anydevice.doctor import examine, resolve_devices
    from anydevice.errors import AnydeviceError
    from anydevice.hardware.inventory import inventory

    def refuse(message: object) -> int:
        print(f"anydevice doctor: {message}", file=sys.stderr)
        return 2

    if args.plot and args.plan == "none":
        return refuse("--plot needs measurements; drop --no-measure.")
    if args.plot:
        from anydevice.doctor.plot import check_target

        try:
            check_target(args.plot)  # before the measuring, not after it
        except (ImportError, ValueError) as e:
            return refuse(e)
    err = Console(stderr=True)
    interrupted = False
    try:
        inv = inventory()
        if args.device:
            try:
                resolve_devices(inv, args.device)  # with --no-measure too: bad input is bad
            except AnydeviceError as e:
                return refuse(e)
        if args.plan == "none":
            report = examine(inv)
        else:
            from anydevice.doctor.render import measuring

            with measuring(err) as progress:
                report = examine(inv, measure=args.plan, devices=args.device, progress=progress)
    except KeyboardInterrupt as e:  # Ctrl-C: what was measured so far, then one line
        so_far = getattr(e, "report", None)
        if so_far is None:
            print("anydevice doctor: interrupted (Ctrl-C) before anything was measured.",
                  file=sys.stderr)  # fmt: skip
            return 130
        report, interrupted = so_far, True
    if args.plot and report.measurements is not None:
        from anydevice.doctor.plot import plot

        plot(report.measurements, args.plot, report.inventory)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from anydevice.doctor.render import render_report

        render_report(report, Console())
    if args.plot:
        err.print(f"wrote {args.plot}", highlight=False, soft_wrap=True)  # a path, unbroken
    if interrupted:
        m = report.measurements
        done = f"{len(m.results)} number(s) and {len(m.levers)} lever(s)" if m else "the checks"
        print(f"anydevice doctor: interrupted (Ctrl-C); the report holds what was measured "
              f"before it: {done}.", file=sys.stderr)  # fmt: skip
        return 130
    return report.exit_code


# ----------------------------------------------------------------------------- launch


def quiet_lookup_warnings(environ: MutableMapping[str, str] | None = None) -> bool:
    """Keep torch's C++ warnings (c10d's "The hostname of the client socket cannot be
    retrieved", printed where a peer's address has no name: most clusters, containers and
    network namespaces) out of a launcher's summary output.

    torch reads ``TORCH_CPP_LOG_LEVEL`` once, when it is imported: call this before, in the
    launcher only. The variable is set for the import and taken out again: the workers'
    level is the launch's to set (errors only across nodes unless ``--verbose``). A level
    the user set is left alone.

    Returns:
        True where this quieted the launcher; False where torch was already imported or the
        user set the level.
    """
    env = os.environ if environ is None else environ
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in env:
        return False
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        import torch  # noqa: F401  # reads the level now
    finally:
        del env["TORCH_CPP_LOG_LEVEL"]
    return True


def _launch_args(p: argparse.ArgumentParser) -> None:
    p.usage = "anydevice launch [-n N] [options] [-m] SCRIPT [ARGS...]"
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
        type=_nprocs,
        default="auto",
        metavar="N",
        help="processes on this node: a number, 'gpu' (one per GPU) or 'auto' (default: "
        "one per GPU, else 1)",
    )
    p.add_argument(
        "--nnodes", type=_nodes, default="1", metavar="N|MIN:MAX", help="nodes (default 1)"
    )
    p.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=_whole_number,
        default=None,
        metavar="R",
        help="0 on the node at --rdzv-endpoint, which hosts the rendezvous",
    )
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        type=_endpoint,
        default=None,
        metavar="HOST:PORT",
        help="where the nodes meet (needed with --nnodes > 1)",
    )
    p.add_argument(
        "--local-addr",
        "--local_addr",
        dest="local_addr",
        default=None,
        metavar="ADDR",
        help="this node's address that the other nodes reach (default: the source address "
        "of the route to --rdzv-endpoint); gloo and NCCL listen on its interface",
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
        type=_whole_number,
        default=0,
        metavar="K",
        help="restarts after a failure",
    )
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=300.0,
        metavar="S",
        help="seconds any wait may last: reaching the rendezvous, all nodes joining (default 300)",
    )
    p.add_argument(
        "--grace",
        type=_seconds,
        default=30.0,
        metavar="S",
        help="seconds the workers get to save and exit after a signal reaches the launcher "
        "(SIGTERM, Ctrl-C) before they are killed; a second signal kills them at once "
        "(default 30)",
    )
    p.add_argument(
        "--hang-after",
        dest="hang_after",
        type=_seconds,
        default=30.0,
        metavar="S",
        help="seconds a rank may wait in one collective before the launch says which rank "
        "is where and why the job makes no progress (at least twice the longest gap "
        "between collectives seen); ranks that call different collectives stop the job "
        "at once; 0 turns the watch off (default 30)",
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
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module name: run it as `python -m SCRIPT` does",
    )
    p.add_argument("target", metavar="SCRIPT", help="the script to run (with -m, the module)")
    rest = p.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to SCRIPT (optional)"
    )
    rest.required = False  # argparse counts a REMAINDER as required when nothing is left
    p.set_defaults(_launch_parser=p)


def _nprocs(text: str) -> int | str:
    word = text.strip().lower()
    if word in ("auto", "gpu"):
        return word
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of processes (at least 1), 'gpu' or 'auto'"
        ) from None


def _nodes(text: str) -> str:
    low, sep, high = text.strip().partition(":")
    if low.isdigit() and (not sep or high.isdigit()) and 1 <= int(low) <= int(high or low):
        return text.strip()
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a number of nodes (at least 1) or a range MIN:MAX with 1 <= MIN <= MAX"
    )


def _whole_number(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 0")
    return int(text)


def _endpoint(text: str) -> str:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or host.split() != [host] or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not HOST:PORT with a port up to 65535, e.g. 10.0.0.1:29400"
        )
    return text.strip()


#: Variables of a launcher (torchrun, srun, mpirun) that can say where the nodes meet, or
#: make ``launch`` run the script in place (``anydevice.launching.environment``).
_LAUNCHER_VARS = (
    "TORCHELASTIC_RUN_ID",
    "RANK",
    "WORLD_SIZE",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "MV2_COMM_WORLD_SIZE",
)


def _launch_usage_error(args: argparse.Namespace) -> str | None:
    """What in the flags cannot work together, found before torch is imported."""
    high = int(args.nnodes.partition(":")[2] or args.nnodes.partition(":")[0])
    if high > 1 and args.rdzv_endpoint is None:
        import os

        if not any(name in os.environ for name in _LAUNCHER_VARS):
            return (
                f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT: an address of the "
                "node with --node-rank 0 that every node can reach, the same on every node "
                "(e.g. --rdzv-endpoint 10.0.0.1:29400)"
            )
    return None


def _missing_target(target: str, module: bool) -> str | None:
    """Why ``target`` cannot run, looked up as the workers would, without running it."""
    import os

    if not module:
        if os.path.isfile(target):
            return None
        return f"No script {target!r} (in {os.getcwd()})."
    return _missing_module(target, [os.getcwd(), *sys.path[1:]])  # a worker's sys.path


def _missing_module(name: str, path: list[str]) -> str | None:
    """Why ``python -m name`` would find nothing to run on ``path``, or None.

    Each package on the way is found on disk without running its ``__init__``; only a
    module that a plain search cannot see (one a custom import hook provides) is looked up
    with :func:`importlib.util.find_spec`, which imports its parent packages.
    """
    import importlib.machinery
    import importlib.util

    top, *parts = name.split(".")
    spec = importlib.machinery.PathFinder.find_spec(top, path)
    if spec is None:  # perhaps a module that an import hook provides
        saved = sys.path[:]
        sys.path[:] = path
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        except (Exception, SystemExit):  # the package's own code failed: the worker says how
            return None
        finally:
            sys.path[:] = saved
        parts = []
    for part in parts:
        where = spec.submodule_search_locations if spec is not None else None
        spec = importlib.machinery.PathFinder.find_spec(part, list(where)) if where else None
    if spec is None:
        return f"No module named {name!r} (looked in {path[0]} and on sys.path)."
    package = spec.submodule_search_locations is not None
    if package and _missing_module(f"{name}.__main__", path) is not None:
        return f"{name!r} is a package without a __main__ module, so it cannot be run with -m."
    return None


def _bad_device_variable() -> str | None:
    """What is wrong with ``ANYDEVICE_DEVICE`` here, found before any worker starts."""
    from anydevice.hardware.override import device_override  # torch-free: torch is not imported yet

    if device_override() is None:
        return None
    from anydevice.errors import AnydeviceError
    from anydevice.hardware.selection import describe

    try:
        describe("auto", telemetry=False)  # what ad.device() in each worker would pick
    except AnydeviceError as e:
        return f"no worker was started, as each would fail on ANYDEVICE_DEVICE: {e}"
    return None


def _launch(args: argparse.Namespace) -> int:
    import signal

    problem = _launch_usage_error(args)
    if problem is not None:
        args._launch_parser.error(problem)  # exits 2, as a bad flag does
    missing = _missing_target(args.target, args.module)
    if missing is not None:
        print(f"anydevice launch: {missing}", file=sys.stderr)
        return 1
    bad_device = _bad_device_variable()
    if bad_device is not None:
        print(f"anydevice launch: {bad_device}", file=sys.stderr)
        return 2

    if not args.verbose:
        quiet_lookup_warnings()
    from anydevice.errors import DistributedError, WorkerFailedError
    from anydevice.launching.elastic import launch_script
    from anydevice.launching.options import LaunchOptions

    def stop(signum: int, frame: object) -> None:  # before and after the agent's own
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, stop)
    try:
        options = LaunchOptions(
            nprocs=args.nprocs,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            run_id=args.rdzv_id,
            max_restarts=args.max_restarts,
            timeout=args.timeout,
            grace=args.grace,
            hang_after=args.hang_after,
            verbose=args.verbose,
            local_addr=args.local_addr,
            log_dir=args.log_dir,
        )
        return launch_script(args.target, args.args, options, module=args.module)
    except WorkerFailedError as e:
        print(f"anydevice launch: {e}", file=sys.stderr)
        return e.exitcode if e.exitcode > 0 else 128 - e.exitcode if e.exitcode < 0 else 1
    except DistributedError as e:
        if getattr(e, "argument", None):  # a flag ad.launch refuses: what the parser missed
            args._launch_parser.error(str(e))  # exits 2, as a bad flag does
        print(f"anydevice launch: {e}", file=sys.stderr)
        return 1
    except (ValueError, LookupError, OSError) as e:
        print(f"anydevice launch: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("anydevice launch: interrupted (SIGINT); the workers were stopped.", file=sys.stderr)
        return 128 + signal.SIGINT
    except SystemExit as e:  # SIGTERM, SIGHUP, SIGQUIT: 128 + the signal
        code = e.code if isinstance(e.code, int) else 1
        report = getattr(e, "report", None)
        if report:  # the workers stopped for a preemption
            print(f"anydevice launch: {report}", file=sys.stderr)
        elif code > 128:
            name = signal.Signals(code - 128).name
            print(
                f"anydevice launch: stopped by {name}; the workers were stopped.", file=sys.stderr
            )
        return code


COMMANDS: dict[str, Command] = {
    "info": Command(
        "what devices this machine has (no CUDA context is created)", _info_args, _info
    ),
    "top": Command(
        "a live view of every accelerator, the torch jobs and their ranks, and the host",
        _top_args,
        _top,
    ),
    "select": Command("print CUDA_VISIBLE_DEVICES for the N freest GPUs", _select_args, _select),
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
        p.set_defaults(_run=cmd.run, _parser=p)
    return parser


#: Flags people reach for that mean one of ours: the suggestion where spelling is no guide.
_SYNONYMS = {
    "--fast": ("--quick",),
    "--short": ("--quick",),
    "--slow": ("--full",),
    "--long": ("--full",),
    "--thorough": ("--full",),
    "--gpu": ("--device", "--nprocs"),
    "--gpus": ("--device", "--nprocs"),
    "--nodes": ("--nnodes",),
    "--restarts": ("--max-restarts",),
}


def nearest_flag(word: str, options: Sequence[str]) -> str | None:
    """The flag of ``options`` that ``word`` (an unknown ``--flag`` or ``--flag=value``)
    most likely meant: its synonym, else the closest spelling; None where none is close.

    >>> nearest_flag("--fast", ["--quick", "--full", "--json"])
    '--quick'
    >>> nearest_flag("--jsno", ["--quick", "--full", "--json"])
    '--json'
    >>> nearest_flag("--banana", ["--quick", "--full", "--json"]) is None
    True
    """
    import difflib

    flag = word.split("=", 1)[0]
    for meant in _SYNONYMS.get(flag, ()):
        if meant in options:
            return meant
    longs = [o for o in options if o.startswith("--")]
    close = difflib.get_close_matches(flag, longs if flag.startswith("--") else options, 1, 0.6)
    return close[0] if close else None


def _unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """argparse's "unrecognized arguments" message, with the nearest flag of ``parser``
    after each unknown one."""
    options = [o for action in parser._actions for o in action.option_strings]
    said = []
    for word in extras:
        near = nearest_flag(word, options) if word.startswith("-") else None
        said.append(f"{word} (did you mean {near}?)" if near else word)
    return f"unrecognized arguments: {' '.join(said)}"


class ExitCode(int):
    """The command's exit status: an ``int`` in every way (``sys.exit`` takes it), which a
    notebook cell ending in ``main([...])`` does not echo as ``0`` under the report; a
    failure's status it shows as one line."""

    __slots__ = ()

    def _ipython_display_(self) -> None:  # IPython's hook: called instead of showing repr
        if self:
            print(f"exit status {int(self)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``anydevice`` command; returns the exit code (an
    :class:`ExitCode`, which a notebook does not echo)."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # said by the sub-command's parser (its usage), with the nearest flag
        where = getattr(args, "_parser", parser)
        where.error(_unrecognized(where, extras))
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return ExitCode(2)
    return ExitCode(args._run(args))
