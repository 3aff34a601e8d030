"""Matching reload sources against resident weights, before anything is copied.

Why: `reload_weights(source)` replaces weights *in place* (same storage, so captured traces
keep reading the right addresses), which is only possible when every name, shape and dtype
matches. The check runs over the whole source first and names the first mismatching tensor,
so a refused reload leaves every weight as it was.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch


@attrs.frozen
class ReloadPair:
    """One in-place copy: `source`'s values into `target` (resident storage or a view of it)."""

    name: str
    target: torch.Tensor
    source: torch.Tensor


class WeightMismatchError(ValueError):
    """A reload source does not match the resident weights (names the first tensor)."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(
            f"reload_weights: tensor {name!r} {problem}; allowed: a source with the same "
            "tensor names, shapes and dtypes as the resident weights (weights are replaced in "
            "place)"
        )
        self.tensor_name = name


def _describe(tensor: torch.Tensor) -> str:
    return f"{list(tensor.shape)} {tensor.dtype}"


def match_tensors(
    resident: Mapping[str, torch.Tensor], source: Mapping[str, object]
) -> tuple[ReloadPair, ...]:
    """Pairs for every resident tensor; `WeightMismatchError` at the first difference.

    Resident order decides which difference is "first"; a source name the model does not
    have is reported after every resident name matched.
    """
    pairs: list[ReloadPair] = []
    for name, target in resident.items():
        if name not in source:
            raise WeightMismatchError(name, "is missing from the source")
        given = source[name]
        if not isinstance(given, torch.Tensor):
            raise WeightMismatchError(
                name, f"is a {type(given).__name__} in the source, not a torch.Tensor"
            )
        if tuple(given.shape) != tuple(target.shape) or given.dtype != target.dtype:
            raise WeightMismatchError(
                name, f"is {_describe(given)} in the source but {_describe(target)} resident"
            )
        pairs.append(ReloadPair(name, target, given))
    extra = [name for name in source if name not in resident]
    if extra:
        raise WeightMismatchError(extra[0], "is in the source but not a weight of this model")
    return tuple(pairs)
