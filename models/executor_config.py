"""`ModelExecutorConfig`: the static policy of one lane, checked once at construction.

Trace mode, warmup coverage, paged KV geometry and lane shape; everything the components of
a lane are resolved from. It also derives the lane's page-table layout for a block count,
which the late-capacity path (`configure_paged_kv_cache`) recomputes when capacity shrinks.
"""

from __future__ import annotations

import attrs

from runtime.config import (
    PagedKVCacheConfig,
    PageTableLayout,
    RuntimePolicy,
    TraceConfig,
    WarmupConfig,
    require_positive_int,
)


def require_exact_type(name: str, value: object, kind: type) -> None:
    """TypeError naming `name` unless `value` is exactly a `kind` (subclasses refused)."""
    if type(value) is not kind:
        raise TypeError(f"{name} must be exactly {kind.__name__}, got {type(value).__name__}")


@attrs.frozen
class ModelExecutorConfig:
    """Static policy of one lane: trace mode, warmup coverage, KV geometry, lane shape."""

    trace: TraceConfig
    warmup: WarmupConfig
    paged_kv_cache: PagedKVCacheConfig
    device_sampling_enabled: bool
    max_batch_size: int
    max_prefill_chunk_size: int
    max_seq_len: int
    policy: RuntimePolicy
    max_prefill_batch_size: int = 8
    supports_batched_prefill: bool = True
    prefill_sequence_lengths: tuple[int, ...] | None = None

    def __attrs_post_init__(self) -> None:
        require_exact_type("trace", self.trace, TraceConfig)
        require_exact_type("warmup", self.warmup, WarmupConfig)
        require_exact_type("paged_kv_cache", self.paged_kv_cache, PagedKVCacheConfig)
        require_exact_type("policy", self.policy, RuntimePolicy)
        if not isinstance(self.device_sampling_enabled, bool):
            raise TypeError(
                f"device_sampling_enabled must be bool, got {self.device_sampling_enabled!r}"
            )
        require_positive_int("max_batch_size", self.max_batch_size)
        require_positive_int("max_prefill_chunk_size", self.max_prefill_chunk_size)
        require_positive_int("max_seq_len", self.max_seq_len)

    @property
    def traced(self) -> bool:
        """Whether any operation is traced (the lane captures before serving)."""
        return self.trace.enabled

    def default_prefill_lengths(self) -> tuple[int, ...]:
        """Every padded length a prompt can take, up to the chunk size (warmup coverage)."""
        if self.prefill_sequence_lengths is not None:
            return self.prefill_sequence_lengths
        limit = min(self.max_prefill_chunk_size, self.max_seq_len)
        lengths: list[int] = []
        n = 1
        while True:
            padded = self.policy.padded_prefill_length(n)
            if padded > limit:
                break
            lengths.append(padded)
            n = padded + 1
        return tuple(lengths) or (self.policy.padded_prefill_length(1),)

    def page_table_layout(self, num_blocks: int) -> PageTableLayout:
        """The lane's page-table layout over `num_blocks` physical KV blocks."""
        return PageTableLayout.resolve(
            block_size=self.paged_kv_cache.block_size,
            model_max_sequence_length=self.max_seq_len,
            physical_num_blocks=num_blocks,
            max_prefill_chunk_size=min(self.max_prefill_chunk_size, self.max_seq_len),
            alignment=self.policy.page_table_width_alignment,
        )
