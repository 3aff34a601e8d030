"""`llm-runtime lifecycle diagram`: a state machine as mermaid text, one state highlighted."""

from __future__ import annotations

import argparse
import sys

from lifecycle import mermaid
from lifecycle.phases import HOST_TABLE
from models.cli.errors import EXIT_OK, EXIT_USAGE, PROG
from runtime.component_tables import COMPONENT_TABLE_NAMES, component_table

MACHINES: tuple[str, ...] = ("host", *COMPONENT_TABLE_NAMES)


def lifecycle_diagram(args: argparse.Namespace) -> int:
    # The component tables are imported only when asked: they pull in torch.
    table = HOST_TABLE if args.machine == "host" else component_table(args.machine)
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
