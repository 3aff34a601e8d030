"""`QuantizedMatrix`: a `[rows, cols]` weight as small integers plus per-block scales.

Why one repacked form instead of each GGUF type's own bytes: the kernels then need two inner
loops, not five, and a fused projection can hold parts of different types side by side. The
form keeps every weight value exact (bit-equal to the `gguf` package's dequantization):

* `q4`: `qs` is uint8 `[rows, cols / 2]`; in each block of 32 values, byte `j` holds value
  `j` in its low nibble and value `j + 16` in its high nibble (the Q4_0/Q4_1 order; Q4_K's
  64-value chunks are re-ordered into it). Value = `q * scale + min`; Q4_0's symmetric blocks
  store no `mins` (None), their min being `-8 * scale` (`block_mins`), so they hold the file's
  18 bytes a block rather than 20.
* `q8`: `qs` is int8 `[rows, cols]` in natural order. Value = `q * scale` (`mins` is None).

`scales` (and `mins`) are `[rows, cols / block]`, float16 where the file's scales are float16
and enter unchanged (Q4_0, Q4_1, Q8_0: the resident bytes are the file's), float32 where the
scale is a product of the file's super-block and sub-block scales (Q4_K, Q6_K: the product
is kept exact, at 1.33x and 1.52x the file's bytes).
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch

BlockKind = Literal["q4", "q8"]
BLOCK_KINDS: tuple[BlockKind, ...] = ("q4", "q8")


@attrs.frozen(eq=False)
class QuantizedMatrix:
    """A weight `[rows, cols]` (HF `[out, in]` orientation) in one of the `BlockKind` forms.

    `source` names the file type the blocks came from (`"Q4_1"`), for the journal and plans.
    """

    kind: BlockKind
    source: str
    rows: int
    cols: int
    block: int
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    # The native kernels' descriptor of these blocks, built on first use and kept here so a
    # decode step's ~150 products skip rebuilding it (`runtime.backends.native_kernels`).
    native_view: list[object] = attrs.field(factory=list, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise ValueError(f"QuantizedMatrix({self.source} as {self.kind}): {problem}")

    def _problem(self) -> str | None:
        if self.kind not in BLOCK_KINDS:
            return f"kind {self.kind!r} is invalid: allowed are {BLOCK_KINDS}"
        if self.block < 2 or self.cols % self.block:
            return f"cols {self.cols} is not a multiple of the block size {self.block}"
        if self.kind == "q4" and self.block != 32:
            return f"q4 blocks hold 32 values, not {self.block}"
        width = self.cols // 2 if self.kind == "q4" else self.cols
        dtype = torch.uint8 if self.kind == "q4" else torch.int8
        if tuple(self.qs.shape) != (self.rows, width) or self.qs.dtype != dtype:
            got = f"{self.qs.dtype} {list(self.qs.shape)}"
            return f"qs is {got}, expected {dtype} {[self.rows, width]}"
        blocks = (self.rows, self.cols // self.block)
        if tuple(self.scales.shape) != blocks or self.scales.dtype not in _SCALE_DTYPES:
            return (
                f"scales are {self.scales.dtype} {list(self.scales.shape)}, expected {list(blocks)}"
            )
        if self.kind == "q8" and self.mins is not None:
            return "q8 blocks have no mins"
        if self.mins is not None and (
            tuple(self.mins.shape) != blocks or self.mins.dtype != self.scales.dtype
        ):
            return "mins must match scales in shape and dtype"
        tensors = (self.qs, self.scales) + (() if self.mins is None else (self.mins,))
        if not all(t.is_contiguous() for t in tensors):
            return "qs, scales and mins must be contiguous"
        return None

    def block_mins(self, start: int = 0, stop: int | None = None) -> torch.Tensor | None:
        """Rows `[start, stop)`'s per-block mins as float32 (`-8 * scale` for symmetric q4
        blocks, exact), or None for q8."""
        if self.kind == "q8":
            return None
        stop = self.rows if stop is None else stop
        if self.mins is None:
            return self.scales[start:stop].to(torch.float32) * -8.0
        return self.mins[start:stop].to(torch.float32)

    def float_parts(self) -> list[torch.Tensor]:
        """The scales (and mins): what must be finite for every value to be."""
        return [self.scales] if self.mins is None else [self.scales, self.mins]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed values and scales."""
        tensors = (self.qs, self.scales) + (() if self.mins is None else (self.mins,))
        return sum(t.numel() * t.element_size() for t in tensors)

    def row_slice(self, start: int, stop: int) -> QuantizedMatrix:
        """Rows `[start, stop)` as views (a fused projection's part)."""
        return attrs.evolve(
            self,
            rows=stop - start,
            qs=self.qs[start:stop],
            scales=self.scales[start:stop],
            mins=None if self.mins is None else self.mins[start:stop],
        )

    def take_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` as float32 `[len(index), cols]` (token embeddings of a tied head)."""
        picked = attrs.evolve(
            self,
            rows=int(index.shape[0]),
            qs=self.qs.index_select(0, index),
            scales=self.scales.index_select(0, index),
            mins=None if self.mins is None else self.mins.index_select(0, index),
        )
        return picked.dequantize()

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows `[start, stop)` as float32 (the reference the kernels are held to)."""
        stop = self.rows if stop is None else stop
        scales = self.scales[start:stop].to(torch.float32)
        if self.kind == "q8":
            values = self.qs[start:stop].to(torch.float32)
            grouped = values.view(
                stop - start, self.cols // self.block, self.block
            ) * scales.unsqueeze(-1)
            return grouped.reshape(stop - start, self.cols)
        packed = self.qs[start:stop].view(stop - start, self.cols // 32, 16)
        low = (packed & 0x0F).to(torch.float32)
        high = (packed >> 4).to(torch.float32)
        values = torch.cat((low, high), dim=-1)
        mins = self.block_mins(start, stop)
        assert mins is not None
        return (values * scales.unsqueeze(-1) + mins.unsqueeze(-1)).reshape(stop - start, self.cols)


_SCALE_DTYPES = (torch.float16, torch.float32)


def concat_rows(parts: list[QuantizedMatrix]) -> QuantizedMatrix | None:
    """One matrix of `parts` stacked by rows, or None when their forms differ."""
    first = parts[0]
    same = all(
        (p.kind, p.block, p.cols, p.scales.dtype, p.mins is None)
        == (first.kind, first.block, first.cols, first.scales.dtype, first.mins is None)
        for p in parts
    )
    if not same:
        return None
    sources = sorted({p.source for p in parts})
    return QuantizedMatrix(
        kind=first.kind,
        source="+".join(sources),
        rows=sum(p.rows for p in parts),
        cols=first.cols,
        block=first.block,
        qs=torch.cat([p.qs for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        mins=None
        if first.mins is None
        else torch.cat([p.mins for p in parts if p.mins is not None]),
    )
