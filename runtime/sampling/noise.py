"""Counter-based Gumbel noise: the sampler's random draws, reproducible from (seed, position).

The noise of token `t` in a seeded row is a hash of `(seed, position, t)`, so a seeded row's
stream depends only on its seed, its positions and its logits: not on the slot it occupies, the
other rows in the batch, or earlier calls. The hash uses int64 ops that are exact on every
device, so CPU and accelerator draw the same noise, inside a trace too.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_SEED_SALT = 0x9E3779B9
_TOKEN_SALT = 0x85EBCA6B


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """`x * constant mod 2**32` for int64 `x` in [0, 2**32), without int64 overflow."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xorshift-multiply), exact on every device."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_row_keys(
    seed_low: torch.Tensor, seed_high: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Per-row 32-bit key from a 64-bit seed (two 32-bit halves) and an absolute position."""
    key = _mix32(seed_high ^ _SEED_SALT)
    key = _mix32(key ^ seed_low)
    return _mix32(key ^ (positions.to(torch.int64) & _MASK32))


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) float32 noise for `token_ids [B, C]` of rows with `keys [B]`."""
    bits = _mix32(_mix32((token_ids & _MASK32) ^ _TOKEN_SALT) ^ keys[:, None])
    # 23 bits -> uniform strictly inside (0, 1), exactly representable in float32.
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return -torch.log(-torch.log(uniform))
