"""Static runtime policy: frozen values resolved once at construction.

Policy values that are device or model policy in the reference (padding buckets, chunk
multiple, supported prefill waves, lane capacity, page-table alignment) live in
`RuntimePolicy`, with the ttnn defaults and a torch default.
"""

from __future__ import annotations

import attrs

SUPPORTED_PREFILL_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
MAX_BATCHED_PREFILL_TOKENS: int = 128 * 1024
PAGE_TABLE_WIDTH_ALIGNMENT: int = 8


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_buckets(
    instance: RuntimePolicy, attribute: attrs.Attribute[object], value: object
) -> None:
    if not isinstance(value, tuple) or not value:
        raise TypeError(f"{attribute.name} must be a non-empty tuple, got {value!r}")
    for item in value:
        _positive_int(attribute.name, item)
    if list(value) != sorted(set(value)):
        raise ValueError(f"{attribute.name} must be strictly increasing, got {value!r}")


def _check_positive(
    instance: RuntimePolicy, attribute: attrs.Attribute[object], value: object
) -> None:
    _positive_int(attribute.name, value)


@attrs.frozen
class RuntimePolicy:
    """Device/model policy values the planner, decode staging and layout read.

    `padded_prefill_length(n)` is the smallest bucket `>= n`, else the next power of two.
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

    @classmethod
    def ttnn(cls) -> RuntimePolicy:
        """The reference (Tenstorrent) defaults: buckets 128/1024, chunks of 2048, 32 lanes."""
        return cls(
            prefill_padding_buckets=(128, 1024),
            chunk_size_multiple=2048,
            decode_lane_capacity_limit=32,
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
        _positive_int("n", n)
        for bucket in self.prefill_padding_buckets:
            if n <= bucket:
                return bucket
        return 1 << (n - 1).bit_length()
