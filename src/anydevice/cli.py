"""The ``anydevice`` command: ``info``, ``doctor``.

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


def _doctor(args: argparse.Namespace) -> int:
    from anydevice.doctor import examine

    report = examine()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return report.exit_code
    from rich.console import Console

    from anydevice.console import render_report

    render_report(report, Console())
    return report.exit_code


COMMANDS: dict[str, Command] = {
    "info": Command(
        "what devices this machine has (no CUDA context is created)", _info_args, _info
    ),
    "doctor": Command("check this machine's set-up and say what to fix", _doctor_args, _doctor),
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
