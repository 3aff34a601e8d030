"""The planner pads every prompt a lane holds within the lane's canonical page table.

`PageTableLayout.resolve` gives prefill one chunk of headroom past the KV capacity, not room
for a power-of-two padding (3,000 tokens pad to 4,096 past a 104-block x 32 table): a chunked
row is padded to the last whole chunk the table holds, keeping its chunk size, so its
program signatures are the ones warmup derives. The reference policy keeps refusing.
"""

from __future__ import annotations

import pytest
import torch

from runtime.config import PageTableLayout, RuntimePolicy
from runtime.prefill.plan import plan_prefill_requests, prefill_chunk_size
from runtime.prefill.request import PrefillRequest, validated

TORCH = RuntimePolicy.torch_default()


def _plan(
    length: int, cached: int, layout: PageTableLayout, chunk: int, policy: RuntimePolicy
) -> tuple[PrefillRequest, ...]:
    block = layout.block_size
    return plan_prefill_requests(
        tokens=torch.arange(length, dtype=torch.long).reshape(1, length) % 200 + 1,
        page_table=torch.arange(-(-length // block), dtype=torch.int32).reshape(1, -1) + 1,
        prompt_lens=[length],
        start_pos=[cached],
        block_size=block,
        max_batch_size=8,
        max_prefill_chunk_size=chunk,
        supports_batched_prefill=True,
        max_actual_page_table_width=layout.raw_capacity_width,
        canonical_page_table_width=layout.prefill_width,
        policy=policy,
    )


@pytest.mark.parametrize(
    ("block", "chunk", "blocks", "context"),
    [(16, 32, 19, 512), (16, 32, 24, 512), (32, 256, 96, 8192), (32, 256, 41, 8192)],
)
def test_every_length_the_lane_holds_is_planned_within_the_page_table(
    block: int, chunk: int, blocks: int, context: int
) -> None:
    layout = PageTableLayout.resolve(
        block_size=block,
        model_max_sequence_length=context,
        physical_num_blocks=blocks,
        max_prefill_chunk_size=chunk,
    )
    table_tokens = layout.prefill_width * block
    clamped = 0
    for length in range(1, layout.raw_capacity_width * block + 1):
        for cached in {0, (length - 1) // block // 2 * block}:  # uncached, about half cached
            (request,) = _plan(length, cached, layout, chunk, TORCH)
            validated(request)  # every invariant of a planned request still holds
            uncached = length - cached
            padded = TORCH.padded_prefill_length(uncached)
            assert cached + request.padded_sequence_length <= table_tokens, (length, cached)
            assert request.padded_sequence_length >= uncached
            assert request.final_chunk.token_slice.stop <= request.padded_sequence_length
            if request.uses_chunked_prefill:
                size = prefill_chunk_size(padded, chunk, policy=TORCH)
                assert {c.chunk_size for c in request.chunks} == {size}, (length, cached)
            if request.padded_sequence_length != padded:
                clamped += 1
                assert request.padded_sequence_length % request.first_chunk.chunk_size == 0
    assert clamped or table_tokens >= TORCH.padded_prefill_length(layout.raw_capacity_width * block)


def test_the_issue_geometry_pads_3000_tokens_to_the_last_chunk_that_fits() -> None:
    """SmolLM2 with 96 KV blocks of 32: the table holds 104 x 32 = 3,328 tokens."""
    layout = PageTableLayout.resolve(
        block_size=32,
        model_max_sequence_length=8192,
        physical_num_blocks=96,
        max_prefill_chunk_size=256,
    )
    assert layout.prefill_width == 104
    (request,) = _plan(3000, 0, layout, 256, TORCH)
    assert request.padded_sequence_length == 3328 and request.first_chunk.chunk_size == 256
    assert len(request.chunks) == 12 and request.final_chunk.token_slice == slice(2816, 3072)
    with pytest.raises(ValueError, match="exceeds the canonical page-table capacity of 104"):
        _plan(3000, 0, layout, 2048, RuntimePolicy.ttnn())
