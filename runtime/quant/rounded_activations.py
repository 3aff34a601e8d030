"""How far a block product with rounded (int8 or int16) activations may be from the exact one.

Two native forms round each block of `block` activation values x_b to integers in steps of
d_b = max|x_b| / levels, so each rounded value is off by at most d_b / 2:

- int8 (`levels` 127): the `q_int8` form and the fused stack's int8 variant
  (`native/quant_blocks_i8.h`), only with `--weights stored-int8`;
- int16 (`levels` 32767): the `q_int16` form and the fused stack's int16 variant over q4
  blocks (`native/quant_blocks_i16.h`), on CPUs with AVX-512 VNNI, candidates warmup keeps
  where they measure faster; 258x finer than int8.

Only the weights' `q * scale` part meets the rounded values (a q4 block's `min * sum(x_b)`
uses the exact float sum), so per output

    |y_rounded - y| <= sum_i |q_i * scale_i| * d_(block of i) / 2

plus the float32 accumulation's share, held like the float forms' (`1e-4 * |W| @ |x| + 1e-5`).
Tests assert products against this bound.
"""

from __future__ import annotations

import torch

from runtime.quant.matrix import QuantizedMatrix

INT8_LEVELS = 127
INT16_LEVELS = 32767
ACCUMULATION_RELATIVE = 1e-4
ACCUMULATION_ABSOLUTE = 1e-5


def activation_block(matrix: QuantizedMatrix) -> int:
    """Values per activation step: a q4 block (32) or the q8 weight's block."""
    return 32 if matrix.kind == "q4" else matrix.block


def activation_steps(x: torch.Tensor, block: int, levels: int = INT8_LEVELS) -> torch.Tensor:
    """d_b per row and block of `x` `[R, cols]`: `[R, cols / block]` float64."""
    blocks = x.double().reshape(x.shape[0], -1, block)
    steps: torch.Tensor = blocks.abs().amax(dim=-1) / float(levels)
    return steps


def error_bound(
    matrix: QuantizedMatrix, x: torch.Tensor, levels: int = INT8_LEVELS
) -> torch.Tensor:
    """The largest `|y_rounded - x @ W^T|` allowed per output, `[R, rows]` float64 (see
    above), for activations rounded to `levels` steps either side of zero."""
    weight = matrix.dequantize().double()
    meets_rounded = weight
    block_mins = matrix.block_mins()
    if block_mins is not None:
        meets_rounded = weight - block_mins.double().repeat_interleave(matrix.block, dim=1)
    block = activation_block(matrix)
    steps = activation_steps(x, block, levels).repeat_interleave(block, dim=1)
    rounding = 0.5 * steps @ meets_rounded.abs().T
    accumulation = ACCUMULATION_RELATIVE * (x.double().abs() @ weight.abs().T)
    return rounding + accumulation + ACCUMULATION_ABSOLUTE
