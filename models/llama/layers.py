"""Building blocks of the Llama decoder: rotary tables, projections and the decoder layer."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.llama.config import LlamaArgs


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Per-pair rotary frequencies (float32), with the config's scaling applied."""
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.int64).to(torch.float32)
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


def rope_tables(args: LlamaArgs, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos` and signed `sin` tables `[max_seq_len, head_dim]` for rotate-half rotary.

    The sin table carries the sign of rotate-half (`-sin` on the first half), so applying
    rotary is `x * cos + roll(x, head_dim / 2) * sin`.
    """
    inv_freq = rope_inv_freq(args)
    positions = torch.arange(args.max_seq_len, dtype=torch.int64).to(torch.float32)
    angles = torch.outer(positions, inv_freq)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)
    return cos.to(dtype), sin.to(dtype)


# Rows from which `Projection` uses `F.linear` (as fast as `W @ x^T` there, no output copy).
LINEAR_FROM_ROWS = 64


class Projection(nn.Module):
    """A bias-free linear map, weight stored `[out, in]`, computed as `W @ x^T` on CPU.

    Why this form: on the project's CPU (MKL, 2 threads) `torch.mm(W, x.T)` with the weight
    as the left operand is the fastest product for decode's row counts, and one row is padded
    to two, because MKL's two-row matrix product streams the weight faster than its
    matrix-vector product: one decode step's projections at batch 1 took
    26 instead of 32 ms (`[in, out]` matrix-vector), at batch 8 44 instead of 70 ms and at
    batch 32 89 instead of 114 ms (`benchmarks/RESULTS.md`). From `LINEAR_FROM_ROWS` rows on
    (prefill chunks) `F.linear` is as fast and its output needs no transposing copy; other
    devices always use it.
    """

    def __init__(
        self, in_features: int, out_features: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        shape = (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        if weight.device.type != "cpu" or count >= LINEAR_FROM_ROWS:
            return F.linear(x, weight)
        if count == 1:
            product = torch.mm(weight, torch.cat((rows, rows)).t())[:, :1]
        else:
            product = torch.mm(weight, rows.t())
        return product.t().contiguous().view(*x.shape[:-1], self.out_features)

    def load(self, weight: torch.Tensor) -> None:
        """Take a `[out, in]` (HF-layout) weight."""
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight has shape {list(weight.shape)}: allowed is {list(expected)}")
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)

    def hf_weight(self) -> torch.Tensor:
        """The weight as `[out, in]` (no copy)."""
        return self.weight.detach()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, projections fused (qkv and gate/up)."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        q_out = args.n_heads * args.head_dim
        kv_out = args.n_kv_heads * args.head_dim
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.input_layernorm = nn.RMSNorm(args.dim, eps=args.norm_eps, **kw)
        self.wqkv = Projection(args.dim, q_out + 2 * kv_out, **kw)
        self.wo = Projection(q_out, args.dim, **kw)
        self.post_attention_layernorm = nn.RMSNorm(args.dim, eps=args.norm_eps, **kw)
        self.w_gate_up = Projection(args.dim, 2 * args.ffn_dim, **kw)
        self.w_down = Projection(args.ffn_dim, args.dim, **kw)

    def attention_out(self, attended: torch.Tensor) -> torch.Tensor:
        """The attention output projection `wo` (typed)."""
        out: torch.Tensor = self.wo(attended)
        return out

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        out: torch.Tensor = self.w_down(F.silu(gate) * up)
        return out
