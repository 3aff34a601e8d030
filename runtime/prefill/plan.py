"""The prefill planner: pure host logic that turns a checked prefill call into requests.

Prefix caching, batching into padded waves and chunking are decided once, here, so the
runtime that executes a plan never re-derives them. A plan depends only on each row's tokens,
prompt length, cached prefix and the allocated prefix of its page-table row: stale scheduler
tails beyond `ceil(prompt_len / block_size)` are never read.

Planning makes decisions only: request and chunk tensors are built from the caller's token
matrix and page table when first read (`plan_source`), and `chunk_tokens` (what staging
reads) copies a chunk's columns from them without building the request's tokens. So the
caller must not modify either in place until the plan has run: any build from them
afterwards raises; tensors already built keep their planned values.

`plan_batch` trusts its `PrefillBatch` (checked at the public boundary by `check_batch`);
`plan_prefill_requests` is the planner's own public call, which checks its arguments first.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TypeVar

import attrs
import torch

from runtime.config import RuntimePolicy
from runtime.prefill.batch import (
    IntVector,
    PlanLimits,
    PrefillBatch,
    PrefillRowArguments,
    check_batch,
)
from runtime.prefill.plan_source import PlanSource, TableGroup
from runtime.prefill.request import (
    DEFERRED,
    SDPA_SAFE_BLOCK,
    SKIP_BLOCK,
    PrefillChunk,
    PrefillRequest,
    planned,
    validated,
    whole_chunk,
)
from runtime.validation import positive_int

logger = logging.getLogger(__name__)

DISABLE_BATCHED_PREFILL_ENV = "DISABLE_BATCHED_PREFILL"
_TRUE_VALUES = frozenset({"1", "true", "yes"})

TTNN_POLICY = RuntimePolicy.ttnn()
"""The reference policy; the planner's default so the reference examples reproduce."""

_GroupDeferral = tuple[PlanSource, int, TableGroup]

_T = TypeVar("_T")


def batched_prefill_disabled_by_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `DISABLE_BATCHED_PREFILL` turns batching off; read on every call.

    Only `1`, `true` or `yes` (any case) disable batching. Every other non-empty value is
    ignored with a warning, because the reference runtime would have treated it (even `0`)
    as "disable".
    """
    value = (os.environ if environ is None else environ).get(DISABLE_BATCHED_PREFILL_ENV, "")
    if not value:
        return False
    if value.strip().lower() in _TRUE_VALUES:
        return True
    _warn_ignored_env_value(value)
    return False


@functools.lru_cache(maxsize=64)
def _warn_ignored_env_value(value: str) -> None:
    # Cached per value: the variable is read on every prefill call; one warning is enough.
    logger.warning(
        "%s=%r is not one of 1/true/yes (case-insensitive); batched prefill stays enabled",
        DISABLE_BATCHED_PREFILL_ENV,
        value,
    )


def prefill_chunk_size(
    padded_length: int, max_prefill_chunk_size: int, *, policy: RuntimePolicy = TTNN_POLICY
) -> int:
    """Tokens per invocation of a request whose padded length is `padded_length`.

    The padded length itself when it fits; otherwise the largest multiple of
    `policy.chunk_size_multiple` that is `<= max_prefill_chunk_size` and divides the padded
    length, so every chunk has the same (traceable) size.
    """
    if padded_length <= max_prefill_chunk_size:
        return padded_length
    multiple = policy.chunk_size_multiple
    if padded_length <= 0 or max_prefill_chunk_size <= 0:
        raise ValueError(
            f"prefill chunk lengths must be positive, got padded length {padded_length} and "
            f"max_prefill_chunk_size {max_prefill_chunk_size}"
        )
    if padded_length % multiple or max_prefill_chunk_size % multiple:
        raise ValueError(
            f"prefill chunk lengths must be multiples of {multiple} (policy "
            f"chunk_size_multiple), got padded length {padded_length} and "
            f"max_prefill_chunk_size {max_prefill_chunk_size}"
        )
    candidate = min(padded_length, max_prefill_chunk_size)
    while padded_length % candidate:
        candidate -= multiple
    return candidate


@attrs.frozen
class _WaveRule:
    """What decides whether one bucket of equal padded length becomes one batched wave."""

    limits: PlanLimits
    disabled: bool

    def smallest_supported(self, rows: int) -> int | None:
        sizes = [size for size in self.limits.policy.supported_prefill_batch_sizes if size >= rows]
        return min(sizes) if sizes else None

    def decide(self, rows: int, seq: int, any_cached: bool) -> tuple[int | None, str]:
        """The padded batch of a batched wave, or None and the reason it runs sequentially."""
        if self.limits.supports_batched_prefill is None:
            return self.legacy_wave_size(rows, seq, any_cached)
        return self.wave_size(rows, seq, any_cached)

    def wave_size(self, rows: int, seq: int, any_cached: bool) -> tuple[int | None, str]:
        """The current rule: any bucket of uncached rows that fits a supported batch."""
        limits = self.limits
        if rows <= 1:
            return None, "a single row"
        if not limits.supports_batched_prefill:
            return None, "batched prefill unsupported"
        if self.disabled:
            return None, "batched prefill disabled"
        if any_cached:
            return None, "rows with cached tokens"
        if seq > limits.max_prefill_chunk_size:
            return None, f"padded length {seq} > max_prefill_chunk_size"
        padded = self.smallest_supported(rows)
        if padded is None:
            return None, f"{rows} rows exceed every supported batch size"
        if padded > limits.max_prefill_batch_size or padded > limits.max_batch_size:
            return None, f"padded batch {padded} exceeds max_prefill_batch_size or lane capacity"
        if padded * seq >= limits.policy.max_batched_prefill_tokens:
            return None, f"{padded} x {seq} tokens reach the batched token limit"
        return padded, "batched"

    def legacy_wave_size(self, rows: int, seq: int, any_cached: bool) -> tuple[int | None, str]:
        """The reference's earlier rule: contiguous, uncached, first-bucket-only batching."""
        limits = self.limits
        if rows <= 1:
            return None, "a single row"
        if self.disabled:
            return None, "legacy batching disabled"
        if seq != limits.policy.prefill_padding_buckets[0] or any_cached:
            return None, "legacy batching needs the first padding bucket and no cached tokens"
        if seq > limits.max_prefill_chunk_size:
            return None, f"padded length {seq} > max_prefill_chunk_size"
        padded = self.smallest_supported(rows)
        if padded is None or padded > limits.max_batch_size:
            return None, f"no supported batch size >= {rows} fits lane capacity"
        if padded * seq >= limits.policy.max_batched_prefill_tokens:
            return None, f"{padded} x {seq} tokens reach the batched token limit"
        return padded, "batched"


def _batching_disabled(
    batch: PrefillBatch, limits: PlanLimits, buckets: int, uncached: Sequence[int]
) -> bool:
    """The switch, the environment, and (legacy rule only) anything but one contiguous bucket."""
    disabled = limits.disable_batched_prefill or batched_prefill_disabled_by_env()
    if limits.supports_batched_prefill is not None:
        return disabled
    return (
        disabled
        or buckets > 1
        or batch.slots != tuple(range(batch.batch_size))
        or any(row_uncached <= 0 for row_uncached in uncached)
    )


def _batched_request(
    batch: PrefillBatch,
    limits: PlanLimits,
    bucket: Sequence[int],
    shape: tuple[int, int],
    source: PlanSource,
) -> PrefillRequest:
    """One padded wave of `bucket` (uncached rows); `shape` is (padded rows, padded length)."""
    padded, seq = shape
    assert not any(batch.cached_tokens[row] for row in bucket), "waves are uncached"
    width = limits.canonical_width or -(-seq // limits.block_size)
    prompts, cached = batch.prompt_lens, batch.cached_tokens
    return planned(
        PrefillRequest,
        {
            "kind": "batched",
            "source_rows": tuple(bucket),
            "slots": tuple(batch.slots[row] for row in bucket),
            "prompt_lengths": tuple(prompts[row] for row in bucket),
            "cached_tokens": tuple(cached[row] for row in bucket),
            "last_token_indices": tuple(prompts[row] - 1 for row in bucket),
            "padded_sequence_length": seq,
            "padded_batch_size": padded,
            "chunks": (whole_chunk(seq),),
            "uses_chunked_prefill": False,
            DEFERRED: (source, width, None),
        },
    )


def _stock_padding(policy: RuntimePolicy) -> bool:
    """Whether `policy` pads with `RuntimePolicy.padded_prefill_length` itself (not overridden)."""
    return type(policy).padded_prefill_length is RuntimePolicy.padded_prefill_length


def _padded_lengths(policy: RuntimePolicy, uncached: Sequence[int]) -> list[int]:
    """`policy.padded_prefill_length(n)` for each `n > 0`, inlined for the stock policy."""
    if not _stock_padding(policy):
        return [policy.padded_prefill_length(n) if n > 0 else 0 for n in uncached]
    buckets = policy.prefill_padding_buckets
    padded: list[int] = []
    for n in uncached:
        if n <= 0:
            padded.append(0)
            continue
        for bucket in buckets:
            if n <= bucket:
                padded.append(bucket)
                break
        else:
            padded.append(1 << (n - 1).bit_length())
    return padded


def _planned_chunks(
    source: PlanSource, row: int, allocated: int, cached: int, uncached: int, size: int
) -> tuple[PrefillChunk, ...]:
    """A chunked row's `size`-token chunks up to the one holding its last token.

    Each chunk's table (its slice of the row's `allocated` prefix, then the skip block) is
    deferred to `source`.
    """
    deferred = (source, row, allocated)
    last = (uncached - 1) // size
    chunks: list[PrefillChunk] = []
    for index in range(last + 1):
        start = index * size
        values: dict[str, object] = {
            "token_slice": slice(start, start + size),
            "chunk_start_idx": cached + start,
            "chunk_size": size,
            "contains_last_token": index == last,
            DEFERRED: deferred,
        }
        chunks.append(planned(PrefillChunk, values))
    return tuple(chunks)


class _SharedPieces:
    """What single requests of one plan share: chunk sizes, whole chunks, table groups.

    An unchunked row's one chunk is immutable and equal for every row of its padded length;
    page tables of one width and filler are built together (see `TableGroup`), so the
    deferral `(source, width, group)` is shared by the group's requests.
    """

    def __init__(self, source: PlanSource, limits: PlanLimits, prompts: Sequence[int]) -> None:
        self._source = source
        self._limits = limits
        self._prompts = prompts
        self._chunk_sizes: dict[int, int] = {}
        self._whole: dict[int, tuple[PrefillChunk, ...]] = {}
        self._groups: tuple[dict[int, _GroupDeferral], dict[int, _GroupDeferral]] = ({}, {})

    def whole(self, padded: int) -> tuple[PrefillChunk, ...]:
        chunks = self._whole.get(padded)
        if chunks is None:
            chunks = self._whole[padded] = (whole_chunk(padded),)
        return chunks

    def chunk_size(self, padded: int) -> int:
        """The chunk size of the policy's padded length `padded` (before any fitting)."""
        size = self._chunk_sizes.get(padded)
        if size is None:
            limits = self._limits
            size = self._chunk_sizes[padded] = prefill_chunk_size(
                padded, limits.max_prefill_chunk_size, policy=limits.policy
            )
        return size

    def chunked(
        self, row: int, allocated: int, cached: int, uncached: int, size: int
    ) -> tuple[PrefillChunk, ...]:
        return _planned_chunks(self._source, row, allocated, cached, uncached, size)

    def table_deferral(self, row: int, width: int, chunked: bool) -> _GroupDeferral:
        """The deferral of `row`'s page table (its group records the row)."""
        deferred = self._groups[chunked].get(width)
        if deferred is None:
            fill = SDPA_SAFE_BLOCK if chunked else SKIP_BLOCK
            group = TableGroup(self._source, width, fill, self._prompts)
            deferred = self._groups[chunked][width] = (self._source, width, group)
        deferred[2].rows.append(row)
        return deferred


def _fitted_length(
    row: int, lengths: tuple[int, int, int], size: int, width: int, limits: PlanLimits
) -> int:
    """A padded length that passes the `width`-block canonical page table, made to fit.

    `lengths` is the row's (cached, uncached, padded) tokens and `size` its chunk size. The
    padding beyond a row's last chunk is never run, so under `pad_within_page_table` a chunked
    row is padded to the last whole chunk the table holds, keeping its chunk size (and so its
    program signatures); a row whose tokens need more chunks than that is refused, as is
    every such row under the reference policy.
    """
    cached, uncached, padded = lengths
    capacity = width * limits.block_size
    fitted = (capacity - cached) // size * size
    if limits.policy.pad_within_page_table and fitted >= uncached:
        return fitted
    raise ValueError(
        f"row {row}: cached {cached} + padded {padded} tokens exceeds the canonical "
        f"page-table capacity of {width} blocks x {limits.block_size} tokens = {capacity}"
    )


def _single_requests(
    batch: PrefillBatch,
    limits: PlanLimits,
    order: Sequence[int],
    uncached: Sequence[int],
    padded_of: Sequence[int],
    source: PlanSource,
) -> list[PrefillRequest]:
    """Single requests for `order` (one per row), their tensors deferred to `source`.

    Rows are planned in `order`, so the first failing row raises the same error as planning
    the rows one at a time would. A row's tokens are its uncached tokens padded with 0 to its
    padded length; its page table is its allocated prefix padded with the SDPA-safe block
    when chunked (else the skip block).
    """
    block, canonical = limits.block_size, limits.canonical_width
    prompt_lens, cached_of, slots = batch.prompt_lens, batch.cached_tokens, batch.slots
    shared = _SharedPieces(source, limits, prompt_lens)
    columns = int(batch.page_table.shape[1])
    requests: list[PrefillRequest] = []
    for row in order:
        prompt, cached, padded = prompt_lens[row], cached_of[row], padded_of[row]
        width = canonical or -(-(padded + cached) // block)
        chunked = padded > limits.max_prefill_chunk_size or cached > 0
        size = shared.chunk_size(padded) if chunked else padded
        if cached + padded > width * block:
            padded = _fitted_length(row, (cached, uncached[row], padded), size, width, limits)
        allocated = -(-prompt // block)
        assert allocated <= columns, "check_batch: the page table holds every planned row"
        chunks = (
            shared.chunked(row, allocated, cached, uncached[row], size)
            if chunked
            else shared.whole(padded)
        )
        requests.append(
            planned(
                PrefillRequest,
                {
                    "kind": "single",
                    "source_rows": (row,),
                    "slots": (slots[row],),
                    "prompt_lengths": (prompt,),
                    "cached_tokens": (cached,),
                    "last_token_indices": (prompt - 1,),
                    "padded_sequence_length": padded,
                    "padded_batch_size": 1,
                    "chunks": chunks,
                    "uses_chunked_prefill": chunked,
                    DEFERRED: shared.table_deferral(row, width, chunked),
                },
            )
        )
    return requests


def plan_batch(batch: PrefillBatch, limits: PlanLimits) -> tuple[PrefillRequest, ...]:
    """Plan one lane's checked call: batched waves first (bucket order), then single rows.

    Fully cached rows are dropped. Batching is also off when `DISABLE_BATCHED_PREFILL` is
    true-ish (see `batched_prefill_disabled_by_env`).
    """
    assert len(batch.cached_tokens) == len(batch.slots) == batch.batch_size, "one per row"
    source = PlanSource(batch.tokens, batch.page_table, limits.block_size)
    uncached = [
        prompt - cached
        for prompt, cached in zip(batch.prompt_lens, batch.cached_tokens, strict=True)
    ]
    padded_of = _padded_lengths(limits.policy, uncached)
    buckets: dict[int, list[int]] = {}
    for row, row_uncached in enumerate(uncached):
        if row_uncached > 0:
            buckets.setdefault(padded_of[row], []).append(row)
    rule = _WaveRule(limits, _batching_disabled(batch, limits, len(buckets), uncached))
    waves: list[PrefillRequest] = []
    sequential: list[int] = []
    for seq, bucket in buckets.items():
        any_cached = any(batch.cached_tokens[row] for row in bucket)
        padded, reason = rule.decide(len(bucket), seq, any_cached)
        if padded is None:
            if len(bucket) > 1:
                logger.debug(
                    "prefill bucket %d (%d rows) runs sequentially: %s", seq, len(bucket), reason
                )
            sequential.extend(bucket)
        else:
            waves.append(_batched_request(batch, limits, bucket, (padded, seq), source))
    singles = _single_requests(batch, limits, sorted(sequential), uncached, padded_of, source)
    if not _stock_padding(limits.policy):
        return tuple(validated(request) for request in (*waves, *singles))
    return (*waves, *singles)


def plan_prefill_requests(
    *,
    tokens: torch.Tensor,
    page_table: torch.Tensor,
    block_size: int,
    max_batch_size: int,
    max_prefill_chunk_size: int,
    prompt_lens: IntVector = None,
    start_pos: IntVector = None,
    empty_slots: IntVector = None,
    supports_batched_prefill: bool | None = None,
    disable_batched_prefill: bool = False,
    max_prefill_batch_size: int = 8,
    max_actual_page_table_width: int | None = None,
    canonical_page_table_width: int | None = None,
    policy: RuntimePolicy = TTNN_POLICY,
) -> tuple[PrefillRequest, ...]:
    """Check the planner's arguments, then `plan_batch` them (the planner's public call).

    `start_pos` is each row's cached prefix (block aligned). `supports_batched_prefill=None`
    selects the reference's legacy batching rule.
    """
    limits = PlanLimits.checked(
        block_size=block_size,
        max_batch_size=max_batch_size,
        max_prefill_chunk_size=max_prefill_chunk_size,
        max_prefill_batch_size=max_prefill_batch_size,
        supports_batched_prefill=supports_batched_prefill,
        disable_batched_prefill=disable_batched_prefill,
        max_actual_width=max_actual_page_table_width,
        canonical_width=canonical_page_table_width,
        policy=policy,
    )
    arguments = PrefillRowArguments(tokens=tokens, page_table=page_table)
    arguments["prompt_lens"], arguments["start_pos"] = prompt_lens, start_pos
    arguments["empty_slots"] = empty_slots
    batch = check_batch(arguments, limits)
    return plan_batch(batch, limits)


def restore_source_order(
    requests: Sequence[PrefillRequest],
    per_request_rows: Sequence[Sequence[_T]],
    batch_size: int,
) -> tuple[_T | None, ...]:
    """Place each request's per-active-row results at their source rows.

    `per_request_rows[i][j]` is the result of local row `j` of `requests[i]`. Rows that were
    not planned (fully cached) stay None; the caller decides their filler.
    """
    positive_int("batch_size", batch_size)
    if len(per_request_rows) != len(requests):
        raise ValueError(
            f"per_request_rows has {len(per_request_rows)} entries, there are "
            f"{len(requests)} requests"
        )
    restored: list[_T | None] = [None] * batch_size
    seen: set[int] = set()
    for request, results in zip(requests, per_request_rows, strict=True):
        if len(results) != request.active_batch_size:
            raise ValueError(
                f"request for source rows {request.source_rows} has "
                f"{request.active_batch_size} active rows, got {len(results)} results"
            )
        for source_row, result in zip(request.source_rows, results, strict=True):
            if not 0 <= source_row < batch_size or source_row in seen:
                raise ValueError(
                    f"source row {source_row} is outside [0, {batch_size}) or appears twice"
                )
            seen.add(source_row)
            restored[source_row] = result
    return tuple(restored)
