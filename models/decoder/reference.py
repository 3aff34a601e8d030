"""A plain greedy generation loop over the tensor model, for tests and benchmarks.

It owns a KV cache of ordinary torch tensors and a contiguous page table per row, so the
model can be exercised end to end before (and independently of) the runtime package.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from models.decoder.model import DecoderModel
from runtime.backends import huge_pages

logger = logging.getLogger(__name__)


def allocate_kv_cache(
    model: DecoderModel, num_blocks: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed K/V tensors for every layer, shaped for the model's configured block size (on
    huge pages on the CPU, as the runtime's device allocates them)."""
    shape = model.kv_cache_shape(num_blocks)
    return [
        (
            huge_pages.full(shape, 0.0, model.dtype, model.device),
            huge_pages.full(shape, 0.0, model.dtype, model.device),
        )
        for _ in range(model.n_layers)
    ]


def contiguous_page_table(
    lengths: Sequence[int], block_size: int, *, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, int]:
    """Row i gets the next `ceil(lengths[i] / block_size)` blocks; returns (table, blocks used)."""
    counts = [(n + block_size - 1) // block_size for n in lengths]
    width = max(max(counts, default=0), 1)
    table = torch.full((len(lengths), width), -1, dtype=torch.int32)
    next_block = 0
    for row, count in enumerate(counts):
        table[row, :count] = torch.arange(next_block, next_block + count, dtype=torch.int32)
        next_block += count
    return table.to(device), next_block


def prefill_prompts(
    model: DecoderModel,
    prompts: Sequence[Sequence[int]],
    page_table: torch.Tensor,
    *,
    chunk_size: int | None = None,
    cached_tokens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Prefill padded prompts chunk by chunk; returns each row's last-token logits `[B, V]`.

    `cached_tokens[i]` (block aligned) positions of row i are taken as already in the cache.
    """
    batch = len(prompts)
    lens = [len(p) for p in prompts]
    cached = list(cached_tokens) if cached_tokens is not None else [0] * batch
    todo = [n - c for n, c in zip(lens, cached, strict=True)]
    if any(t <= 0 for t in todo):
        raise ValueError(f"every prompt needs an uncached token: lengths {lens}, cached {cached}")
    longest = max(todo)
    chunk = chunk_size or longest
    logits = torch.zeros(batch, model.vocab_size, dtype=torch.float32, device=model.device)
    for offset in range(0, longest, chunk):
        width = min(chunk, longest - offset)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            part = prompt[cached[row] + offset : cached[row] + offset + width]
            tokens[row, : len(part)] = torch.tensor(list(part), dtype=torch.long)
        starts = torch.tensor([c + offset for c in cached], dtype=torch.long)
        out = model.prefill(
            tokens,
            page_table=page_table,
            prompt_lens=torch.tensor(lens, dtype=torch.long),
            chunk_start=starts,
        )
        for row in range(batch):
            if offset < todo[row] <= offset + width:
                logits[row] = out[row]
    return logits


@torch.inference_mode()
def greedy_generate(
    model: DecoderModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    block_size: int = 16,
    chunk_size: int | None = None,
    stop_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    """Greedy continuation of every prompt in one batch; returns only the new tokens.

    Rows that emit a token in `stop_token_ids` stop (the stop token is included) and are
    marked inactive (negative position) for the remaining decode steps.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: allowed is >= 1")
    lens = [len(p) for p in prompts]
    table, used = contiguous_page_table([n + max_new_tokens for n in lens], block_size)
    previous_paged = model.paged_attention_config
    previous_cache = model.kv_cache
    model.set_kv_cache(None)
    model.configure_paged_attention(block_size=block_size, max_num_blocks=used)
    model.set_kv_cache(allocate_kv_cache(model, used))
    try:
        logits = prefill_prompts(model, prompts, table, chunk_size=chunk_size)
        outputs: list[list[int]] = [[] for _ in prompts]
        positions = torch.tensor(lens, dtype=torch.long)
        stops = set(stop_token_ids)
        for step in range(max_new_tokens):
            next_tokens = logits.argmax(dim=-1)
            for row, token in enumerate(next_tokens.tolist()):
                if positions[row] >= 0:
                    outputs[row].append(int(token))
                    if token in stops:
                        positions[row] = -1
            if step == max_new_tokens - 1 or bool((positions < 0).all()):
                break
            logits = model.decode(next_tokens, positions=positions, page_table=table)
            positions = torch.where(positions >= 0, positions + 1, positions)
        return outputs
    finally:
        model.set_kv_cache(None)
        if previous_paged is not None:
            model.configure_paged_attention(
                block_size=previous_paged.block_size,
                max_num_blocks=previous_paged.max_num_blocks,
            )
        if previous_cache is not None:
            model.set_kv_cache(previous_cache)
