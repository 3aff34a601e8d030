"""Prefill-only sampling glue on top of `runtime.sampling`.

`runtime.sampling` owns request parameters, their device normalisation, slicing, placing and
log-probability merging. What is left here is what only prefill needs: the request-owned token
history of a planned request (rows picked from the public call, padded to the sampler batch),
fitting a request's logits to the sampler batch, and broadcasting a single active row to every
physical sampler row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TypeVar

import attrs
import torch

from runtime.sampling import PreparedSamplingParams

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

NO_TOKEN = -1
"""History filler: "no token at this position" (the sampler ignores it)."""


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


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
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
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
    _positive_int("rows", rows)
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
    if not isinstance(rows, int) or isinstance(rows, bool) or rows <= 0:
        raise ValueError(f"sampling rows must be a positive integer, got {rows!r}")
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


def _broadcast_history(value: torch.Tensor | None, row: int, rows: int) -> torch.Tensor | None:
    if value is None:
        return None
    return value[row : row + 1].expand(rows, int(value.shape[1])).clone()


def broadcast_active_row(prepared: PreparedSamplingParams) -> PreparedSamplingParams:
    """Copy the single active row of `prepared` into every physical row (all become active).

    A single-row prefill runs the sampler over the whole sampler batch; giving every row the
    request's parameters means whichever row a device reads carries the request's values.
    Values with more than one active row, or a batch of one, come back unchanged.
    """
    if not isinstance(prepared, PreparedSamplingParams):
        raise TypeError(f"prepared must be PreparedSamplingParams, got {type(prepared).__name__}")
    rows = prepared.batch_size
    if prepared.active_rows != 1 or rows == 1:
        return prepared
    (row,) = prepared.active_row_indices

    def repeat(values: tuple[_T, ...]) -> tuple[_T, ...]:
        return (values[row],) * rows

    return attrs.evolve(
        prepared,
        active_rows=rows,
        top_k=repeat(prepared.top_k),
        top_p=repeat(prepared.top_p),
        inverse_temperature=repeat(prepared.inverse_temperature),
        presence_penalty=repeat(prepared.presence_penalty),
        frequency_penalty=repeat(prepared.frequency_penalty),
        repetition_penalty=repeat(prepared.repetition_penalty),
        seeds=repeat(prepared.seeds),
        enable_log_probs=repeat(prepared.enable_log_probs),
        num_logprobs=repeat(prepared.num_logprobs),
        logprob_modes=repeat(prepared.logprob_modes),
        greedy_mask=repeat(prepared.greedy_mask),
        row_paths=repeat(prepared.row_paths),
        active_mask=(True,) * rows,
        prompt_tokens=_broadcast_history(prepared.prompt_tokens, row, rows),
        output_tokens=_broadcast_history(prepared.output_tokens, row, rows),
    )
