"""Prefill-only sampling glue on top of `runtime.sampling`.

`runtime.sampling` owns request parameters, their device normalisation, slicing, placing,
broadcasting one active row, and log-probability merging. What is left here is what only
prefill needs: the request-owned token history of a planned request (rows picked from the
public call, padded to the sampler batch) and fitting a request's logits to the sampler batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from runtime.validation import integer_tensor, positive_int

logger = logging.getLogger(__name__)

NO_TOKEN = -1
"""History filler: "no token at this position" (the sampler ignores it)."""


def default_prompt_history(tokens: torch.Tensor, prompt_lens: Sequence[int]) -> torch.Tensor:
    """Prompt history of rows: int64 copy of `tokens [rows, width]`, `-1` at `>= prompt_len`.

    The caller's tensor is never modified. Cached positions are real prompt tokens and stay.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"tokens must be a rank-2 tensor, got {tokens!r:.80}")
    rows, width = int(tokens.shape[0]), int(tokens.shape[1])
    if len(prompt_lens) != rows:
        raise ValueError(f"prompt_lens has {len(prompt_lens)} entries, tokens has {rows} rows")
    for row, length in enumerate(prompt_lens):
        if not 0 <= length <= width:
            raise ValueError(
                f"prompt_lens[{row}] is {length}; allowed is [0, {width}] (the token width)"
            )
    history = tokens.detach().to(device="cpu", dtype=torch.int64).clone()
    columns = torch.arange(width).unsqueeze(0)
    limits = torch.tensor(list(prompt_lens), dtype=torch.int64).unsqueeze(1)
    history[columns >= limits] = NO_TOKEN
    return history


def select_history_rows(
    name: str,
    value: torch.Tensor,
    *,
    source_rows: Sequence[int],
    slots: Sequence[int],
    request_batch: int,
    lane_capacity: int,
) -> torch.Tensor:
    """The history rows of one planned request, chosen by the tensor's leading length.

    `lane_capacity` rows are slot indexed (rows at the request's slots), `request_batch` rows
    follow the public call's rows (the request's source rows), one row broadcasts.
    """
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        raise ValueError(f"{name} must be a rank-2 [rows, length] tensor, got {value!r:.80}")
    integer_tensor(name, value)
    rows = int(value.shape[0])
    if rows == lane_capacity:
        picked = list(slots)
    elif rows == request_batch:
        picked = list(source_rows)
    elif rows == 1:
        picked = [0] * len(source_rows)
    else:
        raise ValueError(
            f"prefill sampling state {name} has {rows} rows, expected 1, request batch "
            f"{request_batch}, or lane capacity {lane_capacity}"
        )
    index = torch.tensor(picked, dtype=torch.int64, device=value.device)
    return value.index_select(0, index).to(torch.int64)


def pad_history_rows(history: torch.Tensor, rows: int) -> torch.Tensor:
    """`history [n, length]` extended to `rows` rows with `-1` (no token); n must be <= rows."""
    positive_int("rows", rows)
    present = int(history.shape[0])
    if present > rows:
        raise ValueError(f"history has {present} rows, more than the sampler batch of {rows}")
    out = torch.full((rows, int(history.shape[1])), NO_TOKEN, dtype=torch.int64)
    out[:present] = history.to(device="cpu", dtype=torch.int64)
    return out


def fit_sampling_logits(logits: torch.Tensor, rows: int) -> torch.Tensor:
    """`logits [n, vocab]` fitted to the sampler batch: the first `rows` rows, or zero padded.

    Returns `logits` itself when it already has `rows` rows.
    """
    positive_int("sampling rows", rows)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    present = int(logits.shape[0])
    if present == rows:
        return logits
    if present > rows:
        return logits[:rows]
    padded = torch.zeros((rows, int(logits.shape[1])), dtype=logits.dtype, device=logits.device)
    padded[:present] = logits
    return padded
