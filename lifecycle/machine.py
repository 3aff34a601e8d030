"""Declared state tables turned into `transitions` machines, plus cheap guards.

An owner declares its states and transitions as a `MachineTable`, builds one `StateMachine`
from it and holds it by composition. Guards compare the current state with a frozen set (tens
of nanoseconds) and never fire a trigger; triggers fire only at real phase changes, through
`StateMachine.transact`, which runs the work first and changes state only when it succeeded.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import ParamSpec, TypeVar

import attrs
from transitions import Machine

from lifecycle.errors import (
    FaultedError,
    PhaseError,
    TerminalError,
    TransitionRefused,
    left_resources,
)
from lifecycle.journal import Journal, Outcome, now

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


@attrs.frozen
class StateSpec:
    """One declared state: what it means and which calls move an object onwards from it."""

    state: Enum
    description: str = ""
    next_calls: tuple[str, ...] = ()
    refusal: str = ""


@attrs.frozen
class TransitionSpec:
    """One declared transition: `trigger` moves any of `sources` to `dest`."""

    trigger: str
    sources: tuple[Enum, ...]
    dest: Enum
    description: str = ""


@attrs.frozen
class MachineTable:
    """A complete declaration: states, transitions, the initial state and the absorbing ones.

    `fault_trigger` names the transition taken when work left resources it could not release.
    """

    name: str
    states: tuple[StateSpec, ...]
    transitions: tuple[TransitionSpec, ...]
    initial: Enum
    terminal: frozenset[Enum] = frozenset()
    faulted: frozenset[Enum] = frozenset()
    fault_trigger: str | None = None

    def __attrs_post_init__(self) -> None:
        declared = {spec.state for spec in self.states}
        if self.initial not in declared:
            raise ValueError(f"{self.name}: initial state {self.initial!r} is not declared")
        for transition in self.transitions:
            unknown = [s for s in (*transition.sources, transition.dest) if s not in declared]
            if unknown:
                raise ValueError(
                    f"{self.name}: transition {transition.trigger!r} uses undeclared "
                    f"state(s) {unknown!r}"
                )
        if self.fault_trigger is not None and self.fault_trigger not in self.triggers():
            raise ValueError(f"{self.name}: fault trigger {self.fault_trigger!r} is not declared")

    def spec(self, state: Enum) -> StateSpec:
        """The declaration of `state`."""
        for spec in self.states:
            if spec.state == state:
                return spec
        raise KeyError(state)

    def triggers(self) -> tuple[str, ...]:
        """Every trigger name, in declaration order, without repeats."""
        return tuple(dict.fromkeys(t.trigger for t in self.transitions))

    def triggers_from(self, state: Enum) -> tuple[str, ...]:
        """Triggers that have a transition leaving `state`."""
        return tuple(dict.fromkeys(t.trigger for t in self.transitions if state in t.sources))

    def dest(self, trigger: str, source: Enum) -> Enum | None:
        """Where `trigger` leads from `source`, or None when it is not legal there."""
        for transition in self.transitions:
            if transition.trigger == trigger and source in transition.sources:
                return transition.dest
        return None

    def build(self, *, owner: str | None = None, journal: Journal | None = None) -> StateMachine:
        """A fresh machine in the initial state."""
        return StateMachine(self, owner=owner or self.name, journal=journal)


class _StateHolder:
    """The `transitions` model: it only carries `state` (and the triggers transitions adds)."""

    state: Enum


class StateMachine:
    """One owner's live machine: current state, guarded refusals, transactional triggers."""

    __slots__ = ("_holder", "_machine", "adjust_next_calls", "journal", "owner", "table")

    def __init__(self, table: MachineTable, *, owner: str, journal: Journal | None) -> None:
        self.table = table
        self.owner = owner
        self.journal = journal if journal is not None else Journal()
        self.adjust_next_calls: Callable[[Enum, tuple[str, ...]], tuple[str, ...]] | None = None
        """The owner's say on its onward calls in a state (drops one that would be refused)."""
        self._holder = _StateHolder()
        self._machine = Machine(
            model=self._holder,
            states=[spec.state for spec in table.states],
            transitions=[
                {"trigger": t.trigger, "source": list(t.sources), "dest": t.dest}
                for t in table.transitions
            ],
            initial=table.initial,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            model_attribute="state",
        )

    @property
    def state(self) -> Enum:
        """The current state (an Enum member of the table)."""
        return self._holder.state

    def can(self, trigger: str) -> bool:
        """Whether `trigger` has a transition from the current state."""
        return self.table.dest(trigger, self._holder.state) is not None

    def next_calls(self) -> tuple[str, ...]:
        """The calls that move the owner onwards from where it is now."""
        state = self._holder.state
        calls = self.table.spec(state).next_calls
        return calls if self.adjust_next_calls is None else self.adjust_next_calls(state, calls)

    def refusal(
        self,
        operation: str,
        legal: Iterable[Enum],
        *,
        reason: str | None = None,
        record: bool = True,
    ) -> PhaseError:
        """Build (and journal) the teaching error for a call that is illegal right now."""
        state = self._holder.state
        error_type: type[PhaseError] = PhaseError
        reason = reason or self.table.spec(state).refusal.format(owner=self.owner) or None
        if state in self.table.terminal:
            error_type = TerminalError
        elif state in self.table.faulted:
            error_type = FaultedError
        absorbed = error_type is TerminalError
        error = error_type(
            owner=self.owner,
            operation=operation,
            phase=_name(state),
            legal_phases=() if absorbed else [_name(s) for s in _ordered(self.table, legal)],
            next_calls=self.next_calls(),
            reason=reason,
        )
        if record:
            self._record_in_place(operation, Outcome.REFUSED, error=error)
        return error

    def require(self, operation: str, legal: frozenset[Enum], *, reason: str | None = None) -> None:
        """Raise the teaching `PhaseError` unless the current state is in `legal`."""
        if self._holder.state not in legal:
            raise self.refusal(operation, legal, reason=reason)

    def _refuse_trigger(self, trigger: str) -> PhaseError:
        legal = [t.sources for t in self.table.transitions if t.trigger == trigger]
        sources = {state for group in legal for state in group}
        error = self.refusal(trigger, sources, record=False)
        if not isinstance(error, TerminalError | FaultedError):
            error = TransitionRefused(
                owner=error.owner,
                operation=error.operation,
                phase=error.phase,
                legal_phases=error.legal_phases,
                next_calls=error.next_calls,
                reason=error.reason,
            )
        self._record_in_place(trigger, Outcome.REFUSED, error=error)
        return error

    def fire(self, trigger: str, *, detail: str = "", duration_s: float = 0.0) -> Enum:
        """Take a transition that needs no work (or whose work already succeeded)."""
        source = self._holder.state
        dest = self.table.dest(trigger, source)
        if dest is None:
            raise self._refuse_trigger(trigger)
        started = now()
        self._holder.trigger(trigger)  # type: ignore[attr-defined]
        self.journal.record(
            machine=self.owner,
            trigger=trigger,
            source=_name(source),
            dest=_name(dest),
            started=started,
            duration_s=duration_s,
            outcome=Outcome.OK,
            detail=detail,
        )
        return dest

    def note(self, operation: str, detail: str) -> None:
        """Journal a call that is legal here but has nothing to do (an idempotent no-op)."""
        self._record_in_place(operation, Outcome.OK, detail=f"no-op: {detail}")

    def _record_in_place(
        self,
        operation: str,
        outcome: Outcome,
        *,
        detail: str = "",
        error: BaseException | None = None,
    ) -> None:
        """Journal `operation` as an instant entry that left the state where it was."""
        state = _name(self._holder.state)
        self.journal.record(
            machine=self.owner,
            trigger=operation,
            source=state,
            dest=state,
            started=now(),
            duration_s=0.0,
            outcome=outcome,
            detail=detail,
            error=error,
        )

    def transact(
        self,
        trigger: str,
        work: Callable[[], T],
        *,
        detail: Callable[[T], str] | str = "",
    ) -> T:
        """Run `work`, then take `trigger`; a failure leaves the state unchanged.

        When the failed work left resources it could not release (see
        `lifecycle.errors.left_resources`), the machine takes its fault trigger instead, so
        only cleanup stays legal. The error is re-raised either way.
        """
        source = self._holder.state
        dest = self.table.dest(trigger, source)
        if dest is None:
            raise self._refuse_trigger(trigger)
        started = now()
        clock = time.perf_counter()
        try:
            result = work()
        except BaseException as error:
            elapsed = time.perf_counter() - clock
            faulted_dest = self._fault_dest(error)
            self.journal.record(
                machine=self.owner,
                trigger=trigger,
                source=_name(source),
                dest=_name(faulted_dest or source),
                started=started,
                duration_s=elapsed,
                outcome=Outcome.FAILED,
                error=error,
            )
            if faulted_dest is not None and self.table.fault_trigger is not None:
                self._holder.trigger(self.table.fault_trigger)  # type: ignore[attr-defined]
            raise
        elapsed = time.perf_counter() - clock
        text = detail(result) if callable(detail) else detail
        self.fire(trigger, detail=text, duration_s=elapsed)
        return result

    def _fault_dest(self, error: BaseException) -> Enum | None:
        trigger = self.table.fault_trigger
        if trigger is None or not left_resources(error):
            return None
        return self.table.dest(trigger, self._holder.state)


def _name(state: Enum) -> str:
    return state.name


def _ordered(table: MachineTable, states: Iterable[Enum]) -> list[Enum]:
    wanted = set(states)
    return [spec.state for spec in table.states if spec.state in wanted]


GUARD_ATTRIBUTE = "__legal_states__"


def guarded(
    *legal: Enum, operation: str | None = None, reasons: Mapping[Enum, str] | None = None
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Method decorator: refuse the call unless `self._lifecycle` is in one of `legal`.

    The check is one attribute read and one frozenset lookup; no trigger fires. `reasons`
    gives the refusal a call-specific reason in particular states (e.g. `start()` twice).
    """
    legal_set = frozenset(legal)
    why = dict(reasons or {})

    def decorate(method: Callable[P, R]) -> Callable[P, R]:
        name = operation or method.__name__

        @functools.wraps(method)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            machine: StateMachine = args[0]._lifecycle  # type: ignore[attr-defined]
            state = machine._holder.state
            if state not in legal_set:
                raise machine.refusal(name, legal_set, reason=why.get(state))
            return method(*args, **kwargs)

        setattr(wrapper, GUARD_ATTRIBUTE, (name, legal_set))
        return wrapper

    return decorate


def guard_table(cls: type) -> dict[str, frozenset[Enum]]:
    """Operation name -> legal states, collected from the `guarded` methods of `cls`."""
    table: dict[str, frozenset[Enum]] = {}
    for klass in reversed(cls.__mro__):
        for attribute in vars(klass).values():
            # Set by `guarded` as (operation name, legal states).
            marker: tuple[str, frozenset[Enum]] | None = getattr(attribute, GUARD_ATTRIBUTE, None)
            if marker is not None:
                name, legal_states = marker
                table[name] = legal_states
    return table
