"""A generic state-machine lifecycle framework (transitions + attrs; never torch)."""

from lifecycle.diagram import mermaid
from lifecycle.errors import (
    FaultedError,
    LifecycleError,
    PhaseError,
    TerminalError,
    TransitionRefused,
    attach_cleanup_failures,
    raise_cleanup_failures,
)
from lifecycle.host import LifecycleHost
from lifecycle.journal import Journal, JournalEntry, Outcome
from lifecycle.machine import (
    MachineTable,
    StateMachine,
    StateSpec,
    TransitionSpec,
    guard_table,
    guarded,
)
from lifecycle.phases import HOST_TABLE, Phase, host_table

__all__ = [
    "HOST_TABLE",
    "FaultedError",
    "Journal",
    "JournalEntry",
    "LifecycleError",
    "LifecycleHost",
    "MachineTable",
    "Outcome",
    "Phase",
    "PhaseError",
    "StateMachine",
    "StateSpec",
    "TerminalError",
    "TransitionRefused",
    "TransitionSpec",
    "attach_cleanup_failures",
    "guard_table",
    "guarded",
    "host_table",
    "mermaid",
    "raise_cleanup_failures",
]
