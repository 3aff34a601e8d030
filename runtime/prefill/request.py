"""The planned values: `PrefillRequest` (one invocation sequence) and `PrefillChunk`.

The planner builds them without running their constructors' validation (it derived every
value itself) and leaves their tensors to be built from the caller's matrices when first
read (`plan_source`); values built through the public constructors are validated. A request's
tensors and a chunk's page table come from the builders here; `chunk_tokens` is what staging
reads.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import attrs
import torch

from runtime.prefill.plan_source import PlanSource, install_deferred_fields
from runtime.validation import is_int, non_negative_int, plain_bool, positive_int

PrefillKind = Literal["single", "batched"]
PREFILL_KINDS: tuple[PrefillKind, ...] = ("single", "batched")

SKIP_BLOCK = -1
"""Regular page-table filler: the KV write skips these entries (padding rows, tails)."""
SDPA_SAFE_BLOCK = 0
"""Chunked full-table filler: attention reads the whole table, so entries must be valid."""

DEFERRED = "_deferred"
"""Instance-dict key of what a planner-built request or chunk builds its tensors from:
`(PlanSource, page_table_width, TableGroup | None)` on a request (single requests of one
width and filler share a page-table group), `(PlanSource, row, allocated blocks)` on a chunk.
Absent on values constructed (and validated) through the public constructors."""

_C = TypeVar("_C")


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
        if not is_int(piece.start) or not is_int(piece.stop):
            raise ValueError(f"token_slice start and stop must be explicit ints, got {piece!r}")
        if not 0 <= piece.start < piece.stop:
            raise ValueError(f"token_slice must satisfy 0 <= start < stop, got {piece!r}")
        non_negative_int("chunk_start_idx", self.chunk_start_idx)
        positive_int("chunk_size", self.chunk_size)
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
        plain_bool("contains_last_token", self.contains_last_token)

    @property
    def chunk_page_table_width(self) -> int | None:
        deferred = self.__dict__.get(DEFERRED)
        if deferred is not None:
            return _ceil_div(self.chunk_size, deferred[0].block_size)
        return None if self.chunk_page_table is None else int(self.chunk_page_table.shape[1])


def _build_chunk_page_table(chunk: PrefillChunk) -> torch.Tensor:
    """A planned chunk's table: the chunk's slice of the allocated prefix, then the skip block."""
    source, row, allocated = chunk.__dict__[DEFERRED]
    block = source.block_size
    width = _ceil_div(chunk.chunk_size, block)
    start = chunk.chunk_start_idx // block
    mapped = min(width, max(0, allocated - start))
    table: torch.Tensor = source.table_rows((row,), (start,), (mapped,), (1, width), SKIP_BLOCK)
    return table


install_deferred_fields(PrefillChunk, chunk_page_table=_build_chunk_page_table)


def _int_tuple(
    instance: object, attribute: attrs.Attribute[tuple[int, ...]], value: object
) -> None:
    if not isinstance(value, tuple) or not value or not all(is_int(v) for v in value):
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
        seq = positive_int("padded_sequence_length", self.padded_sequence_length)
        batch = positive_int("padded_batch_size", self.padded_batch_size)
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
        if plain_bool("uses_chunked_prefill", self.uses_chunked_prefill) != has_tables:
            raise ValueError(
                f"uses_chunked_prefill={self.uses_chunked_prefill} must equal whether any "
                f"chunk has a chunk page table ({has_tables})"
            )

    @property
    def page_table_width(self) -> int:
        deferred = self.__dict__.get(DEFERRED)
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
    source = request.__dict__[DEFERRED][0]
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
    source, width, group = request.__dict__[DEFERRED]
    if group is not None:
        grouped: torch.Tensor = group.table(request.source_rows[0])
        return grouped
    block = source.block_size
    table: torch.Tensor = source.table_rows(
        request.source_rows,
        [0] * len(request.source_rows),
        [_ceil_div(prompt, block) for prompt in request.prompt_lengths],
        (request.padded_batch_size, width),
        SDPA_SAFE_BLOCK if request.uses_chunked_prefill else SKIP_BLOCK,
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
    deferred = values.get(DEFERRED)
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


def planned(cls: type[_C], values: dict[str, object]) -> _C:
    """An instance of `cls` holding `values` as they are: values the planner derived itself.

    Skips the constructor's validation (`validated` re-runs it when a policy override
    supplied the padding) and may leave deferred fields out (see `DEFERRED`).
    """
    instance = object.__new__(cls)
    object.__setattr__(instance, "__dict__", values)
    return instance


def validated(request: PrefillRequest) -> PrefillRequest:
    """`request` rebuilt through the public constructors, which validate every value."""
    chunks = tuple(attrs.evolve(chunk) for chunk in request.chunks)
    return attrs.evolve(request, chunks=chunks)


def whole_chunk(padded: int) -> PrefillChunk:
    """The one chunk of an unchunked request: all `padded` tokens from position 0."""
    return planned(
        PrefillChunk,
        {
            "token_slice": slice(0, padded),
            "chunk_start_idx": 0,
            "chunk_size": padded,
            "chunk_page_table": None,
            "contains_last_token": True,
        },
    )
