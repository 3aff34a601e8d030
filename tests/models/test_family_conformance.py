"""The lifecycle conformance kit (`lifecycle.testing`) on every registered model family.

Each family's first tiny preset is built through `load_executor` (the registry finds the
family) and driven in random call orders against this test's own reading of the host's
phase table, traced and untraced: illegal calls raise `PhaseError` and leave the phase,
legal ones reach the expected phase, the journal only grows, TERMINAL absorbs, and closing
leaves no device allocation live. A family added later is covered by adding a preset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings

from lifecycle import Phase
from lifecycle.testing import host_ordering_machine
from models import load_executor
from models.families import families

P = Phase
SETUP = {P.CONSTRUCTED, P.CAPACITY_RESOLVED, P.SEALED, P.ALLOCATED, P.COMPILED, P.CAPTURED}


class ExpectedExecutor:
    """The phase table of `docs/lifecycle.md` for one model lane."""

    STEPS: ClassVar[dict[str, dict[Phase, Phase]]] = {
        "resolve_capacity": {P.CONSTRUCTED: P.CAPACITY_RESOLVED},
        "seal": {P.CAPACITY_RESOLVED: P.SEALED},
        "allocate": {P.SEALED: P.ALLOCATED},
    }

    def __init__(self, traced: bool) -> None:
        self.traced = traced
        self.phase = P.CONSTRUCTED
        self.warmed: set[str] = set()

    def expect(self, call: str) -> Phase | None:
        reached: Phase | None
        if call == "close":
            reached = P.TERMINAL
        elif call in ("warmup_prefill", "warmup_decode"):
            reached = None
            if self.phase in (P.ALLOCATED, P.COMPILED):
                self.warmed.add(call)
                done = self.warmed == {"warmup_prefill", "warmup_decode"}
                reached = P.COMPILED if done else self.phase
        elif call == "capture":
            reached = P.CAPTURED if self.phase is P.COMPILED and self.traced else None
        elif call == "serve":
            ok = self.phase is P.CAPTURED or (self.phase is P.COMPILED and not self.traced)
            reached = P.SERVING if ok else None
        elif call == "start":
            reached = P.SERVING if self.phase in SETUP else None
        else:
            reached = self.STEPS[call].get(self.phase)
        if reached is not None:
            self.phase = reached
        return reached


CALLS: dict[str, Callable[[Any], object]] = {
    "resolve_capacity": lambda h: h.resolve_capacity(),
    "seal": lambda h: h.seal(),
    "allocate": lambda h: h.allocate(),
    "warmup_prefill": lambda h: h.warmup_prefill(),
    "warmup_decode": lambda h: h.warmup_decode(),
    "capture": lambda h: h.capture(),
    "serve": lambda h: h.serve(),
    "start": lambda h: h.start(),
    "close": lambda h: h.close(),
}


def _first_presets() -> list[str]:
    return [f"tiny-random-{sorted(family.presets)[0]}" for family in families() if family.presets]


def _no_leaks(host: Any) -> None:
    assert host.device.live_allocations == 0


@pytest.mark.parametrize("trace_mode", ["none", "all"])
@pytest.mark.parametrize("model", _first_presets())
def test_family_executor_honours_the_phase_table(model: str, trace_mode: str) -> None:
    ordering = host_ordering_machine(
        host_factory=lambda: load_executor(
            model,
            trace_mode=trace_mode,
            block_size=8,
            max_batch_size=2,
            max_prefill_chunk_size=32,
            max_seq_len=64,
            device_sampling=False,
        ),
        calls=CALLS,
        expected_factory=lambda: ExpectedExecutor(traced=trace_mode != "none"),
        after_teardown=_no_leaks,
    )
    case = ordering.TestCase
    case.settings = settings(
        max_examples=6,
        stateful_step_count=10,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    case("runTest").runTest()


def test_every_family_has_a_preset_for_the_kit() -> None:
    assert {family.name for family in families() if family.presets} >= {"llama", "qwen3"}
