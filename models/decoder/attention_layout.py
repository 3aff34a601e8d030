"""How a model call lays out its rows and tokens for attention (plain data and planning).

Decode groups length-sorted rows so each group gathers only the keys its longest row needs
(`plan_key_groups`, `KeyGroup`); prefill packs a bucket-padded chunk's real tokens so that
token-wise work skips the padding (`PackedChunk`). The flat cache-row arithmetic and the
prefix-then-causal mask are shared by the dynamic planners (`dynamic_addressing`) and the
graph-safe ones (`graph_safe`); the attention paths (`attention`) execute the plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

# Decode attention groups: the fixed cost of one more group (gathers, SDPA call, mask) in units
# of one row attending to one key; measured on the project's CPU (see `plan_key_groups`).
GROUP_COST_KEYS = 128
# Rows are grouped in units of at most this many sorted rows' worth (bounds the planning cost).
_MAX_PLAN_UNITS = 64


class KeyGroup(NamedTuple):
    """Consecutive rows `[start, end)` of a length-sorted decode batch that attend together.

    `gather_index` `[rows, kv, keys]` holds the flat cache rows of the group's keys (as many as
    its longest row needs); `mask` `[rows, 1, 1, keys]` what each row may see, or None when
    every row sees every key.
    """

    start: int
    end: int
    gather_index: torch.Tensor
    mask: torch.Tensor | None


class PackedChunk(NamedTuple):
    """Where a dynamic prefill chunk's real tokens sit in its padded `[B, S]` layout.

    Token-wise work (projections, norms, rotary, MLP) runs on the `N` real tokens packed in
    row-major order; attention needs the padded layout. `scatter` `[N]` holds each real
    token's flat padded position `row * S + col`, or None when every position is real.
    `last_mask` None means each last token sees every key (no prefix, no padding).
    """

    scatter: torch.Tensor | None
    batch: int
    seq: int
    # Each row's last real token (packed index) and what it may see `[B, 1, 1, keys]`: the
    # last layer only needs those tokens' outputs (see `attention.PackedLastTokens`).
    last: torch.Tensor
    last_mask: torch.Tensor | None

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """`[N, ...]` real-token values as `[B, S, ...]`, zeros at padding (never NaN: padded
        keys are masked out, but a masked NaN value would still poison `softmax @ V`)."""
        shape = (self.batch, self.seq, *packed.shape[1:])
        if self.scatter is None:
            return packed.reshape(shape)
        flat = packed.new_zeros(self.batch * self.seq, *packed.shape[1:])
        return flat.index_copy_(0, self.scatter, packed).view(shape)

    def take(self, padded: torch.Tensor) -> torch.Tensor:
        """The real tokens' entries `[N, ...]` of a flat padded tensor `[B * S, ...]`."""
        return padded if self.scatter is None else padded.index_select(0, self.scatter)


def plan_key_groups(
    n_keys: Sequence[int], *, group_cost: int = GROUP_COST_KEYS
) -> list[tuple[int, int]]:
    """Split rows sorted by ascending key count into `[start, end)` groups for decode attention.

    Why: one attention call pads every row to the longest context, so with mixed lengths most
    of the gathered and attended keys are padding. A group costs `group_cost` plus
    `rows * longest` key reads; an exact dynamic program over (at most `_MAX_PLAN_UNITS`
    units of) the sorted rows minimises the total.
    """
    count = len(n_keys)
    if count <= 1:
        return [(0, count)]
    step = -(-count // _MAX_PLAN_UNITS)
    edges = [*range(0, count, step), count]  # unit u is rows edges[u]..edges[u + 1]
    units = len(edges) - 1
    best = [0] * (units + 1)  # best[j]: cheapest split of the first j units
    cut = [0] * (units + 1)  # cut[j]: where the last group of that split starts
    for j in range(1, units + 1):
        end = edges[j]
        longest = n_keys[end - 1]
        best[j], cut[j] = min(
            (best[i] + group_cost + (end - edges[i]) * longest, i) for i in range(j)
        )
    bounds: list[tuple[int, int]] = []
    j = units
    while j > 0:
        bounds.append((edges[cut[j]], edges[j]))
        j = cut[j]
    return bounds[::-1]


def flat_cache_rows(
    blocks: torch.Tensor, offsets: torch.Tensor, *, n_kv_heads: int, block_size: int
) -> torch.Tensor:
    """Flat cache rows of (block, offset) pairs, one per KV head: shape `[..., n_kv_heads]`.

    The cache `[num_blocks, kv, block_size, head_dim]` is viewed as `[-1, head_dim]`.
    """
    heads = torch.arange(n_kv_heads, device=blocks.device)
    return ((blocks.unsqueeze(-1) * n_kv_heads + heads) * block_size) + offsets.unsqueeze(-1)


def prefix_then_causal_mask(prefix_ok: torch.Tensor, seq: int) -> torch.Tensor:
    """Attention mask `[B, 1, S, P + S]` of a prefill chunk whose keys are a cached prefix then
    the chunk itself: query `s` sees the prefix keys `prefix_ok` `[B, P]` allows and the
    chunk's keys up to `s`."""
    batch = prefix_ok.shape[0]
    cols = torch.arange(seq, device=prefix_ok.device)
    causal = cols.unsqueeze(1) >= cols.unsqueeze(0)  # [S, S]
    return torch.cat(
        (
            prefix_ok.unsqueeze(1).expand(batch, seq, -1),
            causal.unsqueeze(0).expand(batch, seq, seq),
        ),
        dim=2,
    ).unsqueeze(1)
