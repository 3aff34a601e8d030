"""Traced execution equals eager execution; coverage misses refuse before device work."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle import Phase
from runtime.config import WarmupConfig
from runtime.execution import TraceCoverageError
from runtime.sampling import SamplingParams
from tests.integration.executor_setup import (
    BLOCK,
    contiguous_tables,
    kv_snapshot,
    prompts_batch,
    run_prefill,
    tiny_executor,
)

CASES = {
    "regular single": [7],
    "regular batched": [5, 7, 6],
    "chunked": [40],
    "mixed": [3, 20, 9, 33],
}


def _serving(trace_mode: str, **kwargs: object):  # type: ignore[no-untyped-def]
    executor = tiny_executor(trace_mode=trace_mode, **kwargs)  # type: ignore[arg-type]
    executor.start()
    return executor


@pytest.fixture(scope="module")
def pair():  # type: ignore[no-untyped-def]
    eager = _serving("none", device_sampling=False)
    traced = _serving("all", device_sampling=False)
    yield eager, traced
    eager.close()
    traced.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_traced_prefill_is_bit_identical_to_eager(pair, case: str) -> None:  # type: ignore[no-untyped-def]
    eager, traced = pair
    lengths = CASES[case]
    expected = run_prefill(eager, lengths)
    replays = traced.trace_compiler.replay_count
    actual = run_prefill(traced, lengths)
    assert torch.equal(actual, expected)
    assert traced.trace_compiler.replay_count > replays


def test_traced_cached_prefill_is_bit_identical(pair) -> None:  # type: ignore[no-untyped-def]
    eager, traced = pair
    lengths = [13]
    for executor in (eager, traced):
        run_prefill(executor, [BLOCK * 2])  # writes the first two blocks of row 0
    tokens = prompts_batch(lengths)
    results = []
    for executor in (eager, traced):
        width = executor.page_table_layout.prefill_width
        results.append(
            executor.prefill_forward(
                tokens=tokens,
                page_table=contiguous_tables(lengths, width=width),
                prompt_lens=torch.tensor(lengths),
                start_pos=torch.tensor([BLOCK * 2]),
                empty_slots=[0],
            )
        )
    assert torch.equal(results[0], results[1])


def test_traced_decode_is_bit_identical_to_eager(pair) -> None:  # type: ignore[no-untyped-def]
    eager, traced = pair
    lane = eager.max_batch_size
    lengths = [5, 9, 3, 6]
    for executor in (eager, traced):
        run_prefill(executor, lengths)
    width = eager.page_table_layout.decode_width
    table = contiguous_tables([length + 4 for length in lengths], width=width)
    tokens = torch.tensor([11, 12, 13, 14])
    positions = torch.tensor(lengths)
    positions[2] = -1  # an inactive slot
    for step in range(3):
        outs = [
            executor.decode_forward(
                tokens=tokens, start_pos=positions + step * (positions >= 0), page_table=table
            )
            for executor in (eager, traced)
        ]
        assert outs[0].shape == (lane, 1, eager.model.vocab_size)
        assert torch.equal(outs[0], outs[1])
        tokens = outs[0][:, 0].argmax(-1)
    assert traced.trace_compiler.replay_counts["decode"] >= 3


def test_coverage_miss_raises_and_leaves_kv_untouched() -> None:
    # Coverage of single rows only: a two-row wave has no trace.
    traced = _serving("all", device_sampling=False, warmup=WarmupConfig(prefill_batch_sizes=(1,)))
    run_prefill(traced, [7])
    before = kv_snapshot(traced)
    misses = traced.traced_executor.coverage_miss_count
    with pytest.raises(TraceCoverageError) as caught:
        run_prefill(traced, [5, 7])
    message = str(caught.value)
    assert "operation=prefill" in message and "trace_mode=all" in message
    assert "signature_digest=" in message and "configured_coverage=" in message
    assert "TraceConfig(mode='none')" in message
    assert traced.traced_executor.coverage_miss_count == misses + 1
    after = kv_snapshot(traced)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    traced.close()


def test_compiling_after_activation_is_rejected_but_compiled_eager_runs() -> None:
    executor = _serving(
        "decode_only", device_sampling=False, warmup=WarmupConfig(prefill_batch_sizes=(1,))
    )
    compiler = executor.program_compiler
    rejected = compiler.post_activation_compile_rejections
    with pytest.raises(RuntimeError, match="after trace activation"):
        executor.eager_executor.compile_prefill(
            tokens=prompts_batch([5, 7]),
            page_table=contiguous_tables([5, 7], width=executor.page_table_layout.prefill_width),
            prompt_lens=torch.tensor([5, 7]),
            empty_slots=[0, 1],
        )
    assert compiler.post_activation_compile_rejections == rejected + 1
    logits = run_prefill(executor, [7])  # warmed signature: an intentional eager call runs
    assert logits.shape[0] == 1
    executor.close()


@settings(max_examples=6, deadline=None)
@given(order=st.lists(st.sampled_from(["prefill", "decode"]), min_size=2, max_size=5))
def test_warmup_order_gives_one_manifest_and_one_capture(order: list[str]) -> None:
    if set(order) != {"prefill", "decode"}:
        order = [*order, "prefill", "decode"]
    executor = tiny_executor(trace_mode="all", device_sampling=False)
    executor.allocate_kv_cache()
    for operation in order:
        if operation == "prefill":
            executor.warmup_prefill()
        else:
            executor.warmup_decode()
    assert executor.phase is Phase.COMPILED
    executor.capture()
    tracer = executor.trace_compiler
    assert tracer.capture_count + tracer.shared_capture_count == tracer.trace_count
    manifest = executor.coverage_manifest
    assert manifest is not None
    reference = _reference_manifest()
    assert manifest.to_json() == reference
    executor.close()


_MANIFEST: dict[str, object] = {}


def _reference_manifest() -> object:
    if not _MANIFEST:
        executor = tiny_executor(trace_mode="all", device_sampling=False)
        executor.start()
        assert executor.coverage_manifest is not None
        _MANIFEST["value"] = executor.coverage_manifest.to_json()
        executor.close()
    return _MANIFEST["value"]


def test_sampled_traced_decode_matches_eager() -> None:
    eager = _serving("none")
    traced = _serving("decode_only")
    lengths = [5, 9, 3, 6]
    for executor in (eager, traced):
        run_prefill(executor, lengths, sampling_params=SamplingParams(temperature=[0.0] * 4))
    width = eager.page_table_layout.decode_width
    table = contiguous_tables([length + 4 for length in lengths], width=width)
    sampling = SamplingParams(temperature=[0.0] * 4)
    outs = [
        executor.decode_forward(
            tokens=torch.tensor([11, 12, 13, 14]),
            start_pos=torch.tensor(lengths),
            page_table=table,
            sampling_params=sampling,
        )
        for executor in (eager, traced)
    ]
    assert torch.equal(outs[0][0], outs[1][0])
    eager.close()
    traced.close()
