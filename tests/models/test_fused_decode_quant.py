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
    StackHead,
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
# to float32 order, except where an input lies within float32 order of a rounding boundary
# (`BOUNDARY`, in steps; seen: -26.499996 steps, rounded one way after the kernel's RMSNorm
# and the other after torch's). Such an input may move one step, so its step times its
# weights is allowed on top (`_boundary_slack`).
# Past the first projection, one moved input makes its row differ by about 1e-3, which puts
# some of that row's later inputs on the other side of their boundaries too, and the moves
# compound through the layers. So later values are held to a share of their largest
# magnitude. Measured over 300 random int8 cases of 1-36 rows: at most 1.75% (the logits),
# median 0.01%; a wrong scale or block shows as tens of percent.
INT8_FIRST_KV = {"atol": 1e-3, "rtol": 1e-3}
BOUNDARY = 1e-4
INT8_LATER_SHARE = 0.05
# The int16 variant rounds q4 parts' inputs (and Q8_0 parts' at one row and on panels, see
# `_int16_rounds`): streamed (`quant_blocks_i16.h`) below this many rows, on int16 panels
# (`gemm_panels_i16.h`'s QI_PANEL_FROM_ROWS) from there on. Against a per-op reference that
# rounds them the same way, an input the two float orders put on either side of a rounding
# boundary moves one step (1/32767 of its block's largest value), shifting what it feeds by
# that times its weight (measured: up to 2e-4).
INT16 = REASON is None and native_kernels.quant_matmul().int16_available
# (the examples below need a value even where the library is missing and the tests skip)
I16_PANEL_FROM_ROWS = native_kernels.quant_matmul().int16_panel_from_rows if REASON is None else 11
INT16_TOLERANCE = {"atol": 1e-3, "rtol": 1e-3}
ACTIVATIONS = ["float32"] + (["int16"] if INT16 else []) + (["int8"] if INT8 else [])
ROWS = tuple(range(1, 37))  # every row count the positions below can make
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
        final_norm: torch.Tensor | None = None,
        head: StackHead | None = None,
        *,
        spread: bool = False,
    ) -> None:
        self._inner.unchecked_mixed(
            geometry,
            table,
            self._parts,
            x,
            cos,
            sin,
            pages,
            n_keys,
            final_norm,
            head,
            spread=spread,
        )


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


def _round_like_kernel(
    x: torch.Tensor, block: int, levels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x with each block of `block` values rounded to steps of max|x_b| / levels, as
    `qb_prepare_i8` (127) and the int16 `qb_prepare_q4` (32767) round it (float32, ties to
    even); the kernel multiplies it with the weights' `q * scale` (a q4 block's min meets the
    exact sum). Also each value's step where it lies within `BOUNDARY` steps of a rounding
    boundary (elsewhere 0): there the kernel's input may round to the neighbouring step."""
    blocks = x.reshape(x.shape[0], -1, block)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, levels / largest, torch.zeros_like(largest))
    scaled = blocks * inverse
    step = (largest / levels).expand_as(blocks)
    near = ((scaled - scaled.floor()) - 0.5).abs() < BOUNDARY
    rounded = torch.round(scaled) * (largest / levels)
    return rounded.reshape(x.shape), torch.where(near, step, 0.0).reshape(x.shape)


def _rounded_reference(
    model: DecoderModel,
    layers: list[list[list[StackPart]]],
    levels: Callable[[QuantizedMatrix], int],
    slack: dict[int, torch.Tensor] | None = None,
) -> None:
    """Make the model's per-op projections compute each block part from its input rounded
    as the stack rounds it (`levels(part)` steps either side of zero; 0: not rounded), and
    float32 parts from the exact input. `slack[0]` gets layer 0's qkv outputs' room for
    inputs on a rounding boundary ([rows, outputs]: the sum of step times |weight|)."""
    for index, (layer, projections) in enumerate(zip(model.layers, layers, strict=True)):
        for name, parts in zip(STACK_PROJECTIONS, projections, strict=True):
            projection = getattr(layer, name)
            weight = projection.weight.detach().clone()  # [out, in]: the parts' values

            def forward(
                x: torch.Tensor,
                parts: list[StackPart] = parts,
                weight: torch.Tensor = weight,
                record: bool = slack is not None and index == 0 and name == "wqkv",
            ) -> torch.Tensor:
                rows, outs, start = x.reshape(-1, weight.shape[1]), [], 0
                room = []
                for part in parts:
                    count = part.rows if isinstance(part, QuantizedMatrix) else weight.shape[0]
                    if not isinstance(part, QuantizedMatrix):
                        count = part.shape[0] if part.shape[1] == weight.shape[1] else part.shape[1]
                    held = weight[start : start + count]
                    if not isinstance(part, QuantizedMatrix) or not levels(part):
                        outs.append(rows @ held.T)
                        room.append(torch.zeros(rows.shape[0], count))
                    else:  # q * scale meets the rounded input, a q4 min the exact one
                        mins = torch.zeros_like(held)
                        block_mins = part.block_mins()
                        if block_mins is not None:
                            mins = block_mins.repeat_interleave(part.block, dim=1)
                        rounded, steps = _round_like_kernel(
                            rows, activation_block(part), levels(part)
                        )
                        outs.append(rounded @ (held - mins).T + rows @ mins.T)
                        room.append(steps @ (held - mins).abs().T)
                    start += count
                if record:
                    assert slack is not None
                    slack[0] = torch.cat(room, dim=1)
                return torch.cat(outs, dim=1).reshape(*x.shape[:-1], -1)

            projection.forward = forward


def _boundary_slack(
    room: torch.Tensor,
    args: LlamaArgs,
    positions: list[int],
    pages: torch.Tensor,
    shape: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's qkv `room` ([rows, outputs]) placed where each row's K and V land in the
    paged cache ([blocks, kv heads, block size, head dim]). A K head's room is its largest
    times 2: rotary mixes each value with another of the same head (|cos| + |sin| <= 2)."""
    q_width, kv_width = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    k_room = room[:, q_width : q_width + kv_width].reshape(-1, args.n_kv_heads, args.head_dim)
    v_room = room[:, q_width + kv_width :].reshape(-1, args.n_kv_heads, args.head_dim)
    k_room = 2 * k_room.amax(dim=-1, keepdim=True).expand_as(k_room)
    k_slack, v_slack = torch.zeros(shape), torch.zeros(shape)
    block_size = shape[2]
    for row, position in enumerate(positions):
        page = int(pages[row, position // block_size])
        k_slack[page, :, position % block_size] = k_room[row]
        v_slack[page, :, position % block_size] = v_room[row]
    return k_slack, v_slack


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


# 20 and 33 rows: the stack's float block products run on panels from 9 rows
# (`gemm_panels.h`); int16 ones stream up to 10 rows and run on int16 panels from 11, in
# groups of 16 rows up to 16 and of 32 past it (17 and 33: a group's last rows are padding).
@example(
    mix="q4_k_m-like",
    layout=0,
    positions=list(range(I16_PANEL_FROM_ROWS - 1)),
    threads=2,
    seed=3,
    activations="int16",
)
@example(
    mix="q4_k_m-like",
    layout=1,
    positions=list(range(I16_PANEL_FROM_ROWS)),
    threads=2,
    seed=4,
    activations="int16",
)
@example(
    mix="straddling", layout=0, positions=list(range(17)), threads=3, seed=5, activations="int16"
)
@example(mix="straddling", layout=0, positions=[9], threads=2, seed=7, activations="int16")
@example(mix="q4_k_m-like", layout=1, positions=[30], threads=3, seed=8, activations="int16")
@example(
    mix="straddling", layout=1, positions=list(range(33)), threads=1, seed=6, activations="int16"
)
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
    """Float32 activations: within float rounding (1e-4 of each value's tensor's largest
    magnitude). Int16 activations (streamed, or on int16 panels from `I16_PANEL_FROM_ROWS`
    rows): against the per-op decode whose q4 projections round their inputs the same way
    (`INT16_TOLERANCE`). Int8 activations: against the per-op decode
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
    room: dict[int, torch.Tensor] = {}
    int16 = activations == "int16"
    if int8:
        _rounded_reference(model, layers, lambda part: INT8_LEVELS, room)
    elif int16:
        _rounded_reference(
            model,
            layers,
            lambda part: INT16_LEVELS if _int16_rounds(part, len(positions)) else 0,
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
            # rounding is relative to the magnitudes summed: a layer-1 V of up to 74 differed
            # by 1.6e-4 (2e-6 of its largest) where a small value sat beside large ones
            scale = max(1.0, float(expected.abs().max()))
            torch.testing.assert_close(got, expected, atol=1e-4 * scale, rtol=1e-4)
        elif index in (1, 2):  # layer 0's K and V
            slack = _boundary_slack(room[0], args, positions, pages, tuple(shape))[index - 1]
            allowed = INT8_FIRST_KV["atol"] + INT8_FIRST_KV["rtol"] * expected.abs() + slack
            worst = float(((got - expected).abs() - allowed).max())
            assert worst <= 0, f"layer 0's {'KV'[index - 1]} off by {worst:.2e} past the bound"
        else:
            share = float((got - expected).abs().max() / expected.abs().max())
            assert share <= INT8_LATER_SHARE, f"value {index} off by {share:.4f} of its largest"


def _int16_rounds(part: QuantizedMatrix, rows: int) -> bool:
    """Whether the int16 stack rounds this part's inputs: q4 blocks always, Q8_0 blocks at
    one row (streamed) and on int16 panels (from `I16_PANEL_FROM_ROWS` rows; float32
    activations at 2-10 rows)."""
    if not native_kernels.int16_takes(part):
        return False
    return part.kind == "q4" or rows == 1 or rows >= I16_PANEL_FROM_ROWS


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
