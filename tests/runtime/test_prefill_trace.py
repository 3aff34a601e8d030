"""Traced prefill with the real ProgramCompiler and TraceCompiler on CPU.

Warmup requests compile and register capture plans; `capture_all` captures one trace per
family (regular single, regular batched, one fixed chunk trace shared by chunked and cached
requests). Other prompts of the same families then replay those traces with refreshed inputs
(a chunked request replays its chunk trace once per planned chunk) and must be bit-identical
to eager execution of the same prompts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import pytest
import torch

from runtime.prefill.result_collector import InvocationResult
from runtime.prefill.signatures import PreparedPrefill
from runtime.prefill.trace import PrefillReplayWorkspace, persistent_device_inputs
from runtime.program_compiler import OutputSpec, ProgramCompiler
from runtime.sampling import SamplingParams
from runtime.trace_compiler import PersistentInputs, TraceCompiler
from tests.runtime.prefill_setup import PrefillHarness, make_harness, prompt, token_matrix

ATOL = 1e-4


def _always(length: int, cached: int) -> bool:
    return True


@attrs.define(eq=False)
class Traced:
    """A harness with its compilers, and the replay loop an executor would run."""

    h: PrefillHarness
    programs: ProgramCompiler
    traces: TraceCompiler

    def prepare(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        start_pos: Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        table: torch.Tensor | None = None,
    ) -> tuple[tuple[PreparedPrefill, ...], torch.Tensor]:
        if table is None:
            table = self.h.page_table(prompts)
            for row, cached in enumerate(start_pos or ()):
                self.h.write_prefix(prompts[row], table[row], cached)
        prepared = self.h.runtime.prepare(
            tokens=token_matrix(prompts),
            page_table=table,
            prompt_lens=[len(p) for p in prompts],
            start_pos=start_pos,
            sampling_params=sampling_params,
        )
        return prepared, table

    def warm_up(self, prepared: Sequence[PreparedPrefill]) -> None:
        for item in prepared:
            signature = item.program_signatures[0]
            compiled = self.programs.compile(
                signature,
                lambda context, item=item: self.h.runtime.invoke(item, count_tokens=False),
                output_spec=lambda result: OutputSpec.from_value(result.value),
                release_output=lambda result: result.owned,
            )
            if self.traces.trace_key_for_program(compiled.key) is None:
                plan = self.h.runtime.capture_plan(item)
                self.traces.register_capture_plan(plan.trace_capture_plan(compiled.key))

    def replay(
        self,
        prepared: Sequence[PreparedPrefill],
        batch_size: int,
        sampling_params: SamplingParams | None = None,
    ) -> tuple[Any, list[int]]:
        steps: list[int] = []

        def results() -> Iterator[tuple[PreparedPrefill, InvocationResult]]:
            for item in prepared:
                key = self.programs.key_for(item.program_signatures[0])
                workspace = self.traces.workspace_for_program(key)
                output: Any = None
                for chunk in item.request.chunks:
                    output = self.traces.replay(
                        key,
                        lambda artifact, decision, item=item, chunk=chunk, ws=workspace: (
                            self.h.runtime.refresh_trace(
                                item, artifact.persistent_inputs, ws, chunk
                            )
                        ),
                    )
                steps.append(len(item.request.chunks))
                yield item, self.h.runtime.finish_trace(item, output, workspace)

        value = self.h.runtime.assemble(
            results(), batch_size=batch_size, sampling_params=sampling_params
        )
        return value, steps

    def eager(
        self,
        prepared: Sequence[PreparedPrefill],
        batch_size: int,
        sampling_params: SamplingParams | None = None,
    ) -> Any:
        results = [(item, self.h.runtime.invoke(item)) for item in prepared]
        return self.h.runtime.assemble(
            results, batch_size=batch_size, sampling_params=sampling_params
        )


def make_traced(**config: Any) -> Traced:
    h = make_harness(can_enable_trace=_always, **config)
    programs = ProgramCompiler(h.device, lambda: h.setup.kv_manager.bound_context)
    return Traced(h, programs, TraceCompiler(programs))


WARMUP_WAVE = [prompt(n, seed=200 + n) for n in (10, 20, 25, 32)]
WARMUP_SINGLE = [prompt(20, seed=210)]
WARMUP_CHUNKED = [prompt(70, seed=211)]
WARMUP_CACHED = [prompt(50, seed=212)]


@pytest.fixture(scope="module")
def traced() -> Traced:
    t = make_traced(trace_capture_prime_sequence_lengths=(32,))
    for prompts, starts in (
        (WARMUP_WAVE, None),
        (WARMUP_SINGLE, None),
        (WARMUP_CHUNKED, None),
        (WARMUP_CACHED, [16]),
    ):
        prepared, _ = t.prepare(prompts, start_pos=starts)
        t.warm_up(prepared)
    assert t.traces.trace_count == 3, "single, batched and one shared chunk trace"
    t.traces.capture_all()
    assert t.h.device.live_traces == 3
    return t


def check_replay_equals_eager(
    traced: Traced, prompts: list[list[int]], starts: list[int], expected_steps: list[int]
) -> None:
    prepared, table = traced.prepare(prompts, start_pos=starts)
    before = traced.h.device.live_allocations
    replays_before = traced.traces.replay_counts["prefill"]
    traced_logits, steps = traced.replay(prepared, batch_size=len(prompts))
    assert steps == expected_steps
    assert traced.traces.replay_counts["prefill"] - replays_before == sum(steps)
    assert traced.h.device.live_allocations == before, "replays allocate nothing"
    again, _ = traced.prepare(prompts, start_pos=starts, table=table)
    eager_logits = traced.eager(again, batch_size=len(prompts))
    assert isinstance(traced_logits, torch.Tensor) and isinstance(eager_logits, torch.Tensor)
    assert torch.equal(traced_logits, eager_logits)
    for row, tokens in enumerate(prompts):
        torch.testing.assert_close(
            traced_logits[row, 0], traced.h.reference_logits(tokens), atol=ATOL, rtol=0
        )


def test_batched_chunked_and_cached_replays_equal_eager(traced: Traced) -> None:
    # One padded-4 wave of 3 active rows (captured with 4), then three requests of the shared
    # chunk trace: 2 chunks, 4 chunks, and a 24-token cached prefix with 2 chunks.
    prompts = [prompt(n, seed=n) for n in (12, 31, 7, 40, 100, 60)]
    prepared, _ = traced.prepare(prompts, start_pos=[0, 0, 0, 0, 0, 24])
    shapes = [
        (p.request.kind, p.request.padded_batch_size, len(p.request.chunks)) for p in prepared
    ]
    assert shapes == [("batched", 4, 1), ("single", 1, 2), ("single", 1, 4), ("single", 1, 2)]
    assert all(p.request.uses_chunked_prefill for p in prepared[1:])
    check_replay_equals_eager(traced, prompts, [0, 0, 0, 0, 0, 24], [1, 2, 4, 2])


def test_single_and_single_chunk_cached_replays_equal_eager(traced: Traced) -> None:
    prompts = [prompt(25, seed=41), prompt(40, seed=42)]
    prepared, _ = traced.prepare(prompts, start_pos=[0, 16])
    variants = [p.program_signatures[0].operation_variant for p in prepared]
    assert variants == ["regular-single", "chunked"]
    check_replay_equals_eager(traced, prompts, [0, 16], [1, 1])


def test_chunk_start_is_a_refreshed_input(traced: Traced) -> None:
    prompts = [prompt(60, seed=8)]
    prepared, _ = traced.prepare(prompts, start_pos=[24])
    (item,) = prepared
    key = traced.programs.key_for(item.program_signatures[0])
    trace_key = traced.traces.trace_key_for_program(key)
    assert trace_key is not None
    record = traced.traces.get(trace_key)
    assert record is not None and record.artifact is not None
    inputs = persistent_device_inputs(record.artifact.persistent_inputs)
    logits, _ = traced.replay(prepared, batch_size=1)
    assert inputs.chunk_start.tolist() == [56], "the last replay ran the second chunk"
    assert inputs.prompt_lens.tolist() == [60]
    torch.testing.assert_close(
        logits[0, 0], traced.h.reference_logits(prompts[0]), atol=ATOL, rtol=0
    )


def test_capture_plans(traced: Traced) -> None:
    prepared, _ = traced.prepare(WARMUP_WAVE)
    plan = traced.h.runtime.capture_plan(prepared[0])
    assert plan.prime is not None and plan.release_prime_output is not None
    assert plan.refresh_fields == ("tokens", "page_table", "prompt_lens", "chunk_start")
    single, _ = traced.prepare(WARMUP_SINGLE)
    assert traced.h.runtime.capture_plan(single[0]).prime is None
    untraced = make_harness()
    prompts = [prompt(20, seed=10)]
    (item,) = untraced.runtime.prepare(
        tokens=token_matrix(prompts), page_table=untraced.page_table(prompts)
    )
    with pytest.raises(ValueError, match="no configured trace family"):
        untraced.runtime.capture_plan(item)


def test_refresh_and_finish_validations(traced: Traced) -> None:
    chunked, _ = traced.prepare([prompt(40, seed=11)])
    wave, _ = traced.prepare(WARMUP_WAVE)
    (item,) = chunked
    persistent = traced.h.runtime.capture_plan(wave[0]).prepare_inputs()
    logits_ws = PrefillReplayWorkspace("logits")
    try:
        snapshot = [value.clone() for value in persistent.values()]
        with pytest.raises(ValueError, match="changed geometry"):
            traced.h.runtime.refresh_trace(item, persistent, logits_ws, item.request.chunks[0])
        assert all(torch.equal(a, b) for a, b in zip(snapshot, persistent.values(), strict=True)), (
            "a failed refresh copies nothing"
        )
        foreign = wave[0].request.chunks[0]
        with pytest.raises(ValueError, match="is not one of the"):
            traced.h.runtime.refresh_trace(item, persistent, logits_ws, foreign)
        with pytest.raises(TypeError, match="must be a PrefillReplayWorkspace"):
            traced.h.runtime.refresh_trace(item, persistent, object())
        with pytest.raises(TypeError, match="persistent prefill inputs must be"):
            traced.h.runtime.refresh_trace(item, PersistentInputs(object()), logits_ws)
        sampled_ws = PrefillReplayWorkspace("topk", torch.zeros(8, dtype=torch.int64))
        with pytest.raises(RuntimeError, match="changed the compiled sampling path"):
            traced.h.runtime.finish_trace(item, torch.zeros(1, 256), sampled_ws)
    finally:
        traced.h.runtime._release_transient(persistent)
    assert traced.h.runtime.transient_orphan_count == 0


def test_sampled_traces_equal_eager_sampling() -> None:
    t = make_traced(sampling=True)
    greedy = SamplingParams(temperature=0.0)
    with_log_probs = SamplingParams(temperature=0.0, enable_log_probs=True)
    warm = [
        (WARMUP_SINGLE, greedy),
        (WARMUP_WAVE, greedy),
        (WARMUP_CHUNKED, with_log_probs),
    ]
    for prompts, params in warm:
        prepared, _ = t.prepare(prompts, sampling_params=params)
        t.warm_up(prepared)
    t.traces.capture_all()
    cases = [
        ([prompt(17, seed=30)], greedy, "argmax"),
        ([prompt(9, seed=31), prompt(30, seed=32), prompt(3, seed=33)], greedy, "topk"),
        ([prompt(90, seed=34)], with_log_probs, "topk"),
    ]
    for prompts, params, path in cases:
        prepared, table = t.prepare(prompts, sampling_params=params)
        assert [p.sampling_path for p in prepared] == [path]
        (tokens, log_probs), _ = t.replay(prepared, len(prompts), params)
        again, _ = t.prepare(prompts, sampling_params=params, table=table)
        eager_tokens, eager_log_probs = t.eager(again, len(prompts), params)
        assert torch.equal(tokens, eager_tokens)
        reference = torch.stack([t.h.reference_logits(p) for p in prompts]).argmax(dim=-1)
        assert tokens.tolist() == reference.tolist()
        if params.enable_log_probs:
            assert log_probs is not None and eager_log_probs is not None
            assert torch.equal(log_probs, eager_log_probs)
            assert float(log_probs[0]) < 0.0
        else:
            assert log_probs is None and eager_log_probs is None
    before_cleanup = t.h.device.live_allocations
    t.traces.cleanup()
    assert t.h.device.live_allocations < before_cleanup
    assert t.h.device.live_traces == 0
