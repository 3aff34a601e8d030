"""GGUF block bytes for the quantized-kernel tests, and the `gguf` package's dequantization."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import torch

from runtime.quant.gguf_blocks import STORED_TYPES

QUANTIZED_BY_GGUF = ("Q4_0", "Q4_1", "Q8_0")
# Byte offsets of the float16 super-block scales (d, dmin) random K-type bytes must keep sane.
K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def raw_blocks(
    type_name: str, rows: int, cols: int, seed: int, magnitude: float = 1.0
) -> np.ndarray:
    """A GGUF tensor's bytes `[rows, bytes per row]`: `gguf`'s quantization of normal weights
    times `magnitude` where it has a quantizer (Q4_0, Q4_1, Q8_0), else random blocks whose
    float16 super-block scales are finite, positive and small (uniform in
    `[1e-3, 5e-2] * magnitude`)."""
    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    if type_name in QUANTIZED_BY_GGUF:
        weights = (rng.standard_normal((rows, cols)) * magnitude).astype(np.float32)
        return np.asarray(gguf.quants.quantize(weights, qtype))
    values, size = STORED_TYPES[type_name]
    blocks = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[type_name]:
        scale = rng.uniform(1e-3 * magnitude, 5e-2 * magnitude, (rows, cols // values))
        blocks[..., offset : offset + 2] = (
            scale.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
        )
    return blocks.reshape(rows, -1)


def gguf_reference(type_name: str, raw: np.ndarray) -> torch.Tensor:
    """The exact weight of `raw` (float64), as the `gguf` package dequantizes it."""
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float64))
