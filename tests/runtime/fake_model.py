"""A tiny stand-in for a tensor model: just the KV-binding half of the model contract."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.model_contract import AttentionMetadata, PagedAttentionConfig


class FakeKVModel:
    """Declares per-layer attention metadata and records `set_kv_cache` calls."""

    def __init__(
        self,
        *,
        n_layers: int = 2,
        n_kv_heads: int = 2,
        head_dim: int = 4,
        block_size: int = 4,
        max_num_blocks: int = 16,
        dtype: torch.dtype = torch.float32,
        layer_dtypes: Sequence[torch.dtype] | None = None,
    ) -> None:
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtypes = list(layer_dtypes) if layer_dtypes is not None else [dtype] * n_layers
        self.paged: PagedAttentionConfig | None = PagedAttentionConfig(block_size, max_num_blocks)
        self.cache: Any = None
        self.bind_calls: list[Any] = []
        self.fail_bind = 0
        self.fail_unbind = 0

    def attention_metadata(self) -> list[AttentionMetadata]:
        return [
            AttentionMetadata(
                kv_cache_dtype=self.dtypes[i],
                n_kv_heads=self.n_kv_heads,
                head_dim=self.head_dim,
                paged_attention_config=self.paged,
            )
            for i in range(self.n_layers)
        ]

    def configure_paged_attention(self, *, block_size: int, max_num_blocks: int) -> None:
        self.paged = PagedAttentionConfig(block_size, max_num_blocks)

    def set_kv_cache(self, cache: Any) -> None:
        self.bind_calls.append(cache)
        if cache is not None and self.fail_bind:
            self.fail_bind -= 1
            raise RuntimeError("injected bind failure")
        if cache is None and self.fail_unbind:
            self.fail_unbind -= 1
            raise RuntimeError("injected unbind failure")
        self.cache = cache
