"""Deferred planner tensors: built on first read, equal to the eager plan, guarded against
in-place changes of the caller's tensors after planning."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given

from runtime.config import RuntimePolicy
from runtime.prefill.inputs import host_inputs
from runtime.prefill.plan import PrefillChunk, PrefillRequest, plan_prefill_requests
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
