"""What the runtime needs from a tensor model (the seed's "reusing the toolkit" contract).

A model family implements `PagedModel`. The paged KV manager reads `attention_metadata()`
and binds through `set_kv_cache`; prefill/decode staging calls `prefill` and `decode`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import attrs
import torch

from runtime.backends.base import DeviceTensor


@attrs.frozen
class PagedAttentionConfig:
    """Paged-attention geometry a layer was configured with."""

    block_size: int
    max_num_blocks: int


@attrs.frozen
class AttentionMetadata:
    """Per-layer facts the KV manager derives cache shapes from.

    The cache of one layer is K and V, each `[num_blocks, local_kv_heads, block_size, head_dim]`.
    `paged_attention_config` is None when the layer is not configured for paged attention.
    """

    kv_cache_dtype: torch.dtype
    n_kv_heads: int
    head_dim: int
    paged_attention_config: PagedAttentionConfig | None
    n_local_kv_heads: int | None = None


KVCache = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""One (K, V) pair per layer."""


@runtime_checkable
class PrefillModel(Protocol):
    """The part of the contract prefill uses: the vocabulary and `prefill` (see `PagedModel`)."""

    @property
    def vocab_size(self) -> int: ...

    def prefill(
        self,
        tokens: torch.Tensor,
        *,
        page_table: torch.Tensor,
        prompt_lens: torch.Tensor,
        chunk_start: torch.Tensor,
    ) -> torch.Tensor: ...


class DecodeModel(Protocol):
    """The part of the contract the decode body calls: `decode` (see `PagedModel`)."""

    def decode(
        self, tokens: torch.Tensor, *, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class PagedModel(PrefillModel, DecodeModel, Protocol):
    """The tensor-model contract.

    `prefill(tokens, *, page_table, prompt_lens, chunk_start)`:
      tokens `[B, S]` int64 (a padded chunk), page_table `[B, W]` int32 (`-1` = unmapped,
      never written), prompt_lens `[B]` int64 total prompt length per row (0 = padding row),
      chunk_start `[B]` int64 absolute position of `tokens[:, 0]` (block-aligned cached
      prefix plus relative chunk start). Writes K/V for the real tokens of the chunk and
      attends to positions `< chunk_start` from the cache plus the causal chunk. Returns
      `[B, vocab]` float logits of each row's last real token inside this chunk.
    `decode(tokens, *, positions, page_table)`:
      tokens `[B]` int64, positions `[B]` int64 (negative = inactive row: nothing written,
      output ignored), page_table `[B, W]` int32. Returns `[B, vocab]` float logits.
    """

    @property
    def n_layers(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    def attention_metadata(self) -> Sequence[AttentionMetadata]: ...

    def configure_paged_attention(self, *, block_size: int, max_num_blocks: int) -> None: ...

    def set_kv_cache(self, cache: Sequence[Sequence[DeviceTensor]] | None) -> None: ...

    def iter_executor_named_modules(self) -> Iterator[tuple[str, torch.nn.Module]]: ...
