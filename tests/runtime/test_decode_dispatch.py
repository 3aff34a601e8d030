"""One signature per step, one lookup per step: the decode dispatcher and the checked lane step.

A decode step's `DecodeSignature` is built once, by `DecodeRuntime.prepare`; the eager and
traced executors find the step's program by that value (`DecodeDispatcher`), so serving a
step computes no digest. A lane group's boundary stamps the steps it checked (`DecodeCheck`);
a lane of that geometry does not check them again, and any other step still is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch

from runtime import decode as decode_module
from runtime import identity
from runtime.config import TraceConfig
from runtime.decode_dispatch import DecodeDispatcher
from runtime.execution import CompileGateClosedError, TraceCoverageError
from runtime.lane_group import LaneGroupExecutor
from runtime.lanes import InProcessLane
from runtime.steps import DecodeCheck, DecodeStep
from tests.integration.executor_setup import tiny_executor

LANE = 2


def _step(executor: Any, *, token: int = 3) -> dict[str, torch.Tensor]:
    """Every row active at position 4 + row, two blocks per row."""
    rows = int(executor.max_batch_size)
    width = executor.page_table_layout.decode_width
    table = torch.zeros((rows, width), dtype=torch.int32)
    table[:, :2] = torch.arange(rows * 2, dtype=torch.int32).reshape(rows, 2)
    return {
        "tokens": torch.full((rows,), token, dtype=torch.long),
        "start_pos": torch.arange(4, 4 + rows, dtype=torch.long),
        "page_table": table,
    }


@pytest.fixture(params=["none", "decode_only"])
def serving(request: pytest.FixtureRequest) -> Iterator[Any]:
    executor = tiny_executor(max_batch_size=LANE, trace_mode=request.param)
    executor.start()
    yield executor
    executor.close()


def test_prepare_builds_the_signature_once_per_sampling_facts(serving: Any) -> None:
    runtime = serving.decode_runtime
    first = runtime.prepare(**_step(serving))
    second = runtime.prepare(**_step(serving, token=5))
    assert first.signature is second.signature, "equal sampling facts share one signature"
    assert runtime.program_signature(first) is first.signature
    assert runtime.trace_signature(first) is first.signature
    assert first.signature.batch_size == LANE
    assert first.signature.page_table_width == serving.page_table_layout.decode_width


def test_a_served_step_computes_no_digest(serving: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    serving.decode_forward(**_step(serving))  # the first lookup may encode it once
    encoded: list[object] = []
    real = identity.tag_key_material

    def counting(value: object) -> identity.TaggedMaterial:
        encoded.append(value)
        return real(value)

    # Every key (the canonical JSON a digest hashes) is built through this encoder.
    monkeypatch.setattr(identity, "tag_key_material", counting)
    for token in range(3, 8):
        serving.decode_forward(**_step(serving, token=token))
    assert encoded == [], f"a served decode step encoded its signature's key: {encoded[:3]}"


def test_the_dispatcher_finds_only_compiled_programs(serving: Any) -> None:
    dispatcher = serving.eager_executor.dispatcher
    assert isinstance(dispatcher, DecodeDispatcher)
    prepared = serving.decode_runtime.prepare(**_step(serving))
    program = dispatcher.program(prepared.signature)
    assert program is not None and program.signature == prepared.signature
    assert dispatcher.program(prepared.signature) is program, "a found program is kept"
    other = attrs.evolve(prepared.signature, batch_size=LANE + 1)
    assert dispatcher.program(other) is None


def test_a_missing_program_is_still_refused_by_each_executor() -> None:
    """Eager after capture: compile gate closed; traced: coverage missing (nothing ran)."""
    executor = tiny_executor(max_batch_size=LANE, trace_mode="decode_only")
    executor.start()
    try:
        runtime = executor.decode_runtime
        prepared = runtime.prepare(**_step(executor))
        foreign = attrs.evolve(
            prepared, signature=attrs.evolve(prepared.signature, page_table_width=999)
        )
        with pytest.raises(TraceCoverageError, match="Required decode trace is unavailable"):
            executor.traced_executor.decode_forward(foreign)
        with pytest.raises(CompileGateClosedError, match="compile gate closed"):
            executor.eager_executor.decode_forward(foreign)
    finally:
        executor.close()


def test_trace_config_answers_what_is_traced() -> None:
    assert [TraceConfig.of(mode).enabled for mode in ("none", "decode_only", "all")] == [
        False,
        True,
        True,
    ]
    assert (
        TraceConfig.of("all").prefill_enabled and not TraceConfig.of("decode_only").prefill_enabled
    )
    with pytest.raises(ValueError, match="Unsupported trace mode: 'eager'"):
        TraceConfig.of("eager")


# -- the checked lane step -----------------------------------------------------------------


@pytest.fixture
def group() -> Iterator[LaneGroupExecutor]:
    lanes = [InProcessLane(tiny_executor(max_batch_size=LANE), index=i) for i in range(2)]
    built = LaneGroupExecutor(lanes)
    built.start()
    yield built
    built.close()


def _count_lane_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the lane boundary's input checks (the group's boundary has its own binding)."""
    calls: list[int] = []
    real = decode_module.check_lane_inputs

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_module, "check_lane_inputs", counting)
    return calls


def _group_step(group: LaneGroupExecutor) -> dict[str, torch.Tensor]:
    """Global slot s is local row s % LANE of its lane: blocks 2r and 2r + 1 (lane-local)."""
    rows = 2 * LANE
    width = group.page_table_layout.decode_width
    table = torch.zeros((rows, width), dtype=torch.int32)
    for slot in range(rows):
        local = slot % LANE
        table[slot, :2] = torch.tensor([2 * local, 2 * local + 1])
    return {
        "tokens": torch.tensor([3, 4, 5, 6]),
        "start_pos": torch.tensor([4, 5, 6, 7]),
        "page_table": table,
    }


def test_a_group_checked_step_is_not_checked_again_by_its_lanes(
    group: LaneGroupExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    arguments = _group_step(group)
    want = group.decode_forward(**arguments)
    calls = _count_lane_checks(monkeypatch)
    have = group.decode_forward(**arguments)
    assert calls == [], "a lane re-checked a step its group boundary checked"
    assert torch.equal(want, have)


def test_a_lane_checks_a_step_stamped_for_another_geometry(
    group: LaneGroupExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    lane = group.lanes[0]
    assert isinstance(lane, InProcessLane)
    executor: Any = lane.executor
    own = executor.decode_runtime._check
    assert isinstance(own, DecodeCheck)
    arguments = _step(executor)
    arguments["tokens"] = torch.tensor([3, 10_000])  # beyond the vocabulary
    calls = _count_lane_checks(monkeypatch)
    for stamp in (None, attrs.evolve(own, vocab_size=own.vocab_size + 10_000)):
        with pytest.raises(ValueError, match="tokens row 1 is 10000"):
            executor.decode_step(DecodeStep.of(arguments, checked=stamp))
    assert len(calls) == 2, "a step not stamped with the lane's own geometry is checked"
    assert executor.phase.name == "SERVING"


def test_a_lane_refuses_what_is_not_a_step(group: LaneGroupExecutor) -> None:
    lane = group.lanes[0]
    assert isinstance(lane, InProcessLane)
    executor: Any = lane.executor
    with pytest.raises(TypeError, match="step must be a DecodeStep, got dict"):
        executor.decode_step(_step(executor))
