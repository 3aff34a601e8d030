"""The refusal state machine over one SERVING lane (no group), each trace mode.

The same refusal classes as the lane group's machine (`test_lane_group_refusal_machine`),
drawn against one executor of the group's whole width: after each refused call the phase is
SERVING, the held resources and the device's live allocations and traces are unchanged, and
the next valid call's logits equal those of the executor before any refusal. Plus the pool
rule at the boundary: a block id outside the pool is refused by `DecodeRuntime.prepare` /
`PrefillRuntime.batch`, before the model (or a trace) sees the step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from lifecycle import Phase
from models.decoder.executor import DecoderExecutor
from tests.integration.executor_setup import tiny_executor
from tests.runtime.test_lane_group_refusal_machine import INVALID, ROWS, Served


def _device_counts(executor: DecoderExecutor) -> tuple[int, int]:
    device = executor.device
    return device.live_allocations, device.live_traces


class SingleLaneRefusals(RuleBasedStateMachine):
    """Valid and invalid calls on one serving executor (shared across examples)."""

    def __init__(self, served: Served) -> None:
        super().__init__()
        self.served = served
        executor = served.group
        assert isinstance(executor, DecoderExecutor)
        self.executor = executor
        self.held = executor.components.held_resources()
        self.counts = _device_counts(executor)

    @rule()
    def valid_prefill(self) -> None:
        out = self.executor.prefill_forward(**self.served.prefill)
        assert torch.equal(out, self.served.prefill_logits)

    @rule()
    def valid_decode(self) -> None:
        out = self.executor.decode_forward(**self.served.decode)
        assert torch.equal(out, self.served.decode_logits)

    @rule(
        case=st.sampled_from(sorted(INVALID)),
        row=st.integers(0, ROWS - 1),
        excess=st.integers(0, 10**5),
    )
    def invalid(self, case: str, row: int, excess: int) -> None:
        error, call = INVALID[case]
        with pytest.raises(error):
            call(self.served, row, excess)
        assert self.executor.components.held_resources() == self.held
        assert _device_counts(self.executor) == self.counts

    @invariant()
    def serving(self) -> None:
        assert self.executor.phase is Phase.SERVING


@pytest.fixture(scope="module", params=("none", "decode_only", "all"))
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    executor = tiny_executor(max_batch_size=ROWS, trace_mode=request.param)
    executor.start()
    yield Served(executor)
    executor.close()


def test_refusals_interleaved_with_valid_calls(served: Served) -> None:
    run_state_machine_as_test(
        lambda: SingleLaneRefusals(served),
        settings=settings(
            max_examples=12,
            stateful_step_count=8,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


@pytest.mark.parametrize("operation", ["prefill", "decode"])
@pytest.mark.parametrize("entry", [-2, "pool"])
def test_block_ids_outside_the_pool_are_refused_before_the_model(
    served: Served, operation: str, entry: int | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = served.group
    assert isinstance(executor, DecoderExecutor)
    called: list[str] = []
    model = executor.model
    for name in ("prefill", "decode"):
        original = getattr(model, name)

        def spy(*args: object, _name: str = name, _original: object = original, **kw: object):  # type: ignore[no-untyped-def]
            called.append(_name)
            return _original(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(model, name, spy)
    request = dict(served.prefill if operation == "prefill" else served.decode)
    table = request["page_table"].clone()
    value = served.num_blocks if entry == "pool" else entry
    table[1, 0] = value
    request["page_table"] = table
    call = executor.prefill_forward if operation == "prefill" else executor.decode_forward
    with pytest.raises(ValueError, match=rf"page_table\[1, 0\] is {value}\): allowed are -1"):
        call(**request)
    assert called == []
    assert executor.phase is Phase.SERVING


@pytest.mark.parametrize("operation", ["prefill", "decode"])
def test_a_stale_tail_beyond_the_read_blocks_is_not_judged(served: Served, operation: str) -> None:
    """The reference copies only a row's leading blocks (a scheduler's stale tail is never
    read), so an out-of-pool id there is served with the same logits."""
    executor = served.group
    request = dict(served.prefill if operation == "prefill" else served.decode)
    table = request["page_table"].clone()
    table[:, -1] = served.num_blocks + 7  # the last column: past every row's blocks here
    request["page_table"] = table
    call = executor.prefill_forward if operation == "prefill" else executor.decode_forward
    want = served.prefill_logits if operation == "prefill" else served.decode_logits
    assert torch.equal(call(**request), want)
    assert executor.phase is Phase.SERVING
