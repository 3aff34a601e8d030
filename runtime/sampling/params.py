"""What a request asks of the sampler: `SamplingParams`, validated field by field (reference §2.7).

Each field holds one value for every row or one value per request row. Validation happens at
construction, so a bad request fails before any planning or device work; the device form of
these values is `runtime.sampling.prepared` (built by `runtime.sampling.prepare`).

Decisions where this project differs from the reference:

* Invalid values fail at construction (the reference clamps `top_p` and maps a zero repetition
  penalty to 1.0): temperature must be finite and `>= 0`, `top_p` in `(0, 1]`, `top_k >= 0`,
  `repetition_penalty > 0`, presence/frequency penalties finite (negative values are meaningful:
  they encourage repetition), `num_logprobs >= 0`. Each error names the row and the field.
* `top_k = 0` means "no top-k limit". Only a host sampler can honour it: the device-normalised
  path rejects it (like any top_k outside `[1, max_device_top_k]`) for stochastic rows, with a
  message telling the caller to route the request to host sampling.
* Defaults: temperature 0.0 (greedy), top_k 0 (no limit), top_p 1.0 (no nucleus limit),
  penalties neutral (0, 0, 1), no seed, no log-probs. So `SamplingParams()` is greedy decoding
  and a stochastic device request must say its `top_k`.
* A scalar seed applies to row 0 only; sequence seeds are per row (slot-indexed when an
  `active_mask` is given); `-1` means "no seed".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, TypeVar

import attrs
import torch

from runtime.sampling.checks import row_indices

FloatInput: TypeAlias = float | Sequence[float] | torch.Tensor
IntInput: TypeAlias = int | Sequence[int] | torch.Tensor
BoolInput: TypeAlias = bool | Sequence[bool] | torch.Tensor
SeedInput: TypeAlias = int | Sequence[int | None] | torch.Tensor | None

NO_SEED = -1
"""A seed value meaning "this row has no seed" (the same as None)."""
MAX_SEED = 2**64 - 1

DEFAULT_TEMPERATURE = 0.0
DEFAULT_TOP_K = 0
DEFAULT_TOP_P = 1.0
DEFAULT_PRESENCE_PENALTY = 0.0
DEFAULT_FREQUENCY_PENALTY = 0.0
DEFAULT_REPETITION_PENALTY = 1.0

T = TypeVar("T")


def _where(row: int | None) -> str:
    return "all rows (scalar)" if row is None else f"row {row}"


def _split(field: str, value: object) -> tuple[bool, list[object]]:
    """(is_sequence, items): tensors become `.item()` or a flattened list."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return False, [value.item()]
        return True, list(value.detach().reshape(-1).tolist())
    if isinstance(value, str | bytes):
        raise TypeError(
            f"SamplingParams.{field} must be a number or a sequence of numbers, got {value!r}"
        )
    if isinstance(value, Sequence):
        if len(value) == 0:
            raise ValueError(
                f"SamplingParams.{field} is an empty sequence; give a scalar or one value per row"
            )
        return True, [
            item.item() if isinstance(item, torch.Tensor) and item.numel() == 1 else item
            for item in value
        ]
    return False, [value]


def _real(field: str, row: int | None, item: object) -> float:
    if isinstance(item, bool) or not isinstance(item, numbers.Real):
        raise TypeError(
            f"SamplingParams.{field} for {_where(row)} must be a real number, got {item!r}"
        )
    value = float(item)
    if not math.isfinite(value):
        raise ValueError(
            f"SamplingParams.{field} for {_where(row)} is {value!r}; {field} must be finite"
        )
    return value


def _integer(field: str, row: int | None, item: object) -> int:
    if isinstance(item, bool) or not isinstance(item, numbers.Integral):
        raise TypeError(
            f"SamplingParams.{field} for {_where(row)} must be an int, got {item!r} "
            f"({type(item).__name__})"
        )
    return int(item)


def _temperature(row: int | None, item: object) -> float:
    value = _real("temperature", row, item)
    if value < 0.0:
        raise ValueError(
            f"SamplingParams.temperature for {_where(row)} is {value!r}; temperature must be "
            ">= 0 (0 means greedy)"
        )
    return value


def _top_p(row: int | None, item: object) -> float:
    value = _real("top_p", row, item)
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"SamplingParams.top_p for {_where(row)} is {value!r}; top_p must be in (0, 1] "
            "(1 means no nucleus limit)"
        )
    return value


def _top_k(row: int | None, item: object) -> int:
    value = _integer("top_k", row, item)
    if value < 0:
        raise ValueError(
            f"SamplingParams.top_k for {_where(row)} is {value!r}; top_k must be >= 0 "
            "(0 means no top-k limit)"
        )
    return value


def _finite_penalty(field: str) -> Callable[[int | None, object], float]:
    def convert(row: int | None, item: object) -> float:
        return _real(field, row, item)

    return convert


def _repetition(row: int | None, item: object) -> float:
    value = _real("repetition_penalty", row, item)
    if value <= 0.0:
        raise ValueError(
            f"SamplingParams.repetition_penalty for {_where(row)} is {value!r}; "
            "repetition_penalty must be > 0 (1 means no penalty)"
        )
    return value


def _num_logprobs(row: int | None, item: object) -> int:
    value = _integer("num_logprobs", row, item)
    if value < 0:
        raise ValueError(
            f"SamplingParams.num_logprobs for {_where(row)} is {value!r}; num_logprobs must be "
            ">= 0 (0 means only the sampled token's log-probability)"
        )
    return value


def _flag(row: int | None, item: object) -> bool:
    if not isinstance(item, bool):
        raise TypeError(
            f"SamplingParams.enable_log_probs for {_where(row)} must be a bool, got {item!r}"
        )
    return item


def _seed(row: int | None, item: object) -> int | None:
    if item is None:
        return None
    value = _integer("seed", row, item)
    if value == NO_SEED:
        return None
    if not 0 <= value <= MAX_SEED:
        raise ValueError(
            f"SamplingParams.seed for {_where(row)} is {value!r}; a seed must be in "
            f"[0, 2**64 - 1], or -1 / None for no seed"
        )
    return value


def _convert(
    field: str, value: object, convert: Callable[[int | None, object], T]
) -> T | tuple[T, ...]:
    is_sequence, items = _split(field, value)
    if not is_sequence:
        return convert(None, items[0])
    return tuple(convert(row, item) for row, item in enumerate(items))


@attrs.frozen(init=False)
class SamplingParams:
    """Request-facing sampling parameters; each field is one value for every row or one per row.

    Torch tensors are accepted in every field (0-d -> scalar, otherwise a flattened sequence).
    Values are validated here, so a bad request fails before any planning or device work.
    The number of request rows is the length of `temperature` (a scalar counts as one row).
    """

    temperature: float | tuple[float, ...]
    top_k: int | tuple[int, ...]
    top_p: float | tuple[float, ...]
    presence_penalty: float | tuple[float, ...]
    frequency_penalty: float | tuple[float, ...]
    repetition_penalty: float | tuple[float, ...]
    seed: int | tuple[int | None, ...] | None
    enable_log_probs: bool | tuple[bool, ...]
    num_logprobs: int | tuple[int, ...]

    def __init__(
        self,
        *,
        temperature: FloatInput = DEFAULT_TEMPERATURE,
        top_k: IntInput = DEFAULT_TOP_K,
        top_p: FloatInput = DEFAULT_TOP_P,
        presence_penalty: FloatInput = DEFAULT_PRESENCE_PENALTY,
        frequency_penalty: FloatInput = DEFAULT_FREQUENCY_PENALTY,
        repetition_penalty: FloatInput = DEFAULT_REPETITION_PENALTY,
        seed: SeedInput = None,
        enable_log_probs: BoolInput = False,
        num_logprobs: IntInput = 0,
    ) -> None:
        seed_value: int | tuple[int | None, ...] | None = None
        if seed is not None:
            seed_value = _convert("seed", seed, _seed)
        self.__attrs_init__(
            temperature=_convert("temperature", temperature, _temperature),
            top_k=_convert("top_k", top_k, _top_k),
            top_p=_convert("top_p", top_p, _top_p),
            presence_penalty=_convert(
                "presence_penalty", presence_penalty, _finite_penalty("presence_penalty")
            ),
            frequency_penalty=_convert(
                "frequency_penalty", frequency_penalty, _finite_penalty("frequency_penalty")
            ),
            repetition_penalty=_convert("repetition_penalty", repetition_penalty, _repetition),
            seed=seed_value,
            enable_log_probs=_convert("enable_log_probs", enable_log_probs, _flag),
            num_logprobs=_convert("num_logprobs", num_logprobs, _num_logprobs),
        )

    @property
    def num_rows(self) -> int:
        """Request rows: the length of `temperature` (a scalar counts as one row)."""
        return len(self.temperature) if isinstance(self.temperature, tuple) else 1


SAMPLING_FIELDS: tuple[str, ...] = tuple(field.name for field in attrs.fields(SamplingParams))
"""Every `SamplingParams` field, in declaration order (what a duck-typed request may carry)."""
_PER_ROW_FIELDS = tuple(name for name in SAMPLING_FIELDS if name != "seed")


def slice_sampling_params(sp: SamplingParams, rows: Sequence[int] | torch.Tensor) -> SamplingParams:
    """The raw parameters of `rows` (in that order), e.g. one planned request's source rows.

    Scalars and length-1 sequences broadcast and stay as they are. A scalar seed belongs to
    row 0, so it follows row 0 (or disappears when row 0 is not selected); seed sequences
    shorter than a selected row give that row no seed.
    """
    if not isinstance(sp, SamplingParams):
        raise TypeError(f"sp must be SamplingParams, got {type(sp).__name__}")
    selected = row_indices("rows", rows)
    if not selected:
        raise ValueError("slice_sampling_params needs at least one row")
    changes: dict[str, Any] = {}
    for name in _PER_ROW_FIELDS:
        value = getattr(sp, name)
        if not isinstance(value, tuple) or len(value) == 1:
            continue
        for row in selected:
            if row >= len(value):
                raise ValueError(
                    f"SamplingParams.{name} has {len(value)} values and does not cover row {row}"
                )
        changes[name] = tuple(value[row] for row in selected)
    seeds: list[int | None]
    if sp.seed is None:
        seeds = [None] * len(selected)
    elif isinstance(sp.seed, int):
        seeds = [sp.seed if row == 0 else None for row in selected]
    else:
        seed_tuple = sp.seed
        seeds = [seed_tuple[row] if row < len(seed_tuple) else None for row in selected]
    if all(seed is None for seed in seeds):
        changes["seed"] = None
    else:
        changes["seed"] = seeds[0] if len(seeds) == 1 else tuple(seeds)
    return attrs.evolve(sp, **changes)
