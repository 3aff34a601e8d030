"""Derived warmup coverage: the planner's identities for every admissible request, Q128 tile
ends on the torch and ttnn policies, and cached prefixes that never change identity."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config import RuntimePolicy
from runtime.identity import key_material_of
from runtime.warmup_coverage import (
    CoverageFilter,
    WarmupCase,
    derive_prefill_cases,
    identity_field_counts,
    recipe_params,
)
from tests.runtime.prefill_setup import BLOCK, LANES, PrefillHarness, make_harness

RECIPES = ("none", "greedy", "sampled")
MAX_PROMPT = 200


@pytest.fixture(scope="module")
def torch_lane() -> Iterator[PrefillHarness]:
    harness = make_harness(sampling=True, max_prefill_chunk_size=128)
    yield harness
    harness.setup.close()


def _signatures(harness: PrefillHarness, case_or_request: dict[str, object]) -> set[object]:
    prepared = harness.runtime.prepare(**case_or_request)  # type: ignore[arg-type]
    return {key_material_of(s) for item in prepared for s in item.program_signatures}


def _derived(harness: PrefillHarness) -> tuple[tuple[WarmupCase, ...], set[object]]:
    cases = derive_prefill_cases(
        harness.runtime,
        max_prompt_length=MAX_PROMPT,
        lane_batch_size=LANES,
        recipes=RECIPES,
        max_top_k=8,
    )
    covered: set[object] = set()
    for case in cases:
        covered |= _signatures(harness, case.prefill_request(block_size=BLOCK, max_top_k=8))
    return cases, covered


def test_ttnn_policy_primes_every_q128_tile_end() -> None:
    harness = make_harness(sampling=True, policy=RuntimePolicy.ttnn(), max_prefill_chunk_size=2048)
    try:
        cases, _ = _derived(harness)
        tiles = {c.tile_start: c.prompt_length for c in cases if c.tile_start is not None}
        # Reference 2.19: one argmax program per tile start, primed at the tile ends.
        assert tiles == {0: 32, 32: 64, 64: 96, 96: 128}
        assert all(c.sampling_path == "argmax" for c in cases if c.tile_start is not None)
    finally:
        harness.setup.close()


def test_torch_policy_tiles_are_the_reachable_ones(torch_lane: PrefillHarness) -> None:
    cases, _ = _derived(torch_lane)
    tiles = {c.tile_start: c.prompt_length for c in cases if c.tile_start is not None}
    assert tiles == {64: 96, 96: 128}  # 1..64 tokens pad to 32 or 64, not Q128


def test_waves_are_bounded_by_the_lane_and_the_filter(torch_lane: PrefillHarness) -> None:
    narrow = make_harness(sampling=True, max_prefill_chunk_size=128, max_batch_size=3)
    try:
        cases = derive_prefill_cases(
            narrow.runtime,
            max_prompt_length=MAX_PROMPT,
            lane_batch_size=3,
            recipes=RECIPES,
            max_top_k=8,
        )
    finally:
        narrow.setup.close()
    assert {c.batch_size for c in cases} == {1, 2}  # 3 rows pad to 4 > lane: sequential
    trimmed = derive_prefill_cases(
        torch_lane.runtime,
        max_prompt_length=MAX_PROMPT,
        lane_batch_size=LANES,
        recipes=RECIPES,
        max_top_k=8,
        coverage=CoverageFilter(batch_sizes=(1, 2)),
    )
    assert {c.batch_size for c in trimmed} == {1, 2}


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(data=st.data())
def test_every_admissible_request_maps_to_a_derived_signature(
    torch_lane: PrefillHarness, data: st.DataObject
) -> None:
    _, covered = _DERIVED.setdefault("torch", _derived(torch_lane))
    rows = data.draw(st.integers(1, LANES))
    cached = data.draw(st.lists(st.integers(0, 6), min_size=rows, max_size=rows))
    lengths = [data.draw(st.integers(c * BLOCK + 1, MAX_PROMPT)) for c in cached]
    recipe = data.draw(st.sampled_from(RECIPES))
    width = max(-(-n // BLOCK) for n in lengths)
    request = {
        "tokens": torch.zeros(rows, max(lengths), dtype=torch.long),
        "page_table": torch.zeros(rows, width, dtype=torch.int32),
        "prompt_lens": torch.tensor(lengths),
        "start_pos": torch.tensor([c * BLOCK for c in cached]),
        "empty_slots": list(range(rows)),
        "sampling_params": recipe_params(recipe, rows, max_top_k=8),
    }
    assert _signatures(torch_lane, request) <= covered


_DERIVED: dict[str, tuple[tuple[WarmupCase, ...], set[object]]] = {}


def test_identity_field_counts_name_each_value() -> None:
    harness = make_harness(sampling=True, policy=RuntimePolicy.ttnn(), max_prefill_chunk_size=2048)
    try:
        prepared = harness.runtime.prepare(
            tokens=torch.zeros(1, 40, dtype=torch.long),
            page_table=torch.zeros(1, 5, dtype=torch.int32),
            sampling_params=recipe_params("greedy", 1, max_top_k=8),
        )
        counts = identity_field_counts(prepared[0].program_signatures)
        assert counts["last_token_tile_start"] == {"32": 1}
        assert counts["sampling_path"] == {"argmax": 1}
    finally:
        harness.setup.close()


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(
    lengths=st.lists(st.integers(1, MAX_PROMPT), min_size=1, max_size=12),
    cached_blocks=st.integers(0, 3),
)
def test_planning_rows_together_equals_planning_each_alone(
    torch_lane: PrefillHarness, lengths: list[int], cached_blocks: int
) -> None:
    # plan_single_rows (one planner call for many probes) is the planner's single-row plan.
    runtime = torch_lane.runtime
    cached = cached_blocks * BLOCK
    lengths = [n + cached for n in lengths]
    together = runtime.plan_single_rows(lengths, [cached] * len(lengths))
    for request, length in zip(together, lengths, strict=True):
        tokens = torch.zeros(1, length, dtype=torch.long)
        alone = runtime.plan(
            tokens=tokens,
            page_table=torch.zeros(1, -(-length // BLOCK), dtype=torch.int32),
            prompt_lens=[length],
            start_pos=[cached],
        )
        assert len(alone) == 1
        for recipe in RECIPES:
            raw = recipe_params(recipe, 1, max_top_k=8)
            sampling = (
                None if raw is None else runtime.prepare_request_sampling(alone[0], raw, tokens)
            )
            assert runtime.program_signatures(request, sampling) == runtime.program_signatures(
                alone[0], sampling
            )
        assert request.prompt_lengths == alone[0].prompt_lengths
        assert request.chunks == alone[0].chunks


@pytest.mark.parametrize(
    ("batching", "widest"), [(True, 8), (None, 32)], ids=["current-rule", "legacy-rule"]
)
def test_waves_past_the_widest_batch_add_no_case(
    monkeypatch: pytest.MonkeyPatch, batching: bool | None, widest: int
) -> None:
    # A lane wider than any batched wave (40 slots > 32, the largest supported prefill
    # batch): stopping the waves at the widest batch derives what probing every width did.
    import runtime.warmup_coverage as coverage

    lane = 40
    harness = make_harness(
        sampling=True,
        sampler_rows=lane,
        max_prefill_chunk_size=64,
        max_batch_size=lane,
        supports_batched_prefill=batching,
        max_prefill_batch_size=8,
    )
    try:
        assert coverage.widest_wave(harness.runtime, lane) == 32

        def derive() -> tuple[WarmupCase, ...]:
            return derive_prefill_cases(
                harness.runtime,
                max_prompt_length=70,
                lane_batch_size=lane,
                recipes=RECIPES,
                max_top_k=8,
            )

        bounded = derive()
        monkeypatch.setattr(coverage, "widest_wave", lambda prefill, lanes: lanes)
        unbounded = derive()
    finally:
        harness.setup.close()
    assert bounded == unbounded
    assert max(c.batch_size for c in bounded) == widest  # waves were derived at all
