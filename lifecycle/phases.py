"""The host's phase table: CONSTRUCTED .. TERMINAL, as the architecture fixes it.

`host_table(next_calls=...)` lets a host subclass name its own onward calls (a model executor
says `warmup_prefill()` where the generic host says `compile()`), without changing the phases
or transitions themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from lifecycle.machine import MachineTable, StateSpec, TransitionSpec


class Phase(StrEnum):
    """Where a host is in its life. Only `close()` is legal in CLOSING, FAULTED, TERMINAL."""

    CONSTRUCTED = "CONSTRUCTED"
    CAPACITY_RESOLVED = "CAPACITY_RESOLVED"
    SEALED = "SEALED"
    ALLOCATED = "ALLOCATED"
    COMPILED = "COMPILED"
    CAPTURED = "CAPTURED"
    SERVING = "SERVING"
    CLOSING = "CLOSING"
    FAULTED = "FAULTED"
    TERMINAL = "TERMINAL"


REFUSALS: dict[Phase, str] = {
    Phase.CLOSING: "{owner} is closing and still holds resources; call close() again to retry",
    Phase.FAULTED: (
        "a failed call left resources unreleased; only close() is legal (it retries the "
        "release and ends {owner})"
    ),
    Phase.TERMINAL: "{owner} is terminal; construct a new one",
}

PHASE_DESCRIPTIONS: dict[Phase, str] = {
    Phase.CONSTRUCTED: "built against static maximums; no device memory held",
    Phase.CAPACITY_RESOLVED: "physical KV capacity is final",
    Phase.SEALED: "runtime configuration is immutable",
    Phase.ALLOCATED: "paged KV cache allocated and bound to the model",
    Phase.COMPILED: "every configured program compiled (warmup complete)",
    Phase.CAPTURED: "traces captured; the compile gate is closed",
    Phase.SERVING: "requests may run",
    Phase.CLOSING: "cleanup ran but left resources; close() again retries",
    Phase.FAULTED: "a failed call left resources unreleased; only close() is legal",
    Phase.TERMINAL: "everything released; construct a new host",
}

GENERIC_NEXT_CALLS: dict[Phase, tuple[str, ...]] = {
    Phase.CONSTRUCTED: ("resolve_capacity",),
    Phase.CAPACITY_RESOLVED: ("seal",),
    Phase.SEALED: ("allocate",),
    Phase.ALLOCATED: ("compile",),
    Phase.COMPILED: ("capture", "serve"),
    Phase.CAPTURED: ("serve",),
    Phase.SERVING: ("close",),
    Phase.CLOSING: ("close",),
    Phase.FAULTED: ("close",),
    Phase.TERMINAL: (),
}

LIVE_PHASES = _LIVE = (
    Phase.CONSTRUCTED,
    Phase.CAPACITY_RESOLVED,
    Phase.SEALED,
    Phase.ALLOCATED,
    Phase.COMPILED,
    Phase.CAPTURED,
    Phase.SERVING,
)

HOST_TRANSITIONS: tuple[TransitionSpec, ...] = (
    TransitionSpec("resolve_capacity", (Phase.CONSTRUCTED,), Phase.CAPACITY_RESOLVED),
    TransitionSpec("seal", (Phase.CAPACITY_RESOLVED,), Phase.SEALED),
    TransitionSpec("allocate", (Phase.SEALED,), Phase.ALLOCATED),
    TransitionSpec("compile", (Phase.ALLOCATED,), Phase.COMPILED, "warmup complete"),
    TransitionSpec("capture", (Phase.COMPILED,), Phase.CAPTURED, "trace mode decode_only/all"),
    TransitionSpec("serve", (Phase.COMPILED, Phase.CAPTURED), Phase.SERVING),
    TransitionSpec("fault", _LIVE, Phase.FAULTED, "work left resources unreleased"),
    TransitionSpec(
        "close_incomplete", (*_LIVE, Phase.CLOSING, Phase.FAULTED), Phase.CLOSING, "orphans left"
    ),
    TransitionSpec("close", (*_LIVE, Phase.CLOSING, Phase.FAULTED), Phase.TERMINAL),
)


def host_table(
    *, name: str = "host", next_calls: Mapping[Phase, tuple[str, ...]] | None = None
) -> MachineTable:
    """The host machine, optionally with host-specific onward calls per phase."""
    calls = dict(GENERIC_NEXT_CALLS)
    if next_calls:
        calls.update(next_calls)
    return MachineTable(
        name=name,
        states=tuple(
            StateSpec(phase, PHASE_DESCRIPTIONS[phase], calls[phase], REFUSALS.get(phase, ""))
            for phase in Phase
        ),
        transitions=HOST_TRANSITIONS,
        initial=Phase.CONSTRUCTED,
        terminal=frozenset({Phase.TERMINAL}),
        faulted=frozenset({Phase.FAULTED, Phase.CLOSING}),
        fault_trigger="fault",
    )


HOST_TABLE = host_table()
