"""Repack a GGUF tensor's quantized blocks into a `QuantizedMatrix`, exactly, with numpy.

GGUF block layouts (ggml's `block_q4_0` ... `block_q6_K`), per row of `cols` values:

* Q4_0 (32 values, 18 bytes): f16 `d`, 16 bytes of nibbles; value = `(q - 8) * d`.
* Q4_1 (32, 20): f16 `d`, f16 `m`, 16 bytes; value = `q * d + m`.
* Q8_0 (32, 34): f16 `d`, 32 int8; value = `q * d`.
* Q4_K (256, 144): f16 `d`, f16 `dmin`, 12 bytes of 6-bit sub-block scales and mins, 128 bytes
  of nibbles in four 64-value chunks (low nibbles the chunk's first 32 values, high nibbles
  its last 32); value = `q * (d * sc) - dmin * m` per 32-value sub-block.
* Q6_K (256, 210): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales,
  f16 `d`; value = `(q - 32) * (d * sc)` per 16-value sub-block.

Only this tensor's bytes are touched (a memory-mapped view in, compact arrays out); no float
copy of the tensor is made.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.quant.matrix import QuantizedMatrix

# GGUF type name -> (values per block, bytes per block) of the types kept as blocks.
STORED_TYPES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}


class BlockLayoutError(ValueError):
    """A tensor whose bytes do not fit its block type (row length, byte count)."""


def check_block_shape(type_name: str, rows: int, cols: int, nbytes: int) -> str | None:
    """What is wrong with a `[rows, cols]` tensor of `type_name` holding `nbytes`, or None."""
    values, size = STORED_TYPES[type_name]
    if cols % values:
        return f"row length {cols} is not a multiple of {type_name}'s block of {values} values"
    expected = rows * (cols // values) * size
    if nbytes != expected:
        return f"holds {nbytes} bytes, {type_name} [{rows}, {cols}] needs {expected}"
    return None


def repack(type_name: str, raw: np.ndarray, rows: int, cols: int) -> QuantizedMatrix:
    """The `QuantizedMatrix` of a GGUF tensor's raw bytes (`[rows, cols]` values)."""
    problem = check_block_shape(type_name, rows, cols, int(raw.size))
    if problem is not None:
        raise BlockLayoutError(problem)
    values, size = STORED_TYPES[type_name]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // values, size)
    return _REPACKERS[type_name](blocks, rows, cols)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _q4_0(blocks: np.ndarray, rows: int, cols: int) -> QuantizedMatrix:
    # Symmetric blocks: value = (q - 8) * d, so no mins are stored (min = -8 * d).
    return QuantizedMatrix(
        kind="q4",
        source="Q4_0",
        rows=rows,
        cols=cols,
        block=32,
        qs=_tensor(blocks[..., 2:].reshape(rows, cols // 2)),
        scales=_tensor(_f16(blocks, 0)),
    )


def _q4_1(blocks: np.ndarray, rows: int, cols: int) -> QuantizedMatrix:
    return QuantizedMatrix(
        kind="q4",
        source="Q4_1",
        rows=rows,
        cols=cols,
        block=32,
        qs=_tensor(blocks[..., 4:].reshape(rows, cols // 2)),
        scales=_tensor(_f16(blocks, 0)),
        mins=_tensor(_f16(blocks, 2)),
    )


def _q8_0(blocks: np.ndarray, rows: int, cols: int) -> QuantizedMatrix:
    return QuantizedMatrix(
        kind="q8",
        source="Q8_0",
        rows=rows,
        cols=cols,
        block=32,
        qs=_tensor(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)),
        scales=_tensor(_f16(blocks, 0)),
    )


def _k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's eight 6-bit scales and mins per super-block, from its 12 bytes."""
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(blocks: np.ndarray, rows: int, cols: int) -> QuantizedMatrix:
    supers = cols // 256
    d = _f16(blocks, 0).astype(np.float32)[..., None]
    dmin = _f16(blocks, 2).astype(np.float32)[..., None]
    sc, mn = _k4_scales(blocks[..., 4:16])
    scales = d * sc.astype(np.float32)
    mins = -(dmin * mn.astype(np.float32))
    chunks = blocks[..., 16:].reshape(rows, supers, 4, 32)
    # Each 64-value chunk: sub-block 2c is the low nibbles, 2c + 1 the high nibbles.
    values = np.stack([chunks & 0x0F, chunks >> 4], axis=3).reshape(rows, supers * 8, 32)
    packed = values[..., :16] | (values[..., 16:] << 4)
    return QuantizedMatrix(
        kind="q4",
        source="Q4_K",
        rows=rows,
        cols=cols,
        block=32,
        qs=_tensor(packed.reshape(rows, cols // 2).astype(np.uint8)),
        scales=_tensor(scales.reshape(rows, supers * 8)),
        mins=_tensor(mins.reshape(rows, supers * 8)),
    )


def _q6_k(blocks: np.ndarray, rows: int, cols: int) -> QuantizedMatrix:
    supers = cols // 256
    ql = blocks[..., 0:128].reshape(rows, supers, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks, 208).astype(np.float32)[..., None]
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    low = low.reshape(rows, supers, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    q = (low | (high << 4)).astype(np.int16) - 32
    return QuantizedMatrix(
        kind="q8",
        source="Q6_K",
        rows=rows,
        cols=cols,
        block=16,
        qs=_tensor(q.astype(np.int8).reshape(rows, cols)),
        scales=_tensor((d * sc).reshape(rows, supers * 16)),
    )


_REPACKERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def permute_rows(matrix: QuantizedMatrix, order: torch.Tensor) -> QuantizedMatrix:
    """`matrix` with its rows taken in `order` (undoing llama.cpp's Q/K row interleave)."""
    return QuantizedMatrix(
        kind=matrix.kind,
        source=matrix.source,
        rows=matrix.rows,
        cols=matrix.cols,
        block=matrix.block,
        qs=matrix.qs.index_select(0, order).contiguous(),
        scales=matrix.scales.index_select(0, order).contiguous(),
        mins=None if matrix.mins is None else matrix.mins.index_select(0, order).contiguous(),
    )
