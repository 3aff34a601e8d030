"""The `llm-runtime` command.

Subcommands are small functions registered on one argparse parser; each returns an exit
status (0 ok, 1 runtime failure, 2 bad arguments), and errors go to stderr as one line with
the fix.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lifecycle import MachineTable, mermaid
from lifecycle.phases import HOST_TABLE
from runtime.lifecycles import COMPONENT_TABLES

MACHINES: dict[str, MachineTable] = {
    "host": HOST_TABLE,
    "kv-cache": COMPONENT_TABLES["kv-cache"],
    "program-compiler": COMPONENT_TABLES["program-compiler"],
    "trace-compiler": COMPONENT_TABLES["trace-compiler"],
    "output-read": COMPONENT_TABLES["output-read"],
}


def _lifecycle_diagram(args: argparse.Namespace) -> int:
    table = MACHINES[args.machine]
    current = table.initial
    if args.current is not None:
        names = {spec.state.name: spec.state for spec in table.states}
        key = args.current.upper().replace("-", "_")
        if key not in names:
            print(
                f"llm-runtime: --current {args.current!r} is not a state of {args.machine}; "
                f"choose one of: {', '.join(names)}",
                file=sys.stderr,
            )
            return 2
        current = names[key]
    print(mermaid(table, current=current))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command-line surface."""
    parser = argparse.ArgumentParser(
        prog="llm-runtime", description="An execution runtime for LLM inference."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    lifecycle = commands.add_parser("lifecycle", help="inspect the lifecycle state machines")
    lifecycle_commands = lifecycle.add_subparsers(dest="lifecycle_command", required=True)
    diagram = lifecycle_commands.add_parser(
        "diagram", help="print a machine as mermaid text, the current state highlighted"
    )
    diagram.add_argument("--machine", choices=sorted(MACHINES), default="host")
    diagram.add_argument(
        "--current", default=None, help="state to highlight (default: the initial state)"
    )
    diagram.set_defaults(handler=_lifecycle_diagram)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    status: int = args.handler(args)
    return status


def run() -> None:
    """Console-script wrapper: exit with `main`'s status."""
    sys.exit(main())


if __name__ == "__main__":
    run()
