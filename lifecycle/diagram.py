"""Mermaid text of any declared machine, with the current state highlighted."""

from __future__ import annotations

from enum import Enum

from lifecycle.machine import MachineTable


def mermaid(table: MachineTable, *, current: Enum | None = None) -> str:
    """A `stateDiagram-v2` of `table`; `current` gets the `current` class."""
    lines = ["stateDiagram-v2", f"    %% {table.name}", f"    [*] --> {table.initial.name}"]
    for transition in table.transitions:
        for source in transition.sources:
            lines.append(f"    {source.name} --> {transition.dest.name}: {transition.trigger}")
    for state in sorted(table.terminal, key=lambda s: s.name):
        lines.append(f"    {state.name} --> [*]")
    for spec in table.states:
        if spec.description:
            lines.append(f"    {spec.state.name}: {spec.state.name} - {spec.description}")
    if current is not None:
        lines.append("    classDef current fill:#f9a825,stroke:#333,stroke-width:3px")
        lines.append(f"    class {current.name} current")
    return "\n".join(lines)
