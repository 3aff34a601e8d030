"""Host-planned cache addressing of the dynamic (CPU) model calls, as attention paths.

Why: on CPU the fastest call reads tensor values on the host to size its work (only the keys
up to the longest row, only the real tokens of a padded chunk). The functions here do that
planning once per call and return the per-call context every layer uses (`attention`); the
capturable counterparts, with shapes fixed by the input shapes, are in `graph_safe`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.decoder.attention import CacheWrites, GroupedDecode, PackedPrefill, PagedDecode
from models.decoder.attention_layout import (
    KeyGroup,
    PackedChunk,
    flat_cache_rows,
    plan_key_groups,
    prefix_then_causal_mask,
)

# Grows (never shrinks) and returns the model's flat K and V gather buffers of a given size.
Workspace = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def token_writes(
    block: torch.Tensor, pos: torch.Tensor, *, n_kv_heads: int, block_size: int
) -> CacheWrites:
    """Cache writes of tokens at positions `pos` on pages `block` (`-1`: unmapped, skipped)."""
    rows = None
    mapped = block >= 0
    if not bool(mapped.all()):
        rows = mapped.nonzero().squeeze(1)
        block, pos = block[rows], pos[rows]
    index = flat_cache_rows(block, pos % block_size, n_kv_heads=n_kv_heads, block_size=block_size)
    return CacheWrites(token_rows=rows, cache_rows=index.reshape(-1))


def _decode_writes(
    pages: torch.Tensor, pos: torch.Tensor, *, n_kv_heads: int, block_size: int
) -> CacheWrites:
    """Where each decode row writes its new K/V (the dynamic paths read no other rows)."""
    block = pages.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
    return token_writes(block, pos, n_kv_heads=n_kv_heads, block_size=block_size)


def paged_decode(
    pages: torch.Tensor,
    pos: torch.Tensor,
    *,
    n_kv_heads: int,
    block_size: int,
    spread: bool = False,
) -> PagedDecode:
    """Active rows' decode with attention reading K/V pages in place (no sort, no gather);
    `spread` picks the kernel's prefetch placement (`PagedDecodeAttention`)."""
    writes = _decode_writes(pages, pos, n_kv_heads=n_kv_heads, block_size=block_size)
    return PagedDecode(writes=writes, pages=pages.contiguous(), n_keys=pos + 1, spread=spread)


def position_order(pos: torch.Tensor) -> torch.Tensor | None:
    """The stable order sorting decode rows by position, or None when already sorted.

    Attention groups rows of similar length; batches already sorted (batch 1 included) keep
    their order.
    """
    if pos.shape[0] > 1 and bool((pos[1:] < pos[:-1]).any()):
        return torch.argsort(pos, stable=True)
    return None


def grouped_decode(
    pages: torch.Tensor,
    pos: torch.Tensor,
    workspace: Workspace,
    *,
    n_kv_heads: int,
    block_size: int,
    head_dim: int,
    group_cost: int,
) -> GroupedDecode:
    """Attention groups of a position-sorted decode batch, and a workspace to fit them.

    Keys are gathered a whole (block, KV head) tile at a time: the cache
    `[num_blocks, kv, block_size, hd]` viewed as `[num_blocks * kv, block_size * hd]`
    has one contiguous row per tile, and gathering rows `(page * kv + head)` in
    `[rows, kv, blocks]` order lands them directly in SDPA's `[rows, kv, keys, hd]`
    layout. Copying 8 KiB tiles is much faster than copying 256-byte key rows; the few
    keys past a row's position are masked.
    """
    bs, kv = block_size, n_kv_heads
    n_blocks = [p // bs + 1 for p in pos.tolist()]
    heads = torch.arange(kv, device=pages.device).view(1, kv, 1)
    groups = []
    largest = 0
    for start, end in plan_key_groups([n * bs for n in n_blocks], group_cost=group_cost):
        width = n_blocks[end - 1]
        group_pages = pages[start:end, :width]
        index = group_pages.clamp(min=0).unsqueeze(1) * kv + heads  # [rows, kv, width]
        key_pos = torch.arange(width * bs, device=pages.device)
        visible = key_pos.unsqueeze(0) <= pos[start:end].unsqueeze(1)
        if not bool((group_pages >= 0).all()):
            visible &= (group_pages >= 0).repeat_interleave(bs, dim=1)
        groups.append(KeyGroup(start, end, index, visible.view(end - start, 1, 1, -1)))
        largest = max(largest, index.numel() * bs * head_dim)
    writes = _decode_writes(pages, pos, n_kv_heads=kv, block_size=bs)
    return GroupedDecode(writes=writes, groups=tuple(groups), workspace=workspace(largest))


def prefix_key_rows(
    page_table: torch.Tensor, n_keys: int, *, n_kv_heads: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache rows `[B, kv, n_keys]` of positions `0..n_keys-1`, and which are mapped.

    Exactly `n_keys` keys (not whole blocks) keep the gather and attention minimal.
    """
    kv = n_kv_heads
    key_pos = torch.arange(n_keys, device=page_table.device)
    pages = page_table[:, key_pos // block_size]  # [B, n_keys]
    mapped = pages >= 0
    heads = torch.arange(kv, device=pages.device).view(1, kv, 1)
    rows = (pages.clamp(min=0).unsqueeze(1) * kv + heads) * block_size + key_pos % block_size
    return rows, mapped


def packed_prefill(
    tokens: torch.Tensor,
    pages: torch.Tensor,
    real: torch.Tensor,
    start: torch.Tensor,
    *,
    n_kv_heads: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, PackedPrefill]:
    """Rows that each have `real` (>= 1) tokens from `start`: `(token_ids, positions, path)`
    of the `N` real tokens, packed in row-major order.

    Why packed: a planner chunk is padded to a bucket shape (a row's last 8 tokens can
    arrive as a `[1, 256]` chunk), so the projections and MLPs, most of the work, run on
    the `N` real tokens only; attention uses the `[B, longest]` padded layout. The last
    layer computes only each row's last token past its K/V write (all the logits need).
    """
    device = tokens.device
    bs = block_size
    batch = tokens.shape[0]
    seq = int(real.max())
    cols = torch.arange(seq, device=device)
    positions = start.unsqueeze(1) + cols  # [B, S]
    chunk_ok = cols.unsqueeze(0) < real.unsqueeze(1)  # [B, S]: real tokens
    is_real = chunk_ok.reshape(-1)
    scatter = None if bool(is_real.all()) else is_real.nonzero().squeeze(1)
    # Cached prefix: positions < chunk_start, read from the cache.
    prefix = int(start.max())
    prefix_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # no prefix: SDPA's own causal path (half the work)
    last_mask = None if scatter is None else chunk_ok.view(batch, 1, 1, seq)
    if prefix:
        prefix_index, page_ok = prefix_key_rows(pages, prefix, n_kv_heads=n_kv_heads, block_size=bs)
        key_pos = torch.arange(prefix, device=device)
        prefix_ok = (key_pos.unsqueeze(0) < start.unsqueeze(1)) & page_ok  # [B, P]
        mask = prefix_then_causal_mask(prefix_ok, seq)
        last_mask = torch.cat((prefix_ok, chunk_ok), dim=1).view(batch, 1, 1, -1)
    chunk = PackedChunk(
        scatter=scatter,
        batch=batch,
        seq=seq,
        last=torch.cumsum(real, 0) - 1,  # each row's last real token in packed order
        last_mask=last_mask,
    )
    token_ids = chunk.take(tokens[:, :seq].reshape(-1))
    token_pos = chunk.take(positions.reshape(-1))
    block = chunk.take(
        pages.gather(1, positions.clamp(max=pages.shape[1] * bs - 1) // bs).reshape(-1)
    )
    writes = token_writes(block, token_pos, n_kv_heads=n_kv_heads, block_size=bs)
    path = PackedPrefill(writes=writes, chunk=chunk, prefix_index=prefix_index, mask=mask)
    return token_ids, token_pos, path
