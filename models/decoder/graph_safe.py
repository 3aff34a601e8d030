"""Static-shape cache addressing for `DecoderModel`, so decode and prefill can be CUDA-graph
captured.

Why: a CUDA graph records kernels with fixed shapes and forbids host synchronisation. The
dynamic paths of `DecoderModel` read tensor values on the host to size their work (`int(pos.max())`
keys, `nonzero()` rows, early return when no row is active). That is the fastest choice on CPU,
but it cannot be captured. The functions here compute the same addressing from device tensors
only, with every shape fixed by the input shapes:

* attention reads the whole page-table width (`W * block_size` keys) and masks what a row may
  not see, instead of gathering just enough keys for the longest row. So its cost grows with
  the page-table width (the configured maximum sequence length), not with the live context:
  that is why CPU keeps the dynamic path by default;
* every row (and, in prefill, every chunk column) computes; results of inactive rows are
  discarded afterwards (their logits read 0, as in the dynamic path);
* a row that must not write (inactive, padding, or an unmapped page) is redirected to repeat the
  first valid row's write: the same cache index with the same value, so the duplicate index in
  `index_copy_` is harmless and the result stays deterministic. When no row writes at all (every
  row inactive, or every active row's page unmapped), every row targets row 0's (clamped)
  address and writes back the value already stored there: a no-op write that costs two small
  gathers per layer (K and V) but never corrupts the cache. This case is reachable: the decode
  runtime refuses an all-inactive step only when sampling parameters are given; a logits-path
  decode with every slot inactive reaches the model (warmup and capture themselves use
  all-active lanes);
* values that index tables (tokens, positions, block columns) are clamped into range, so a bad
  input can never become an out-of-bounds device access inside a graph. Eager calls still
  validate values on the host first (see `DecoderModel.decode`), so bad inputs raise as before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from models.decoder.attention import CacheWrites, TableDecode, TablePrefill
from models.decoder.attention_layout import flat_cache_rows, prefix_then_causal_mask


class StaticDecode(NamedTuple):
    """Everything a graph-safe decode computes before running the layers."""

    tokens: torch.Tensor  # [B] long, in range
    positions: torch.Tensor  # [B] long, in range of the rotary tables
    active: torch.Tensor  # [B] bool
    attention: TableDecode


class StaticPrefill(NamedTuple):
    """Everything a graph-safe prefill computes before running the layers."""

    tokens: torch.Tensor  # [B, S] long, in range
    positions: torch.Tensor  # [B, S] long, in range of the rotary tables
    last: torch.Tensor  # [B] column of each row's last real token (0 for rows without one)
    has_tokens: torch.Tensor  # [B] bool: the row has real tokens in this chunk
    attention: TablePrefill


def stream_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream of a CUDA `device` is being captured into a graph.

    Host-side validation (which reads tensor values) must be skipped then. Always False on CPU
    (the query itself needs a CUDA build of torch; a model on CUDA implies one).
    """
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def table_key_rows(
    pages: torch.Tensor, *, n_kv_heads: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache rows `[B, kv, W * block_size]` of every position the page table can hold,
    and `[B, W * block_size]` whether its page is mapped (unmapped pages read block 0)."""
    batch, width = pages.shape
    mapped = (pages >= 0).unsqueeze(2).expand(batch, width, block_size).reshape(batch, -1)
    blocks = pages.clamp(min=0).view(batch, 1, width, 1)
    heads = torch.arange(n_kv_heads, device=pages.device).view(1, n_kv_heads, 1, 1)
    offsets = torch.arange(block_size, device=pages.device).view(1, 1, 1, block_size)
    rows = (blocks * n_kv_heads + heads) * block_size + offsets
    return rows.view(batch, n_kv_heads, width * block_size), mapped


def redirect_writes(
    writer: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Static-shape writes for `N` token rows of which only `writer` ([N] bool) may write.

    `rows` ([N, kv]) are each token's flat cache rows. Returns `(source, index, any_writer)`:
    `source` [N] is the token row whose K/V each write carries (itself when it writes, else the
    first writer), `index` [N * kv] the flat cache rows written, and `any_writer` a 0-d bool.
    Duplicate indices therefore always carry identical values. The first writer is found on
    the device (`argmax` returns the first maximum); with no writer it is row 0.
    """
    count = writer.shape[0]
    first = torch.argmax(writer.to(torch.int32))
    source = torch.where(writer, torch.arange(count, device=writer.device), first)
    index = rows.index_select(0, source).reshape(-1)
    return source, index, writer.any()


def static_decode(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    pages: torch.Tensor,
    *,
    n_kv_heads: int,
    block_size: int,
    vocab_size: int,
    max_seq_len: int,
) -> StaticDecode:
    """Graph-safe decode addressing for `tokens` [B], `positions` [B] (negative = inactive) and
    `pages` [B, W] (long, W >= 1; -1 = unmapped), all on the model device.

    Active rows see keys `0..pos` on mapped pages, as in the dynamic path. An inactive row sees
    key 0 only (any finite value), so its attention row is never empty: its output is
    discarded, but this keeps NaNs out of the computation.
    """
    width = pages.shape[1]
    active = positions >= 0
    limit = min(width * block_size, max_seq_len) - 1
    safe_pos = torch.where(active, positions, torch.zeros_like(positions)).clamp(max=limit)
    block = pages.gather(1, (safe_pos // block_size).unsqueeze(1)).squeeze(1)
    writer = active & (block >= 0)
    rows = flat_cache_rows(
        block.clamp(min=0), safe_pos % block_size, n_kv_heads=n_kv_heads, block_size=block_size
    )
    source, write_index, any_writer = redirect_writes(writer, rows)
    gather_index, mapped = table_key_rows(pages, n_kv_heads=n_kv_heads, block_size=block_size)
    key_pos = torch.arange(width * block_size, device=pages.device)
    visible = (key_pos.unsqueeze(0) <= positions.unsqueeze(1)) & mapped
    visible = visible | ((~active).unsqueeze(1) & (key_pos == 0).unsqueeze(0))
    safe_tokens = torch.where(active, tokens, torch.zeros_like(tokens)).clamp(0, vocab_size - 1)
    return StaticDecode(
        tokens=safe_tokens,
        positions=safe_pos,
        active=active,
        attention=TableDecode(
            writes=CacheWrites(token_rows=source, cache_rows=write_index, any_writer=any_writer),
            gather_index=gather_index,
            mask=visible.view(visible.shape[0], 1, 1, -1),
        ),
    )


def static_prefill(
    tokens: torch.Tensor,
    pages: torch.Tensor,
    prompt_lens: torch.Tensor,
    chunk_start: torch.Tensor,
    *,
    n_kv_heads: int,
    block_size: int,
    vocab_size: int,
    max_seq_len: int,
) -> StaticPrefill:
    """Graph-safe prefill addressing for a padded chunk `tokens` [B, S] (long, on device).

    Same rules as the dynamic path: a row's real tokens in this chunk are
    `clamp(prompt_len - chunk_start, 0, S)`; rows without any read no cached prefix; only real
    tokens on mapped pages write. Queries attend to the cached prefix (positions below the
    row's chunk start, on mapped pages: the whole page-table width is gathered and masked) and
    causally to the chunk's own keys.
    """
    batch, seq = tokens.shape
    width = pages.shape[1]
    device = tokens.device
    cols = torch.arange(seq, device=device)
    start = chunk_start.clamp(min=0)
    real = (prompt_lens - start).clamp(min=0, max=seq)
    has_tokens = real > 0
    start = torch.where(has_tokens, start, torch.zeros_like(start))
    positions = start.unsqueeze(1) + cols
    is_real = cols.unsqueeze(0) < real.unsqueeze(1)
    limit = width * block_size - 1
    safe_pos = torch.where(is_real, positions, torch.zeros_like(positions)).clamp(max=limit)
    block = pages.gather(1, safe_pos // block_size)
    writer = (is_real & (block >= 0)).reshape(-1)
    rows = flat_cache_rows(
        block.clamp(min=0), safe_pos % block_size, n_kv_heads=n_kv_heads, block_size=block_size
    ).reshape(batch * seq, n_kv_heads)
    source, write_index, any_writer = redirect_writes(writer, rows)
    gather_index, mapped = table_key_rows(pages, n_kv_heads=n_kv_heads, block_size=block_size)
    key_pos = torch.arange(width * block_size, device=device)
    prefix_ok = (key_pos.unsqueeze(0) < start.unsqueeze(1)) & mapped  # [B, L]
    mask = prefix_then_causal_mask(prefix_ok, seq)
    return StaticPrefill(
        tokens=tokens.clamp(0, vocab_size - 1),
        positions=positions.clamp(max=max_seq_len - 1),
        last=(real - 1).clamp(min=0),
        has_tokens=has_tokens,
        attention=TablePrefill(
            writes=CacheWrites(token_rows=source, cache_rows=write_index, any_writer=any_writer),
            prefix_index=gather_index,
            mask=mask,
        ),
    )
