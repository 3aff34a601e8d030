"""GGUF block encoders for tests: every type the runtime reads, K types included.

Why: the `gguf` package dequantizes every type but quantizes none of the K types, and the tests
need Q4_K, Q5_K and Q6_K files. The K encoders here are plain min/max (not llama.cpp's
error-minimising search): each block they produce is a valid ggml block, which is all a
loader test needs. The other types go through `gguf.quants.quantize`.

ggml K layouts (256 values per super-block), as written here:

* Q4_K (144 bytes): f16 `d`, f16 `dmin`, 12 bytes of eight 6-bit scales and mins, 128 bytes of
  nibbles (chunk c of 32 bytes: low nibbles sub-block 2c, high nibbles sub-block 2c + 1);
  value = `d * sc * q - dmin * m`, q in 0..15 per 32-value sub-block.
* Q5_K (176 bytes): as Q4_K plus 32 bytes `qh` before the nibbles: bit i of byte j is the
  fifth bit of value j of sub-block i; q in 0..31.
* Q6_K (210 bytes): 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 `d`;
  value = `d * sc * (q - 32)` per 16-value sub-block.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

F32Array = npt.NDArray[np.float32]
U8Array = npt.NDArray[np.uint8]

SUPER = 256

# Type name -> (values per block, bytes per block), for every type the test files use.
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
QUANTIZED_TYPES: tuple[str, ...] = tuple(t for t in BLOCK_SIZES if t not in ("F32", "F16"))


def _f16_bytes(values: F32Array) -> U8Array:
    """`[n]` float32 -> `[n, 2]` bytes of their float16 (little-endian, as ggml stores)."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _f16_round(values: F32Array) -> F32Array:
    return values.astype(np.float16).astype(np.float32)


def _safe_div(num: F32Array, den: F32Array) -> F32Array:
    """`num / den`, 0 where `den` is 0 (all-zero blocks)."""
    out = np.zeros(np.broadcast_shapes(num.shape, den.shape), dtype=np.float32)
    np.divide(num, den, out=out, where=den != 0)
    return out


def _k_scales(x: F32Array, levels: int) -> tuple[F32Array, F32Array, U8Array, U8Array, U8Array]:
    """Super-block `d`, `dmin` (f16-rounded), 6-bit scales and mins, and q of Q4_K/Q5_K.

    `x` is `[n, 8, 32]`; each sub-block gets `value = s * q - m` with `m = -min(x, 0)` and
    `s = (max - min) / levels`; `s` and `m` are then stored as 6-bit multiples of `d`, `dmin`.
    """
    low = np.minimum(x.min(axis=-1), 0.0)
    high = x.max(axis=-1)
    sub_scale = ((high - low) / levels).astype(np.float32)
    sub_min = (-low).astype(np.float32)
    d = _f16_round(sub_scale.max(axis=-1) / 63.0)
    dmin = _f16_round(sub_min.max(axis=-1) / 63.0)
    sc = np.clip(np.rint(_safe_div(sub_scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(sub_min, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc.astype(np.float32)
    offset = dmin[:, None] * mn.astype(np.float32)
    q = np.rint(_safe_div(x + offset[..., None], step[..., None]))
    return d, dmin, sc, mn, np.clip(q, 0, levels).astype(np.uint8)


def _pack_k_scales(sc: U8Array, mn: U8Array) -> U8Array:
    """Eight 6-bit scales and mins -> ggml's 12 bytes (the upper four split over two bytes)."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def _pack_nibbles(q: U8Array) -> U8Array:
    """`[n, 8, 32]` 4-bit values -> 128 bytes: sub-block 2c low nibbles, 2c + 1 high."""
    low = q[:, 0::2, :] & 0x0F
    high = q[:, 1::2, :] & 0x0F
    return (low | (high << 4)).reshape(-1, 128).astype(np.uint8)


def _super_blocks(x: F32Array) -> F32Array:
    if x.ndim != 2 or x.shape[1] % SUPER:
        raise ValueError(
            f"x of shape {list(x.shape)} is invalid: allowed is [rows, cols] with cols a "
            f"multiple of {SUPER} (one K super-block)"
        )
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1, SUPER)


def encode_q4_k(x: F32Array) -> U8Array:
    """`[rows, cols]` float32 -> Q4_K bytes `[rows, cols / 256 * 144]`."""
    rows = x.shape[0]
    d, dmin, sc, mn, q = _k_scales(_super_blocks(x).reshape(-1, 8, 32), 15)
    blocks = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), _pack_nibbles(q)]
    return np.concatenate(blocks, axis=1).reshape(rows, -1)


def encode_q5_k(x: F32Array) -> U8Array:
    """`[rows, cols]` float32 -> Q5_K bytes `[rows, cols / 256 * 176]`."""
    rows = x.shape[0]
    d, dmin, sc, mn, q = _k_scales(_super_blocks(x).reshape(-1, 8, 32), 31)
    fifth = ((q >> 4) & 1).astype(np.uint8)  # [n, 8 sub-blocks, 32 values]
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qh = np.bitwise_or.reduce(fifth << shifts, axis=1).astype(np.uint8)  # [n, 32]
    blocks = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qh, _pack_nibbles(q)]
    return np.concatenate(blocks, axis=1).reshape(rows, -1)


def encode_q6_k(x: F32Array) -> U8Array:
    """`[rows, cols]` float32 -> Q6_K bytes `[rows, cols / 256 * 210]`.

    Each 16-value sub-block's scale maps its largest-magnitude value to -32 (q in -32..31);
    the sixteen scales are int8 multiples of the super-block's f16 `d`.
    """
    rows = x.shape[0]
    sub = _super_blocks(x).reshape(-1, 16, 16)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    sub_scale = (peak / -32.0).astype(np.float32)
    d = _f16_round(np.abs(sub_scale).max(axis=-1) / 127.0)
    sc = np.clip(np.rint(_safe_div(sub_scale, d[:, None])), -127, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = np.clip(np.rint(_safe_div(sub, step[..., None])), -32, 31).astype(np.int16) + 32
    # Value v of a super-block: half h = v // 128, row r = (v % 128) // 32, column v % 32.
    q6 = q.astype(np.uint8).reshape(-1, 2, 4, 32)
    low = q6 & 0x0F
    ql = (low[:, :, 0:2, :] | (low[:, :, 2:4, :] << 4)).reshape(-1, 128)
    pairs = (q6 >> 4) & 0x03
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = np.bitwise_or.reduce(pairs << shifts, axis=2).reshape(-1, 64)
    blocks = [ql.astype(np.uint8), qh.astype(np.uint8), sc.view(np.uint8), _f16_bytes(d)]
    return np.concatenate(blocks, axis=1).reshape(rows, -1)


_OWN_ENCODERS: dict[str, Callable[[F32Array], U8Array]] = {
    "Q4_K": encode_q4_k,
    "Q5_K": encode_q5_k,
    "Q6_K": encode_q6_k,
}


def encode(x: npt.NDArray[np.floating], type_name: str) -> npt.NDArray[np.generic]:
    """`x` `[rows, cols]` in GGUF type `type_name`: float32/float16 values for F32/F16, else the
    uint8 block bytes `[rows, cols / block * bytes]` as `GGUFWriter.add_tensor` takes them."""
    if type_name not in BLOCK_SIZES:
        raise ValueError(f"type_name={type_name!r} is unknown: allowed are {list(BLOCK_SIZES)}")
    values = np.ascontiguousarray(x, dtype=np.float32)
    block = BLOCK_SIZES[type_name][0]
    if values.ndim != 2 or values.shape[1] % block:
        raise ValueError(
            f"x of shape {list(values.shape)} is invalid for {type_name}: allowed is [rows, cols] "
            f"with cols a multiple of {block}"
        )
    if type_name == "F32":
        return values
    if type_name == "F16":
        return values.astype(np.float16)
    if type_name in _OWN_ENCODERS:
        return _OWN_ENCODERS[type_name](values)
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    out: npt.NDArray[np.uint8] = gguf.quants.quantize(values, qtype)
    return out


def decode(raw: npt.NDArray[np.generic], type_name: str) -> F32Array:
    """The `gguf` package's dequantization of `raw` (the reference every test holds to)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    out: F32Array = gguf.quants.dequantize(np.asarray(raw), qtype).astype(np.float32)
    return out
