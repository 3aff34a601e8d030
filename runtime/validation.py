"""The caller-input checks the public boundaries share (one definition each).

Public calls turn caller input into typed values with these; code below a boundary trusts
those values and states invariants with assertions instead of re-checking.
"""

from __future__ import annotations

from typing import TypeGuard

import torch


def is_int(value: object) -> TypeGuard[int]:
    """A real int (bools are not integers here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: object) -> int:
    """`value` as an int >= 1, or ValueError naming `name`."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def non_negative_int(name: str, value: object) -> int:
    """`value` as an int >= 0, or ValueError naming `name`."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def require_bool(name: str, value: object) -> bool:
    """`value` if it is True or False, or TypeError naming `name` (1 and "yes" are refused)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}"
        )
    return value


def plain_bool(name: str, value: object) -> bool:
    """As `require_bool`, worded "`name` must be bool" (the configuration and planner texts)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be bool, got {type(value).__name__} {value!r}")
    return value


def integer_tensor(name: str, value: object) -> torch.Tensor:
    """`value` if it is a tensor of an integer dtype, or TypeError naming `name`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
    return value


def check_block_ids(
    page_table: torch.Tensor,
    num_blocks: int,
    *,
    read: torch.Tensor | None = None,
    note: str = "",
) -> None:
    """Every page-table entry the step reads is -1 (unmapped) or a block id of a pool of
    `num_blocks` (one rule for the model, the lane boundaries and the group's).

    `read` (int64 `[rows]`) counts the leading entries of each row the step reads; the rest
    (a scheduler's stale tail, an inactive row) is never copied, so it is not judged. One
    host reduction when every entry is in range.
    """
    if not page_table.numel():
        return
    bounds = torch.aminmax(page_table)
    if int(bounds.min) >= -1 and int(bounds.max) < num_blocks:
        return
    bad = (page_table < -1) | (page_table >= num_blocks)
    low, high = int(bounds.min), int(bounds.max)
    if read is not None:
        columns = torch.arange(page_table.shape[1], device=page_table.device)
        judged = columns < read.to(page_table.device).unsqueeze(1)
        bad &= judged
        if not bool(bad.any()):
            return
        region = page_table[judged]
        low, high = int(region.min()), int(region.max())
    row, column = bad.nonzero()[0].tolist()
    raise ValueError(
        f"page_table has entries in [{low}, {high}] (page_table[{row}, {column}] is "
        f"{int(page_table[row, column])}): allowed are -1 (unmapped) and block ids in "
        f"[0, {num_blocks}){note}"
    )
