"""Planner properties over random rows, cached prefixes, slots and policies (ttnn and torch)."""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config import RuntimePolicy
from runtime.prefill.plan import plan_prefill_requests, restore_source_order
from runtime.prefill.request import PrefillRequest


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@attrs.frozen
class Case:
    policy: RuntimePolicy
    block: int
    max_chunk: int
    lane: int
    cap: int
    supports: bool | None
    disable: bool
    env: str
    prompts: tuple[int, ...]
    cached: tuple[int, ...]
    slots: tuple[int, ...]
    tokens: torch.Tensor = attrs.field(eq=False)
    table: torch.Tensor = attrs.field(eq=False)
    max_actual: int | None
    canonical: int | None

    @property
    def batch(self) -> int:
        return len(self.prompts)

    def uncached(self, row: int) -> int:
        return self.prompts[row] - self.cached[row]

    def padded(self, row: int) -> int:
        return self.policy.padded_prefill_length(self.uncached(row))

    def allocated(self, row: int) -> int:
        return ceil_div(self.prompts[row], self.block)

    def planned_rows(self) -> list[int]:
        return [row for row in range(self.batch) if self.uncached(row) > 0]

    def plan(self, table: torch.Tensor | None = None) -> tuple[PrefillRequest, ...]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("DISABLE_BATCHED_PREFILL", self.env)
            return plan_prefill_requests(
                tokens=self.tokens,
                page_table=self.table if table is None else table,
                prompt_lens=torch.tensor(self.prompts),
                start_pos=list(self.cached),
                empty_slots=self.slots,
                block_size=self.block,
                max_batch_size=self.lane,
                max_prefill_chunk_size=self.max_chunk,
                supports_batched_prefill=self.supports,
                disable_batched_prefill=self.disable,
                max_prefill_batch_size=self.cap,
                max_actual_page_table_width=self.max_actual,
                canonical_page_table_width=self.canonical,
                policy=self.policy,
            )


@st.composite
def cases(draw: st.DrawFn) -> Case:
    # "friendly" cases are eligible for a wave (legacy included) unless a limit says otherwise.
    friendly = draw(st.booleans())
    if draw(st.booleans()):
        policy = RuntimePolicy.ttnn()
        block = draw(st.sampled_from([32, 64]))
        max_chunk = draw(st.sampled_from([2048, 4096]))
        length = st.one_of(st.integers(0, 140), st.integers(0, 4700))
    else:
        multiple = draw(st.sampled_from([32, 64]))
        policy = RuntimePolicy.torch_default(chunk_size_multiple=multiple)
        block = draw(st.sampled_from([16, 32]))
        max_chunk = multiple * draw(st.integers(1, 4))
        length = st.one_of(st.integers(0, 40), st.integers(0, 300))
    if friendly:
        length = st.integers(1, policy.prefill_padding_buckets[0])
    first = policy.prefill_padding_buckets[0]
    limits = [policy.max_batched_prefill_tokens, 256, 1024, 2 * first, 8 * first, 4 * first + 1]
    limit = draw(st.sampled_from(limits))  # multiples of the first bucket probe the boundary
    policy = attrs.evolve(policy, max_batched_prefill_tokens=limit)
    batch = draw(st.integers(1, 10))
    pool = draw(st.lists(length, min_size=1, max_size=1 if friendly else 3))
    prompts = tuple(draw(st.lists(st.sampled_from(pool), min_size=batch, max_size=batch)))
    with_cache = not friendly and draw(st.booleans())
    cached = tuple(
        block * draw(st.integers(1, p // block)) if with_cache and p >= block else 0
        for p in prompts
    )
    lane = (
        max(batch, draw(st.sampled_from([32, 40, 12])))
        if friendly
        else draw(st.integers(batch, 40))
    )
    slots = tuple(draw(st.permutations(range(lane)))[:batch])
    if draw(st.booleans()):
        slots = tuple(range(batch))
    seed = draw(st.integers(0, 2**31))
    generator = torch.Generator().manual_seed(seed)
    width = max(prompts) + draw(st.integers(0, 5))
    allocated = max(1, *(ceil_div(p, block) for p in prompts))
    table_width = allocated + draw(st.integers(0, 4))
    max_actual = canonical = None
    if draw(st.booleans()):
        max_actual = allocated + draw(st.integers(0, 3))
        needed = max(
            [max_actual]
            + [
                ceil_div(c + policy.padded_prefill_length(p - c), block)
                for p, c in zip(prompts, cached, strict=True)
                if p > c
            ]
        )
        align = policy.page_table_width_alignment
        canonical = ceil_div(needed, align) * align + align * draw(st.integers(0, 1))
    sizes = policy.supported_prefill_batch_sizes
    return Case(
        policy=policy,
        block=block,
        max_chunk=max_chunk,
        lane=lane,
        cap=draw(st.sampled_from(sizes[::-1])),
        supports=(None if draw(st.booleans()) else True)
        if friendly
        else draw(st.sampled_from([True, None, False])),
        disable=not friendly and draw(st.booleans()),
        env=draw(st.sampled_from(["", "0"] if friendly else ["", "0", "1"])),
        prompts=prompts,
        cached=cached,
        slots=slots,
        tokens=torch.randint(1, 50_000, (batch, width), generator=generator),
        table=torch.randint(
            0, 10_000, (batch, table_width), generator=generator, dtype=torch.int32
        ),
        max_actual=max_actual,
        canonical=canonical,
    )


def smallest_supported(case: Case, rows: int) -> int | None:
    sizes = [s for s in case.policy.supported_prefill_batch_sizes if s >= rows]
    return min(sizes) if sizes else None


def expected_wave(case: Case, rows: list[int], seq: int, bucket_count: int) -> int | None:
    """An independent statement of the reference's batching rules (2.5)."""
    padded = smallest_supported(case, len(rows))
    disabled = case.disable or case.env == "1"
    common = (
        len(rows) > 1
        and not disabled
        and not any(case.cached[row] for row in rows)
        and seq <= case.max_chunk
        and padded is not None
        and padded <= case.lane
        and padded * seq < case.policy.max_batched_prefill_tokens
    )
    if case.supports is None:
        eligible = (
            common
            and bucket_count == 1
            and case.slots == tuple(range(case.batch))
            and all(case.uncached(row) > 0 for row in range(case.batch))
            and seq == case.policy.prefill_padding_buckets[0]
        )
    else:
        eligible = common and case.supports and padded is not None and padded <= case.cap
    return padded if eligible else None


def expected_chunk_size(case: Case, padded: int) -> int:
    if padded <= case.max_chunk:
        return padded
    multiple = case.policy.chunk_size_multiple
    return max(
        size
        for size in range(multiple, case.max_chunk + 1, multiple)
        if padded % size == 0 and case.max_chunk % multiple == 0
    )


def check_rows_and_waves(case: Case, requests: tuple[PrefillRequest, ...]) -> None:
    planned = [row for r in requests for row in r.source_rows]
    assert sorted(planned) == case.planned_rows() and len(set(planned)) == len(planned)
    buckets: dict[int, list[int]] = {}
    for row in case.planned_rows():
        buckets.setdefault(case.padded(row), []).append(row)
    kinds = [r.kind for r in requests]
    assert kinds == sorted(kinds)  # "batched" waves strictly before "single" requests
    singles = [r.source_rows[0] for r in requests if r.kind == "single"]
    assert singles == sorted(singles)
    waves = {r.padded_sequence_length: r for r in requests if r.kind == "batched"}
    assert [r.padded_sequence_length for r in requests if r.kind == "batched"] == [
        seq for seq in buckets if seq in waves
    ]
    for seq, rows in buckets.items():
        padded = expected_wave(case, rows, seq, len(buckets))
        if padded is None:
            assert seq not in waves
            continue
        wave = waves[seq]  # a bucket is one whole wave, never split
        assert wave.source_rows == tuple(rows) and wave.padded_batch_size == padded
        assert padded in case.policy.supported_prefill_batch_sizes
        assert padded * seq < case.policy.max_batched_prefill_tokens and padded <= case.lane


def check_request(case: Case, request: PrefillRequest) -> None:
    batched = request.kind == "batched"
    seq = request.padded_sequence_length
    expected_width = case.canonical or (
        ceil_div(seq, case.block)
        if batched
        else ceil_div(seq + request.cached_tokens[0], case.block)
    )
    assert request.page_table_width == expected_width
    chunked = not batched and (seq > case.max_chunk or request.cached_tokens[0] > 0)
    assert request.uses_chunked_prefill == chunked
    filler = 0 if chunked else -1
    for local, row in enumerate(request.source_rows):
        uncached, allocated = case.uncached(row), case.allocated(row)
        assert seq == case.padded(row) and request.slots[local] == case.slots[row]
        assert request.prompt_lengths[local] == case.prompts[row]
        assert request.cached_tokens[local] == case.cached[row]
        assert request.last_token_indices[local] == case.prompts[row] - 1
        tokens = request.tokens[local]
        assert torch.equal(
            tokens[:uncached], case.tokens[row, case.cached[row] : case.prompts[row]]
        )
        assert not tokens[uncached:].any()
        table = request.page_table[local]
        assert torch.equal(table[:allocated], case.table[row, :allocated])
        assert (table[allocated:] == filler).all()
    for pad_row in range(request.active_batch_size, request.padded_batch_size):
        assert not request.tokens[pad_row].any() and (request.page_table[pad_row] == -1).all()
    check_chunks(case, request)


def check_chunks(case: Case, request: PrefillRequest) -> None:
    seq = request.padded_sequence_length
    if not request.uses_chunked_prefill:
        (chunk,) = request.chunks
        assert (chunk.token_slice, chunk.chunk_start_idx) == (slice(0, seq), 0)
        assert chunk.chunk_page_table is None and chunk.contains_last_token
        return
    row = request.source_rows[0]
    cached, uncached, allocated = case.cached[row], case.uncached(row), case.allocated(row)
    size = expected_chunk_size(case, seq)
    assert len(request.chunks) == (uncached - 1) // size + 1
    for index, chunk in enumerate(request.chunks):
        assert chunk.token_slice == slice(index * size, (index + 1) * size)
        assert chunk.chunk_start_idx == cached + index * size
        assert chunk.chunk_start_idx % case.block == 0
        assert chunk.contains_last_token == (index == len(request.chunks) - 1)
        table = chunk.chunk_page_table
        assert table is not None and table.shape == (1, ceil_div(size, case.block))
        start_block = chunk.chunk_start_idx // case.block
        mapped = min(table.shape[1], max(0, allocated - start_block))
        assert torch.equal(table[0, :mapped], case.table[row, start_block : start_block + mapped])
        assert (table[0, mapped:] == -1).all()


# Wave decisions hinge on rare combinations (boundaries, legacy contiguity); look harder.
@settings(max_examples=max(200, settings().max_examples))
@given(cases())
def test_every_uncached_row_is_planned_once_in_whole_waves_within_limits(case: Case) -> None:
    check_rows_and_waves(case, case.plan())


@given(cases())
def test_requests_carry_sliced_tokens_sentinel_tables_and_absolute_chunks(case: Case) -> None:
    for request in case.plan():
        check_request(case, request)


@given(cases(), st.integers(0, 2**31))
def test_plan_ignores_stale_page_table_tails(case: Case, seed: int) -> None:
    baseline = case.plan()
    generator = torch.Generator().manual_seed(seed)
    perturbed = case.table.clone()
    noise = torch.randint(-5, 90_000, perturbed.shape, generator=generator, dtype=torch.int32)
    for row in range(case.batch):
        perturbed[row, case.allocated(row) :] = noise[row, case.allocated(row) :]
    assert case.plan(perturbed) == baseline
    narrowest = max(1, *(case.allocated(row) for row in range(case.batch)))
    assert case.plan(case.table[:, :narrowest].clone()) == baseline


@given(cases(), st.randoms(use_true_random=False))
def test_results_assembled_by_source_rows_restore_source_order(
    case: Case, shuffler: random.Random
) -> None:
    requests = list(case.plan())
    per_request: list[tuple[Any, ...]] = [
        tuple(("row", row, int(case.tokens[row, case.prompts[row] - 1])) for row in r.source_rows)
        for r in requests
    ]
    restored = restore_source_order(requests, per_request, case.batch)
    expected = [
        ("row", row, int(case.tokens[row, case.prompts[row] - 1]))
        if row in case.planned_rows()
        else None
        for row in range(case.batch)
    ]
    assert list(restored) == expected
    order = list(range(len(requests)))
    shuffler.shuffle(order)
    shuffled = restore_source_order(
        [requests[i] for i in order], [per_request[i] for i in order], case.batch
    )
    assert shuffled == restored
