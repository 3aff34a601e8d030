"""Hypothesis: random orders of the group's public calls, with lane faults injected.

The expected model is this test's own table: which phase each call reaches, and that an
armed lane fault turns the next legal lane-touching call into a failure after which the group
cleaned every lane and is TERMINAL.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import settings

from lifecycle import Phase
from lifecycle.testing import host_ordering_machine
from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import InProcessLane, LaneFailure
from tests.runtime.lane_fakes import FakeLane

P = Phase
STATE: dict[str, object] = {}


def _factory() -> LaneGroupExecutor:
    fakes = [FakeLane(i, trace_mode="all") for i in range(2)]
    STATE["fakes"] = fakes
    STATE["armed"] = False
    return LaneGroupExecutor([InProcessLane(f, index=i) for i, f in enumerate(fakes)])


def _fakes() -> list[FakeLane]:
    fakes = STATE["fakes"]
    assert isinstance(fakes, list)
    return fakes


def _tolerating_lane_faults(call: Callable[[LaneGroupExecutor], object]) -> Callable[..., None]:
    def run(group: LaneGroupExecutor) -> None:
        try:
            call(group)
        except LaneFailure as error:
            assert STATE["armed"], f"unexpected lane failure: {error}"
            assert "injected lane fault" in str(error)
            assert error.lane == 1

    return run


def _arm(group: LaneGroupExecutor) -> None:
    _fakes()[1].fail_next_call = True
    STATE["armed"] = True


def _prefill(group: LaneGroupExecutor) -> None:
    group.prefill_forward(
        tokens=torch.zeros((2, 3), dtype=torch.long),
        page_table=torch.zeros((2, 1), dtype=torch.int32),
        empty_slots=[0, 3],
    )


def _decode(group: LaneGroupExecutor) -> None:
    group.decode_forward(
        tokens=torch.zeros(4, dtype=torch.long),
        start_pos=torch.zeros(4, dtype=torch.long),
        page_table=torch.zeros((4, 1), dtype=torch.int32),
    )


CALLS: dict[str, Callable[[LaneGroupExecutor], object]] = {
    name: _tolerating_lane_faults(call)
    for name, call in {
        "resolve_capacity": lambda g: g.resolve_capacity(),
        "seal": lambda g: g.seal(),
        "allocate": lambda g: g.allocate(),
        "allocate_kv_cache": lambda g: g.allocate_kv_cache(),
        "warmup_prefill": lambda g: g.warmup_prefill(),
        "warmup_decode": lambda g: g.warmup_decode(),
        "compile": lambda g: g.compile(),
        "capture": lambda g: g.capture(),
        "serve": lambda g: g.serve(),
        "prefill": _prefill,
        "decode": _decode,
        "close": lambda g: g.close(),
    }.items()
}
CALLS["arm_lane_fault"] = _arm

LEGAL: dict[str, dict[Phase, Phase]] = {
    "resolve_capacity": {P.CONSTRUCTED: P.CAPACITY_RESOLVED},
    "seal": {P.CAPACITY_RESOLVED: P.SEALED},
    "allocate": {P.SEALED: P.ALLOCATED},
    "allocate_kv_cache": {
        P.CONSTRUCTED: P.ALLOCATED,
        P.CAPACITY_RESOLVED: P.ALLOCATED,
        P.SEALED: P.ALLOCATED,
    },
    "warmup_prefill": {P.ALLOCATED: P.COMPILED, P.COMPILED: P.COMPILED},
    "warmup_decode": {P.ALLOCATED: P.COMPILED, P.COMPILED: P.COMPILED},
    "compile": {P.ALLOCATED: P.COMPILED},
    "capture": {P.COMPILED: P.CAPTURED},
    "serve": {P.CAPTURED: P.SERVING},
    "prefill": {P.SERVING: P.SERVING},
    "decode": {P.SERVING: P.SERVING},
}


class ExpectedGroup:
    def __init__(self) -> None:
        self.phase = P.CONSTRUCTED

    def expect(self, call: str) -> Phase | None:
        if call == "close":
            self.phase = P.TERMINAL
            _fakes()[1].fail_next_call = False
            STATE["armed"] = False
            return self.phase
        if call == "arm_lane_fault":
            return self.phase
        dest = LEGAL[call].get(self.phase)
        if dest is None:
            return None
        if STATE["armed"]:
            STATE["armed"] = True  # consumed by the call; the group must end terminal
            self.phase = P.TERMINAL
            return self.phase
        self.phase = dest
        return dest


def _after(group: LaneGroupExecutor) -> None:
    assert group.phase is P.TERMINAL
    assert all(fake.closed == 1 for fake in _fakes()), [f.closed for f in _fakes()]


GroupOrdering = host_ordering_machine(
    host_factory=_factory,
    calls=CALLS,
    expected_factory=ExpectedGroup,
    after_teardown=_after,
)
TestGroupOrdering = GroupOrdering.TestCase
TestGroupOrdering.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
