"""The fused decode path: every decoder layer of a few-row float32 decode step in one native call.

Projections held in quantized blocks (`--weights stored`) run the same stack over a parts
table (`native_kernels.stack_parts_table`): each block is unpacked in registers as it
streams, with float32 activations and accumulators, so a decode step reads the file's bytes;
or, where warmup measured it faster, with q4 blocks meeting activations rounded to int16 per
block (VNNI, `native/quant_blocks_i16.h`), or (`--weights stored-int8`) with the activations
quantized to int8 per block.

Why: at batch 1 the per-op path runs about 1,000 small torch ops a step (norms, rotary,
views, copies, residual adds) around the weight-streaming products; their overhead is a
third of the step. `runtime/backends/native/fused_decode_layers.c` runs the whole stack in
one OpenMP region instead, streaming each weight once in the layout the kernel plan chose,
writing K/V into the paged cache and attending over the row's pages in place. The final norm
runs in the same call, and in the buckets where warmup measured it faster
(`KernelPlan.fused_head`) the LM head too, as its last stage (with the activations of the form
the plan measured for the head at that bucket: int16 or int8 where it chose those, float32
otherwise); the embedding lookup stays outside.

Warmup decides, per row bucket, whether this path runs (`models.decoder.fused_choice`); the
model's dynamic decode asks `FusedDecodeStack.runs(rows)` (see `DecoderModel.decode_rows`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs
import torch
from torch import nn

from models.decoder import kernels
from models.decoder.attention import LayerCache
from models.decoder.block_forms import BLOCK_FORMS
from models.decoder.config import DecoderArgs
from models.decoder.kernels import FUSED_MAX_ROWS
from models.decoder.layers import DecoderLayer, Projection
from runtime.backends import native_kernels
from runtime.backends.native_kernels import (
    STACK_MAX_PARTS,
    STACK_TABLE_WIDTH,
    DecodeStackGeometry,
    StackHead,
    StackPart,
    stack_head_parts,
)


class StackSource(Protocol):
    """What the fused stack reads of the model it runs (`DecoderModel`; not imported here)."""

    @property
    def args(self) -> DecoderArgs: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def layers(self) -> Iterable[nn.Module]: ...

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    @property
    def final_norm_weight(self) -> torch.Tensor: ...

    @property
    def head_projection(self) -> Projection: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def uses_graph_safe_path(self) -> bool: ...

    def fused_decode_unsupported(self) -> str | None: ...


_LAYOUT_CODES = {"out_in": 0, "in_out": 1}
_PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


def fused_unsupported_reason(model: StackSource) -> str | None:
    """Why this model cannot decode through the fused stack, or None when it can (the
    family's answer first: a family the stack does not know runs the per-op path)."""
    family_reason = model.fused_decode_unsupported()
    if family_reason is not None:
        return family_reason
    if model.dtype != torch.float32:
        return f"the fused decode stack is float32 only, the model is {model.dtype}"
    if model.device.type != "cpu":
        return f"the fused decode stack is CPU-only, the model is on {model.device.type}"
    if model.uses_graph_safe_path():
        return "the model runs the graph-safe decode (the fused stack is dynamic-path only)"
    for layer in model.layers:
        for name in _PROJECTIONS:
            held = getattr(layer, name, None)
            if (
                isinstance(held, Projection)
                and held.blocks is not None
                and len(held.blocks) > STACK_MAX_PARTS
            ):
                return (
                    f"the fused decode stack takes at most {STACK_MAX_PARTS} block parts per "
                    f"projection, {name} has {len(held.blocks)}"
                )
    return native_kernels.unavailable_reason()


def _layer_addresses(layer: DecoderLayer, cache: LayerCache) -> list[int]:
    """One row of the kernel's layer table (order fixed by `fused_decode_layers.c`); a
    projection held in blocks has address 0 there (the parts table holds it)."""
    held: list[Projection | torch.Tensor] = [
        layer.input_layernorm.weight,
        layer.wqkv,
        layer.wo,
        layer.post_attention_layernorm.weight,
        layer.w_gate_up,
        layer.w_down,
        cache[0],
        cache[1],
    ]
    addresses = []
    for item in held:
        if isinstance(item, Projection) and item.blocks is not None:
            addresses.append(0)
            continue
        tensor = item.weight if isinstance(item, Projection) else item
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError("the fused decode stack needs contiguous float32 weights and caches")
        addresses.append(tensor.data_ptr())
    return addresses


def _stack_parts(layer: DecoderLayer) -> list[list[StackPart]]:
    """A layer's four projections as the mixed stack's parts (blocks, or the float weight)."""
    parts: list[list[StackPart]] = []
    for name in _PROJECTIONS:
        projection = _projection(layer, name)
        held = projection.blocks
        parts.append(list(held) if held is not None else [projection.weight])
    return parts


class FusedDecodeStack:
    """The fused path for one model as its kernel plan laid it out, for the buckets `rows`.

    Built when a plan that chose it is applied (the projections' layouts are fixed from
    then on); the layer table of a bound cache is built once and reused while the same
    cache stays bound.
    """

    def __init__(
        self,
        model: StackSource,
        buckets: Sequence[int],
        rows: Sequence[int],
        *,
        activations: str = "float32",
        spread_attention: bool = False,
        head_rows: Iterable[int] | None = None,
    ) -> None:
        """`activations`: how block weights meet their activations (the plan's
        `fused_activations`: "float32", "int16" or "int8"); `spread_attention`: the
        attention's prefetch placement (the plan's `decode_attention` is
        "paged_inplace_spread"); `head_rows`: the buckets of `rows` whose steps run the LM
        head in the call (the plan's `fused_head`; None: `kernels.head_in_call_by_default`)."""
        args = model.args
        self.activations = activations
        self.spread_attention = spread_attention
        self._model = model
        self._buckets = tuple(sorted(buckets))
        self._rows = frozenset(rows)
        if head_rows is None:
            head_rows = filter(kernels.head_in_call_by_default, rows)
        self._head_rows = frozenset(head_rows)
        self._kernel = native_kernels.fused_decode_layers()
        layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
        self._layers = layers
        self._layouts = torch.tensor(
            [_LAYOUT_CODES[_projection(layers[0], name).layout] for name in _PROJECTIONS],
            dtype=torch.int64,
        )
        self._geometry = DecodeStackGeometry(
            n_layers=args.n_layers,
            dim=args.dim,
            n_heads=args.n_heads,
            n_kv_heads=args.n_kv_heads,
            head_dim=args.head_dim,
            ffn_dim=args.ffn_dim,
            block_size=0,
            norm_eps=args.norm_eps,
        )
        self._table_for: tuple[LayerCache, ...] | None = None
        self._table = torch.empty(0, STACK_TABLE_WIDTH, dtype=torch.int64)
        # Block weights run the mixed stack; its parts table holds their addresses, so it is
        # built on first use after the plan laid the weights out, and again after they moved.
        self._mixed = any(
            _projection(layer, n).blocks is not None for layer in layers for n in _PROJECTIONS
        )
        self._parts: torch.Tensor | None = None
        self._head_parts: dict[str, torch.Tensor] = {}

    def forget_addresses(self) -> None:
        """Rebuild the layer and parts tables on the next call (the weights moved: sleep,
        wake, reload)."""
        self._table_for = None
        self._parts = None
        self._head_parts.clear()

    def _head_for(self, rows: int) -> torch.Tensor | None:
        """The head's parts entry for a `rows` step, or None where it runs in its own call."""
        if self._bucket_of(rows) not in self._head_rows:
            return None
        head = self._model.head_projection
        blocks = head.blocks
        form = None if head.choice is None or blocks is None else head.choice.form_for(rows)
        activations = "float32" if form is None else BLOCK_FORMS[form].activations
        parts = self._head_parts.get(activations)
        if parts is None:
            args = self._model.args
            held: list[StackPart] = list(blocks) if blocks is not None else [head.weight]
            layout = _LAYOUT_CODES[head.layout]
            parts = stack_head_parts(
                held, layout, args.dim, args.vocab_size, activations=activations
            )
            self._head_parts[activations] = parts
        return parts

    def _parts_table(self) -> torch.Tensor:
        if self._parts is None:
            self._parts = native_kernels.stack_parts_table(
                self._geometry,
                [_stack_parts(layer) for layer in self._layers],
                self._layouts.tolist(),
                activations=self.activations,
            )
        return self._parts

    def _bucket_of(self, rows: int) -> int | None:
        """The bucket a decode of `rows` active rows runs in (None: past the stack's)."""
        if rows > FUSED_MAX_ROWS:
            return None
        return next((bucket for bucket in self._buckets if rows <= bucket), None)

    def runs(self, rows: int) -> bool:
        """Whether a decode of `rows` active rows takes this path (its bucket chose it)."""
        return self._bucket_of(rows) in self._rows

    def _table_of(self, cache: tuple[LayerCache, ...]) -> torch.Tensor:
        if self._table_for is not cache:
            pairs = zip(self._layers, cache, strict=True)
            rows = [_layer_addresses(layer, layer_cache) for layer, layer_cache in pairs]
            self._table = torch.tensor(rows, dtype=torch.int64)
            self._table_for = cache
        return self._table

    def logits(
        self,
        cache: tuple[LayerCache, ...],
        block_size: int,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        pages: torch.Tensor,
    ) -> torch.Tensor:
        """float32 logits `[rows, vocab]` of active rows (`tokens`, `pos` `[rows]`, `pages`
        `[rows, W]`, long, validated by the decode), their K/V written. The final norm runs
        in the native call, and in the buckets of `head_rows` the head too; elsewhere the
        head runs in its own call, in its plan form."""
        rows = tokens.shape[0]
        parts = self._head_for(rows)
        head = None
        if parts is not None:
            head = StackHead(parts=parts, logits=torch.empty(rows, self._model.args.vocab_size))
        model = self._model
        x = model.embed(tokens).contiguous()
        cos, sin = model.rope
        norm = model.final_norm_weight
        geometry = self._geometry
        if geometry.block_size != block_size:
            geometry = attrs.evolve(geometry, block_size=block_size)
            self._geometry = geometry
        table = self._table_of(cache)
        step = (x, cos, sin, pages.contiguous(), (pos + 1).contiguous(), norm, head)
        spread = self.spread_attention
        if not self._mixed:
            self._kernel.unchecked(geometry, table, self._layouts, *step, spread=spread)
        else:
            self._kernel.unchecked_mixed(geometry, table, self._parts_table(), *step, spread=spread)
        if head is not None:
            return head.logits
        product: torch.Tensor = model.head_projection(x)
        return product.float()


def _projection(layer: DecoderLayer, name: str) -> Projection:
    projection = getattr(layer, name)
    assert isinstance(projection, Projection)
    return projection
