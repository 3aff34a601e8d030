"""The declared-table machine: guards, transactional triggers, refusals, journal."""

from __future__ import annotations

from enum import Enum

import pytest

from lifecycle import (
    FaultedError,
    MachineTable,
    Outcome,
    PhaseError,
    StateSpec,
    TerminalError,
    TransitionRefused,
    TransitionSpec,
    guard_table,
    guarded,
)


class Door(Enum):
    OPEN = "open"
    SHUT = "shut"
    BROKEN = "broken"
    GONE = "gone"


TABLE = MachineTable(
    name="door",
    states=(
        StateSpec(Door.OPEN, "open", ("shut",)),
        StateSpec(Door.SHUT, "shut", ("open",)),
        StateSpec(Door.BROKEN, "broken", ("remove",), refusal="{owner} is broken"),
        StateSpec(Door.GONE, "gone"),
    ),
    transitions=(
        TransitionSpec("shut", (Door.OPEN,), Door.SHUT),
        TransitionSpec("open", (Door.SHUT,), Door.OPEN),
        TransitionSpec("break_", (Door.OPEN, Door.SHUT), Door.BROKEN),
        TransitionSpec("remove", (Door.OPEN, Door.SHUT, Door.BROKEN), Door.GONE),
    ),
    initial=Door.OPEN,
    terminal=frozenset({Door.GONE}),
    faulted=frozenset({Door.BROKEN}),
    fault_trigger="break_",
)


class DoorOwner:
    def __init__(self) -> None:
        self._lifecycle = TABLE.build(owner="FrontDoor")

    @guarded(Door.OPEN)
    def walk_through(self) -> str:
        return "walked"

    @guarded(Door.SHUT, Door.OPEN, operation="knock_on")
    def knock(self) -> str:
        return "knock"


def test_table_rejects_undeclared_states() -> None:
    with pytest.raises(ValueError, match="undeclared"):
        MachineTable(
            name="bad",
            states=(StateSpec(Door.OPEN),),
            transitions=(TransitionSpec("shut", (Door.OPEN,), Door.SHUT),),
            initial=Door.OPEN,
        )
    with pytest.raises(ValueError, match="initial state"):
        MachineTable(name="bad", states=(StateSpec(Door.OPEN),), transitions=(), initial=Door.SHUT)
    with pytest.raises(ValueError, match="fault trigger"):
        MachineTable(
            name="bad",
            states=(StateSpec(Door.OPEN),),
            transitions=(),
            initial=Door.OPEN,
            fault_trigger="nope",
        )


def test_no_auto_transitions() -> None:
    machine = TABLE.build()
    assert not hasattr(machine._holder, "to_GONE")
    assert not hasattr(machine._holder, "to_SHUT")


def test_guard_allows_and_refuses_with_teaching_message() -> None:
    owner = DoorOwner()
    assert owner.walk_through() == "walked"
    owner._lifecycle.fire("shut")
    with pytest.raises(PhaseError) as caught:
        owner.walk_through()
    message = str(caught.value)
    assert "FrontDoor: walk_through() is not legal in SHUT" in message
    assert "it is legal in OPEN" in message
    assert "next: open()" in message
    assert caught.value.phase == "SHUT"
    assert caught.value.legal_phases == ("OPEN",)
    assert isinstance(caught.value, RuntimeError)
    assert owner._lifecycle.state is Door.SHUT
    assert owner.knock() == "knock"


def test_refusals_are_journaled() -> None:
    owner = DoorOwner()
    owner._lifecycle.fire("shut")
    with pytest.raises(PhaseError):
        owner.walk_through()
    last = owner._lifecycle.journal.entries[-1]
    assert last.outcome is Outcome.REFUSED
    assert last.trigger == "walk_through"
    assert "not legal" in (last.error or "")


def test_guard_table_lists_operations() -> None:
    table = guard_table(DoorOwner)
    assert table == {
        "walk_through": frozenset({Door.OPEN}),
        "knock_on": frozenset({Door.OPEN, Door.SHUT}),
    }


def test_transact_changes_state_only_after_work_succeeds() -> None:
    machine = TABLE.build()
    seen: list[Enum] = []

    def work() -> int:
        seen.append(machine.state)
        return 7

    assert machine.transact("shut", work, detail=lambda r: f"result {r}") == 7
    assert seen == [Door.OPEN]
    assert machine.state is Door.SHUT
    entry = machine.journal.entries[-1]
    assert (entry.source, entry.dest, entry.outcome) == ("OPEN", "SHUT", Outcome.OK)
    assert entry.detail == "result 7"


def test_failed_work_leaves_state_unchanged() -> None:
    machine = TABLE.build()

    def work() -> None:
        raise OSError("disk on fire")

    with pytest.raises(OSError, match="disk on fire"):
        machine.transact("shut", work)
    assert machine.state is Door.OPEN
    entry = machine.journal.entries[-1]
    assert entry.outcome is Outcome.FAILED
    assert entry.dest == "OPEN"
    assert "disk on fire" in (entry.error or "")


def test_failed_work_with_leftovers_faults() -> None:
    machine = TABLE.build(owner="FrontDoor")

    def work() -> None:
        error = OSError("allocation failed")
        error.cleanup_failures = (RuntimeError("could not release"),)  # type: ignore[attr-defined]
        raise error

    with pytest.raises(OSError):
        machine.transact("shut", work)
    assert machine.state is Door.BROKEN
    assert machine.journal.entries[-1].dest == "BROKEN"
    with pytest.raises(FaultedError, match="FrontDoor is broken"):
        machine.require("open", frozenset({Door.SHUT}))


def test_resources_left_flag_also_faults() -> None:
    machine = TABLE.build()

    def work() -> None:
        error = RuntimeError("partial")
        error.resources_left = True  # type: ignore[attr-defined]
        raise error

    with pytest.raises(RuntimeError):
        machine.transact("shut", work)
    assert machine.state is Door.BROKEN


def test_illegal_trigger_is_refused_before_work() -> None:
    machine = TABLE.build()
    ran: list[bool] = []
    with pytest.raises(TransitionRefused, match=r"open\(\) is not legal in OPEN"):
        machine.transact("open", lambda: ran.append(True))
    assert ran == []
    assert machine.state is Door.OPEN
    assert machine.journal.entries[-1].outcome is Outcome.REFUSED


def test_terminal_refusal_type() -> None:
    machine = TABLE.build(owner="FrontDoor")
    machine.fire("remove")
    with pytest.raises(TerminalError):
        machine.fire("shut")
    with pytest.raises(TerminalError):
        machine.require("shut", frozenset({Door.OPEN}))


def test_can_and_next_calls() -> None:
    machine = TABLE.build()
    assert machine.can("shut") and not machine.can("open")
    assert machine.next_calls() == ("shut",)
    assert TABLE.triggers_from(Door.SHUT) == ("open", "break_", "remove")
