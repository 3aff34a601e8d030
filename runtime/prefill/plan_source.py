"""What one planning call read, kept so planned tensors are built when first read.

Planning 1,000 rows used to fill about 18 MB of zero-padded tokens and thousands of page-table
views that the runtime then read one request at a time (and chunk page tables it never reads
at all). The planner now records a `PlanSource` per call and leaves those tensors out of the
requests; each is built from the source the first time it is read (see `DeferredField`), so
planning costs what its decisions cost and the bytes are produced next to the invocation that
consumes them.

Values are exactly the eager ones: the caller's token matrix and page table are borrowed with
their version counters, so an in-place change to either after planning makes reading a
deferred tensor raise instead of silently producing different values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import attrs
import torch

_T = TypeVar("_T")

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


class PlanSource:
    """The caller's token matrix and page table, borrowed and guarded by version counters.

    Nothing is copied at planning time: bulk copies there cost milliseconds (and, being
    multi-threaded, can stall on a busy machine). Each deferred tensor copies only its own
    rows, when it is built.
    """

    __slots__ = ("_page_table", "_table_version", "_token_version", "_tokens", "block_size")

    def __init__(self, tokens: torch.Tensor, page_table: torch.Tensor, block_size: int) -> None:
        self._tokens, self._token_version = _borrow(tokens)
        self._page_table, self._table_version = _borrow(page_table)
        self.block_size = block_size

    def __reduce__(self) -> tuple[type[PlanSource], tuple[torch.Tensor, torch.Tensor, int]]:
        # Copies (deepcopy, pickle) get fresh tensors, hence fresh version counters: check
        # the originals now and let the copy borrow its own tensors from scratch.
        tokens = self._checked(self._tokens, self._token_version, "tokens")
        table = self._checked(self._page_table, self._table_version, "page_table")
        return (PlanSource, (tokens, table, self.block_size))

    def _checked(self, tensor: torch.Tensor, version: int | None, name: str) -> torch.Tensor:
        if version is not None and _version_of(tensor) != version:
            raise RuntimeError(
                f"the {name} tensor passed to plan_prefill_requests was modified in place "
                f"after planning; planned requests read it when their tensors are first used, "
                f"so plan again after changing it"
            )
        return tensor

    def token_rows(
        self, rows: Sequence[int], starts: Sequence[int], lengths: Sequence[int], shape: Shape
    ) -> torch.Tensor:
        """int64 `shape`: row i holds `tokens[rows[i], starts[i] : starts[i] + lengths[i]]`,
        then 0; padding rows (`i >= len(rows)`) are all 0."""
        matrix = self._checked(self._tokens, self._token_version, "tokens")
        return _gather_rows(matrix, rows, starts, lengths, shape, 0, torch.int64)

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
        table = self._checked(self._page_table, self._table_version, "page_table")
        return _gather_rows(table, rows, starts, counts, shape, fill, torch.int32)


def _gather_rows(
    matrix: torch.Tensor,
    rows: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
    shape: Shape,
    fill: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`shape` of `dtype`: row i is `matrix[rows[i], starts[i]:][:lengths[i]]`, then `fill`.

    One row (a single request or chunk) is one pad op: per-op overhead dominates there.
    """
    batch, width = shape
    if batch == 1 and len(rows) == 1:
        row, start, length = rows[0], starts[0], min(lengths[0], width)
        window = matrix[row : row + 1, start : start + length].to(dtype)
        return torch.constant_pad_nd(window, (0, width - length), fill)
    out = torch.full(shape, fill, dtype=dtype)
    for local, (row, start, length) in enumerate(zip(rows, starts, lengths, strict=True)):
        length = min(length, width)
        if length > 0:
            out[local, :length] = matrix[row, start : start + length]
    return out


class DeferredField(Generic[_T]):
    """A non-data descriptor for an attrs field the planner may leave out of an instance.

    Python consults a non-data descriptor only when the instance dict lacks the name, so
    values given to the constructor (or already built) are plain attribute reads; a missing
    value is built once by `build(instance)` and stored in the instance dict.
    """

    def __init__(self, name: str, build: Callable[[Any], _T]) -> None:
        self._name = name
        self._build = build

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = self._build(instance)
        instance.__dict__[self._name] = value
        return value


def install_deferred_fields(cls: type, **builders: Callable[[Any], object]) -> None:
    """Make each named field of the dict-based attrs class `cls` buildable on first read.

    attrs removes field names from the class body, so the descriptors go in afterwards.
    """
    fields = attrs.fields_dict(cls)
    for name, build in builders.items():
        if name not in fields:
            raise AttributeError(f"{cls.__name__} has no attrs field {name!r}")
        setattr(cls, name, DeferredField(name, build))
