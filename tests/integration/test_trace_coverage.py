"""Traced lanes serve every request they admit: derived warmup coverage, tile starts, the
closed-gate error, and the warmup entry points' arguments, on tiny-random through `Generator`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.decoder.executor import DecoderExecutor, load_executor
from models.generation import GenerationParams, Generator
from runtime.config import WarmupConfig
from runtime.execution import CompileGateClosedError, TraceCoverageError
from runtime.identity import key_material_of
from runtime.sampling import SamplingParams
from tests.integration.executor_setup import kv_snapshot

BLOCK = 16
CHUNK = 128
MAX_SEQ = 160  # prompts of 1..159 tokens: padded 32, 64, 128 (Q128) and chunked 256
LANE = 4
MODES = ("none", "decode_only", "all")


def _executor(mode: str, *, warmup: WarmupConfig | None = None, **extra: Any) -> DecoderExecutor:
    return load_executor(
        "tiny-random",
        trace_mode=mode,
        block_size=BLOCK,
        num_blocks=LANE * (MAX_SEQ // BLOCK) + 2,
        max_batch_size=LANE,
        max_prefill_chunk_size=CHUNK,
        max_seq_len=MAX_SEQ,
        warmup=warmup,
        **extra,
    )


@pytest.fixture(scope="module")
def lanes() -> Iterator[dict[str, DecoderExecutor]]:
    built = {mode: _executor(mode) for mode in MODES}
    for executor in built.values():
        executor.start()
    yield built
    for executor in built.values():
        executor.close()


def _prompts(draw: Any) -> list[list[int]]:
    """Distinct prompts over the whole admissible range, some sharing a prefix (cache hits)."""
    base = draw(st.lists(st.integers(3, 255), min_size=MAX_SEQ, max_size=MAX_SEQ))
    count = draw(st.integers(1, LANE + 2))
    prompts: list[list[int]] = []
    for index in range(count):
        length = draw(st.integers(1, MAX_SEQ - 1))
        shared = draw(st.integers(0, length - 1))
        # The last token names the prompt, so prompts stay distinct even when they share.
        prompts.append([*base[:shared], *([7 + index] * (length - shared))])
    return prompts


@st.composite
def _workloads(draw: Any) -> tuple[str, bool, list[list[int]], list[GenerationParams]]:
    mode = draw(st.sampled_from(("decode_only", "all")))
    prefix_cache = draw(st.booleans())
    prompts = _prompts(draw)
    params = [
        GenerationParams(
            temperature=draw(st.sampled_from((0.0, 0.0, 0.8))),
            top_k=draw(st.integers(1, 64)),
            top_p=draw(st.sampled_from((1.0, 0.9))),
            seed=draw(st.integers(0, 1000)),
            max_new_tokens=draw(st.integers(1, 3)),
            ignore_eos=True,
        )
        for _ in prompts
    ]
    return mode, prefix_cache, prompts, params


def _generate(
    executor: DecoderExecutor, prefix_cache: bool, prompts: list[list[int]], params: Any
) -> list[list[int]]:
    generator = Generator(executor, enable_prefix_cache=prefix_cache)
    return [list(c.token_ids) for c in generator.generate(prompts, params)]


@settings(max_examples=max(8, settings.default.max_examples // 4))
@given(workload=_workloads())
def test_traced_lanes_serve_every_admitted_request_like_eager(
    lanes: dict[str, DecoderExecutor],
    workload: tuple[str, bool, list[list[int]], list[GenerationParams]],
) -> None:
    mode, prefix_cache, prompts, params = workload
    traced = _generate(lanes[mode], prefix_cache, prompts, params)  # never a coverage error
    eager = _generate(lanes["none"], prefix_cache, prompts, params)
    for tokens, reference, request in zip(traced, eager, params, strict=True):
        assert len(tokens) == len(reference)
        if request.greedy:
            assert tokens == reference
    assert lanes[mode].eager_executor.compile_gate_refusals == 0


@pytest.mark.parametrize("mode", ["decode_only", "all"])
def test_reported_prompt_is_served_with_eager_greedy_tokens(
    lanes: dict[str, DecoderExecutor], mode: str
) -> None:
    # The reproduction: one greedy prompt whose last token is in Q128 tile 64.
    prompt = [[120, 32] * 39 + [120]]
    params = GenerationParams(max_new_tokens=3, ignore_eos=True)
    assert _generate(lanes[mode], True, prompt, params) == _generate(
        lanes["none"], True, prompt, params
    )


@pytest.mark.parametrize("mode", MODES)
def test_every_q128_argmax_tile_start_is_in_the_manifest(
    lanes: dict[str, DecoderExecutor], mode: str
) -> None:
    executor = lanes[mode]
    manifest = executor.coverage_manifest
    assert manifest is not None
    covered = {key_material_of(s) for s in manifest.eager_program_signatures}
    traced = {key_material_of(s) for s in manifest.traced_source_program_signatures}
    tiles: set[int] = set()
    greedy = SamplingParams(temperature=0.0, top_k=1, top_p=1.0)
    for length in range(1, MAX_SEQ):
        prepared = executor.prefill_runtime.prepare(
            tokens=torch.zeros(1, length, dtype=torch.long),
            page_table=torch.zeros(1, -(-length // BLOCK), dtype=torch.int32),
            sampling_params=greedy,
        )
        for signature in prepared[0].program_signatures:
            if signature.last_token_tile_start is None:
                continue
            tiles.add(signature.last_token_tile_start)
            assert key_material_of(signature) in covered, (length, signature)
            if mode == "all":
                assert key_material_of(signature) in traced, (length, signature)
    assert tiles == {64, 96}  # the torch policy pads 65..128 tokens to Q128
    fields = manifest.to_json()["identity_fields"]["prefill_programs"]
    assert fields["last_token_tile_start"]["64"] == 1
    assert fields["last_token_tile_start"]["96"] == 1


def test_closed_gate_error_names_the_signature_and_leaves_kv_unchanged() -> None:
    # Coverage trimmed to 32-token invocations: a 40-token prompt (padded 64) is outside it.
    executor = _executor("decode_only", warmup=WarmupConfig(prefill_seq_lens=(32,)))
    executor.start()
    try:
        before = kv_snapshot(executor)
        with pytest.raises(CompileGateClosedError) as caught:
            executor.prefill_forward(
                tokens=torch.arange(3, 43).reshape(1, 40),
                page_table=torch.arange(0, 3, dtype=torch.int32).reshape(1, 3),
                prompt_lens=torch.tensor([40]),
                sampling_params=SamplingParams(temperature=0.0, top_k=1, top_p=1.0),
            )
        assert isinstance(caught.value, TraceCoverageError)
        message = str(caught.value)
        for text in (
            "operation=prefill",
            "trace_mode=decode_only",
            "invocation_sequence_length=64",
            "padded_batch_size=1",
            "sampling_path=argmax",
            "operation_variant=regular-single",
            "cached_tokens=[0]",
            "prompt_lengths=[40]",
            "signature_digest=",
            "configured_coverage (nearest first)=[",
            "invocation_sequence_length=32",
            "(1) warm up this signature",
            "(2) serve it",
            "no KV cache entry was written",
        ):
            assert text in message, text
        after = kv_snapshot(executor)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert executor.eager_executor.compile_gate_refusals == 1
    finally:
        executor.close()


def test_warmup_entry_points_honour_and_validate_their_arguments() -> None:
    executor = _executor("all")
    executor.allocate_kv_cache()
    blocks = executor.num_blocks
    assert blocks is not None
    cache = executor.kv_cache
    for kwargs, name in (
        ({"max_batch_size": LANE + 1}, "max_batch_size"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"num_blocks": blocks + 1}, "num_blocks"),
    ):
        with pytest.raises(ValueError, match=name):
            executor.warmup_model_decode(kv_cache=cache, **kwargs)
    with pytest.raises(TypeError, match="can_sample_on_device"):
        executor.warmup_model_prefill(kv_cache=cache, can_sample_on_device="yes")
    assert executor.program_compiler.compiled_programs == ()
    # Honoured: warmed without device sampling, only the logits path is compiled.
    executor.warmup_model_prefill(kv_cache=cache, can_sample_on_device=False, enable_trace=True)
    executor.warmup_model_decode(
        kv_cache=cache,
        max_batch_size=LANE - 1,
        num_blocks=blocks - 1,
        can_sample_on_device=False,
        enable_trace=True,
    )
    executor.capture()
    manifest = executor.coverage_manifest
    assert manifest is not None
    paths = manifest.identity_fields()
    assert set(paths["prefill_programs"]["sampling_path"]) == {"logits"}
    assert set(paths["decode_programs"]["sampling_path"]) == {"logits"}
    assert paths["decode_traces"]["batch_size"] == {str(LANE): 1}
    executor.close()


def test_trace_none_rejects_trace_warmup_hints() -> None:
    executor = _executor("none", device_sampling=False)
    executor.allocate_kv_cache()
    with pytest.raises(ValueError, match="exceeds the configured trace policy"):
        executor.warmup_model_decode(enable_trace=True)
    with pytest.raises(ValueError, match="statically disabled"):
        executor.warmup_model_prefill(can_sample_on_device=True)
    executor.close()


def test_sampling_siblings_share_one_compile_forward(lanes: dict[str, DecoderExecutor]) -> None:
    # Logits, argmax and top-k programs of one probe run the model forward once.
    for mode in MODES:
        executor = lanes[mode]
        programs = [
            p
            for p in executor.program_compiler.compiled_programs
            if type(p.signature).__name__ == "PrefillSignature"
        ]
        shared = executor.prefill_runtime.shared_compile_forwards
        assert shared >= len(programs) // 3, (mode, shared, len(programs))


def test_prefill_traces_of_one_capture_schema_share_one_capture(
    lanes: dict[str, DecoderExecutor],
) -> None:
    tracer = lanes["all"].trace_compiler
    assert tracer is not None
    # logits, argmax and top-k traces of one geometry replay one hidden-state capture
    assert tracer.shared_capture_count > 0
    assert tracer.capture_count + tracer.shared_capture_count == tracer.trace_count
    schemas = {
        record.plan.schema_fingerprint
        for key, _ in tracer.registered_coverage("prefill")
        if (record := tracer.get(key)) is not None
    }
    decode_traces = len(tracer.registered_coverage("decode"))
    assert tracer.capture_count == len(schemas) + decode_traces
