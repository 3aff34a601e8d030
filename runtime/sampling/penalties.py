"""Repetition, frequency and presence penalties over a batch of logits (the sampler's step 1).

History is request-owned token ids (`-1` = no token; ids outside `[0, vocab)` are ignored): a
token seen in the prompt or the output has a positive logit divided by `repetition_penalty` and
a negative logit multiplied by it; then `frequency_penalty * count` is subtracted, with `count`
the token's occurrences in the output; then `presence_penalty` is subtracted once for every
token present in the output. Only torch ops, so it runs inside a captured trace.
"""

from __future__ import annotations

import torch


def _row_values(
    name: str, value: float | torch.Tensor, rows: int, device: torch.device
) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        out = value.to(device=device, dtype=torch.float32).reshape(-1)
        if out.shape[0] != rows:
            raise ValueError(f"{name} has {out.shape[0]} rows; expected {rows}")
        return out
    return torch.full((rows,), float(value), dtype=torch.float32, device=device)


def _token_counts(
    name: str, tokens: torch.Tensor | None, rows: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """Per-row occurrences of each vocab id, float32 `[rows, vocab]`; ids outside it skipped."""
    counts = torch.zeros((rows, vocab + 1), dtype=torch.float32, device=device)
    if tokens is None:
        return counts[:, :vocab]
    if tokens.dim() != 2 or tokens.shape[0] != rows:
        raise ValueError(f"{name} must be [{rows}, length], got shape {tuple(tokens.shape)}")
    ids = tokens.to(device=device, dtype=torch.int64)
    index = torch.where((ids >= 0) & (ids < vocab), ids, torch.full_like(ids, vocab))
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    *,
    prompt_tokens: torch.Tensor | None = None,
    output_tokens: torch.Tensor | None = None,
    presence_penalty: float | torch.Tensor = 0.0,
    frequency_penalty: float | torch.Tensor = 0.0,
    repetition_penalty: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Penalised float32 copy of `logits [B, V]` (the rules are in the module docstring).

    Penalties are a float (every row) or a `[B]` tensor. History is `[B, length]` integer,
    `-1` padded. Neutral values (0, 0, 1) leave a row bit-identical.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    device = logits.device
    x = logits.to(torch.float32)
    output_counts = _token_counts("output_tokens", output_tokens, rows, vocab, device)
    prompt_counts = _token_counts("prompt_tokens", prompt_tokens, rows, vocab, device)
    in_output = output_counts > 0
    seen = in_output | (prompt_counts > 0)
    repetition = _row_values("repetition_penalty", repetition_penalty, rows, device)[:, None]
    frequency = _row_values("frequency_penalty", frequency_penalty, rows, device)[:, None]
    presence = _row_values("presence_penalty", presence_penalty, rows, device)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * output_counts
    return torch.where(in_output, x - presence, x)
