"""Caller-input checks the sampling modules share, beyond those in `runtime.validation`.

Row lists, slot lists and masks arrive as a sequence or a tensor; `listed` turns either into a
plain list (or names the argument), and `row_indices` is the row-list rule used by every slice,
place and merge.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch


def listed(name: str, value: object, kind: str) -> list[object]:
    """`value` (a sequence other than str/bytes, or a tensor) as a flat list.

    Anything else is a TypeError naming `name` and saying it must be a sequence of `kind`.
    """
    if isinstance(value, torch.Tensor):
        return list(value.detach().reshape(-1).tolist())
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return list(value)
    raise TypeError(f"{name} must be a sequence of {kind}, got {type(value).__name__}")


def row_indices(name: str, rows: Sequence[int] | torch.Tensor) -> list[int]:
    """Distinct non-negative int row indices, in the caller's order."""
    out: list[int] = []
    for value in listed(name, rows, "row indices"):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
            raise ValueError(f"{name} must hold non-negative int row indices, got {value!r}")
        out.append(int(value))
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must not repeat a row, got {out}")
    return out


def checked_slot_remap(
    value: Sequence[int] | torch.Tensor | None, batch_size: int
) -> tuple[int, ...] | None:
    """`slot_remap` as a tuple of `batch_size` source slots in `[-1, batch_size)` (-1: none)."""
    if value is None:
        return None
    items = listed("slot_remap", value, "ints")
    if len(items) != batch_size:
        raise ValueError(f"slot_remap has {len(items)} entries; expected batch_size {batch_size}")
    out: list[int] = []
    for slot, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise TypeError(f"slot_remap slot {slot} must be an int, got {item!r}")
        if not -1 <= int(item) < batch_size:
            raise ValueError(
                f"slot_remap slot {slot} is {item}; a source slot must be in [0, {batch_size}) "
                "or -1 for none"
            )
        out.append(int(item))
    return tuple(out)
