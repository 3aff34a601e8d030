"""Hypothesis: random call orders against an independent expected table."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lifecycle import Phase, PhaseError
from lifecycle.testing import host_ordering_machine
from tests.lifecycle.hosts import Pool, ToyHost

P = Phase
LIVE = {P.CONSTRUCTED, P.CAPACITY_RESOLVED, P.SEALED, P.ALLOCATED, P.COMPILED, P.CAPTURED}


class ExpectedToyHost:
    """The test's own reading of the architecture's phase and guard tables."""

    STEPS: ClassVar[dict[str, dict[Phase, Phase]]] = {
        "resolve_capacity": {P.CONSTRUCTED: P.CAPACITY_RESOLVED},
        "seal": {P.CAPACITY_RESOLVED: P.SEALED},
        "allocate": {P.SEALED: P.ALLOCATED},
        "compile": {P.ALLOCATED: P.COMPILED},
        "request": {P.SERVING: P.SERVING},
        "warm": {P.ALLOCATED: P.ALLOCATED, P.COMPILED: P.COMPILED},
    }

    def __init__(self, traced: bool) -> None:
        self.traced = traced
        self.phase = P.CONSTRUCTED

    def expect(self, call: str) -> Phase | None:
        reached: Phase | None
        if call == "close":
            reached = P.TERMINAL
        elif call == "capture":
            reached = P.CAPTURED if self.phase is P.COMPILED and self.traced else None
        elif call == "serve":
            ok = self.phase is P.CAPTURED or (self.phase is P.COMPILED and not self.traced)
            reached = P.SERVING if ok else None
        elif call == "start":
            reached = P.SERVING if self.phase in LIVE else None  # start() twice is refused
        else:
            reached = self.STEPS[call].get(self.phase)
        if reached is not None:
            self.phase = reached
        return reached


CALLS: dict[str, Callable[[ToyHost], object]] = {
    "resolve_capacity": lambda h: h.resolve_capacity(),
    "seal": lambda h: h.seal(),
    "allocate": lambda h: h.allocate(),
    "compile": lambda h: h.compile(),
    "capture": lambda h: h.capture(),
    "serve": lambda h: h.serve(),
    "start": lambda h: h.start(),
    "request": lambda h: h.request(),
    "warm": lambda h: h.warm(),
    "close": lambda h: h.close(),
}


def _no_leaks(host: ToyHost) -> None:
    assert host.pool.live == set()
    assert host.pool.double_releases == 0


TracedOrdering = host_ordering_machine(
    host_factory=lambda: ToyHost(Pool(), traced=True),
    calls=CALLS,
    expected_factory=lambda: ExpectedToyHost(traced=True),
    after_teardown=_no_leaks,
)
UntracedOrdering = host_ordering_machine(
    host_factory=lambda: ToyHost(Pool(), traced=False),
    calls=CALLS,
    expected_factory=lambda: ExpectedToyHost(traced=False),
    after_teardown=_no_leaks,
)

TestTracedHostOrderings = TracedOrdering.TestCase
TestUntracedHostOrderings = UntracedOrdering.TestCase


class FaultyHostMachine(RuleBasedStateMachine):
    """Random phase calls with injected allocation and release failures."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool()
        self.host = ToyHost(self.pool, buffers=3, traced=False)

    @rule(failures=st.integers(0, 3))
    def inject_release_failures(self, failures: int) -> None:
        self.pool.fail_release = failures

    @rule(failures=st.integers(0, 2))
    def inject_allocation_failures(self, failures: int) -> None:
        self.pool.fail_allocate = failures

    @rule(call=st.sampled_from(["resolve_capacity", "seal", "allocate", "compile", "serve"]))
    def phase_call(self, call: str) -> None:
        before = self.host.phase
        try:
            CALLS[call](self.host)
        except PhaseError:
            assert self.host.phase is before
        except MemoryError as error:
            assert call == "allocate"
            expected = P.FAULTED if getattr(error, "cleanup_failures", ()) else before
            assert self.host.phase is expected

    @precondition(lambda self: self.host.phase is not P.TERMINAL)
    @rule()
    def close(self) -> None:
        try:
            self.host.close()
        except RuntimeError as error:
            assert "injected release failure" in str(error)
            assert self.host.phase is P.CLOSING
            assert self.pool.live, "a failed close must still hold something"
        else:
            assert self.host.phase is P.TERMINAL
            assert self.pool.live == set()

    @invariant()
    def never_released_twice(self) -> None:
        assert self.pool.double_releases == 0

    @invariant()
    def held_matches_pool(self) -> None:
        assert set(self.host.held) == self.pool.live

    def teardown(self) -> None:
        self.pool.fail_release = 0
        self.host.close()
        assert self.pool.live == set()


TestFaultyHost = FaultyHostMachine.TestCase
