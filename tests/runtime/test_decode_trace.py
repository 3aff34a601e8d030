"""Decode trace parts with the real ProgramCompiler and TraceCompiler on CPU: capture, refresh
decisions, replay bit-identical to eager decode, sampling copies, device feedback, cleanup."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch

from runtime.decode import (
    DecodeInvocationResult,
    DecodePersistentInputs,
    DecodeRuntime,
    PreparedDecode,
)
from runtime.identity import ProgramKey
from runtime.program_compiler import OutputSpec, ProgramCompiler
from runtime.sampling import SamplingParams
from runtime.tensor_resources import release_or_orphan
from runtime.trace_compiler import (
    InputRefreshPolicy,
    PersistentInputs,
    RefreshDecision,
    TraceArtifact,
    TraceCompiler,
)
from tests.runtime.tiny_setup import (
    TinySetup,
    block_page_table,
    build_tiny_setup,
    prefill_prompts,
    tiny_sampler,
)

LANE = 4
PROMPTS: list[list[int] | None] = [[1, 5, 9, 13, 17], None, [3, 4, 200], None]


@pytest.fixture
def setup() -> Iterator[TinySetup]:
    built = build_tiny_setup()
    built.model.sampling = tiny_sampler(built.model, max_batch_size=LANE)
    yield built
    built.close()


def make_runtime(setup: TinySetup) -> DecodeRuntime:
    return DecodeRuntime(setup.decode_config(lane_capacity=LANE, device_sampling_enabled=True))


def prefilled(setup: TinySetup) -> torch.Tensor:
    table = block_page_table(LANE, 8)
    prefill_prompts(setup, PROMPTS, table)
    return table


@attrs.define
class Traced:
    """A runtime with a ProgramCompiler/TraceCompiler pair bound to the setup's KV cache."""

    setup: TinySetup
    runtime: DecodeRuntime
    programs: ProgramCompiler
    traces: TraceCompiler

    def compile_and_register(
        self, prepared: PreparedDecode, *, policy: InputRefreshPolicy | None = None
    ) -> ProgramKey:
        rt = self.runtime
        program = self.programs.compile(
            rt.program_signature(prepared),
            lambda context: rt.invoke(prepared, device_feedback=prepared.device_feedback),
            output_spec=lambda result: OutputSpec.from_value(result.value),
            release_output=lambda result: result.owned,
        )
        plan = rt.capture_plan(prepared)
        if policy is not None:
            plan = attrs.evolve(plan, refresh_policy=policy)
        self.traces.register_capture_plan(
            plan.to_trace_capture_plan(program.key, rt.trace_signature(prepared))
        )
        return program.key

    def replay(
        self,
        key: ProgramKey,
        prepared: PreparedDecode,
        *,
        feedback_compatible: bool = False,
        seen: list[RefreshDecision] | None = None,
    ) -> Any:
        rt = self.runtime

        def refresh(artifact: TraceArtifact, decision: RefreshDecision) -> None:
            if seen is not None:
                seen.append(decision)
            rt.refresh_trace(artifact, prepared, decision)

        raw = self.traces.replay(
            key,
            refresh,
            reset_batch=prepared.reset_batch,
            device_feedback_enabled=prepared.device_feedback,
            feedback_compatible=feedback_compatible,
            page_table_changed=prepared.page_table_changed,
        )
        rt.note_submitted(prepared)
        return raw

    def read(self, raw: Any, prepared: PreparedDecode) -> Any:
        result = DecodeInvocationResult(
            value=raw, owned=None, is_tokens=prepared.sampling_path != "logits"
        )
        return self.runtime.consume(result)

    def close(self) -> None:
        self.traces.cleanup()
        self.programs.cleanup()


def traced(setup: TinySetup) -> Traced:
    programs = ProgramCompiler(setup.device, lambda: setup.kv_manager.bound_context)
    return Traced(setup, make_runtime(setup), programs, TraceCompiler(programs))


def eager(rt: DecodeRuntime, prepared: PreparedDecode) -> Any:
    return rt.consume(rt.invoke(prepared))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return isinstance(b, tuple) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(torch.equal(a, b))


# --------------------------------------------------------------------------------------------
# Replay equals eager
# --------------------------------------------------------------------------------------------


def test_logits_trace_replays_bit_identical_to_eager(setup: TinySetup) -> None:
    table = prefilled(setup)
    t = traced(setup)
    rt = t.runtime
    start = torch.tensor([5, -1, 3, -1])
    first = rt.prepare(torch.tensor([21, 0, 42, 0]), start, table)
    key = t.compile_and_register(first)
    t.traces.capture_all()
    assert setup.device.live_traces == 1
    outputs: list[Any] = []
    for step in range(4):
        positions = start + torch.tensor([step, 0, step, 0])
        tokens = torch.tensor([30 + step, 0, 60 + step, 0])
        if step == 2:  # a new request joins row 1: prefill it, then decode it
            joined = torch.full((LANE, 8), -1, dtype=torch.int32)
            joined[1] = table[1]
            prefill_prompts(setup, [None, [7, 8], None, None], joined)
        if step >= 2:
            positions[1] = step
            tokens[1] = 90 + step
        prepared = rt.prepare(tokens, positions, table)
        expected = eager(rt, prepared)
        raw = t.replay(key, prepared)
        outputs.append(raw)
        assert torch.equal(t.read(raw, prepared), expected)
        assert bool(expected[1].any()) == (step >= 2)
    assert all(raw is outputs[0] for raw in outputs)  # trace-owned outputs, rewritten in place
    t.close()
    assert setup.device.live_traces == 0
    assert setup.device.live_allocations == setup.resident_allocations


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=16, top_p=0.9, seed=[5, -1, 9, -1]),
        SamplingParams(
            temperature=1.3, top_k=16, seed=[5, -1, 9, -1], enable_log_probs=[True, False, True]
        ),
    ],
    ids=["argmax", "seeded-topk", "seeded-topk-logprobs"],
)
def test_sampled_trace_replays_bit_identical_to_eager(
    setup: TinySetup, params: SamplingParams
) -> None:
    table = prefilled(setup)
    t = traced(setup)
    rt = t.runtime
    start = torch.tensor([5, -1, 3, -1])
    tokens = torch.tensor([21, 0, 42, 0])
    first = rt.prepare(tokens, start, table, sampling_params=params)
    key = t.compile_and_register(first)
    t.traces.capture_all()
    for step in range(3):
        positions = start + torch.tensor([step, 0, step, 0])
        prepared = rt.prepare(tokens, positions, table, sampling_params=params)
        expected = eager(rt, prepared)
        got = t.read(t.replay(key, prepared), prepared)
        assert same(got, expected)
        tokens = (expected[0] if isinstance(expected, tuple) else expected).clone()
    t.close()
    assert setup.device.live_allocations == setup.resident_allocations


def test_trace_uses_its_own_sampling_copies_and_restages_only_on_change(
    setup: TinySetup,
) -> None:
    table = prefilled(setup)
    t = traced(setup)
    rt = t.runtime
    sampler = setup.model.sampling
    calls: list[Any] = []
    real_stage = sampler.stage

    def counting_stage(prepared: Any) -> Any:
        calls.append(prepared)
        return real_stage(prepared)

    sampler.stage = counting_stage
    start = torch.tensor([5, -1, 3, -1])
    tokens = torch.tensor([21, 0, 42, 0])
    params = SamplingParams(temperature=1.1, top_k=8, seed=[1, -1, 2, -1])
    key = t.compile_and_register(rt.prepare(tokens, start, table, sampling_params=params))
    t.traces.capture_all()
    foreign = rt.prepare(
        tokens,
        torch.tensor([0, 0, 0, 0]),
        table,
        sampling_params=SamplingParams(temperature=2.0, top_k=32, seed=[7, 7, 7, 7]),
    ).prepared_sampling
    changed = SamplingParams(temperature=0.9, top_k=4, seed=[1, -1, 3, -1])
    for step, step_params in enumerate([params, params, changed]):
        positions = start + torch.tensor([step, 0, step, 0])
        prepared = rt.prepare(tokens, positions, table, sampling_params=step_params)
        expected = eager(rt, prepared)
        sampler.stage(foreign)  # e.g. a prefill staged other values into the shared buffers
        calls.clear()
        got = t.read(t.replay(key, prepared), prepared)
        assert torch.equal(got, expected)
        assert len(calls) == (1 if step == 2 else 0)  # restaged only when the values changed
    t.close()


def test_device_feedback_trace_advances_without_host_refresh(setup: TinySetup) -> None:
    table = prefilled(setup)

    def increment_positions(positions: torch.Tensor) -> None:
        positions.add_((positions >= 0).to(positions.dtype))

    setup.model.increment_positions = increment_positions
    t = traced(setup)
    rt = t.runtime
    start = torch.tensor([3, -1, 2, -1])  # row 0 crosses a block boundary after one step
    tokens = torch.tensor([21, 0, 42, 0])
    params = SamplingParams(temperature=0.0)
    first = rt.prepare(tokens, start, table, sampling_params=params)
    assert first.device_feedback and rt.program_signature(first).device_feedback
    key = t.compile_and_register(first)
    t.traces.capture_all()
    decisions: list[RefreshDecision] = []
    for step in range(3):
        prepared = rt.prepare(
            tokens, start + torch.tensor([step, 0, step, 0]), table, sampling_params=params
        )
        expected = eager(rt, prepared)
        got = t.read(t.replay(key, prepared, feedback_compatible=True, seen=decisions), prepared)
        assert torch.equal(got, expected)
        tokens = expected.clone()
    assert [decision.full for decision in decisions] == [True, False, False]
    t.close()


# --------------------------------------------------------------------------------------------
# Capture and refresh rules
# --------------------------------------------------------------------------------------------


def test_capture_allocates_nothing_and_reads_only_persistent_inputs(setup: TinySetup) -> None:
    table = prefilled(setup)
    rt = make_runtime(setup)
    prepared = rt.prepare(
        torch.tensor([21, 0, 42, 0]),
        torch.tensor([5, -1, 3, -1]),
        table,
        sampling_params=SamplingParams(temperature=1.0, top_k=4, seed=[3, -1, 4, -1]),
    )
    plan = rt.capture_plan(prepared)
    persistent = plan.prepare_inputs()
    assert isinstance(persistent, DecodePersistentInputs)
    assert persistent.sampling is not None and set(persistent.sampling) == set(
        setup.model.sampling.buffers
    )
    allocated = setup.device.allocations_total
    live = setup.device.live_allocations
    first = plan.capture(PersistentInputs(persistent))
    second = plan.capture(persistent)
    assert setup.device.allocations_total == allocated
    assert setup.device.live_allocations == live
    assert torch.equal(first, second)
    orphan, failures = release_or_orphan(PersistentInputs(persistent), setup.device)
    assert orphan is None and not failures
    assert setup.device.live_allocations == setup.resident_allocations


def test_refresh_copies_what_the_decision_says(setup: TinySetup) -> None:
    rt = make_runtime(setup)
    table = block_page_table(LANE, 8)
    first = rt.prepare(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3]), table)
    persistent = rt.capture_plan(first).prepare_inputs()
    inputs = persistent.device_inputs
    moved = block_page_table(LANE, 8, first_block=1)
    second = rt.prepare(torch.tensor([9, 8, 7, 6]), torch.tensor([4, 5, 6, 7]), moved)

    rt.refresh_trace(persistent, second, RefreshDecision(full=False, page_table=False, fields=()))
    assert torch.equal(inputs.tokens, first.tokens)
    assert torch.equal(inputs.page_table, first.page_table)

    rt.refresh_trace(persistent, second, RefreshDecision(full=False, page_table=True, fields=()))
    assert torch.equal(inputs.tokens, first.tokens)  # a page-table refresh copies no tokens
    assert torch.equal(inputs.positions, first.start_pos)
    assert torch.equal(inputs.page_table, second.page_table)

    rt.refresh_trace(persistent, second, RefreshDecision(full=True, page_table=False, fields=()))
    assert torch.equal(inputs.tokens, second.tokens)
    assert torch.equal(inputs.positions, second.start_pos)
    release_or_orphan(persistent, setup.device)


def test_page_table_only_replay_through_the_trace_compiler(setup: TinySetup) -> None:
    table = prefilled(setup)
    t = traced(setup)
    rt = t.runtime
    policy = InputRefreshPolicy(full_on_graph_switch=False, full_without_device_feedback=False)
    first = rt.prepare(torch.tensor([21, 0, 42, 0]), torch.tensor([5, -1, 3, -1]), table)
    key = t.compile_and_register(first, policy=policy)
    t.traces.capture_all()
    persistent = t.traces.get(t.traces.trace_key_for_program(key)).persistent  # type: ignore[union-attr]
    assert persistent is not None
    inputs = persistent.values.device_inputs
    decisions: list[RefreshDecision] = []
    moved = table.clone()
    moved[2, 0] = 30
    second = rt.prepare(torch.tensor([1, 0, 2, 0]), torch.tensor([6, -1, 4, -1]), moved)
    assert second.page_table_changed
    t.replay(key, second, seen=decisions)
    assert decisions == [RefreshDecision(full=False, page_table=True, fields=())]
    assert torch.equal(inputs.page_table, second.page_table)
    assert torch.equal(inputs.tokens, first.tokens)
    t.close()


def test_sampling_path_changes_are_refused(setup: TinySetup) -> None:
    rt = make_runtime(setup)
    table = block_page_table(LANE, 8)
    tokens = torch.tensor([1, 2, 3, 4])
    start = torch.tensor([0, 1, 2, 3])
    full = RefreshDecision(full=True, page_table=False, fields=("sampling",))

    def persistent_for(params: SamplingParams | None) -> DecodePersistentInputs:
        return rt.capture_plan(
            rt.prepare(tokens, start, table, sampling_params=params)
        ).prepare_inputs()

    logits_inputs = persistent_for(None)
    argmax_inputs = persistent_for(SamplingParams(temperature=0.0))
    sampled = rt.prepare(tokens, start, table, sampling_params=SamplingParams(temperature=0.0))
    unsampled = rt.prepare(tokens, start, table)
    topk = rt.prepare(
        tokens, start, table, sampling_params=SamplingParams(temperature=1.0, top_k=3)
    )
    message = "sampling parameters changed the compiled sampling path"
    with pytest.raises(RuntimeError, match=message):
        rt.refresh_trace(logits_inputs, sampled, full)
    with pytest.raises(RuntimeError, match=message):
        rt.refresh_trace(argmax_inputs, unsampled, full)
    with pytest.raises(RuntimeError, match=message):
        rt.refresh_trace(argmax_inputs, topk, full)
    rt.refresh_trace(argmax_inputs, sampled, full)
    for value in (logits_inputs, argmax_inputs):
        release_or_orphan(value, setup.device)
    assert setup.device.live_allocations == setup.resident_allocations


def test_penalty_history_has_a_fixed_captured_shape(setup: TinySetup) -> None:
    rt = make_runtime(setup)
    table = block_page_table(LANE, 8)
    tokens = torch.tensor([1, 2, 3, 4])
    start = torch.tensor([0, 1, 2, 3])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    history = torch.full((LANE, 6), -1, dtype=torch.int64)
    prepared = rt.prepare(tokens, start, table, sampling_params=params, output_tokens=history)
    assert prepared.penalties_enabled and rt.program_signature(prepared).penalties_enabled
    persistent = rt.capture_plan(prepared).prepare_inputs()
    assert tuple(persistent.device_inputs.output_tokens.shape) == (LANE, 6)
    grown = history.clone()
    grown[:, 0] = 5
    refreshed = rt.prepare(tokens, start, table, sampling_params=params, output_tokens=grown)
    rt.refresh_trace(persistent, refreshed, RefreshDecision(False, False, ("sampling",)))
    assert torch.equal(persistent.device_inputs.output_tokens, grown)
    longer = torch.full((LANE, 7), -1, dtype=torch.int64)
    too_long = rt.prepare(tokens, start, table, sampling_params=params, output_tokens=longer)
    with pytest.raises(RuntimeError, match=r"captured with \(4, 6\); pad history"):
        rt.refresh_trace(persistent, too_long, RefreshDecision(False, False, ("sampling",)))
    release_or_orphan(persistent, setup.device)


def test_trace_parts_validate_their_arguments(setup: TinySetup) -> None:
    rt = make_runtime(setup)
    prepared = rt.prepare(
        torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3]), block_page_table(LANE, 8)
    )
    persistent = rt.capture_plan(prepared).prepare_inputs()
    decision = RefreshDecision(full=True, page_table=False, fields=())
    refresh: Callable[..., None] = rt.refresh_trace
    with pytest.raises(TypeError, match="decode TraceArtifact, PersistentInputs"):
        refresh({"tokens": None}, prepared, decision)
    with pytest.raises(TypeError, match="PreparedDecode"):
        refresh(persistent, "prepared", decision)
    with pytest.raises(TypeError, match="RefreshDecision"):
        refresh(persistent, prepared, {"full": True})
    with pytest.raises(TypeError, match="PreparedDecode"):
        rt.capture_plan(None)  # type: ignore[arg-type]
    release_or_orphan(persistent, setup.device)
