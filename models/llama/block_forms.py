"""Forms of `rows @ W^T` for a weight kept in quantized blocks (`runtime.quant`).

* `q_rows`: the native block kernel (`native/quant_matmul.c`): every block is read once,
  unpacked in registers and used for all rows; float32 activations and accumulators. For
  decode, where the product is bound by reading the weight.
* `q_tiles`: dequantize a tile of output rows at a time into one reused float32 buffer and
  run torch's GEMM on it. For prefill and large decode batches, which are bound by
  arithmetic: the GEMM stays the library's, and no full-size float copy of the weight ever
  exists (the buffer holds `_TILE_ROWS` rows). Without the native library the tile is
  dequantized by torch (`QuantizedMatrix.dequantize`).

Warmup times them per row bucket like the float forms (`kernel_measure`); the plan records
the choice.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from runtime.backends import native_kernels
from runtime.quant.matrix import QuantizedMatrix

# Output rows dequantized per tile: 256 rows of a 576-wide matrix are 576 KiB of float32,
# which stays in a Zen 4 / Xeon core's L2 while the GEMM reads it.
_TILE_ROWS = 256
_BUFFERS: dict[int, torch.Tensor] = {}


def _native_available() -> bool:
    # TEMPORARY until the native block kernel lands (helper branch i22-kernels).
    return native_kernels.unavailable_reason() is None and hasattr(native_kernels, "quant_matmul")


def _always() -> bool:
    return True


def _as_f32(rows: torch.Tensor) -> torch.Tensor:
    if rows.dtype == torch.float32 and rows.is_contiguous():
        return rows
    return rows.to(torch.float32).contiguous()


def _q_rows(matrix: QuantizedMatrix, rows: torch.Tensor) -> torch.Tensor:
    return native_kernels.quant_matmul().unchecked(matrix, _as_f32(rows))


def _tile_buffer(elements: int) -> torch.Tensor:
    buffer = _BUFFERS.get(elements)
    if buffer is None:
        buffer = _BUFFERS[elements] = torch.empty(elements)
    return buffer


def tile_buffer_bytes() -> int:
    """Bytes held by the reused tile buffers of this process."""
    return sum(buffer.numel() * buffer.element_size() for buffer in _BUFFERS.values())


def _q_tiles(matrix: QuantizedMatrix, rows: torch.Tensor) -> torch.Tensor:
    x = _as_f32(rows)
    out_t = torch.empty(matrix.rows, x.shape[0])
    step = min(_TILE_ROWS, matrix.rows)
    buffer = _tile_buffer(step * matrix.cols)
    native = _native_available()
    for start in range(0, matrix.rows, step):
        stop = min(start + step, matrix.rows)
        tile = buffer[: (stop - start) * matrix.cols].view(stop - start, matrix.cols)
        if native:
            native_kernels.quant_matmul().dequantize_rows(matrix, start, stop, tile)
        else:
            tile.copy_(matrix.dequantize(start, stop))
        torch.mm(tile, x.t(), out=out_t[start:stop])
    return out_t.t().contiguous()


@attrs.frozen
class BlockForm:
    """One way to compute `rows @ W^T` from a `QuantizedMatrix`, for at most `max_rows`
    rows (None: any), where `available()` says it can run."""

    name: str
    compute: Callable[[QuantizedMatrix, torch.Tensor], torch.Tensor]
    max_rows: int | None = None
    available: Callable[[], bool] = _always

    def fits(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows


BLOCK_FORMS: dict[str, BlockForm] = {
    form.name: form
    for form in (
        BlockForm("q_rows", _q_rows, max_rows=64, available=_native_available),
        BlockForm("q_tiles", _q_tiles),
    )
}
# Rows up to which an un-warmed model uses `q_rows` (when it can run).
_ROWS_FORM_UP_TO = 16


def default_block_form(rows: int) -> str:
    """The form an un-warmed model uses for a block weight."""
    return "q_rows" if rows <= _ROWS_FORM_UP_TO and _native_available() else "q_tiles"


def block_product(
    parts: tuple[QuantizedMatrix, ...], rows: torch.Tensor, form: str
) -> torch.Tensor:
    """`rows @ W^T` (float32) over a weight stored as row-stacked `parts`."""
    compute = BLOCK_FORMS[form].compute
    if len(parts) == 1:
        return compute(parts[0], rows)
    return torch.cat([compute(part, rows) for part in parts], dim=1)
