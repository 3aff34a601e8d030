"""The prefill planner: pure host logic that turns a prefill call into immutable requests.

Prefix caching, batching into padded waves and chunking are decided once, here, so the
runtime that executes a plan never re-derives them. A plan depends only on each row's tokens,
prompt length, cached prefix and the allocated prefix of its page-table row: stale scheduler
tails beyond `ceil(prompt_len / block_size)` are never read.

Planning makes decisions only: request and chunk tensors are built from the caller's token
matrix and page table when first read (`plan_source`), and `chunk_tokens` (what staging
reads) copies a chunk's columns from them without building the request's tokens. So the
caller must not modify either in place until the plan has run: any build from them
afterwards raises; tensors already built keep their planned values.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Literal, TypeGuard, TypeVar

import attrs
import torch

from runtime.config import RuntimePolicy
from runtime.prefill.plan_source import PlanSource, TableGroup, install_deferred_fields

logger = logging.getLogger(__name__)

PrefillKind = Literal["single", "batched"]
PREFILL_KINDS: tuple[PrefillKind, ...] = ("single", "batched")

DISABLE_BATCHED_PREFILL_ENV = "DISABLE_BATCHED_PREFILL"
_TRUE_VALUES = frozenset({"1", "true", "yes"})

TTNN_POLICY = RuntimePolicy.ttnn()
"""The reference policy; the planner's default so the reference examples reproduce."""

_SKIP_BLOCK = -1
"""Regular page-table filler: the KV write skips these entries (padding rows, tails)."""
_SDPA_SAFE_BLOCK = 0
"""Chunked full-table filler: attention reads the whole table, so entries must be valid."""

_DEFERRED = "_deferred"
"""Instance-dict key of what a planner-built request or chunk builds its tensors from:
`(PlanSource, page_table_width, TableGroup | None)` on a request (single requests of one
width and filler share a page-table group), `(PlanSource, row, allocated blocks)` on a chunk.
Absent on values constructed (and validated) through the public constructors."""

_GroupDeferral = tuple[PlanSource, int, TableGroup]

_T = TypeVar("_T")
_C = TypeVar("_C")


def batched_prefill_disabled_by_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `DISABLE_BATCHED_PREFILL` turns batching off; read on every call.

    Only `1`, `true` or `yes` (any case) disable batching. Any other non-empty value is
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


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _tensors_equal(left: torch.Tensor, right: torch.Tensor) -> bool:
    return (
        left.shape == right.shape
        and left.dtype == right.dtype
        and left.device == right.device
        and bool(torch.equal(left, right))
    )


def _optional_tensors_equal(left: torch.Tensor | None, right: torch.Tensor | None) -> bool:
    if left is None or right is None:
        return left is right
    return _tensors_equal(left, right)


_TENSOR_EQ = attrs.cmp_using(eq=_tensors_equal)
_OPTIONAL_TENSOR_EQ = attrs.cmp_using(eq=_optional_tensors_equal)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_positive_int(name: str, value: object) -> int:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be bool, got {type(value).__name__} {value!r}")
    return value


@attrs.frozen(slots=False)
class PrefillChunk:
    """One model invocation of a request: a token slice at an absolute cache position.

    `token_slice` indexes the request's (uncached, padded) token tensor; `chunk_start_idx` is
    the absolute position of its first token (cached prefix included). The planner leaves a
    chunked row's `chunk_page_table` to be built on first read (the runtime only reads its
    width); instances are dict-based so it can do that and construct them cheaply.
    """

    token_slice: slice = attrs.field(hash=False)
    chunk_start_idx: int
    chunk_size: int
    chunk_page_table: torch.Tensor | None = attrs.field(eq=_OPTIONAL_TENSOR_EQ, hash=False)
    contains_last_token: bool

    def __attrs_post_init__(self) -> None:
        piece = self.token_slice
        if not isinstance(piece, slice):
            raise ValueError(f"token_slice must be a slice, got {piece!r}")
        if piece.step not in (None, 1):
            raise ValueError(f"token_slice step must be None or 1, got {piece!r}")
        if not _is_int(piece.start) or not _is_int(piece.stop):
            raise ValueError(f"token_slice start and stop must be explicit ints, got {piece!r}")
        if not 0 <= piece.start < piece.stop:
            raise ValueError(f"token_slice must satisfy 0 <= start < stop, got {piece!r}")
        if not _is_int(self.chunk_start_idx) or self.chunk_start_idx < 0:
            raise ValueError(f"chunk_start_idx must be an int >= 0, got {self.chunk_start_idx!r}")
        _require_positive_int("chunk_size", self.chunk_size)
        if piece.stop - piece.start != self.chunk_size:
            raise ValueError(
                f"token_slice {piece!r} covers {piece.stop - piece.start} tokens, "
                f"chunk_size is {self.chunk_size}"
            )
        table = self.chunk_page_table
        if table is not None and (not isinstance(table, torch.Tensor) or table.dim() != 2):
            raise ValueError(
                f"chunk_page_table must be None or a rank-2 torch tensor, got {table!r:.80}"
            )
        _require_bool("contains_last_token", self.contains_last_token)

    @property
    def chunk_page_table_width(self) -> int | None:
        deferred = self.__dict__.get(_DEFERRED)
        if deferred is not None:
            return _ceil_div(self.chunk_size, deferred[0].block_size)
        return None if self.chunk_page_table is None else int(self.chunk_page_table.shape[1])


def _build_chunk_page_table(chunk: PrefillChunk) -> torch.Tensor:
    """A planned chunk's table: the chunk's slice of the allocated prefix, then the skip block."""
    source, row, allocated = chunk.__dict__[_DEFERRED]
    block = source.block_size
    width = _ceil_div(chunk.chunk_size, block)
    start = chunk.chunk_start_idx // block
    mapped = min(width, max(0, allocated - start))
    table: torch.Tensor = source.table_rows((row,), (start,), (mapped,), (1, width), _SKIP_BLOCK)
    return table


install_deferred_fields(PrefillChunk, chunk_page_table=_build_chunk_page_table)


def _int_tuple(
    instance: object, attribute: attrs.Attribute[tuple[int, ...]], value: object
) -> None:
    if not isinstance(value, tuple) or not value or not all(_is_int(v) for v in value):
        raise ValueError(f"{attribute.name} must be a non-empty tuple of ints, got {value!r}")


@attrs.frozen(slots=False)
class PrefillRequest:
    """One planned invocation sequence: a single row or one padded batched wave.

    Device tensors use padded geometry; `source_rows`, `slots` and the per-row tuples hold
    the logical (active) rows, in the wave's local row order. The planner leaves `tokens` and
    `page_table` to be built on first read; instances are dict-based so it can do that and
    construct them cheaply.
    """

    kind: PrefillKind
    source_rows: tuple[int, ...] = attrs.field(validator=_int_tuple)
    slots: tuple[int, ...] = attrs.field(validator=_int_tuple)
    tokens: torch.Tensor = attrs.field(eq=_TENSOR_EQ, hash=False)
    page_table: torch.Tensor = attrs.field(eq=_TENSOR_EQ, hash=False)
    prompt_lengths: tuple[int, ...] = attrs.field(validator=_int_tuple)
    cached_tokens: tuple[int, ...] = attrs.field(validator=_int_tuple)
    last_token_indices: tuple[int, ...] = attrs.field(validator=_int_tuple)
    padded_sequence_length: int
    padded_batch_size: int
    chunks: tuple[PrefillChunk, ...]
    uses_chunked_prefill: bool

    def __attrs_post_init__(self) -> None:
        if self.kind not in PREFILL_KINDS:
            raise ValueError(f"kind must be one of {PREFILL_KINDS}, got {self.kind!r}")
        seq = _require_positive_int("padded_sequence_length", self.padded_sequence_length)
        batch = _require_positive_int("padded_batch_size", self.padded_batch_size)
        self._check_rows(batch)
        self._check_row_positions(seq)
        for name, tensor in (("tokens", self.tokens), ("page_table", self.page_table)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
                raise ValueError(f"{name} must be a rank-2 torch tensor, got {tensor!r:.80}")
        if tuple(self.tokens.shape) != (batch, seq):
            raise ValueError(
                f"tokens shape {tuple(self.tokens.shape)} must be (padded_batch_size, "
                f"padded_sequence_length) = {(batch, seq)}"
            )
        if self.page_table.shape[0] != batch:
            raise ValueError(
                f"page_table has {self.page_table.shape[0]} rows, padded_batch_size is {batch}"
            )
        self._check_chunks(seq, batch)

    def _check_rows(self, batch: int) -> None:
        rows = len(self.source_rows)
        per_row = {
            "slots": self.slots,
            "prompt_lengths": self.prompt_lengths,
            "cached_tokens": self.cached_tokens,
            "last_token_indices": self.last_token_indices,
        }
        for name, values in per_row.items():
            if len(values) != rows:
                raise ValueError(f"{name} has {len(values)} entries, source_rows has {rows}")
        if self.kind == "single" and (rows != 1 or batch != 1):
            raise ValueError(
                f"a single request has exactly one row and padded_batch_size 1, got {rows} "
                f"rows and padded_batch_size {batch}"
            )
        if rows > batch:
            raise ValueError(f"{rows} active rows exceed padded_batch_size {batch}")
        if len(set(self.source_rows)) != rows or len(set(self.slots)) != rows:
            raise ValueError(
                f"source_rows {self.source_rows} and slots {self.slots} must be unique"
            )

    def _check_row_positions(self, seq: int) -> None:
        for prompt, cached, last in zip(
            self.prompt_lengths, self.cached_tokens, self.last_token_indices, strict=True
        ):
            if not 0 <= cached <= last < prompt or last - cached >= seq:
                raise ValueError(
                    f"row positions must satisfy 0 <= cached <= last < prompt_length and "
                    f"last - cached < padded_sequence_length ({seq}); got cached {cached}, "
                    f"last {last}, prompt_length {prompt}"
                )

    def _check_chunks(self, seq: int, batch: int) -> None:
        chunks = self.chunks
        if not isinstance(chunks, tuple) or not chunks:
            raise ValueError(f"chunks must be a non-empty tuple of PrefillChunk, got {chunks!r}")
        if not all(isinstance(chunk, PrefillChunk) for chunk in chunks):
            raise ValueError(f"chunks must contain only PrefillChunk values, got {chunks!r}")
        last_flags = [chunk.contains_last_token for chunk in chunks]
        if last_flags.count(True) != 1 or not last_flags[-1]:
            raise ValueError(
                f"exactly one chunk, the final one, must contain the last token; "
                f"contains_last_token flags are {last_flags}"
            )
        for chunk in chunks:
            if chunk.token_slice.stop > seq:
                raise ValueError(
                    f"chunk {chunk.token_slice!r} extends beyond padded_sequence_length {seq}"
                )
            table = chunk.chunk_page_table
            if table is not None and table.shape[0] != batch:
                raise ValueError(
                    f"chunk page table has {table.shape[0]} rows, padded_batch_size is {batch}"
                )
        has_tables = any(chunk.chunk_page_table is not None for chunk in chunks)
        if _require_bool("uses_chunked_prefill", self.uses_chunked_prefill) != has_tables:
            raise ValueError(
                f"uses_chunked_prefill={self.uses_chunked_prefill} must equal whether any "
                f"chunk has a chunk page table ({has_tables})"
            )

    @property
    def page_table_width(self) -> int:
        deferred = self.__dict__.get(_DEFERRED)
        if deferred is not None:
            width: int = deferred[1]
            return width
        return int(self.page_table.shape[1])

    @property
    def active_batch_size(self) -> int:
        return len(self.source_rows)

    @property
    def first_chunk(self) -> PrefillChunk:
        return self.chunks[0]

    @property
    def final_chunk(self) -> PrefillChunk:
        return self.chunks[-1]


def _build_tokens(request: PrefillRequest) -> torch.Tensor:
    """Each row's uncached tokens, zero padded to the padded geometry (padding rows zero)."""
    source = request.__dict__[_DEFERRED][0]
    tokens: torch.Tensor = source.token_rows(
        request.source_rows,
        request.cached_tokens,
        [
            prompt - cached
            for prompt, cached in zip(request.prompt_lengths, request.cached_tokens, strict=True)
        ],
        (request.padded_batch_size, request.padded_sequence_length),
    )
    return tokens


def _build_page_table(request: PrefillRequest) -> torch.Tensor:
    """Each row's allocated prefix, then 0 (chunked) or the skip block; padding rows skip."""
    source, width, group = request.__dict__[_DEFERRED]
    if group is not None:
        grouped: torch.Tensor = group.table(request.source_rows[0])
        return grouped
    block = source.block_size
    table: torch.Tensor = source.table_rows(
        request.source_rows,
        [0] * len(request.source_rows),
        [_ceil_div(prompt, block) for prompt in request.prompt_lengths],
        (request.padded_batch_size, width),
        _SDPA_SAFE_BLOCK if request.uses_chunked_prefill else _SKIP_BLOCK,
    )
    return table


install_deferred_fields(PrefillRequest, tokens=_build_tokens, page_table=_build_page_table)


def chunk_tokens(request: PrefillRequest, chunk: PrefillChunk) -> torch.Tensor:
    """`request.tokens[:, chunk.token_slice]` as a contiguous int64 tensor.

    A planner-built request whose tokens were not read yet gets a new tensor holding only the
    chunk's columns, copied for every row of the wave at once straight from the caller's
    token matrix (the padded request tensor is not built). Both caller tensors are checked
    first: inputs built from the source after an in-place change raise.
    """
    values = request.__dict__
    deferred = values.get(_DEFERRED)
    if deferred is None or "tokens" in values:
        return request.tokens[:, chunk.token_slice].to(torch.int64).contiguous()
    source: PlanSource = deferred[0]
    first, stop = chunk.token_slice.start, chunk.token_slice.stop
    cached = request.cached_tokens
    if request.padded_batch_size == 1:
        start = cached[0]
        length = min(stop, request.prompt_lengths[0] - start) - first
        return source.token_row(request.source_rows[0], start + first, length, stop - first)
    source.check_unchanged()
    tokens: torch.Tensor = source.token_rows(
        request.source_rows,
        [start + first for start in cached],
        [
            max(0, min(stop, prompt - start) - first)
            for prompt, start in zip(request.prompt_lengths, cached, strict=True)
        ],
        (request.padded_batch_size, stop - first),
    )
    return tokens


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


@attrs.frozen(eq=False)
class _Rows:
    """Validated per-row inputs of one planning call."""

    tokens: torch.Tensor
    page_table: torch.Tensor
    prompt_lens: tuple[int, ...]
    cached: tuple[int, ...]
    slots: tuple[int, ...]
    block_size: int
    max_prefill_chunk_size: int
    max_actual_width: int | None
    canonical_width: int | None
    policy: RuntimePolicy

    def allocated_width(self, row: int) -> int:
        """Page-table columns the row's prompt occupies; validated against the caller."""
        needed = _ceil_div(self.prompt_lens[row], self.block_size)
        if self.max_actual_width is not None and needed > self.max_actual_width:
            raise ValueError(
                f"row {row} with prompt length {self.prompt_lens[row]} needs {needed} blocks "
                f"of {self.block_size} tokens, which exceeds the configured paged-KV capacity "
                f"of {self.max_actual_width} blocks (max_actual_page_table_width)"
            )
        if self.page_table.shape[1] < needed:
            raise ValueError(
                f"page table is too narrow for row {row}: prompt length "
                f"{self.prompt_lens[row]} needs {needed} blocks of {self.block_size} tokens, "
                f"the page table has {self.page_table.shape[1]} columns"
            )
        return needed


def _vector(name: str, value: object, batch: int, default: tuple[int, ...]) -> tuple[int, ...]:
    if value is None:
        return default
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex():
            raise ValueError(
                f"{name} must be a rank-1 integer tensor, got shape {tuple(value.shape)} "
                f"dtype {value.dtype}"
            )
        # An integer tensor lists Python ints already; only bool elements need converting.
        listed: list[int] = value.tolist()
        ints = [int(v) for v in listed] if value.dtype == torch.bool else listed
    elif isinstance(value, Sequence) and not isinstance(value, str):
        items = tuple(value)
        ints = [item for item in items if _is_int(item)]
        if len(ints) != len(items):
            raise ValueError(f"{name} must contain only ints, got {items!r}")
    else:
        raise ValueError(f"{name} must be a rank-1 tensor or a sequence of ints, got {value!r}")
    if len(ints) != batch:
        raise ValueError(f"{name} has {len(ints)} entries, the batch has {batch} rows")
    return tuple(ints)


def _check_matrix(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        raise ValueError(f"{name} must be a rank-2 torch tensor, got {value!r:.80}")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {value.dtype}")
    return value


def _validate(
    *,
    tokens: object,
    page_table: object,
    prompt_lens: object,
    start_pos: object,
    empty_slots: object,
    block_size: int,
    max_batch_size: int,
    max_prefill_chunk_size: int,
    max_actual_page_table_width: int | None,
    canonical_page_table_width: int | None,
    policy: RuntimePolicy,
) -> _Rows:
    token_matrix = _check_matrix("tokens", tokens)
    table = _check_matrix("page_table", page_table)
    batch, width = int(token_matrix.shape[0]), int(token_matrix.shape[1])
    if table.shape[0] != batch:
        raise ValueError(
            f"tokens and page_table must have the same batch, got {batch} and {table.shape[0]}"
        )
    if batch == 0:
        raise ValueError("tokens must have at least one row, got batch 0")
    prompts = _vector("prompt_lens", prompt_lens, batch, (width,) * batch)
    cached = _vector("start_pos", start_pos, batch, (0,) * batch)
    slots = _vector("empty_slots", empty_slots, batch, tuple(range(batch)))
    if len(set(slots)) != batch or not all(0 <= slot < max_batch_size for slot in slots):
        raise ValueError(
            f"empty_slots must contain unique lane-local slots in [0, {max_batch_size}) "
            f"(max_batch_size), got {slots}"
        )
    if (max_actual_page_table_width is None) != (canonical_page_table_width is None):
        raise ValueError(
            f"max_actual_page_table_width and canonical_page_table_width must be given "
            f"together, got {max_actual_page_table_width!r} and {canonical_page_table_width!r}"
        )
    if max_actual_page_table_width is not None and canonical_page_table_width is not None:
        actual = _require_positive_int("max_actual_page_table_width", max_actual_page_table_width)
        canonical = _require_positive_int("canonical_page_table_width", canonical_page_table_width)
        align = policy.page_table_width_alignment
        if canonical < actual or canonical % align:
            raise ValueError(
                f"canonical_page_table_width must be >= max_actual_page_table_width "
                f"({actual}) and a multiple of {align} (policy page_table_width_alignment), "
                f"got {canonical}"
            )
    for row in range(batch):
        if not 0 <= cached[row] <= prompts[row] <= width:
            raise ValueError(
                f"row {row} must satisfy 0 <= start_pos <= prompt_len <= token width {width}, "
                f"got start_pos {cached[row]} and prompt_len {prompts[row]}"
            )
        if cached[row] % block_size:
            raise ValueError(
                f"cached prefill start for row {row} must be block aligned: start_pos "
                f"{cached[row]} is not a multiple of block_size {block_size}"
            )
    return _Rows(
        tokens=token_matrix,
        page_table=table,
        prompt_lens=prompts,
        cached=cached,
        slots=slots,
        block_size=block_size,
        max_prefill_chunk_size=max_prefill_chunk_size,
        max_actual_width=max_actual_page_table_width,
        canonical_width=canonical_page_table_width,
        policy=policy,
    )


@attrs.frozen
class _WaveLimits:
    """What decides whether one bucket of equal padded length becomes one batched wave."""

    supports_batched_prefill: bool | None
    disabled: bool
    max_batch_size: int
    max_prefill_batch_size: int
    max_prefill_chunk_size: int
    policy: RuntimePolicy

    def smallest_supported(self, rows: int) -> int | None:
        sizes = [size for size in self.policy.supported_prefill_batch_sizes if size >= rows]
        return min(sizes) if sizes else None

    def wave_size(self, rows: int, seq: int, any_cached: bool) -> tuple[int | None, str]:
        """The padded batch of a batched wave, or None and the reason it runs sequentially."""
        if rows <= 1:
            return None, "a single row"
        if not self.supports_batched_prefill:
            return None, "batched prefill unsupported"
        if self.disabled:
            return None, "batched prefill disabled"
        if any_cached:
            return None, "rows with cached tokens"
        if seq > self.max_prefill_chunk_size:
            return None, f"padded length {seq} > max_prefill_chunk_size"
        padded = self.smallest_supported(rows)
        if padded is None:
            return None, f"{rows} rows exceed every supported batch size"
        if padded > self.max_prefill_batch_size or padded > self.max_batch_size:
            return None, f"padded batch {padded} exceeds max_prefill_batch_size or lane capacity"
        if padded * seq >= self.policy.max_batched_prefill_tokens:
            return None, f"{padded} x {seq} tokens reach the batched token limit"
        return padded, "batched"

    def legacy_wave_size(self, rows: int, seq: int, any_cached: bool) -> tuple[int | None, str]:
        """The reference's earlier rule: contiguous, uncached, first-bucket-only batching."""
        if rows <= 1:
            return None, "a single row"
        if self.disabled:
            return None, "legacy batching disabled"
        if seq != self.policy.prefill_padding_buckets[0] or any_cached:
            return None, "legacy batching needs the first padding bucket and no cached tokens"
        if seq > self.max_prefill_chunk_size:
            return None, f"padded length {seq} > max_prefill_chunk_size"
        padded = self.smallest_supported(rows)
        if padded is None or padded > self.max_batch_size:
            return None, f"no supported batch size >= {rows} fits lane capacity"
        if padded * seq >= self.policy.max_batched_prefill_tokens:
            return None, f"{padded} x {seq} tokens reach the batched token limit"
        return padded, "batched"


def _planned(cls: type[_C], values: dict[str, object]) -> _C:
    """An instance of `cls` holding `values` as they are: values the planner derived itself.

    Skips the constructor's validation (`_validated` re-runs it when a policy override
    supplied the padding) and may leave deferred fields out (see `_DEFERRED`).
    """
    instance = object.__new__(cls)
    object.__setattr__(instance, "__dict__", values)
    return instance


def _validated(request: PrefillRequest) -> PrefillRequest:
    """`request` rebuilt through the public constructors, which validate every value."""
    chunks = tuple(attrs.evolve(chunk) for chunk in request.chunks)
    return attrs.evolve(request, chunks=chunks)


def _whole_chunk(padded: int) -> PrefillChunk:
    """The one chunk of an unchunked request: all `padded` tokens from position 0."""
    return _planned(
        PrefillChunk,
        {
            "token_slice": slice(0, padded),
            "chunk_start_idx": 0,
            "chunk_size": padded,
            "chunk_page_table": None,
            "contains_last_token": True,
        },
    )


def _batched_request(
    rows: _Rows, bucket: Sequence[int], seq: int, padded: int, source: PlanSource
) -> PrefillRequest:
    """One padded wave of `bucket` (uncached rows of padded length `seq`); tensors deferred."""
    for row in bucket:
        rows.allocated_width(row)  # raises the caller-facing error
    width = rows.canonical_width or _ceil_div(seq, rows.block_size)
    return _planned(
        PrefillRequest,
        {
            "kind": "batched",
            "source_rows": tuple(bucket),
            "slots": tuple(rows.slots[row] for row in bucket),
            "prompt_lengths": tuple(rows.prompt_lens[row] for row in bucket),
            "cached_tokens": tuple(rows.cached[row] for row in bucket),
            "last_token_indices": tuple(rows.prompt_lens[row] - 1 for row in bucket),
            "padded_sequence_length": seq,
            "padded_batch_size": padded,
            "chunks": (_whole_chunk(seq),),
            "uses_chunked_prefill": False,
            _DEFERRED: (source, width, None),
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
    source: PlanSource, row: int, allocated: int, cached: int, uncached: int, padded: int, size: int
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
            _DEFERRED: deferred,
        }
        chunks.append(_planned(PrefillChunk, values))
    return tuple(chunks)


def _single_requests(
    rows: _Rows,
    order: Sequence[int],
    uncached: Sequence[int],
    padded_of: Sequence[int],
    source: PlanSource,
) -> list[PrefillRequest]:
    """Single requests for `order` (one per row), their tensors deferred to `source`.

    Validation happens row by row in `order`, so the first failing row raises the same error
    as planning the rows one at a time would. A row's tokens are its uncached tokens padded
    with 0 to its padded length; its page table is its allocated prefix padded with the
    SDPA-safe block when chunked (else the skip block).
    """
    block, max_chunk = rows.block_size, rows.max_prefill_chunk_size
    canonical, max_actual = rows.canonical_width, rows.max_actual_width
    prompt_lens, cached_of, slots = rows.prompt_lens, rows.cached, rows.slots
    table_columns = int(rows.page_table.shape[1])
    chunk_sizes: dict[int, int] = {}
    # Immutable and equal for every unchunked row of one padded length: shared.
    whole_chunks: dict[int, tuple[PrefillChunk, ...]] = {}
    # Page tables of one width and filler are built together (see `TableGroup`); the
    # deferral `(source, width, group)` is shared by the group's requests.
    deferrals: tuple[dict[int, _GroupDeferral], dict[int, _GroupDeferral]] = ({}, {})
    requests: list[PrefillRequest] = []
    for row in order:
        prompt, cached, padded = prompt_lens[row], cached_of[row], padded_of[row]
        allocated = -(-prompt // block)
        if (max_actual is not None and allocated > max_actual) or table_columns < allocated:
            rows.allocated_width(row)  # raises the caller-facing error
        width = canonical or -(-(padded + cached) // block)
        if cached + padded > width * block:
            raise ValueError(
                f"row {row}: cached {cached} + padded {padded} tokens exceeds the canonical "
                f"page-table capacity of {width} blocks x {block} tokens = {width * block}"
            )
        chunked = padded > max_chunk or cached > 0
        chunks: tuple[PrefillChunk, ...] | None
        if chunked:
            size = chunk_sizes.get(padded)
            if size is None:
                size = chunk_sizes[padded] = prefill_chunk_size(
                    padded, max_chunk, policy=rows.policy
                )
            chunks = _planned_chunks(source, row, allocated, cached, uncached[row], padded, size)
        else:
            chunks = whole_chunks.get(padded)
            if chunks is None:
                chunks = whole_chunks[padded] = (_whole_chunk(padded),)
        deferred = deferrals[chunked].get(width)
        if deferred is None:
            fill = _SDPA_SAFE_BLOCK if chunked else _SKIP_BLOCK
            group = TableGroup(source, width, fill, prompt_lens)
            deferred = deferrals[chunked][width] = (source, width, group)
        deferred[2].rows.append(row)
        requests.append(
            _planned(
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
                    _DEFERRED: deferred,
                },
            )
        )
    return requests


def plan_prefill_requests(
    *,
    tokens: torch.Tensor,
    page_table: torch.Tensor,
    block_size: int,
    max_batch_size: int,
    max_prefill_chunk_size: int,
    prompt_lens: torch.Tensor | Sequence[int] | None = None,
    start_pos: torch.Tensor | Sequence[int] | None = None,
    empty_slots: torch.Tensor | Sequence[int] | None = None,
    supports_batched_prefill: bool | None = None,
    disable_batched_prefill: bool = False,
    max_prefill_batch_size: int = 8,
    max_actual_page_table_width: int | None = None,
    canonical_page_table_width: int | None = None,
    policy: RuntimePolicy = TTNN_POLICY,
) -> tuple[PrefillRequest, ...]:
    """Plan one lane's prefill call: batched waves first (bucket order), then single rows.

    `start_pos` is each row's cached prefix (block aligned); fully cached rows are dropped.
    `supports_batched_prefill=None` selects the reference's legacy batching rule. Batching is
    also off when `DISABLE_BATCHED_PREFILL` is true-ish (see
    `batched_prefill_disabled_by_env`).
    """
    if not isinstance(policy, RuntimePolicy):
        raise TypeError(f"policy must be a RuntimePolicy, got {type(policy).__name__}")
    for name, value in (
        ("block_size", block_size),
        ("max_batch_size", max_batch_size),
        ("max_prefill_chunk_size", max_prefill_chunk_size),
        ("max_prefill_batch_size", max_prefill_batch_size),
    ):
        _require_positive_int(name, value)
    if supports_batched_prefill is not None:
        _require_bool("supports_batched_prefill", supports_batched_prefill)
    _require_bool("disable_batched_prefill", disable_batched_prefill)
    rows = _validate(
        tokens=tokens,
        page_table=page_table,
        prompt_lens=prompt_lens,
        start_pos=start_pos,
        empty_slots=empty_slots,
        block_size=block_size,
        max_batch_size=max_batch_size,
        max_prefill_chunk_size=max_prefill_chunk_size,
        max_actual_page_table_width=max_actual_page_table_width,
        canonical_page_table_width=canonical_page_table_width,
        policy=policy,
    )
    batch = len(rows.prompt_lens)
    source = PlanSource(rows.tokens, rows.page_table, block_size)
    uncached = [
        prompt - cached for prompt, cached in zip(rows.prompt_lens, rows.cached, strict=True)
    ]
    padded_of = _padded_lengths(policy, uncached)
    buckets: dict[int, list[int]] = {}
    for row in range(batch):
        if uncached[row] > 0:
            buckets.setdefault(padded_of[row], []).append(row)
    disabled = disable_batched_prefill or batched_prefill_disabled_by_env()
    legacy = supports_batched_prefill is None
    if legacy:
        disabled = (
            disabled
            or len(buckets) > 1
            or rows.slots != tuple(range(batch))
            or any(row_uncached <= 0 for row_uncached in uncached)
        )
    limits = _WaveLimits(
        supports_batched_prefill=supports_batched_prefill,
        disabled=disabled,
        max_batch_size=max_batch_size,
        max_prefill_batch_size=max_prefill_batch_size,
        max_prefill_chunk_size=max_prefill_chunk_size,
        policy=policy,
    )
    waves: list[PrefillRequest] = []
    sequential: list[int] = []
    for seq, bucket in buckets.items():
        any_cached = any(rows.cached[row] for row in bucket)
        decide = limits.legacy_wave_size if legacy else limits.wave_size
        padded, reason = decide(len(bucket), seq, any_cached)
        if padded is None:
            if len(bucket) > 1:
                logger.debug(
                    "prefill bucket %d (%d rows) runs sequentially: %s", seq, len(bucket), reason
                )
            sequential.extend(bucket)
        else:
            waves.append(_batched_request(rows, bucket, seq, padded, source))
    singles = _single_requests(rows, sorted(sequential), uncached, padded_of, source)
    if not _stock_padding(policy):
        return tuple(_validated(request) for request in (*waves, *singles))
    return (*waves, *singles)


def restore_source_order(
    requests: Sequence[PrefillRequest],
    per_request_rows: Sequence[Sequence[_T]],
    batch_size: int,
) -> tuple[_T | None, ...]:
    """Place each request's per-active-row results at their source rows.

    `per_request_rows[i][j]` is the result of local row `j` of `requests[i]`. Rows that were
    not planned (fully cached) stay None; the caller decides their filler.
    """
    _require_positive_int("batch_size", batch_size)
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
