"""What one planning call read, kept so planned tensors are built when first read.

Planning 1,000 rows used to fill about 18 MB of zero-padded tokens and thousands of page-table
views that the runtime then read one request at a time (and chunk page tables it never reads
at all). The planner now records a `PlanSource` per call and leaves those tensors out of the
requests; each is built from the source the first time it is read (see `DeferredField`), so
planning costs what its decisions cost and the bytes are produced next to the invocation that
consumes them.

Staging does not build a request's padded tokens at all: a chunk's host tokens are copied
straight from the source, only that chunk's columns (`PlanSource.token_row`, `token_rows`).
Single requests' page tables are built a block of rows at a time (`TableGroup`). Multi-row
builds use a fixed number of ops per block, each below torch's parallel grain, so nothing is
split across threads (on a shared machine that can stall for milliseconds).

Values are exactly the eager ones: the caller's token matrix and page table are borrowed with
their version counters. The rule: every read of the source checks them, so an in-place change
to either after planning makes building a deferred tensor, or a chunk's host inputs from the
source, raise instead of silently producing different values. Tensors built before the change
are kept and stay readable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, overload

import attrs
import torch
from attrs import AttrsInstance

_T = TypeVar("_T")
_Owner = TypeVar("_Owner", bound=AttrsInstance)
"""The class a `DeferredField` is installed on."""

Shape = tuple[int, int]
"""(rows, columns) of a built tensor."""


def _version_of(tensor: torch.Tensor) -> int | None:
    """The in-place version counter, or None for inference tensors (they have none)."""
    if tensor.is_inference():
        return None
    return tensor._version


def _borrow(tensor: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """`tensor` and its version; an inference tensor (no version counter) is copied instead."""
    version = _version_of(tensor)
    return (tensor, version) if version is not None else (tensor.clone(), None)


_PARALLEL_GRAIN = 32768
"""Elements from which torch may split an element-wise op across threads. Builds here stay
below it: on a shared machine a multi-threaded fill can wait milliseconds for a second core."""

_BLOCK_ELEMENTS = _PARALLEL_GRAIN // 2
"""Elements per block of rows a multi-row build handles at once (see `_build_rows`)."""

_Geometry = tuple[int, int, int, int]
"""(storage offset, row stride, column stride, columns) of a borrowed matrix."""


def _geometry(matrix: torch.Tensor) -> _Geometry:
    rows_stride, columns_stride = matrix.stride()
    return (int(matrix.storage_offset()), rows_stride, columns_stride, int(matrix.shape[1]))


class PlanSource:
    """The caller's token matrix and page table, borrowed and guarded by version counters.

    Nothing is copied at planning time: bulk copies there cost milliseconds (and, being
    multi-threaded, can stall on a busy machine). Each deferred tensor copies only its own
    rows (a chunk's host tokens only its columns), when it is built.
    """

    __slots__ = (
        "_page_table",
        "_table_geometry",
        "_table_version",
        "_token_geometry",
        "_token_version",
        "_tokens",
        "block_size",
    )

    def __init__(self, tokens: torch.Tensor, page_table: torch.Tensor, block_size: int) -> None:
        self._tokens, self._token_version = _borrow(tokens)
        self._page_table, self._table_version = _borrow(page_table)
        self._token_geometry = _geometry(self._tokens)
        self._table_geometry = _geometry(self._page_table)
        self.block_size = block_size

    def __reduce__(self) -> tuple[type[PlanSource], tuple[torch.Tensor, torch.Tensor, int]]:
        # Copies (deepcopy, pickle) get fresh tensors, hence fresh version counters: check
        # the originals now and let the copy borrow its own tensors from scratch.
        tokens = self._checked(self._tokens, self._token_version, "tokens")
        page_table = self._checked(self._page_table, self._table_version, "page_table")
        return (PlanSource, (tokens, page_table, self.block_size))

    def _checked(self, tensor: torch.Tensor, version: int | None, name: str) -> torch.Tensor:
        if version is not None and _version_of(tensor) != version:
            raise RuntimeError(
                f"the {name} tensor passed to plan_prefill_requests was modified in place "
                f"after planning; planned requests read it when their tensors are first used, "
                f"so plan again after changing it"
            )
        return tensor

    def check_table(self) -> None:
        """Raise if the caller changed the page table in place since planning."""
        self._checked(self._page_table, self._table_version, "page_table")

    def check_unchanged(self) -> None:
        """Raise if the caller changed either tensor in place since planning."""
        self._checked(self._tokens, self._token_version, "tokens")
        self.check_table()

    def token_row(self, row: int, start: int, length: int, width: int) -> torch.Tensor:
        """int64 `(1, width)`: `tokens[row, start : start + length]`, then 0.

        A chunk's tokens: checks both tensors, since they are staged with the page table.
        """
        self.check_unchanged()
        return _padded_row(
            self._tokens, self._token_geometry, row, start, length, width, 0, torch.int64
        )

    def token_rows(
        self, rows: Sequence[int], starts: Sequence[int], lengths: Sequence[int], shape: Shape
    ) -> torch.Tensor:
        """int64 `shape`: row i holds `tokens[rows[i], starts[i] : starts[i] + lengths[i]]`,
        then 0; padding rows (`i >= len(rows)`) are all 0."""
        matrix = self._checked(self._tokens, self._token_version, "tokens")
        return _build_rows(
            matrix, self._token_geometry, rows, starts, lengths, shape, 0, torch.int64
        )

    def table_rows(
        self,
        rows: Sequence[int],
        starts: Sequence[int],
        counts: Sequence[int],
        shape: Shape,
        fill: int,
    ) -> torch.Tensor:
        """int32 `shape`: row i holds `counts[i]` page-table entries of source row `rows[i]`
        from column `starts[i]`, then `fill`; padding rows are all `fill`."""
        page_table = self._checked(self._page_table, self._table_version, "page_table")
        return _build_rows(
            page_table, self._table_geometry, rows, starts, counts, shape, fill, torch.int32
        )


def _build_rows(
    matrix: torch.Tensor,
    geometry: _Geometry,
    rows: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
    shape: Shape,
    fill: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A new `shape` tensor of `dtype`: row i holds `lengths[i]` values of `matrix[rows[i]]`
    from column `starts[i]`, then `fill`; padding rows (`i >= len(rows)`) are all `fill`.

    One row takes the strided-view path. Several are gathered a block of rows at a time: a
    fixed number of ops per block whatever the row count, each below `_PARALLEL_GRAIN`
    elements, so the whole build runs on the calling thread.
    """
    if len(rows) == 1 and shape[0] == 1:
        return _padded_row(matrix, geometry, rows[0], starts[0], lengths[0], shape[1], fill, dtype)
    batch, width = shape
    out = torch.empty(shape, dtype=dtype)
    step = max(1, _BLOCK_ELEMENTS // max(1, width))
    for first in range(0, batch, step):
        last = first + step
        _gather_block(
            matrix, rows[first:last], starts[first:last], lengths[first:last], out[first:last], fill
        )
    return out


def _padded_row(
    matrix: torch.Tensor,
    geometry: _Geometry,
    row: int,
    start: int,
    length: int,
    width: int,
    fill: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A new `(1, width)` tensor of `dtype`: `matrix[row, start:][:length]`, then `fill`.

    One view and one pad op: for a single row, per-op overhead is the whole cost.
    """
    offset, row_stride, column_stride, columns = geometry
    taken = max(0, min(length, width, columns - start))
    if taken:
        offset += row * row_stride + start * column_stride
    # `matrix[row : row + 1, start : start + taken]`, as one call (indexing costs two).
    window = matrix.as_strided((1, taken), (row_stride, column_stride), offset)
    if window.dtype != dtype:
        window = window.to(dtype)
    # A copy even when nothing is padded: the result never aliases the caller's tensor.
    return torch.constant_pad_nd(window, (0, width - taken), fill)


def _gather_block(
    matrix: torch.Tensor,
    rows: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
    target: torch.Tensor,
    fill: int,
) -> None:
    """Write one block of `_build_rows`'s rows into `target` (rows beyond `rows` get `fill`)."""
    active, width = len(rows), int(target.shape[1])
    if active < target.shape[0]:
        target[active:].fill_(fill)
    if active == 0 or width == 0:
        return
    columns = int(matrix.shape[1])
    low = min(starts)
    high = min(columns, max(start + length for start, length in zip(starts, lengths, strict=True)))
    if high <= low:
        target[:active].fill_(fill)
        return
    # Only the columns any row reads, gathered row-wise (advanced indexing would split
    # across threads even for small copies).
    row_index, offset, count = torch.tensor(
        [list(rows), [start - low for start in starts], list(lengths)], dtype=torch.int64
    ).unbind(0)
    window = matrix[:, low:high].index_select(0, row_index)
    positions = torch.arange(width, dtype=torch.int64)
    index = offset[:, None] + positions
    valid = (positions < count[:, None]) & (index < high - low)
    # Positions outside a row's window read column 0 (always in range) and are masked out.
    gathered = window.gather(1, index.where(valid, 0)).to(target.dtype)
    target[:active].copy_(gathered.where(valid, fill))


class TableGroup:
    """Page tables of single-row requests of one plan that share a width and filler.

    The planner appends each request's source row to `rows`; the first read of a table builds
    the tables of a block of rows together (a few ops for the block instead of one pad op per
    row, which dominated staging), and each request takes a view of its own row. Blocks stay
    below `_PARALLEL_GRAIN` elements. Every read checks the page table's version counter, so a
    read after an in-place change raises even when its block was built before the change.
    """

    def __init__(
        self, source: PlanSource, width: int, fill: int, prompt_lengths: Sequence[int]
    ) -> None:
        self.source = source
        self.width = width
        self.fill = fill
        self.rows: list[int] = []
        """Source rows in request order; the planner appends each request's row."""
        self._prompt_lengths = prompt_lengths
        self._per_block = max(1, _BLOCK_ELEMENTS // max(1, width))
        self._blocks: dict[int, tuple[torch.Tensor, ...]] = {}
        self._positions: dict[int, int] | None = None

    def table(self, row: int) -> torch.Tensor:
        """int32 `(1, width)`: source row `row`'s allocated prefix, then the filler."""
        source = self.source
        source.check_table()  # also when the block was built before a change
        positions = self._positions
        if positions is None:
            positions = self._positions = {member: at for at, member in enumerate(self.rows)}
        block, local = divmod(positions[row], self._per_block)
        built = self._blocks.get(block)
        if built is None:
            first = block * self._per_block
            rows = self.rows[first : first + self._per_block]
            block_size, lengths = source.block_size, self._prompt_lengths
            counts = [-(-lengths[row] // block_size) for row in rows]  # allocated blocks
            table = source.table_rows(
                rows, [0] * len(rows), counts, (len(rows), self.width), self.fill
            )
            built = self._blocks[block] = table.chunk(len(rows))  # (1, width) views, one call
        return built[local]


class DeferredField(Generic[_Owner, _T]):
    """A non-data descriptor for an attrs field the planner may leave out of an instance.

    Python consults a non-data descriptor only when the instance dict lacks the name, so
    values given to the constructor (or already built) are plain attribute reads; a missing
    value is built once by `build(instance)` and stored in the instance dict.
    """

    def __init__(self, name: str, build: Callable[[_Owner], _T]) -> None:
        self._name = name
        self._build = build

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> DeferredField[_Owner, _T]: ...

    @overload
    def __get__(self, instance: _Owner, owner: type | None = None) -> _T: ...

    def __get__(
        self, instance: _Owner | None, owner: type | None = None
    ) -> _T | DeferredField[_Owner, _T]:
        if instance is None:
            return self
        value = self._build(instance)
        instance.__dict__[self._name] = value
        return value


def install_deferred_fields(cls: type[_Owner], **builders: Callable[[_Owner], object]) -> None:
    """Make each named field of the dict-based attrs class `cls` buildable on first read.

    attrs removes field names from the class body, so the descriptors go in afterwards.
    """
    fields = attrs.fields_dict(cls)
    for name, build in builders.items():
        if name not in fields:
            raise AttributeError(f"{cls.__name__} has no attrs field {name!r}")
        setattr(cls, name, DeferredField(name, build))
