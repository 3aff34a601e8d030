"""Static runtime policy: frozen values resolved once at construction.

Policy values that are device or model policy in the reference (padding buckets, chunk
multiple, supported prefill waves, lane capacity, page-table alignment) live in
`RuntimePolicy`, with the ttnn defaults and a torch default.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import attrs
import torch

from runtime.validation import is_int, positive_int

SUPPORTED_PREFILL_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
MAX_BATCHED_PREFILL_TOKENS: int = 128 * 1024
PAGE_TABLE_WIDTH_ALIGNMENT: int = 8

_T = TypeVar("_T")
"""A validated field's declared type (validators check the value at run time)."""


def _check_buckets(instance: object, attribute: attrs.Attribute[_T], value: _T) -> None:
    if not isinstance(value, tuple) or not value:
        raise TypeError(f"{attribute.name} must be a non-empty tuple, got {value!r}")
    for item in value:
        positive_int(attribute.name, item)
    if list(value) != sorted(set(value)):
        raise ValueError(f"{attribute.name} must be strictly increasing, got {value!r}")


def _check_positive(instance: object, attribute: attrs.Attribute[_T], value: _T) -> None:
    positive_int(attribute.name, value)


@attrs.frozen
class RuntimePolicy:
    """Device/model policy values the planner, decode staging and layout read.

    `padded_prefill_length(n)` is the smallest bucket `>= n`, else the next power of two.
    `pad_within_page_table`: a chunked row whose padded length passes the canonical page
    table is padded to the last whole chunk that fits instead (its chunks never reach past
    the table); the reference (`ttnn()`) refuses such a row.
    """

    prefill_padding_buckets: tuple[int, ...] = attrs.field(validator=_check_buckets)
    chunk_size_multiple: int = attrs.field(validator=_check_positive)
    decode_lane_capacity_limit: int = attrs.field(validator=_check_positive)
    supported_prefill_batch_sizes: tuple[int, ...] = attrs.field(
        default=SUPPORTED_PREFILL_BATCH_SIZES, validator=_check_buckets
    )
    max_batched_prefill_tokens: int = attrs.field(
        default=MAX_BATCHED_PREFILL_TOKENS, validator=_check_positive
    )
    page_table_width_alignment: int = attrs.field(
        default=PAGE_TABLE_WIDTH_ALIGNMENT, validator=_check_positive
    )
    pad_within_page_table: bool = attrs.field(
        default=True, validator=attrs.validators.instance_of(bool)
    )

    @classmethod
    def ttnn(cls) -> RuntimePolicy:
        """The reference (Tenstorrent) defaults: buckets 128/1024, chunks of 2048, 32 lanes."""
        return cls(
            prefill_padding_buckets=(128, 1024),
            chunk_size_multiple=2048,
            decode_lane_capacity_limit=32,
            pad_within_page_table=False,
        )

    @classmethod
    def torch_default(
        cls, *, chunk_size_multiple: int = 32, decode_lane_capacity_limit: int = 256
    ) -> RuntimePolicy:
        """torch defaults: powers of two from 32; small chunk multiples for CPU and tests."""
        return cls(
            prefill_padding_buckets=(32,),
            chunk_size_multiple=chunk_size_multiple,
            decode_lane_capacity_limit=decode_lane_capacity_limit,
        )

    def padded_prefill_length(self, n: int) -> int:
        """Padded length for `n` uncached tokens (`n >= 1`)."""
        positive_int("n", n)
        for bucket in self.prefill_padding_buckets:
            if n <= bucket:
                return bucket
        return 1 << (n - 1).bit_length()


# --- Trace, warmup, paged-KV and page-table configuration (reference section 2.1) -------------

TraceMode = Literal["none", "decode_only", "all"]
TRACE_MODES: tuple[TraceMode, ...] = ("none", "decode_only", "all")


def require_positive_int(name: str, value: object) -> int:
    """Validate a positive int; bool is rejected because `True` silently means 1."""
    if not is_int(value):
        raise ValueError(
            f"{name} must be a positive integer (an int >= 1; bool is not accepted), "
            f"got {value!r} of type {type(value).__name__}"
        )
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer (an int >= 1), got {value!r}")
    return value


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _round_up(value: int, multiple: int) -> int:
    return _ceil_div(value, multiple) * multiple


def _check_trace_mode(instance: object, attribute: attrs.Attribute[_T], value: _T) -> None:
    if not isinstance(value, str) or value not in TRACE_MODES:
        allowed = ", ".join(repr(mode) for mode in TRACE_MODES)
        raise ValueError(f"Unsupported trace mode: {value!r}; allowed: {allowed}")


@attrs.frozen
class TraceConfig:
    """Which operations are served by replaying traces (`none`, `decode_only`, `all`)."""

    mode: TraceMode = attrs.field(default="decode_only", validator=_check_trace_mode)

    @classmethod
    def of(cls, mode: object) -> TraceConfig:
        """The config of a mode name from a flag or a settings file (refused unless known)."""
        for known in TRACE_MODES:
            if mode == known:
                return cls(mode=known)
        return cls(mode=mode)  # type: ignore[arg-type]  # the validator names what is allowed

    @property
    def enabled(self) -> bool:
        """Whether any operation is traced (the lane captures traces before serving)."""
        return self.mode != "none"

    @property
    def prefill_enabled(self) -> bool:
        """Prefill is traced only in mode `all`."""
        return self.mode == "all"

    @property
    def decode_enabled(self) -> bool:
        """Decode is traced in modes `decode_only` and `all`."""
        return self.mode in ("decode_only", "all")


def _check_int_tuple(name: str, value: object) -> None:
    if not isinstance(value, tuple):
        raise TypeError(
            f"{name} must be a tuple so WarmupConfig remains immutable, "
            f"got {type(value).__name__} {value!r}; pass e.g. tuple({name})"
        )
    if not value:
        raise ValueError(f"{name} must be a non-empty tuple of positive integers, got ()")
    for item in value:
        require_positive_int(f"{name} item", item)
    if len(set(value)) != len(value):
        duplicates = sorted({item for item in value if value.count(item) > 1})
        raise ValueError(f"{name} must contain unique values, got duplicates {duplicates}")


def _check_seq_lens(instance: object, attribute: attrs.Attribute[_T], value: _T) -> None:
    if value is not None:
        _check_int_tuple(attribute.name, value)


def _check_batch_sizes(instance: object, attribute: attrs.Attribute[_T], value: _T) -> None:
    _check_int_tuple(attribute.name, value)


def _check_bool(instance: object, attribute: attrs.Attribute[_T], value: _T) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be a bool (True or False), got {value!r}")


@attrs.frozen
class WarmupConfig:
    """What warmup compiles and captures.

    `prefill_seq_lens=None` means "use the model's supported lengths" (resolved elsewhere).
    """

    prefill_seq_lens: tuple[int, ...] | None = attrs.field(default=None, validator=_check_seq_lens)
    prefill_batch_sizes: tuple[int, ...] = attrs.field(
        default=SUPPORTED_PREFILL_BATCH_SIZES, validator=_check_batch_sizes
    )
    include_decode_top_k: bool = attrs.field(default=False, validator=_check_bool)


def _check_positive_field(instance: object, attribute: attrs.Attribute[_T], value: _T) -> None:
    require_positive_int(attribute.name, value)


def _check_dtype(instance: object, attribute: attrs.Attribute[_T], value: _T) -> None:
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{attribute.name} must be a torch.dtype (e.g. torch.bfloat16), got {value!r}"
        )


def _check_memory_config(instance: object, attribute: attrs.Attribute[_T], value: _T) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"{attribute.name} must be a non-empty string tag (e.g. 'dram'), got {value!r}"
        )


def _check_num_blocks(
    instance: PagedKVCacheConfig, attribute: attrs.Attribute[_T], value: _T
) -> None:
    if value is None:
        return
    blocks = require_positive_int(attribute.name, value)
    if blocks > instance.max_num_blocks:
        raise ValueError(
            f"num_blocks ({blocks}) exceeds max_num_blocks ({instance.max_num_blocks}); "
            f"allowed: 1..{instance.max_num_blocks}"
        )


@attrs.frozen
class PagedKVCacheConfig:
    """Paged KV-cache geometry; `num_blocks=None` means capacity is resolved later.

    `dtype` is the torch surrogate of the KV dtype; `memory_config` is an opaque tag that a
    backend interprets (``"dram"`` by default).
    """

    block_size: int = attrs.field(validator=_check_positive_field)
    max_num_blocks: int = attrs.field(validator=_check_positive_field)
    dtype: torch.dtype = attrs.field(validator=_check_dtype)
    memory_config: str = attrs.field(default="dram", validator=_check_memory_config)
    num_blocks: int | None = attrs.field(default=None, validator=_check_num_blocks)

    def is_resolved(self) -> bool:
        """Whether the physical block count is known."""
        return self.num_blocks is not None

    @property
    def max_capacity_tokens(self) -> int:
        """Tokens the construction-time ceiling allows."""
        return self.block_size * self.max_num_blocks

    @property
    def capacity_tokens(self) -> int | None:
        """Tokens the resolved geometry holds, or None while unresolved."""
        return None if self.num_blocks is None else self.block_size * self.num_blocks

    def with_num_blocks(self, num_blocks: int) -> PagedKVCacheConfig:
        """A resolved copy; capacity may shrink within `max_num_blocks`, never grow past it."""
        return attrs.evolve(self, num_blocks=num_blocks)


def _check_layout_positive(instance: object, attribute: attrs.Attribute[_T], value: _T) -> None:
    require_positive_int(attribute.name, value)


@attrs.frozen
class PageTableLayout:
    """Canonical page-table widths, fixed up front so no captured width can overflow.

    `decode_width` covers the raw capacity; `prefill_width` also covers the blocks a chunk may
    reach past it. Both are multiples of `alignment`.
    """

    block_size: int = attrs.field(validator=_check_layout_positive)
    raw_capacity_width: int = attrs.field(validator=_check_layout_positive)
    prefill_width: int = attrs.field(validator=_check_layout_positive)
    decode_width: int = attrs.field(validator=_check_layout_positive)
    alignment: int = attrs.field(
        default=PAGE_TABLE_WIDTH_ALIGNMENT, validator=_check_layout_positive, kw_only=True
    )
    num_blocks: int | None = attrs.field(default=None, kw_only=True, eq=False)
    """The KV pool a page-table entry may name (None: a hand-built layout, entries unchecked).
    Not part of equality: the widths are what programs and traces are built for."""

    def __attrs_post_init__(self) -> None:
        for name in ("prefill_width", "decode_width"):
            width: int = getattr(self, name)
            if width < self.raw_capacity_width:
                raise ValueError(
                    f"{name} ({width}) must be >= raw_capacity_width ({self.raw_capacity_width})"
                )
            if width % self.alignment:
                raise ValueError(
                    f"{name} ({width}) must be a multiple of {self.alignment}; "
                    f"the next allowed value is {_round_up(width, self.alignment)}"
                )

    @classmethod
    def resolve(
        cls,
        *,
        block_size: int,
        model_max_sequence_length: int,
        physical_num_blocks: int,
        max_prefill_chunk_size: int,
        alignment: int = PAGE_TABLE_WIDTH_ALIGNMENT,
    ) -> PageTableLayout:
        """Derive widths from capacity: raw = min(model blocks, physical blocks)."""
        require_positive_int("block_size", block_size)
        require_positive_int("model_max_sequence_length", model_max_sequence_length)
        require_positive_int("physical_num_blocks", physical_num_blocks)
        require_positive_int("max_prefill_chunk_size", max_prefill_chunk_size)
        require_positive_int("alignment", alignment)
        model_width = _ceil_div(model_max_sequence_length, block_size)
        raw = min(model_width, physical_num_blocks)
        padding_blocks = _ceil_div(max_prefill_chunk_size - 1, block_size)
        return cls(
            block_size=block_size,
            raw_capacity_width=raw,
            prefill_width=_round_up(raw + padding_blocks, alignment),
            decode_width=_round_up(raw, alignment),
            alignment=alignment,
            num_blocks=physical_num_blocks,
        )
