"""Deferred planner tensors: built on first read, equal to the eager plan, guarded against
in-place changes of the caller's tensors after planning."""

from __future__ import annotations

import copy
import pickle
import random
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.config import RuntimePolicy
from runtime.prefill.inputs import host_inputs
from runtime.prefill.plan import plan_prefill_requests
from runtime.prefill.request import PrefillChunk, PrefillRequest
from tests.runtime.test_prefill_plan_properties import Case, cases, ceil_div

BLOCK = 32


def eager_reference(case: Case, request: PrefillRequest) -> PrefillRequest:
    """`request` as the eager planner built it: every tensor filled at planning time (2.5),
    through the validating public constructors."""
    batched = request.kind == "batched"
    batch, seq = request.padded_batch_size, request.padded_sequence_length
    cached0 = request.cached_tokens[0]
    width = case.canonical or ceil_div(seq if batched else seq + cached0, case.block)
    tokens = torch.zeros((batch, seq), dtype=torch.long)
    table = torch.full((batch, width), 0 if request.uses_chunked_prefill else -1).int()
    for local, row in enumerate(request.source_rows):
        cached, prompt = case.cached[row], case.prompts[row]
        tokens[local, : prompt - cached] = case.tokens[row, cached:prompt]
        table[local, : case.allocated(row)] = case.table[row, : case.allocated(row)]
    chunks = []
    for chunk in request.chunks:
        chunk_table = None
        if request.uses_chunked_prefill:
            row = request.source_rows[0]
            chunk_width = ceil_div(chunk.chunk_size, case.block)
            start = chunk.chunk_start_idx // case.block
            mapped = min(chunk_width, max(0, case.allocated(row) - start))
            chunk_table = torch.full((1, chunk_width), -1, dtype=torch.int32)
            chunk_table[0, :mapped] = case.table[row, start : start + mapped]
        chunks.append(
            PrefillChunk(
                chunk.token_slice,
                chunk.chunk_start_idx,
                chunk.chunk_size,
                chunk_table,
                chunk.contains_last_token,
            )
        )
    return attrs.evolve(request, tokens=tokens, page_table=table, chunks=tuple(chunks))


def staged(request: PrefillRequest, chunk: PrefillChunk) -> list[torch.Tensor]:
    return list(host_inputs(request, chunk).values())


def assert_same_inputs(left: list[torch.Tensor], right: list[torch.Tensor]) -> None:
    for a, b in zip(left, right, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@given(cases())
def test_deferred_plan_equals_the_eager_plan_before_and_after_materialising(case: Case) -> None:
    for request in case.plan():
        reference = eager_reference(case, request)
        # Geometry and staged chunk inputs first: these must not need the whole tensors.
        assert request.page_table_width == reference.page_table_width
        widths = [chunk.chunk_page_table_width for chunk in request.chunks]
        assert widths == [chunk.chunk_page_table_width for chunk in reference.chunks]
        before = [staged(request, chunk) for chunk in request.chunks]
        for chunk, inputs in zip(reference.chunks, before, strict=True):
            assert_same_inputs(inputs, staged(reference, chunk))
        assert request == reference  # materialises every deferred tensor
        for chunk, inputs in zip(request.chunks, before, strict=True):
            assert_same_inputs(inputs, staged(request, chunk))


def plan_rows(tokens: torch.Tensor, table: torch.Tensor, **overrides: Any) -> Any:
    arguments: dict[str, Any] = {
        "tokens": tokens,
        "page_table": table,
        "block_size": BLOCK,
        "max_batch_size": 32,
        "max_prefill_chunk_size": 2048,
        "supports_batched_prefill": True,
    }
    arguments.update(overrides)
    return plan_prefill_requests(**arguments)


def inputs(rows: int = 2, width: int = 3000) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.arange(rows * width, dtype=torch.long).reshape(rows, width) + 1
    table = torch.arange(rows * 100, dtype=torch.int32).reshape(rows, 100) + 1
    return tokens, table


def test_changing_the_callers_tokens_before_first_read_raises() -> None:
    tokens, table = inputs()
    first, second = plan_rows(tokens, table, start_pos=[0, 64])
    tokens[1, 70] = -5
    for read in (
        lambda: first.tokens,
        lambda: second.tokens,
        lambda: host_inputs(second),
    ):
        with pytest.raises(RuntimeError, match=r"tokens tensor .* modified in place"):
            read()


def test_changing_the_callers_page_table_before_first_read_raises() -> None:
    tokens, table = inputs()
    (_, chunked) = plan_rows(tokens, table, start_pos=[0, 64])
    table[:, 99] = 7  # even a stale tail: the guard sees the tensor, not the columns
    with pytest.raises(RuntimeError, match=r"page_table tensor .* modified in place"):
        _ = chunked.page_table
    with pytest.raises(RuntimeError, match=r"page_table tensor .* modified in place"):
        _ = chunked.chunks[0].chunk_page_table
    assert chunked.page_table_width == 130 and chunked.chunks[0].chunk_page_table_width == 64


def test_tensors_read_before_a_change_keep_their_planned_values() -> None:
    tokens, table = inputs()
    (request, _) = plan_rows(tokens, table)
    planned_tokens, planned_table = request.tokens.clone(), request.page_table.clone()
    tokens.zero_()
    table.zero_()
    assert torch.equal(request.tokens, planned_tokens)
    assert torch.equal(request.page_table, planned_table)
    assert torch.equal(host_inputs(request).tokens, planned_tokens[:, :2048])


def test_inference_tensors_are_copied_at_planning_time() -> None:
    with torch.inference_mode():
        tokens, table = inputs()
        planned_tokens, planned_table = tokens.clone(), table.clone()
        (request, _) = plan_rows(tokens, table, start_pos=[64, 0])
        tokens.zero_()
        table.zero_()
    assert torch.equal(request.tokens[0, : 3000 - 64], planned_tokens[0, 64:])
    assert torch.equal(request.page_table[0, :94], planned_table[0, :94])


def test_evolving_an_unread_request_keeps_its_planned_tensors() -> None:
    tokens, table = inputs()
    (first, second) = plan_rows(tokens, table, start_pos=[0, 64])
    moved = attrs.evolve(first, source_rows=(1,), slots=(1,))
    assert torch.equal(moved.tokens[0, :3000], tokens[0])
    assert torch.equal(moved.page_table[0, :94], table[0, :94])
    rebuilt = attrs.evolve(second, chunks=tuple(attrs.evolve(c) for c in second.chunks))
    assert rebuilt == second


@attrs.frozen
class ShiftedPolicy(RuntimePolicy):
    """Pads like the ttnn policy except one length: the planner validates overridden padding."""

    bad_length: int = 0

    def padded_prefill_length(self, n: int) -> int:
        return n - 1 if n == self.bad_length else super().padded_prefill_length(n)


def test_overridden_padding_goes_through_validation() -> None:
    tokens, table = inputs()
    stock = RuntimePolicy.ttnn()
    fields = attrs.asdict(stock, recurse=False)
    same = plan_rows(tokens, table, start_pos=[0, 64], policy=ShiftedPolicy(**fields))
    assert same == plan_rows(tokens, table, start_pos=[0, 64], policy=stock)
    with pytest.raises(ValueError, match="row positions must satisfy"):
        plan_rows(
            tokens, table, prompt_lens=[200, 100], policy=ShiftedPolicy(**fields, bad_length=200)
        )


def test_copied_and_pickled_plans_build_the_planned_tensors() -> None:
    tokens, table = inputs()
    tokens[0, 0] = 9  # a caller tensor with a non-zero version counter
    plan = plan_rows(tokens, table, start_pos=[0, 64])
    copies = [copy.deepcopy(plan), pickle.loads(pickle.dumps(plan))]
    for copied in copies:
        assert copied == plan
    tokens[1, 100] = -1
    with pytest.raises(RuntimeError, match="modified in place"):
        copy.deepcopy(plan)


def inputs_from_request_tensors(request: PrefillRequest, chunk: PrefillChunk) -> list[torch.Tensor]:
    """What `host_inputs` returned before it read the plan source: slices of the request's
    whole padded `tokens` and its `page_table`, element-wise lengths and starts."""
    batch = request.padded_batch_size
    prompt_lens = torch.zeros(batch, dtype=torch.int64)
    chunk_start = torch.zeros(batch, dtype=torch.int64)
    for row, (length, cached) in enumerate(
        zip(request.prompt_lengths, request.cached_tokens, strict=True)
    ):
        prompt_lens[row] = length
        chunk_start[row] = cached + chunk.token_slice.start
    return [
        request.tokens[:, chunk.token_slice].to(torch.int64).contiguous(),
        request.page_table.to(torch.int32).contiguous(),
        prompt_lens,
        chunk_start,
    ]


def assert_identical(fast: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    for a, b in zip(fast, reference, strict=True):
        assert (a.shape, a.dtype, a.is_contiguous()) == (b.shape, b.dtype, True)
        assert torch.equal(a, b)


def assert_fast_path_matches(
    plan: tuple[PrefillRequest, ...], callers_tokens: torch.Tensor, order: random.Random
) -> None:
    for request in plan:
        chunks = list(request.chunks)
        order.shuffle(chunks)  # a later chunk first must not matter
        fast = {}
        for chunk in chunks:
            fast[id(chunk)] = staged(request, chunk)
            assert "tokens" not in request.__dict__  # the padded tokens were never built
            tokens = fast[id(chunk)][0]
            assert tokens.untyped_storage().data_ptr() != (
                callers_tokens.untyped_storage().data_ptr()
            )
        for chunk in chunks:
            assert_identical(fast[id(chunk)], inputs_from_request_tensors(request, chunk))


@given(cases(), st.randoms(use_true_random=False))
def test_host_inputs_from_the_plan_source_equal_slicing_the_request_tensors(
    case: Case, order: random.Random
) -> None:
    """Regular, batched (with padding rows), chunked and cached rows: the chunk's columns
    built straight from the caller's tensors equal slicing the request's padded tensors."""
    assert_fast_path_matches(case.plan(), case.tokens, order)


def assert_request_tensors_from_the_callers(
    plan: tuple[PrefillRequest, ...], tokens: torch.Tensor, table: torch.Tensor
) -> None:
    """Each request's padded tensors, checked row by row against the caller's tensors."""
    for request in plan:
        fill = 0 if request.uses_chunked_prefill else -1
        expected_tokens = torch.zeros(request.tokens.shape, dtype=torch.int64)
        expected_table = torch.full(request.page_table.shape, fill, dtype=torch.int32)
        for local, row in enumerate(request.source_rows):
            cached, prompt = request.cached_tokens[local], request.prompt_lengths[local]
            expected_tokens[local, : prompt - cached] = tokens[row, cached:prompt]
            allocated = ceil_div(prompt, BLOCK)
            expected_table[local, :allocated] = table[row, :allocated]
        assert request.tokens.dtype == torch.int64 and torch.equal(request.tokens, expected_tokens)
        assert request.page_table.dtype == torch.int32
        assert torch.equal(request.page_table, expected_table)


def test_fast_path_across_page_table_blocks_and_wave_blocks() -> None:
    """Hundreds of single rows (several page-table blocks per width) and a 30-row wave of
    [32, 1024] tokens (two gather blocks, the second with the wave's padding rows)."""
    generator = torch.Generator().manual_seed(1)
    rows, width = 600, 5000
    tokens = torch.randint(1, 50000, (rows, width), generator=generator, dtype=torch.int32)
    table = torch.randint(0, 9000, (rows, 160), generator=generator, dtype=torch.int32)
    lengths = torch.randint(1, width, (rows,), generator=generator)
    cached = torch.randint(0, 3, (rows,), generator=generator) * BLOCK
    cached = torch.where(cached < lengths, cached, 0)
    singles = plan_rows(tokens, table, prompt_lens=lengths, start_pos=cached, max_batch_size=rows)
    assert len(singles) == rows and any(request.uses_chunked_prefill for request in singles)
    assert_fast_path_matches(singles, tokens, random.Random(0))
    assert_request_tensors_from_the_callers(singles, tokens, table)
    wave_lengths = torch.randint(600, 1025, (30,), generator=generator)
    (wave,) = plan_rows(
        tokens[:30],
        table[:30],
        prompt_lens=wave_lengths,
        max_prefill_chunk_size=1024,
        max_prefill_batch_size=32,
        policy=RuntimePolicy.torch_default(),
    )
    assert (wave.kind, wave.padded_batch_size, wave.padded_sequence_length) == ("batched", 32, 1024)
    assert_fast_path_matches((wave,), tokens, random.Random(0))
    assert_request_tensors_from_the_callers((wave,), tokens, table)


def test_host_inputs_after_a_change_raise_even_with_the_page_table_block_built() -> None:
    tokens, table = inputs(rows=3)
    first, second, third = plan_rows(tokens, table, start_pos=[0, 64, 32])
    host_inputs(first)  # builds the page tables of every row of first's block
    _ = second.page_table
    table[2, 0] = 5
    for read in (
        lambda: host_inputs(first),  # its tokens were never read: built from the source
        lambda: host_inputs(second),
        lambda: third.page_table,
    ):
        with pytest.raises(RuntimeError, match=r"page_table tensor .* modified in place"):
            read()
