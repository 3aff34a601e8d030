"""The attention paths of `DecoderModel`: one class per path, built once per call for every layer.

A model call plans its cache addressing once (`dynamic_addressing` for the dynamic CPU paths,
`graph_safe` for the capturable ones) and hands the layers one of these per-call contexts. Each
layer then does the same three things (`DecoderModel._attention`): project Q/K/V, store the new
K/V with `write_kv(cache, k, v, path.writes)`, and `path.attend(q, k, v, cache)`. The paths:

* `PagedDecode`: dynamic decode; a native kernel reads each row's keys from its pages in place;
* `GroupedDecode`: dynamic decode; groups of length-sorted rows gather their key tiles, then SDPA;
* `PackedPrefill` / `PackedLastTokens`: dynamic prefill of a chunk's real tokens only, the last
  layer attending for each row's last token alone;
* `TableDecode` / `TablePrefill`: graph-safe; keys over the whole page-table width, masked.

Every layer cache is `(K, V)`, each `[num_blocks, n_kv_heads, block_size, head_dim]`; Q/K/V are
`[..., heads, head_dim]`, so head counts are read from the tensors, not passed around.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from models.decoder.attention_layout import KeyGroup, PackedChunk
from runtime.backends import native_kernels

LayerCache = tuple[torch.Tensor, torch.Tensor]


class CacheWrites(NamedTuple):
    """Where one call stores its new K/V, shared by every layer.

    `token_rows` selects (and may repeat) token rows of the flattened batch whose K/V are
    written, in the order of `cache_rows` (flat cache rows, ordered (token, kv head)); None:
    every token, in order. `any_writer` (0-d bool, graph-safe calls only): when False, each
    write stores the cache's current value instead (see `graph_safe`).

    (Named tuples rather than attrs classes: `torch.compile` traces them, which the CPU tests
    use to prove the graph-safe path has no data-dependent control flow.)
    """

    token_rows: torch.Tensor | None
    cache_rows: torch.Tensor
    any_writer: torch.Tensor | None = None


class AttentionPath(Protocol):
    """What a layer needs from the per-call context (see the module docstring)."""

    @property
    def writes(self) -> CacheWrites: ...

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache
    ) -> torch.Tensor:
        """Attention output with heads flattened (`[..., n_q * head_dim]`), K/V written."""
        ...

    def last_layer(self) -> AttentionPath:
        """The path the final layer takes (itself, except for a packed prefill)."""
        ...

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of the residual stream `x` that `attend`'s output lines up with."""
        ...


def write_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, writes: CacheWrites) -> None:
    """Store the call's new keys and values `[..., kv, hd]` at `writes` in the layer cache."""
    n_kv, hd = k.shape[-2], k.shape[-1]
    k_flat = cache[0].view(-1, hd)
    v_flat = cache[1].view(-1, hd)
    k_tokens = k.reshape(-1, n_kv, hd)
    v_tokens = v.reshape(-1, n_kv, hd)
    if writes.token_rows is not None:
        k_tokens = k_tokens.index_select(0, writes.token_rows)
        v_tokens = v_tokens.index_select(0, writes.token_rows)
    if not writes.cache_rows.numel():
        return
    k_new = k_tokens.reshape(-1, hd)
    v_new = v_tokens.reshape(-1, hd)
    if writes.any_writer is not None:
        # Graph-safe calls: when no row may write, every write stores back the value already
        # there (shapes stay fixed; the cache stays bit-identical).
        k_new = torch.where(writes.any_writer, k_new, k_flat.index_select(0, writes.cache_rows))
        v_new = torch.where(writes.any_writer, v_new, v_flat.index_select(0, writes.cache_rows))
    k_flat.index_copy_(0, writes.cache_rows, k_new)
    v_flat.index_copy_(0, writes.cache_rows, v_new)


def gather_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` `[B, kv, L]` of a layer's K or V cache as `[B, kv, L, head_dim]`.

    `index_select` copies whole rows and is about twice as fast as advanced indexing.
    """
    flat = cache.view(-1, cache.shape[-1])
    return flat.index_select(0, index.view(-1)).view(*index.shape, flat.shape[-1])


def chunk_keys(
    cache: LayerCache, k: torch.Tensor, v: torch.Tensor, prefix_index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's keys and values `[B, kv, P + S, hd]`: the cached prefix (flat cache
    rows `prefix_index`, P keys, when there is one) then the chunk's own `[B, S]`."""
    keys = k.transpose(1, 2)
    values = v.transpose(1, 2)
    if prefix_index is None:
        return keys, values
    prefix_k = gather_rows(cache[0], prefix_index)
    prefix_v = gather_rows(cache[1], prefix_index)
    return torch.cat((prefix_k, keys), dim=2), torch.cat((prefix_v, values), dim=2)


def _flat_heads(out: torch.Tensor) -> torch.Tensor:
    """SDPA's `[B, heads, S, hd]` output as `[B, S, heads * hd]`."""
    batch, heads, seq, hd = out.shape
    return out.transpose(1, 2).reshape(batch, seq, heads * hd)


class PagedDecode(NamedTuple):
    """Dynamic decode: the native kernel reads each row's keys from its pages in place.

    `pages` `[B, W]` (contiguous long) and `n_keys` `[B]` (position + 1) of the active rows;
    `spread` picks the kernel's prefetch placement (`PagedDecodeAttention`).
    """

    writes: CacheWrites
    pages: torch.Tensor
    n_keys: torch.Tensor
    spread: bool = False

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache
    ) -> torch.Tensor:
        batch, _, n_q, hd = q.shape
        n_kv = cache[0].shape[1]
        folded = q.reshape(batch, n_kv, n_q // n_kv, hd)
        attended = native_kernels.paged_decode_attention().unchecked(
            folded, cache[0], cache[1], self.pages, self.n_keys, hd**-0.5, spread=self.spread
        )
        return attended.to(q.dtype).reshape(batch, 1, n_q * hd)

    def last_layer(self) -> AttentionPath:
        return self

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x


class GroupedDecode(NamedTuple):
    """Dynamic decode of length-sorted rows, group by group over gathered key tiles.

    Each group gathers only the key tiles its longest row needs (`dynamic_addressing.
    grouped_decode`) into the reused `workspace` (flat K and V buffers: a fresh
    multi-megabyte tensor per layer costs page faults on every call), and folds each KV head's
    query group into the query axis so SDPA reads K/V once per KV head, not once per query head.
    """

    writes: CacheWrites
    groups: Sequence[KeyGroup]
    workspace: tuple[torch.Tensor, torch.Tensor]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache
    ) -> torch.Tensor:
        batch, _, n_q, hd = q.shape
        k_cache, v_cache = cache
        n_kv = k_cache.shape[1]
        folded = q.reshape(batch, n_kv, n_q // n_kv, hd)
        tile = k_cache.shape[2] * hd
        k_tiles = k_cache.view(-1, tile)
        v_tiles = v_cache.view(-1, tile)
        k_space, v_space = self.workspace
        outs = []
        for group in self.groups:
            rows = group.end - group.start
            index = group.gather_index.view(-1)
            size = index.shape[0] * tile
            keys = torch.index_select(k_tiles, 0, index, out=k_space[:size].view(-1, tile))
            values = torch.index_select(v_tiles, 0, index, out=v_space[:size].view(-1, tile))
            outs.append(
                F.scaled_dot_product_attention(
                    folded[group.start : group.end],
                    keys.view(rows, n_kv, -1, hd),
                    values.view(rows, n_kv, -1, hd),
                    attn_mask=group.mask,
                )
            )
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(batch, 1, n_q * hd)

    def last_layer(self) -> AttentionPath:
        return self

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x


class PackedPrefill(NamedTuple):
    """Dynamic prefill: Q/K/V of a chunk's `N` real tokens `[N, heads, hd]`, attended on the
    chunk's padded `[B, S]` layout (`chunk`) after the cached prefix (`prefix_index`).

    `mask` `[B, 1, S, P + S]`, or None (no prefix: SDPA's own causal path, half the work).
    The final layer takes `PackedLastTokens`: no later layer needs the other tokens.
    """

    writes: CacheWrites
    chunk: PackedChunk
    prefix_index: torch.Tensor | None
    mask: torch.Tensor | None

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache
    ) -> torch.Tensor:
        chunk = self.chunk
        keys, values = chunk_keys(cache, chunk.pad(k), chunk.pad(v), self.prefix_index)
        out = F.scaled_dot_product_attention(
            chunk.pad(q).transpose(1, 2),
            keys,
            values,
            attn_mask=self.mask,
            is_causal=self.mask is None,
            enable_gqa=q.shape[-2] != k.shape[-2],
        )
        return chunk.take(out.transpose(1, 2).reshape(chunk.batch * chunk.seq, -1))

    def last_layer(self) -> AttentionPath:
        return PackedLastTokens(self.writes, self.chunk, self.prefix_index)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x


class PackedLastTokens(NamedTuple):
    """A packed prefill's final layer: every token's K/V is written, but only each row's last
    real token queries (`[B, n_q * hd]` out; the residual keeps those rows alone)."""

    writes: CacheWrites
    chunk: PackedChunk
    prefix_index: torch.Tensor | None

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache
    ) -> torch.Tensor:
        chunk = self.chunk
        keys, values = chunk_keys(cache, chunk.pad(k), chunk.pad(v), self.prefix_index)
        last_q = q.index_select(0, chunk.last).unsqueeze(2)  # [B, n_q, 1, hd]
        out = F.scaled_dot_product_attention(
            last_q, keys, values, attn_mask=chunk.last_mask, enable_gqa=q.shape[-2] != k.shape[-2]
        )
        return out.reshape(chunk.batch, -1)

    def last_layer(self) -> AttentionPath:
        return self

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, self.chunk.last)


def _masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Graph-safe attention of `q` `[B, S, n_q, hd]` over `[B, kv, L, hd]` keys under `mask`."""
    batch, seq, n_q, hd = q.shape
    n_kv = keys.shape[1]
    if seq == 1 and n_q != n_kv:
        # One query per row over the whole page-table width: fold each KV head's query group
        # into the query axis, so no backend repeats K/V per query head.
        out = F.scaled_dot_product_attention(
            q.reshape(batch, n_kv, n_q // n_kv, hd), keys, values, attn_mask=mask
        )
        return out.reshape(batch, 1, n_q * hd)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=n_q != n_kv
    )
    return _flat_heads(out)


class TableDecode(NamedTuple):
    """Graph-safe decode: every row attends over its whole page table (`gather_index`
    `[B, kv, W * block_size]`), masked to what it may see (`mask` `[B, 1, 1, keys]`)."""

    writes: CacheWrites
    gather_index: torch.Tensor
    mask: torch.Tensor

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache
    ) -> torch.Tensor:
        keys = gather_rows(cache[0], self.gather_index)
        values = gather_rows(cache[1], self.gather_index)
        return _masked_attention(q, keys, values, self.mask)

    def last_layer(self) -> AttentionPath:
        return self

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x


class TablePrefill(NamedTuple):
    """Graph-safe prefill: the whole page table as the cached prefix, then the chunk causally
    (`mask` `[B, 1, S, W * block_size + S]`)."""

    writes: CacheWrites
    prefix_index: torch.Tensor
    mask: torch.Tensor

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache
    ) -> torch.Tensor:
        keys, values = chunk_keys(cache, k, v, self.prefix_index)
        return _masked_attention(q, keys, values, self.mask)

    def last_layer(self) -> AttentionPath:
        return self

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x
