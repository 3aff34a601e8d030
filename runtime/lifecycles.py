"""The state tables of the runtime's stateful components.

Each component holds one machine built from its table and guards its own calls, so it is
safe to use on its own; the host's phase machine guards the public surface on top. Declaring
the tables together keeps `llm-runtime lifecycle diagram` and the docs in step with the code.
"""

from __future__ import annotations

from enum import StrEnum

from lifecycle.machine import MachineTable, StateSpec, TransitionSpec


class KVCacheState(StrEnum):
    """`PagedKVCacheManager`: capacity resolved, then allocated and bound, then released."""

    UNRESOLVED = "unresolved"
    CONFIGURED = "configured"
    BOUND = "bound"
    RELEASED = "released"


KV_CACHE_TABLE = MachineTable(
    name="kv-cache",
    states=(
        StateSpec(KVCacheState.UNRESOLVED, "num_blocks not chosen yet", ("configure",)),
        StateSpec(KVCacheState.CONFIGURED, "capacity final; nothing allocated", ("allocate",)),
        StateSpec(KVCacheState.BOUND, "K/V tensors allocated and bound to the model", ()),
        StateSpec(
            KVCacheState.RELEASED,
            "terminal: tensors released",
            (),
            refusal="{owner} is terminal; construct a new paged KV cache manager",
        ),
    ),
    transitions=(
        TransitionSpec("configure", (KVCacheState.UNRESOLVED,), KVCacheState.CONFIGURED),
        TransitionSpec("allocate", (KVCacheState.CONFIGURED,), KVCacheState.BOUND),
        TransitionSpec(
            "release",
            (KVCacheState.UNRESOLVED, KVCacheState.CONFIGURED, KVCacheState.BOUND),
            KVCacheState.RELEASED,
        ),
    ),
    initial=KVCacheState.UNRESOLVED,
    terminal=frozenset({KVCacheState.RELEASED}),
)


class CompilerState(StrEnum):
    """`ProgramCompiler`: the compile gate is open until trace capture begins."""

    OPEN = "open"
    CAPTURING = "capturing"
    ACTIVE = "active"
    RELEASED = "released"


PROGRAM_COMPILER_TABLE = MachineTable(
    name="program-compiler",
    states=(
        StateSpec(CompilerState.OPEN, "gate open: new signatures compile", ("compile",)),
        StateSpec(CompilerState.CAPTURING, "trace capture in progress: gate closed", ()),
        StateSpec(CompilerState.ACTIVE, "traces active: gate closed", ("cleanup",)),
        StateSpec(
            CompilerState.RELEASED,
            "terminal: registry released",
            (),
            refusal="{owner} has been released",
        ),
    ),
    transitions=(
        TransitionSpec("begin_capture", (CompilerState.OPEN,), CompilerState.CAPTURING),
        TransitionSpec("activate", (CompilerState.CAPTURING,), CompilerState.ACTIVE),
        TransitionSpec("rollback", (CompilerState.CAPTURING,), CompilerState.OPEN),
        TransitionSpec("deactivate", (CompilerState.ACTIVE,), CompilerState.OPEN),
        TransitionSpec(
            "release",
            (CompilerState.OPEN, CompilerState.CAPTURING, CompilerState.ACTIVE),
            CompilerState.RELEASED,
        ),
    ),
    initial=CompilerState.OPEN,
    terminal=frozenset({CompilerState.RELEASED}),
)


class TraceState(StrEnum):
    """`TraceCompiler`: register capture plans, capture them all once, replay, release."""

    REGISTERING = "registering"
    CAPTURING = "capturing"
    ACTIVE = "active"
    RELEASED = "released"


TRACE_COMPILER_TABLE = MachineTable(
    name="trace-compiler",
    states=(
        StateSpec(TraceState.REGISTERING, "collecting capture plans", ("capture_all",)),
        StateSpec(TraceState.CAPTURING, "capturing every registered plan", ()),
        StateSpec(TraceState.ACTIVE, "traces replayable", ("replay", "cleanup")),
        StateSpec(
            TraceState.RELEASED,
            "terminal: traces and persistent inputs released",
            (),
            refusal="{owner} has been released",
        ),
    ),
    transitions=(
        TransitionSpec("begin_capture", (TraceState.REGISTERING,), TraceState.CAPTURING),
        TransitionSpec("activate", (TraceState.CAPTURING,), TraceState.ACTIVE),
        TransitionSpec("rollback", (TraceState.CAPTURING,), TraceState.REGISTERING),
        TransitionSpec(
            "release",
            (TraceState.REGISTERING, TraceState.CAPTURING, TraceState.ACTIVE),
            TraceState.RELEASED,
        ),
    ),
    initial=TraceState.REGISTERING,
    terminal=frozenset({TraceState.RELEASED}),
)


class ReadState(StrEnum):
    """One asynchronous output read or decode lease."""

    IDLE = "idle"
    PENDING = "pending"
    COMPLETED = "completed"
    RELEASED = "released"


OUTPUT_READ_TABLE = MachineTable(
    name="output-read",
    states=(
        StateSpec(ReadState.IDLE, "raw device output held", ("submit",)),
        StateSpec(ReadState.PENDING, "non-blocking copy submitted with an event", ("complete",)),
        StateSpec(ReadState.COMPLETED, "event synchronized; host value readable", ()),
        StateSpec(ReadState.RELEASED, "terminal: device output released", ()),
    ),
    transitions=(
        TransitionSpec("submit", (ReadState.IDLE,), ReadState.PENDING),
        TransitionSpec("complete", (ReadState.IDLE, ReadState.PENDING), ReadState.COMPLETED),
        TransitionSpec(
            "release",
            (ReadState.IDLE, ReadState.PENDING, ReadState.COMPLETED),
            ReadState.RELEASED,
        ),
    ),
    initial=ReadState.IDLE,
    terminal=frozenset({ReadState.RELEASED}),
)

COMPONENT_TABLES: dict[str, MachineTable] = {
    table.name: table
    for table in (KV_CACHE_TABLE, PROGRAM_COMPILER_TABLE, TRACE_COMPILER_TABLE, OUTPUT_READ_TABLE)
}
