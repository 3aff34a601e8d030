"""`llm-runtime lifecycle diagram`: a state machine as mermaid text, one state highlighted."""

from __future__ import annotations

import argparse
import sys

from lifecycle import MachineTable, mermaid
from lifecycle.phases import HOST_TABLE
from models.cli.errors import EXIT_OK, EXIT_USAGE, PROG
from runtime.lifecycles import COMPONENT_TABLES

MACHINES: dict[str, MachineTable] = {
    "host": HOST_TABLE,
    "kv-cache": COMPONENT_TABLES["kv-cache"],
    "program-compiler": COMPONENT_TABLES["program-compiler"],
    "trace-compiler": COMPONENT_TABLES["trace-compiler"],
    "output-read": COMPONENT_TABLES["output-read"],
}


def lifecycle_diagram(args: argparse.Namespace) -> int:
    table = MACHINES[args.machine]
    current = table.initial
    if args.current is not None:
        names = {spec.state.name: spec.state for spec in table.states}
        key = args.current.upper().replace("-", "_")
        if key not in names:
            print(
                f"{PROG}: --current {args.current!r} is not a state of {args.machine}; "
                f"choose one of: {', '.join(names)}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        current = names[key]
    print(mermaid(table, current=current))
    return EXIT_OK
