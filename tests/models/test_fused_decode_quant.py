"""The mixed fused decode stack (projections as float32 or quantized parts) equals the per-op
decode of the same model whose weights are the parts' dequantized values."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from models.decoder import DecoderModel, random_state_dict
from models.decoder.fused_decode import FusedDecodeStack
from models.decoder.layers import DecoderLayer
from models.llama import LlamaArgs
from runtime.backends import native_kernels
from runtime.backends.native_kernels import (
    STACK_PROJECTIONS,
    DecodeStackGeometry,
    FusedDecodeLayers,
    StackPart,
)
from runtime.quant.gguf_blocks import repack
from runtime.quant.matrix import QuantizedMatrix
from runtime.quant.rounded_activations import INT8_LEVELS, INT16_LEVELS, activation_block
from tests.runtime.quant_fixtures import raw_blocks

REASON = native_kernels.unavailable_reason()
pytestmark = pytest.mark.skipif(
    REASON is not None, reason=f"the native CPU kernels need a C compiler (gcc): {REASON}"
)
INT8 = REASON is None and native_kernels.quant_matmul().int8_available
# The int8 variant against a per-op reference that rounds each part's input the same way
# (`_round_like_kernel`). Layer 0's K/V come from the same input rounded the same way: equal up
# to float32 order. Past the first projection, an activation that the two float orders put
# on either side of a rounding boundary moves to the neighbouring step and shifts every
# output it feeds by that step times its weight (measured: up to 0.2% of the largest value),
# so later values are held to a share of their largest magnitude.
INT8_FIRST_KV = {"atol": 1e-3, "rtol": 1e-3}
INT8_LATER_SHARE = 0.01
# The int16 variant rounds q4 parts' inputs (`quant_blocks_i16.h`), except from this many
# rows, where the stack's block products run on exact panels (`fused_decode_layers.c`'s
# BLOCK_PANEL_FROM_ROWS). Against a per-op reference that rounds them the same way, an input
# the two float orders put on either side of a rounding boundary moves one step (1/32767 of
# its block's largest value), shifting what it feeds by that times its weight (measured: up
# to 2e-4).
INT16 = REASON is None and native_kernels.quant_matmul().int16_available
BLOCK_PANEL_FROM_ROWS = 9
INT16_TOLERANCE = {"atol": 1e-3, "rtol": 1e-3}
ACTIVATIONS = ["float32"] + (["int16"] if INT16 else []) + (["int8"] if INT8 else [])
ROWS = tuple(range(1, 10))
# Per projection (qkv, o, gate_up, down): the parts' (type, output rows) or ("F32", rows).
# dim 256, q 256, k = v 128, ffn 512: every K type's 256-value super-blocks fit each input.
MIXES = {
    "q4_k_m-like": (
        (("Q4_K", 256), ("Q4_K", 128), ("Q6_K", 128)),
        (("F32", 256),),
        (("Q4_0", 512), ("Q8_0", 512)),
        (("Q4_1", 256),),
    ),
    "straddling": (
        (("Q8_0", 512),),
        (("Q4_K", 256),),
        (("F32", 512), ("Q6_K", 512)),
        (("Q6_K", 144), ("Q4_0", 80), ("F32", 32)),
    ),
}


class _MixedKernel(FusedDecodeLayers):
    """The fused stack's kernel with the projections taken from a parts table (the model's
    own float32 weights, which hold the same values, are ignored)."""

    def __init__(self, parts: torch.Tensor) -> None:
        self._inner = native_kernels.fused_decode_layers()
        self._parts = parts

    def unchecked(
        self,
        geometry: DecodeStackGeometry,
        table: torch.Tensor,
        layouts: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pages: torch.Tensor,
        n_keys: torch.Tensor,
    ) -> None:
        self._inner.unchecked_mixed(geometry, table, self._parts, x, cos, sin, pages, n_keys)


def _quantize_weights(
    model: DecoderModel, mix: str, layout: int, seed: int
) -> list[list[list[StackPart]]]:
    """Each layer's projections as the mix's parts, the model's weights set to their values."""
    layers: list[list[list[StackPart]]] = []
    for index, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        projections: list[list[StackPart]] = []
        for p, (name, parts) in enumerate(zip(STACK_PROJECTIONS, MIXES[mix], strict=True)):
            weight = getattr(layer, name).weight  # [out, in] (the default layout)
            cols, start, made = weight.shape[1], 0, []
            for k, (type_name, rows) in enumerate(parts):
                rows_of = slice(start, start + rows)
                if type_name == "F32":
                    part = weight[rows_of].contiguous()
                    made.append(part if layout == 0 else part.T.contiguous())
                else:
                    raw = raw_blocks(type_name, rows, cols, seed + 97 * index + 7 * p + k, 0.02)
                    matrix = repack(type_name, raw, rows, cols)
                    with torch.no_grad():
                        weight[rows_of] = matrix.dequantize()
                    made.append(matrix)
                start += rows
            projections.append(made)
        layers.append(projections)
    return layers


def _round_like_kernel(x: torch.Tensor, block: int, levels: int) -> torch.Tensor:
    """x with each block of `block` values rounded to steps of max|x_b| / levels, as
    `qb_prepare_i8` (127) and the int16 `qb_prepare_q4` (32767) round it (float32, ties to
    even); the kernel multiplies it with the weights' `q * scale` (a q4 block's min meets the
    exact sum)."""
    blocks = x.reshape(x.shape[0], -1, block)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, levels / largest, torch.zeros_like(largest))
    return (torch.round(blocks * inverse) * (largest / levels)).reshape(x.shape)


def _rounded_reference(
    model: DecoderModel,
    layers: list[list[list[StackPart]]],
    levels: Callable[[QuantizedMatrix], int],
) -> None:
    """Make the model's per-op projections compute each block part from its input rounded
    as the stack rounds it (`levels(part)` steps either side of zero; 0: not rounded), and
    float32 parts from the exact input."""
    for layer, projections in zip(model.layers, layers, strict=True):
        for name, parts in zip(STACK_PROJECTIONS, projections, strict=True):
            projection = getattr(layer, name)
            weight = projection.weight.detach().clone()  # [out, in]: the parts' values

            def forward(
                x: torch.Tensor, parts: list[StackPart] = parts, weight: torch.Tensor = weight
            ) -> torch.Tensor:
                rows, outs, start = x.reshape(-1, weight.shape[1]), [], 0
                for part in parts:
                    count = part.rows if isinstance(part, QuantizedMatrix) else weight.shape[0]
                    if not isinstance(part, QuantizedMatrix):
                        count = part.shape[0] if part.shape[1] == weight.shape[1] else part.shape[1]
                    held = weight[start : start + count]
                    if not isinstance(part, QuantizedMatrix) or not levels(part):
                        outs.append(rows @ held.T)
                    else:  # q * scale meets the rounded input, a q4 min the exact one
                        mins = torch.zeros_like(held)
                        block_mins = part.block_mins()
                        if block_mins is not None:
                            mins = block_mins.repeat_interleave(part.block, dim=1)
                        rounded = _round_like_kernel(rows, activation_block(part), levels(part))
                        outs.append(rounded @ (held - mins).T + rows @ mins.T)
                    start += count
                return torch.cat(outs, dim=1).reshape(*x.shape[:-1], -1)

            projection.forward = forward


def _geometry(args: LlamaArgs) -> DecodeStackGeometry:
    return DecodeStackGeometry(
        n_layers=args.n_layers,
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        ffn_dim=args.ffn_dim,
        block_size=0,
        norm_eps=args.norm_eps,
    )


# 20 and 33 rows: the stack's block products run on panels from 9 rows (`gemm_panels.h`).
@example(
    mix="straddling",
    layout=0,
    positions=list(range(0, 40, 2)),
    threads=2,
    seed=1,
    activations="float32",
)
@example(
    mix="straddling", layout=0, positions=list(range(33)), threads=3, seed=2, activations="float32"
)
@given(
    mix=st.sampled_from(sorted(MIXES)),
    layout=st.sampled_from([0, 1]),
    positions=st.lists(st.integers(0, 40), min_size=1, max_size=36, unique=True),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**10),
    activations=st.sampled_from(ACTIVATIONS),
)
def test_mixed_stack_equals_the_per_op_decode_of_dequantized_weights(
    mix: str, layout: int, positions: list[int], threads: int, seed: int, activations: str
) -> None:
    """Float32 activations: within float rounding (1e-4). Int16 activations (below
    `BLOCK_PANEL_FROM_ROWS` rows): against the per-op decode whose q4 projections round their
    inputs the same way (`INT16_TOLERANCE`). Int8 activations: against the per-op decode
    whose projections round their inputs as the int8 stack does (see `INT8_FIRST_KV`)."""
    if activations not in ACTIVATIONS:
        return  # an explicit example of a variant this CPU cannot run (no VNNI)
    args = LlamaArgs(
        dim=256,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=64,
        ffn_dim=512,
        head_dim=64,
        max_seq_len=64,
        name="tiny-random-quant-fused",
    )
    model = DecoderModel.from_state_dict(args, random_state_dict(args, seed=seed))
    layers = _quantize_weights(model, mix, layout, seed)
    int8 = activations == "int8"
    int16 = activations == "int16" and len(positions) < BLOCK_PANEL_FROM_ROWS
    if int8:
        _rounded_reference(model, layers, lambda part: INT8_LEVELS)
    elif int16:
        _rounded_reference(
            model,
            layers,
            lambda part: INT16_LEVELS if native_kernels.int16_takes(part) else 0,
        )
    parts = native_kernels.stack_parts_table(
        _geometry(args), layers, (layout,) * 4, activations=activations
    )
    generator = torch.Generator().manual_seed(seed)
    block_size, rows = 4, len(positions)
    width = max(positions) // block_size + 1
    blocks = rows * width
    model.configure_paged_attention(block_size=block_size, max_num_blocks=blocks)
    shape = model.kv_cache_shape(blocks)
    cache = [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(args.n_layers)
    ]
    pages = torch.randperm(blocks, generator=generator).view(rows, width)
    tokens = torch.randint(0, args.vocab_size, (rows,), generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    results = []
    try:
        for mixed in (False, True):
            copy = [(k.clone(), v.clone()) for k, v in cache]
            model.set_kv_cache(copy)
            if mixed:
                stack = FusedDecodeStack(model, ROWS, ROWS)
                stack._kernel = _MixedKernel(parts)  # the stack's inputs, the parts' weights
                model.fused_decode = stack
            try:
                logits = model.decode(
                    tokens, positions=torch.tensor(positions), page_table=pages.to(torch.int32)
                )
            finally:
                model.fused_decode = None
                model.set_kv_cache(None)
            results.append((logits, [t for pair in copy for t in pair]))
    finally:
        torch.set_num_threads(before)
    (per_op, per_op_cache), (fused, fused_cache) = results
    pairs = list(zip([fused, *fused_cache], [per_op, *per_op_cache], strict=True))
    for index, (got, expected) in enumerate(pairs):
        if int16:
            torch.testing.assert_close(got, expected, **INT16_TOLERANCE)
        elif not int8:
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        elif index in (1, 2):  # layer 0's K and V
            torch.testing.assert_close(got, expected, **INT8_FIRST_KV)
        else:
            share = float((got - expected).abs().max() / expected.abs().max())
            assert share <= INT8_LATER_SHARE, f"value {index} off by {share:.4f} of its largest"


def test_parts_table_names_the_bad_projection() -> None:
    args = LlamaArgs(
        dim=64,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        vocab_size=16,
        ffn_dim=64,
        head_dim=32,
        max_seq_len=8,
    )
    geometry = _geometry(args)
    good: list[list[StackPart]] = [
        [torch.zeros(128, 64)],
        [torch.zeros(64, 64)],
        [torch.zeros(128, 64)],
        [torch.zeros(64, 64)],
    ]
    assert native_kernels.stack_parts_table(geometry, [good]).shape == (1, 72)
    short: list[list[StackPart]] = [good[0], good[1], [torch.zeros(100, 64)], good[3]]
    with pytest.raises(ValueError, match="layer 0 w_gate_up: parts hold 100 output rows"):
        native_kernels.stack_parts_table(geometry, [short])
    matrix = repack("Q8_0", raw_blocks("Q8_0", 128, 32, seed=0), 128, 32)
    narrow: list[list[StackPart]] = [[matrix], good[1], good[2], good[3]]
    with pytest.raises(ValueError, match=r"layer 0 wqkv: blocks \[128, 32\]"):
        native_kernels.stack_parts_table(geometry, [narrow])
