"""A reusable Hypothesis state machine that checks any host's call orderings.

Give it a host factory, the public calls to drive, and an *independent* expected model (the
test's own table of what each call should do). Hypothesis then tries random orderings and
checks: an illegal call raises `PhaseError` and leaves the phase unchanged, a legal call
reaches the expected phase, TERMINAL is absorbing, `close()` is idempotent, and the journal
only ever grows.

    HostOrdering = host_ordering_machine(
        host_factory=MyHost, calls={"seal": lambda h: h.seal(), ...},
        expected_factory=MyExpectedTable,
    )
    TestMyHost = HostOrdering.TestCase
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lifecycle.errors import PhaseError
from lifecycle.host import LifecycleHost
from lifecycle.phases import Phase

H = TypeVar("H", bound=LifecycleHost)


class ExpectedModel(Protocol):
    """The test's own idea of the host: which phase each call reaches, if any."""

    def expect(self, call: str) -> Phase | None:
        """The phase `call` must reach now (and record it), or None if it must be refused."""
        ...


class HostOrderingRules(RuleBasedStateMachine):
    """The checks every host ordering machine runs; `host_ordering_machine` fills in the host,
    its calls and the expected model, and adds the rule that drives the calls."""

    calls: Mapping[str, Callable[[LifecycleHost], object]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.host = self.new_host()
        self.expected = self.new_expected()
        self.reached_terminal = False
        self.journal_seen = 0

    def new_host(self) -> LifecycleHost:
        raise NotImplementedError

    def new_expected(self) -> ExpectedModel:
        raise NotImplementedError

    def after_teardown(self, host: LifecycleHost) -> None:
        """A hook for extra checks once the host is closed (default: none)."""

    def check_call(self, call: str) -> None:
        """Make `call`; a refused one must raise `PhaseError` and leave the phase unchanged."""
        before = self.host.phase
        want = self.expected.expect(call)
        if want is None:
            try:
                self.calls[call](self.host)
            except PhaseError:
                pass
            else:
                raise AssertionError(f"{call}() in {before.name} should raise PhaseError")
            assert self.host.phase is before, (
                f"refused {call}() moved {before.name} -> {self.host.phase.name}"
            )
        else:
            self.calls[call](self.host)
            assert self.host.phase is want, (
                f"{call}() from {before.name} reached {self.host.phase.name}, expected {want.name}"
            )
        if self.host.phase is Phase.TERMINAL:
            self.reached_terminal = True

    @rule()
    def close_twice(self) -> None:
        self.host.close()
        self.expected.expect("close")
        self.host.close()
        self.expected.expect("close")
        assert self.host.phase is Phase.TERMINAL
        self.reached_terminal = True

    @invariant()
    def terminal_is_absorbing(self) -> None:
        if self.reached_terminal:
            assert self.host.phase is Phase.TERMINAL

    @invariant()
    def journal_only_grows(self) -> None:
        entries = self.host.journal.entries
        assert len(entries) >= self.journal_seen
        assert [e.sequence for e in entries] == list(range(1, len(entries) + 1))
        self.journal_seen = len(entries)

    def teardown(self) -> None:
        self.host.close()
        self.after_teardown(self.host)


def host_ordering_machine(
    *,
    host_factory: Callable[[], H],
    calls: Mapping[str, Callable[[H], object]],
    expected_factory: Callable[[], ExpectedModel],
    after_teardown: Callable[[H], None] | None = None,
) -> type[RuleBasedStateMachine]:
    """Build a `RuleBasedStateMachine` class for one host type."""
    if "close" not in calls:
        raise ValueError("calls must include 'close' so terminal behaviour is exercised")
    names = sorted(calls)

    class HostOrdering(HostOrderingRules):
        def new_host(self) -> LifecycleHost:
            return host_factory()

        def new_expected(self) -> ExpectedModel:
            return expected_factory()

        def after_teardown(self, host: LifecycleHost) -> None:
            if after_teardown is not None:
                after_teardown(host)  # type: ignore[arg-type]

        @rule(call=st.sampled_from(names))
        def call(self, call: str) -> None:
            self.check_call(call)

    HostOrdering.calls = calls  # type: ignore[assignment]
    return HostOrdering
