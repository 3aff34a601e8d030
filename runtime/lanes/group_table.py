"""The lane group's phase table and the pieces of its class built once: the warmup calls
(one fan-out each, named per operation) and the per-lane clone of a capacity config."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Protocol

import attrs

from lifecycle import MachineTable, Phase, guarded, host_table
from runtime.lanes.fanout import TERMINAL_TEXT

P = Phase
SETUP = (P.ALLOCATED, P.COMPILED)
"""The phases a group compiles and warms in."""
BEFORE_ALLOCATED = (P.CONSTRUCTED, P.CAPACITY_RESOLVED, P.SEALED)
"""The phases `allocate_kv_cache` is legal in."""


def _group_table() -> MachineTable:
    table = host_table(
        name="lane-group",
        next_calls={
            P.CONSTRUCTED: ("configure_paged_kv_cache", "allocate_kv_cache"),
            P.CAPACITY_RESOLVED: ("allocate_kv_cache",),
            P.SEALED: ("allocate_kv_cache",),
            P.ALLOCATED: ("warmup_prefill", "warmup_decode"),
            P.COMPILED: ("capture", "serve"),
            P.CAPTURED: ("serve",),
            P.SERVING: ("prefill_forward", "decode_forward", "drain", "close"),
        },
    )
    states = tuple(
        attrs.evolve(spec, refusal=TERMINAL_TEXT) if spec.state is P.TERMINAL else spec
        for spec in table.states
    )
    return attrs.evolve(table, states=states)


GROUP_TABLE = _group_table()


class _Warms(Protocol):
    def _warm(self, operation: str, kv_cache: object, hints: dict[str, bool | None]) -> None: ...


def warmup_call(operation: str, doc: str) -> Callable[..., None]:
    """The group's `warmup_prefill` / `warmup_decode`: one fan-out, named per operation."""

    def warm(
        self: _Warms,
        *,
        kv_cache: object = None,
        can_sample_on_device: bool | None = None,
        enable_trace: bool | None = None,
    ) -> None:
        hints = {"can_sample_on_device": can_sample_on_device, "enable_trace": enable_trace}
        self._warm(operation, kv_cache, hints)

    warm.__name__ = operation
    warm.__qualname__ = f"LaneGroupExecutor.{operation}"
    warm.__doc__ = doc
    return guarded(*SETUP, operation=operation)(warm)


def clone_config(config: object) -> object:
    """A copy of one capacity config for each lane (a dataclass, an attrs class or other)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.replace(config)
    if attrs.has(type(config)):
        return attrs.evolve(config)  # type: ignore[misc]
    return copy.copy(config)
