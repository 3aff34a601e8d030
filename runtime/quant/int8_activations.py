"""How far a block product with int8 activations may be from the exact one.

The `q_int8` form and the fused stack's int8 variant (`native/quant_blocks_i8.h`) round each
block of `block` activation values x_b to integers in steps of d_b = max|x_b| / 127, so each
rounded value is off by at most d_b / 2. Only the weights' `q * scale` part meets the rounded
values (a q4 block's `min * sum(x_b)` uses the exact float sum), so per output

    |y_int8 - y| <= sum_i |q_i * scale_i| * d_(block of i) / 2

plus the float32 accumulation's share, held like the float forms' (`1e-4 * |W| @ |x| + 1e-5`).
Tests assert products against this bound; it is also why the form is not bit-equal to the
others and is kept only where warmup measures it faster.
"""

from __future__ import annotations

import torch

from runtime.quant.matrix import QuantizedMatrix

ACCUMULATION_RELATIVE = 1e-4
ACCUMULATION_ABSOLUTE = 1e-5


def activation_block(matrix: QuantizedMatrix) -> int:
    """Values per activation step: a q4 block (32) or the q8 weight's block."""
    return 32 if matrix.kind == "q4" else matrix.block


def activation_steps(x: torch.Tensor, block: int) -> torch.Tensor:
    """d_b per row and block of `x` `[R, cols]`: `[R, cols / block]` float64."""
    blocks = x.double().reshape(x.shape[0], -1, block)
    steps: torch.Tensor = blocks.abs().amax(dim=-1) / 127.0
    return steps


def error_bound(matrix: QuantizedMatrix, x: torch.Tensor) -> torch.Tensor:
    """The largest `|y_int8 - x @ W^T|` allowed per output, `[R, rows]` float64 (see above)."""
    weight = matrix.dequantize().double()
    meets_rounded = weight
    if matrix.mins is not None:
        mins = matrix.mins.double().repeat_interleave(matrix.block, dim=1)
        meets_rounded = weight - mins
    block = activation_block(matrix)
    steps = activation_steps(x, block).repeat_interleave(block, dim=1)
    rounding = 0.5 * steps @ meets_rounded.abs().T
    accumulation = ACCUMULATION_RELATIVE * (x.double().abs() @ weight.abs().T)
    return rounding + accumulation + ACCUMULATION_ABSOLUTE
