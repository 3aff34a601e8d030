"""The host's phase table: CONSTRUCTED .. TERMINAL, as the architecture fixes it.

`host_table(next_calls=...)` lets a host subclass name its own onward calls (a model executor
says `warmup_prefill()` where the generic host says `compile()`), without changing the phases
or transitions themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, StrEnum

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
    DRAINING = "DRAINING"
    DRAINED = "DRAINED"
    SLEEPING = "SLEEPING"
    WEIGHTS_AWAKE = "WEIGHTS_AWAKE"
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
    Phase.DRAINING: "admission closed; in-flight leases and reads completing",
    Phase.DRAINED: "nothing in flight; weights, KV cache and traces resident",
    Phase.SLEEPING: "traces, programs, KV cache and weights off the device",
    Phase.WEIGHTS_AWAKE: "weights on the device; KV cache and traces still asleep",
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
    Phase.SERVING: ("drain", "close"),
    Phase.DRAINING: ("drain", "close"),
    Phase.DRAINED: ("serve", "sleep", "reload_weights", "close"),
    Phase.SLEEPING: ("wake", "close"),
    Phase.WEIGHTS_AWAKE: ("reload_weights", "wake", "sleep", "close"),
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
    Phase.DRAINING,
    Phase.DRAINED,
    Phase.SLEEPING,
    Phase.WEIGHTS_AWAKE,
)
START_PHASES = LIVE_PHASES[: LIVE_PHASES.index(Phase.SERVING)]
"""Where `start()` may run from: the start-up phases before SERVING."""
AWAKE_PHASES = (Phase.SERVING, Phase.DRAINING, Phase.DRAINED)
"""Phases where weights and the KV cache are on the device (a `wake()` there is a no-op)."""

NOT_SERVING: dict[Enum, str] = {
    Phase.DRAINING: "admission is closed while draining; call drain() to finish",
    Phase.DRAINED: "the host is drained; call serve() to resume",
    Phase.SLEEPING: "the host is asleep; call wake()",
    Phase.WEIGHTS_AWAKE: (
        "only the weights are awake; the KV cache and traces are not: call "
        "wake(tags=('kv_cache',)) first"
    ),
}
"""Why a request call is refused after start-up (the reason its `PhaseError` carries)."""

HOST_TRANSITIONS: tuple[TransitionSpec, ...] = (
    TransitionSpec("resolve_capacity", (Phase.CONSTRUCTED,), Phase.CAPACITY_RESOLVED),
    TransitionSpec("seal", (Phase.CAPACITY_RESOLVED,), Phase.SEALED),
    TransitionSpec("allocate", (Phase.SEALED,), Phase.ALLOCATED),
    TransitionSpec("compile", (Phase.ALLOCATED,), Phase.COMPILED, "warmup complete"),
    TransitionSpec("capture", (Phase.COMPILED,), Phase.CAPTURED, "trace mode decode_only/all"),
    TransitionSpec("serve", (Phase.COMPILED, Phase.CAPTURED, Phase.DRAINED), Phase.SERVING),
    TransitionSpec("drain", (Phase.SERVING,), Phase.DRAINING, "admission closed"),
    TransitionSpec("drained", (Phase.DRAINING,), Phase.DRAINED, "in-flight work retired"),
    TransitionSpec("sleep", (Phase.DRAINED, Phase.WEIGHTS_AWAKE), Phase.SLEEPING),
    TransitionSpec("wake_weights", (Phase.SLEEPING,), Phase.WEIGHTS_AWAKE),
    TransitionSpec(
        "wake_kv_cache", (Phase.WEIGHTS_AWAKE,), Phase.DRAINED, "allocate, warm up, capture"
    ),
    TransitionSpec("reload_weights", (Phase.DRAINED,), Phase.DRAINED, "in place"),
    TransitionSpec("reload_weights", (Phase.WEIGHTS_AWAKE,), Phase.WEIGHTS_AWAKE, "in place"),
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
