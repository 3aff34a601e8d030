"""Forms of `rows @ W^T` for a weight kept in quantized blocks (`runtime.quant`).

* `q_rows`: the native block kernel (`native/quant_matmul.c`): every block is read once,
  unpacked in registers and used for all rows; float32 activations and accumulators. For
  decode, where the product is bound by reading the weight.
* `q_gemm`: the native many-row kernel (`native/quant_gemm.c`): panels of 12 weight rows
  dequantized into a per-thread buffer and multiplied by a register-tiled micro-kernel. For
  prefill and large decode batches, which are bound by arithmetic: 2-3x `q_tiles` at 32 rows
  on Zen 5, near oneDNN's packed float32 rate, so block weights no longer lose to their own
  float32 copy there. No full-size float copy of the weight exists.
* `q_tiles`: dequantize a tile of output rows at a time into one reused float32 buffer and
  run torch's GEMM on it (the buffer holds `_TILE_ROWS` rows). The library's GEMM as a
  candidate, and the form without the native library (the tile is then dequantized by torch,
  `QuantizedMatrix.dequantize`).

* `q_int16`: q4 blocks (or q8 blocks of 32) with the activations rounded to int16 per 32
  values and multiplied with AVX-512 VNNI: q4 below 11 rows streamed like `q_rows`
  (`native/quant_blocks_i16.h`, about four instructions a block instead of six, 1.4-1.8x
  `q_rows` where that is bound by arithmetic, as batch-1 decode on Zen 5; one row, q4 or q8,
  in a layout of its own that splits each value into high and low bytes for `vpdpbusd`), from
  11 rows (q8 from 2) on panels like `q_gemm` (`native/gemm_panels_i16.h`, 32 products a
  `vpdpwssd` where `q_gemm` does 16 an FMA). Not bit-equal: within
  `runtime.quant.rounded_activations.error_bound(..., INT16_LEVELS)` of the exact product
  (1.5e-5 of a block's largest activation), so it is a candidate like the others and kept
  only where warmup measures it faster.

* `q_int8`: the native block kernel with the activations quantized to int8 per block and
  multiplied with AVX-512 VNNI (`native/quant_blocks_i8.h`): fewer instructions per weight
  than `q_rows`, so faster where `q_rows` is bound by arithmetic, but not bit-equal: within
  `runtime.quant.rounded_activations.error_bound` of the exact product. Only on CPUs with VNNI.

* `torch_int4`: torch's own CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`, groups of
  32, `w = (q - 8) * scale + zero`) on q4 blocks, the maintained library's candidate. It runs
  from a converted copy made when it is timed (dropped again unless the plan keeps it).
  Only float32 activations qualify: with bfloat16 activations and scales it is far faster
  but 0.3% off, outside the tolerance the other forms meet. torch's `_weight_int8pack_mm`
  takes one scale per output row, so it cannot hold Q8_0's per-block scales: no candidate.

Warmup times them per row bucket like the float forms (`kernel_measure`); the plan records
the choice and every candidate's time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
import torch

from runtime.backends import native_kernels
from runtime.quant.matrix import QuantizedMatrix

# Output rows dequantized per tile: 256 rows of a 576-wide matrix are 576 KiB of float32,
# which stays in a Zen 4 / Xeon core's L2 while the GEMM reads it.
_TILE_ROWS = 256
NEEDS_NATIVE = "the native kernels"
"""`needs` of a form that runs on the native library (its errors then say why it cannot)."""
_BUFFERS: dict[int, torch.Tensor] = {}


def _native_available() -> bool:
    return native_kernels.unavailable_reason() is None


def _always() -> bool:
    return True


def _any_blocks(matrix: QuantizedMatrix) -> bool:
    return True


def _as_f32(rows: torch.Tensor) -> torch.Tensor:
    if rows.dtype == torch.float32 and rows.is_contiguous():
        return rows
    return rows.to(torch.float32).contiguous()


def _q_rows(matrix: QuantizedMatrix, rows: torch.Tensor) -> torch.Tensor:
    return native_kernels.quant_matmul().unchecked(matrix, _as_f32(rows))


def _int8_available() -> bool:
    return _native_available() and native_kernels.quant_matmul().int8_available


def _q_gemm(matrix: QuantizedMatrix, rows: torch.Tensor) -> torch.Tensor:
    return native_kernels.quant_matmul().unchecked_gemm(matrix, _as_f32(rows))


def _q_int8(matrix: QuantizedMatrix, rows: torch.Tensor) -> torch.Tensor:
    return native_kernels.quant_matmul().unchecked_int8(matrix, _as_f32(rows))


def _int16_available() -> bool:
    return _native_available() and native_kernels.quant_matmul().int16_available


def _q_int16(matrix: QuantizedMatrix, rows: torch.Tensor) -> torch.Tensor:
    return native_kernels.quant_matmul().unchecked_int16(matrix, _as_f32(rows))


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
    # Written tile by tile into its columns: no transposed full-size copy (the LM head's
    # [256, 49152] would be 50 MB twice).
    out = torch.empty(x.shape[0], matrix.rows)
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
        torch.mm(x, tile.t(), out=out[:, start:stop])
    return out


# Converted copies for `torch_int4`, by matrix identity (kept alive with the matrix).
_TORCH_INT4: dict[int, tuple[QuantizedMatrix, torch.Tensor, torch.Tensor]] = {}


def _torch_int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def _torch_int4_weight(matrix: QuantizedMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    held = _TORCH_INT4.get(id(matrix))
    if held is not None and held[0] is matrix:
        return held[1], held[2]
    packed = matrix.qs.view(matrix.rows, -1, 16)
    values = torch.cat((packed & 0x0F, packed >> 4), dim=-1).reshape(matrix.rows, matrix.cols)
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 1)
    mins = matrix.block_mins()
    assert mins is not None
    scale = matrix.scales.to(torch.float32).t()
    zero = mins.t() + 8.0 * scale
    scales_zeros = torch.stack((scale, zero), dim=-1).contiguous()
    _TORCH_INT4[id(matrix)] = (matrix, weight, scales_zeros)
    return weight, scales_zeros


def _torch_int4_takes(matrix: QuantizedMatrix) -> bool:
    # torch's int4 packing refuses an output count that is not a multiple of 16.
    return matrix.rows % 16 == 0


def _torch_int4(matrix: QuantizedMatrix, rows: torch.Tensor) -> torch.Tensor:
    weight, scales_zeros = _torch_int4_weight(matrix)
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
        _as_f32(rows), weight, matrix.block, scales_zeros
    )
    return out


def release_converted(matrices: Iterable[QuantizedMatrix]) -> None:
    """Drop `torch_int4`'s converted copies of `matrices` (timed, then not chosen)."""
    for matrix in matrices:
        _TORCH_INT4.pop(id(matrix), None)


@attrs.frozen
class BlockForm:
    """One way to compute `rows @ W^T` from a `QuantizedMatrix`, for at most `max_rows`
    rows (None: any), where `available()` says it can run and `applies(matrix)` says it
    takes this matrix's kind."""

    name: str
    compute: Callable[[QuantizedMatrix, torch.Tensor], torch.Tensor]
    max_rows: int | None = None
    available: Callable[[], bool] = _always
    kinds: tuple[str, ...] = ("q4", "q8")
    takes: Callable[[QuantizedMatrix], bool] = _any_blocks
    """Which blocks of those kinds it computes over."""
    needs: str = NEEDS_NATIVE
    """What `available()` checks, for errors."""
    converted: bool = False
    """Runs from a converted copy of the blocks: warmup times it on one layer and scales,
    so the timing holds one layer's copy rather than every layer's."""
    activations: str = "float32"
    """How its activations meet the blocks (the fused stack's `ACTIVATIONS` name): the
    stack runs a head of this form with the same rounding."""

    def fits(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows

    def applies(self, matrix: QuantizedMatrix) -> bool:
        return matrix.kind in self.kinds and matrix.device.type == "cpu" and self.takes(matrix)


BLOCK_FORMS: dict[str, BlockForm] = {
    form.name: form
    for form in (
        BlockForm("q_rows", _q_rows, max_rows=64, available=_native_available),
        BlockForm("q_gemm", _q_gemm, available=_native_available),
        BlockForm("q_tiles", _q_tiles),
        BlockForm(
            "q_int16",
            _q_int16,
            available=_int16_available,
            takes=native_kernels.int16_takes,
            needs="AVX-512 VNNI (the int16-activation kernel)",
            activations="int16",
        ),
        BlockForm(
            "q_int8",
            _q_int8,
            max_rows=64,
            available=_int8_available,
            takes=native_kernels.int8_takes,
            needs="AVX-512 VNNI (the int8-activation kernel)",
            activations="int8",
        ),
        BlockForm(
            "torch_int4",
            _torch_int4,
            available=_torch_int4_available,
            kinds=("q4",),
            takes=_torch_int4_takes,
            needs="torch's aten._weight_int4pack_mm_for_cpu",
            converted=True,
        ),
    )
}
# Rows up to which an un-warmed model uses `q_rows` (when it can run).
_ROWS_FORM_UP_TO = 16


def default_block_form(rows: int) -> str:
    """The form an un-warmed model uses for a block weight."""
    if not _native_available():
        return "q_tiles"
    return "q_rows" if rows <= _ROWS_FORM_UP_TO else "q_gemm"


def take_block_rows(matrix: QuantizedMatrix, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of `matrix` as float32 (token embeddings of a tied head held in blocks):
    the native gather where it can run, else `QuantizedMatrix.take_rows`; bit-equal."""
    if _native_available() and matrix.device.type == "cpu":
        return native_kernels.quant_matmul().take_rows(matrix, index)
    return matrix.take_rows(index)


def block_product(
    parts: tuple[QuantizedMatrix, ...], rows: torch.Tensor, form: str
) -> torch.Tensor:
    """`rows @ W^T` (float32) over a weight stored as row-stacked `parts`."""
    compute = BLOCK_FORMS[form].compute
    if len(parts) == 1:
        return compute(parts[0], rows)
    return torch.cat([compute(part, rows) for part in parts], dim=1)
