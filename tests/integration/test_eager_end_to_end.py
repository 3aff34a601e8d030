"""Eager prefill of a mixed batch, then paged decode, equals the model's own full forward."""

from __future__ import annotations

import torch

from models.decoder.reference import allocate_kv_cache
from tests.integration.executor_setup import (
    BLOCK,
    contiguous_tables,
    prompts_batch,
    tiny_executor,
)


def full_forward_last_logits(model: object, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the last token of one prompt, from one prefill over a fresh cache."""
    saved = model.kv_cache  # type: ignore[attr-defined]
    length = tokens.shape[0]
    blocks = -(-length // BLOCK)
    cache = allocate_kv_cache(model, blocks)  # type: ignore[arg-type]
    model.set_kv_cache(cache)  # type: ignore[attr-defined]
    try:
        logits = model.prefill(  # type: ignore[attr-defined]
            tokens.unsqueeze(0),
            page_table=torch.arange(blocks, dtype=torch.int32).unsqueeze(0),
            prompt_lens=torch.tensor([length]),
            chunk_start=torch.tensor([0]),
        )
    finally:
        model.set_kv_cache(saved)  # type: ignore[attr-defined]
    return logits[0]


def test_mixed_prefill_then_decode_matches_full_forward() -> None:
    executor = tiny_executor(device_sampling=False)
    executor.start()
    model = executor.model
    # Two short rows form a batched wave, a long row is chunked, and a fourth row reuses a
    # block-aligned cached prefix (row 2's first 8 tokens, written by the first call).
    lengths = [6, 7, 45, 12]
    tokens = prompts_batch(lengths)
    width = executor.page_table_layout.prefill_width
    table = contiguous_tables([length + 2 for length in lengths], width=width)
    first = executor.prefill_forward(
        tokens=tokens[:3],
        page_table=table[:3],
        prompt_lens=torch.tensor(lengths[:3]),
        empty_slots=[0, 1, 2],
    )
    # Row 3 shares row 2's first two blocks as its cached prefix.
    tokens[3, :8] = tokens[2, :8]
    table[3, :2] = table[2, :2]
    cached = executor.prefill_forward(
        tokens=tokens[3:],
        page_table=table[3:],
        prompt_lens=torch.tensor(lengths[3:]),
        start_pos=torch.tensor([8]),
        empty_slots=[3],
    )
    prefill_logits = torch.cat([first, cached])
    for row, length in enumerate(lengths):
        expected = full_forward_last_logits(model, tokens[row, :length])
        torch.testing.assert_close(prefill_logits[row, 0], expected, atol=1e-4, rtol=0)

    next_tokens = prefill_logits[:, 0].argmax(-1)
    decode_table = contiguous_tables(
        [length + 2 for length in lengths], width=executor.page_table_layout.decode_width
    )
    decode_table[3, :2] = decode_table[2, :2]
    positions = torch.tensor(lengths)
    blocking = executor.decode_forward(
        tokens=next_tokens, start_pos=positions, page_table=decode_table
    )
    for row, length in enumerate(lengths):
        sequence = torch.cat([tokens[row, :length], next_tokens[row : row + 1]])
        expected = full_forward_last_logits(model, sequence)
        torch.testing.assert_close(blocking[row, 0], expected, atol=1e-4, rtol=0)

    # The asynchronous read path gives the same values as the blocking one.
    raw = executor.decode_forward(
        tokens=next_tokens, start_pos=positions, page_table=decode_table, read_from_device=False
    )
    host, events = executor.read_decode_output(raw, async_read=True)
    assert isinstance(events, list)
    asynchronous = executor.process_decode_output_host(host)
    assert torch.equal(asynchronous, blocking)
    executor.close()
    assert executor.device.live_allocations == 0
