"""Building blocks of the decoder: rotary tables, projections and the decoder layer."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from models.decoder.block_forms import block_product, default_block_form, take_block_rows
from models.decoder.config import DecoderArgs
from models.decoder.kernels import FORMS, Layout, ProjectionChoice, default_form
from runtime.quant.matrix import QuantizedMatrix, concat_rows


def rope_inv_freq(args: DecoderArgs) -> torch.Tensor:
    """Per-pair rotary frequencies (float32), with the config's scaling applied."""
    # An explicit CPU device: under `torch.device("meta")` (model construction) a factory call
    # would run torch's reference ops, which import sympy and torch.fx (+40 MB resident).
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (args.rope_theta ** (exponents / args.head_dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend the band in between.
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def rope_tables(args: DecoderArgs, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos` and signed `sin` tables `[max_seq_len, head_dim]` for rotate-half rotary.

    The sin table carries the sign of rotate-half (`-sin` on the first half), so applying
    rotary is `x * cos + roll(x, head_dim / 2) * sin`.
    """
    inv_freq = rope_inv_freq(args)
    positions = torch.arange(args.max_seq_len, dtype=torch.int64, device="cpu").float()
    angles = torch.outer(positions, inv_freq)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)
    return cos.to(dtype), sin.to(dtype)


class Projection(nn.Module):
    """A bias-free linear map `x @ W^T`, computed in the form warmup measured fastest.

    The weight is stored once, contiguous, in the layout its `ProjectionChoice` needs:
    `out_in` (`[out, in]`, the HF layout) or `in_out` (`[in, out]`). Until a choice is applied
    (`apply_choice`, from the warmup's kernel plan) the layout is `out_in` and the form is the
    previous fixed policy (`kernels.default_form`). A fused projection (qkv, gate/up) names its
    output `parts`; a split choice computes them one by one from views of the one matrix.

    A weight loaded as `QuantizedMatrix` blocks stays in them (`blocks`: row-stacked
    matrices, one when the parts share a form, else one per part) and runs a block form
    (`block_forms`); `weight` is then an empty placeholder.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        parts: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.parts = parts or (out_features,)
        if sum(self.parts) != out_features:
            raise ValueError(f"parts {self.parts} do not add up to out_features={out_features}")
        self.layout: Layout = "out_in"
        self.choice: ProjectionChoice | None = None
        self.blocks: tuple[QuantizedMatrix, ...] | None = None
        shape = (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        choice = self.choice
        weight = self.weight
        if self.blocks is not None:
            form = default_block_form(count) if choice is None else choice.form_for(count)
            product = block_product(self.blocks, rows, form).to(x.dtype)
        elif choice is None:
            product = FORMS[default_form(count, weight.device.type == "cpu")].compute(weight, rows)
        else:
            compute = FORMS[choice.form_for(count)].compute
            if choice.split:
                dim = 0 if self.layout == "out_in" else 1
                pieces = weight.split_with_sizes(list(self.parts), dim=dim)
                product = torch.cat([compute(piece, rows) for piece in pieces], dim=1)
            else:
                product = compute(weight, rows)
        return product.view(*x.shape[:-1], self.out_features)

    def load(self, weight: torch.Tensor | list[QuantizedMatrix]) -> None:
        """Take a `[out, in]` (HF-layout) weight, stored in the current layout, or its
        row-stacked parts in quantized blocks (kept as blocks)."""
        expected = (self.out_features, self.in_features)
        if isinstance(weight, list):
            shape = (sum(part.rows for part in weight), weight[0].cols)
            if shape != expected or any(part.cols != shape[1] for part in weight):
                raise ValueError(
                    f"block weight has shape {list(shape)}: allowed is {list(expected)}"
                )
            self.blocks = _joined_runs(weight)
            placeholder = torch.empty(0, dtype=self.weight.dtype, device=weight[0].device)
            self.weight = nn.Parameter(placeholder, requires_grad=False)
            return
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight has shape {list(weight.shape)}: allowed is {list(expected)}")
        self.blocks = None
        stored = weight if self.layout == "out_in" else weight.t()
        self.weight = nn.Parameter(stored.contiguous(), requires_grad=False)

    @property
    def block_source(self) -> str:
        """The GGUF types of the block weight (`"Q4_1"`, `"Q4_K+Q6_K"`), or "" for floats."""
        if self.blocks is None:
            return ""
        return "+".join(sorted({name for b in self.blocks for name in b.source.split("+")}))

    @property
    def resident_bytes(self) -> int:
        """Bytes the weight occupies (blocks and scales, or the float matrix)."""
        if self.blocks is not None:
            return sum(block.nbytes for block in self.blocks)
        return self.weight.numel() * self.weight.element_size()

    def embed_rows(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `tokens` of the `[out, in]` weight (a tied head's token embeddings)."""
        if self.blocks is None:
            return F.embedding(tokens, self.hf_weight())
        flat = tokens.reshape(-1)
        if len(self.blocks) == 1:
            rows = take_block_rows(self.blocks[0], flat)
        else:
            rows = torch.empty(flat.shape[0], self.in_features)
            offset = 0
            for block in self.blocks:
                inside = (flat >= offset) & (flat < offset + block.rows)
                rows[inside] = take_block_rows(block, flat[inside] - offset)
                offset += block.rows
        return rows.to(dtype).view(*tokens.shape, self.in_features)

    def apply_choice(self, choice: ProjectionChoice) -> None:
        """Use `choice`; re-lays the weight out (one transposing copy) if its layout differs."""
        if choice.split and len(self.parts) == 1:
            raise ValueError(f"a split choice needs a fused projection, this one has {self.parts}")
        if self.blocks is not None:
            if choice.layout != "out_in" or choice.split:
                raise ValueError("block weights are laid out out_in, unsplit")
            self.choice = choice
            return
        if choice.layout != self.layout:
            flipped = self.weight.detach().t().contiguous()
            self.weight = nn.Parameter(flipped, requires_grad=False)
            self.layout = choice.layout
        self.choice = choice

    def hf_weight(self) -> torch.Tensor:
        """The weight as `[out, in]` (a view, no copy; transposed in the `in_out` layout).

        A block weight is dequantized (a float copy: for oracles and exports, not serving).
        """
        if self.blocks is not None:
            return torch.cat([block.dequantize() for block in self.blocks]).to(self.weight.dtype)
        weight = self.weight.detach()
        return weight if self.layout == "out_in" else weight.t()

    def extra_repr(self) -> str:
        held = f"blocks={self.block_source}" if self.blocks is not None else f"layout={self.layout}"
        return f"in={self.in_features}, out={self.out_features}, {held}"


class _Placement(TypedDict):
    """Where a layer's parameters are created (the torch factory keywords)."""

    dtype: torch.dtype
    device: torch.device


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, projections fused (qkv and gate/up).

    With `args.qk_norm` each query and key head is RMS-normalised (`q_norm`, `k_norm`, over
    `head_dim`) before rotary, as Qwen3 does.

    The MLP block is the part a family swaps (routed experts instead of dense SwiGLU): a
    subclass overrides `build_mlp`, `mlp`, `load_mlp`, `mlp_tensors`, `mlp_shapes` and
    `MLP_PROJECTIONS`, and its model class names it as `layer_class`; the attention, norms,
    paged cache and every runtime path stay shared.
    """

    ATTENTION_PROJECTIONS: ClassVar[tuple[str, ...]] = ("wqkv", "wo")
    MLP_PROJECTIONS: ClassVar[tuple[str, ...]] = ("w_gate_up", "w_down")

    def __init__(self, args: DecoderArgs, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        q_out = args.n_heads * args.head_dim
        kv_out = args.n_kv_heads * args.head_dim
        kw: _Placement = {"dtype": dtype, "device": device}
        self.input_layernorm = nn.RMSNorm(args.dim, eps=args.norm_eps, **kw)
        self.wqkv = Projection(args.dim, q_out + 2 * kv_out, parts=(q_out, kv_out, kv_out), **kw)
        self.wo = Projection(q_out, args.dim, **kw)
        self.q_norm: nn.RMSNorm | None = None
        self.k_norm: nn.RMSNorm | None = None
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps, **kw)
            self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps, **kw)
        self.post_attention_layernorm = nn.RMSNorm(args.dim, eps=args.norm_eps, **kw)
        self._q_kv_out = (q_out, kv_out)
        self.build_mlp(args, dtype, device)

    # ------------------------------------------------------------------ weight names
    @classmethod
    def weight_shapes(cls, args: DecoderArgs) -> dict[str, tuple[int, ...]]:
        """Canonical suffix (within the layer) -> shape of every tensor this layer loads."""
        q_out = args.n_heads * args.head_dim
        kv_out = args.n_kv_heads * args.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (args.dim,),
            "self_attn.q_proj.weight": (q_out, args.dim),
            "self_attn.k_proj.weight": (kv_out, args.dim),
            "self_attn.v_proj.weight": (kv_out, args.dim),
            "self_attn.o_proj.weight": (args.dim, q_out),
        }
        if args.qk_norm:
            shapes["self_attn.q_norm.weight"] = (args.head_dim,)
            shapes["self_attn.k_norm.weight"] = (args.head_dim,)
        shapes["post_attention_layernorm.weight"] = (args.dim,)
        shapes.update(cls.mlp_shapes(args))
        return shapes

    @classmethod
    def projection_names(cls) -> tuple[str, ...]:
        """The attributes holding this layer's `Projection`s (what a kernel plan covers)."""
        return (*cls.ATTENTION_PROJECTIONS, *cls.MLP_PROJECTIONS)

    def load_canonical(self, tensor: Callable[[str], WeightValue]) -> None:
        """Take this layer's weights from canonical (HF) tensors, `tensor(suffix)` each (the
        suffix within the layer, `"self_attn.q_proj.weight"`); fuses qkv and gate/up."""
        self.input_layernorm.weight = _frozen(_plain(tensor("input_layernorm.weight")))
        norm = tensor("post_attention_layernorm.weight")
        self.post_attention_layernorm.weight = _frozen(_plain(norm))
        self.wqkv.load(_fused([tensor(f"self_attn.{p}_proj.weight") for p in ("q", "k", "v")]))
        self.wo.load(_single(tensor("self_attn.o_proj.weight")))
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.weight = _frozen(_plain(tensor("self_attn.q_norm.weight")))
            self.k_norm.weight = _frozen(_plain(tensor("self_attn.k_norm.weight")))
        self.load_mlp(tensor)

    def canonical_tensors(self) -> dict[str, torch.Tensor]:
        """This layer's weights by canonical suffix, as views split back from the fused ones."""
        q_out, kv_out = self._q_kv_out
        q, k, v = torch.split(self.wqkv.hf_weight(), [q_out, kv_out, kv_out])
        out = {
            "input_layernorm.weight": self.input_layernorm.weight.detach(),
            "self_attn.q_proj.weight": q,
            "self_attn.k_proj.weight": k,
            "self_attn.v_proj.weight": v,
            "self_attn.o_proj.weight": self.wo.hf_weight(),
            "post_attention_layernorm.weight": self.post_attention_layernorm.weight.detach(),
        }
        if self.q_norm is not None and self.k_norm is not None:
            out["self_attn.q_norm.weight"] = self.q_norm.weight.detach()
            out["self_attn.k_norm.weight"] = self.k_norm.weight.detach()
        out.update(self.mlp_tensors())
        return out

    def attention_out(self, attended: torch.Tensor) -> torch.Tensor:
        """The attention output projection `wo` (typed)."""
        out: torch.Tensor = self.wo(attended)
        return out

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of queries and keys `[..., heads, head_dim]` (identity without
        `qk_norm`)."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    # -------------------------------------------------------------------- MLP block
    def build_mlp(self, args: DecoderArgs, dtype: torch.dtype, device: torch.device) -> None:
        """Create the MLP block's modules (dense SwiGLU: fused gate/up, then down)."""
        kw: _Placement = {"dtype": dtype, "device": device}
        self.w_gate_up = Projection(
            args.dim, 2 * args.ffn_dim, parts=(args.ffn_dim, args.ffn_dim), **kw
        )
        self.w_down = Projection(args.ffn_dim, args.dim, **kw)

    @classmethod
    def mlp_shapes(cls, args: DecoderArgs) -> dict[str, tuple[int, ...]]:
        """The MLP block's canonical suffixes and shapes."""
        return {
            "mlp.gate_proj.weight": (args.ffn_dim, args.dim),
            "mlp.up_proj.weight": (args.ffn_dim, args.dim),
            "mlp.down_proj.weight": (args.dim, args.ffn_dim),
        }

    def load_mlp(self, tensor: Callable[[str], WeightValue]) -> None:
        """Take the MLP block's weights (canonical suffixes through `tensor`)."""
        self.w_gate_up.load(_fused([tensor(f"mlp.{p}_proj.weight") for p in ("gate", "up")]))
        self.w_down.load(_single(tensor("mlp.down_proj.weight")))

    def mlp_tensors(self) -> dict[str, torch.Tensor]:
        """The MLP block's weights by canonical suffix (views)."""
        gate, up = self.w_gate_up.hf_weight().chunk(2)
        return {
            "mlp.gate_proj.weight": gate,
            "mlp.up_proj.weight": up,
            "mlp.down_proj.weight": self.w_down.hf_weight(),
        }

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP block over `x` `[..., dim]`."""
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        out: torch.Tensor = self.w_down(F.silu(gate) * up)
        return out


WeightValue = torch.Tensor | QuantizedMatrix


def _joined_runs(parts: list[QuantizedMatrix]) -> tuple[QuantizedMatrix, ...]:
    """Row-stacked parts with each run of neighbours of one form joined into one matrix
    (Q4_K q and k become one matrix beside a Q6_K v: one kernel call less)."""
    runs: list[QuantizedMatrix] = []
    for part in parts:
        joined = concat_rows([runs[-1], part]) if runs else None
        if joined is not None:
            runs[-1] = joined
        else:
            runs.append(part)
    return tuple(runs)


def _plain(value: WeightValue) -> torch.Tensor:
    if isinstance(value, QuantizedMatrix):
        raise ValueError(f"a norm weight cannot be held in {value.source} blocks")
    return value


def _single(value: WeightValue) -> torch.Tensor | list[QuantizedMatrix]:
    return [value] if isinstance(value, QuantizedMatrix) else value


def _fused(parts: list[WeightValue]) -> torch.Tensor | list[QuantizedMatrix]:
    """Fused parts as block parts when every part is in blocks, else as one float matrix
    (a part of a type that was dequantized, e.g. Q5_K next to Q4_K, turns its neighbours
    into floats too: correct, at the float size for that projection)."""
    blocks = [part for part in parts if isinstance(part, QuantizedMatrix)]
    if len(blocks) == len(parts):
        return blocks
    floats = [part for part in parts if isinstance(part, torch.Tensor)]
    dtype = floats[0].dtype
    return torch.cat(
        [
            part.dequantize().to(dtype) if isinstance(part, QuantizedMatrix) else part
            for part in parts
        ]
    )


def _frozen(value: torch.Tensor) -> nn.Parameter:
    """`value` as a contiguous parameter without gradients (the model is inference-only)."""
    return nn.Parameter(value.contiguous(), requires_grad=False)
