"""Log-probability payloads of sampled tokens, merged from per-request rows (reference §2.7, §3).

A prefill or decode call may serve several requests; each hands back a payload for its own
source rows. These helpers bring one payload to float32 `[rows]` and merge the payloads into
one `[batch_size]` tensor, keeping "not requested" (None) apart from "requested".
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TypeAlias

import torch

from runtime.sampling.checks import row_indices
from runtime.validation import positive_int

LogProbRowPayload: TypeAlias = tuple[Sequence[int], object]
"""(source rows of one request, that request's sampled-token log-prob payload or None)."""


def sampled_log_probs_for_rows(value: object, rows: int) -> torch.Tensor:
    """A request's log-prob payload as float32 `[rows]` on the host.

    Accepts a tensor (any shape, flattened), a number, or a sequence of numbers. One value
    broadcasts to every row; more values than rows keep the first `rows`; fewer -> ValueError.
    """
    positive_int("rows", rows)
    flat: torch.Tensor
    if isinstance(value, torch.Tensor):
        flat = value.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    elif isinstance(value, bool):
        raise TypeError("a log-prob payload must be numeric, got a bool")
    elif isinstance(value, numbers.Real):
        flat = torch.tensor([float(value)], dtype=torch.float32)
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        items: list[float] = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, numbers.Real):
                raise TypeError(f"a log-prob payload must hold numbers, got {item!r}")
            items.append(float(item))
        flat = torch.tensor(items, dtype=torch.float32)
    else:
        raise TypeError(
            "a log-prob payload must be a tensor, a number or a sequence of numbers, got "
            f"{type(value).__name__}"
        )
    if flat.numel() == 1:
        return flat.expand(rows).clone()
    if flat.numel() < rows:
        raise ValueError(f"log-prob payload has {flat.numel()} values but {rows} rows need one")
    return flat[:rows].clone()


def merge_log_probs(
    row_payloads: Sequence[LogProbRowPayload], batch_size: int
) -> torch.Tensor | None:
    """Merge per-request payloads into float32 `[batch_size]` filled with 1.0 elsewhere.

    Returns None when no request produced log-probs (every payload is None, or none given), so
    callers can tell "not requested" from "requested".
    """
    positive_int("batch_size", batch_size)
    merged: torch.Tensor | None = None
    for rows, value in row_payloads:
        if value is None:
            continue
        indices = row_indices("payload rows", rows)
        if not indices:
            raise ValueError("a log-prob payload must name at least one source row")
        for row in indices:
            if row >= batch_size:
                raise ValueError(f"payload row {row} is outside the batch of {batch_size}")
        values = sampled_log_probs_for_rows(value, len(indices))
        if merged is None:
            merged = torch.ones(batch_size, dtype=torch.float32)
        merged[torch.tensor(indices, dtype=torch.int64)] = values
    return merged
