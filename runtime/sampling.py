"""Request sampling parameters and their device-normalised form (reference §2.7 and §3).

`SamplingParams` is what a request asks for. `prepare_sampling_params` turns it into a
`PreparedSamplingParams`: one entry per physical row of the sampler batch, with greedy rows in
the device representation (k=1, p=0, inverse temperature 1), stochastic rows carrying the
inverse temperature, inactive rows neutral, and the sampling path the program identity needs.
All of this is host-side and pure, so it can be validated before any device work.

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
from typing import Any, Literal, NamedTuple, TypeAlias, TypeVar

import attrs
import torch

SamplingPath: TypeAlias = Literal["logits", "argmax", "topk"]
PreparedPath: TypeAlias = Literal["argmax", "topk"]
RowPath: TypeAlias = Literal["argmax", "topk", "inactive"]
LogProbMode: TypeAlias = Literal["none", "sampled_token", "top_n"]

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

# Device representation of a greedy row, and the neutral values of an inactive row.
GREEDY_TOP_K = 1
GREEDY_TOP_P = 0.0
GREEDY_INVERSE_TEMPERATURE = 1.0
_FLOAT32_MAX = 3.4028234663852886e38

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------


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


_PER_ROW_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "enable_log_probs",
    "num_logprobs",
)


def slice_sampling_params(sp: SamplingParams, rows: Sequence[int] | torch.Tensor) -> SamplingParams:
    """The raw parameters of `rows` (in that order), e.g. one planned request's source rows.

    Scalars and length-1 sequences broadcast and stay as they are. A scalar seed belongs to
    row 0, so it follows row 0 (or disappears when row 0 is not selected); seed sequences
    shorter than a selected row give that row no seed.
    """
    if not isinstance(sp, SamplingParams):
        raise TypeError(f"sp must be SamplingParams, got {type(sp).__name__}")
    selected = _row_indices("rows", rows)
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


def _row_indices(name: str, rows: Sequence[int] | torch.Tensor) -> list[int]:
    values: list[object]
    if isinstance(rows, torch.Tensor):
        values = list(rows.detach().reshape(-1).tolist())
    elif isinstance(rows, Sequence) and not isinstance(rows, str | bytes):
        values = list(rows)
    else:
        raise TypeError(f"{name} must be a sequence of row indices, got {type(rows).__name__}")
    out: list[int] = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
            raise ValueError(f"{name} must hold non-negative int row indices, got {value!r}")
        out.append(int(value))
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must not repeat a row, got {out}")
    return out


# --------------------------------------------------------------------------------------------
# PreparedSamplingParams
# --------------------------------------------------------------------------------------------


class _Row(NamedTuple):
    """One physical row of a prepared batch (internal; used to slice and place rows)."""

    active: bool
    greedy: bool
    path: RowPath
    top_k: int
    top_p: float
    inverse_temperature: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int | None
    enable_log_probs: bool
    num_logprobs: int
    logprob_mode: LogProbMode


_NEUTRAL_ROW = _Row(
    active=False,
    greedy=False,
    path="inactive",
    top_k=GREEDY_TOP_K,
    top_p=GREEDY_TOP_P,
    inverse_temperature=GREEDY_INVERSE_TEMPERATURE,
    presence_penalty=DEFAULT_PRESENCE_PENALTY,
    frequency_penalty=DEFAULT_FREQUENCY_PENALTY,
    repetition_penalty=DEFAULT_REPETITION_PENALTY,
    seed=None,
    enable_log_probs=False,
    num_logprobs=0,
    logprob_mode="none",
)


def _check_history(instance: PreparedSamplingParams, name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 2:
        raise ValueError(f"PreparedSamplingParams.{name} must be an int64 [rows, length] tensor")
    if value.shape[0] != instance.batch_size:
        raise ValueError(
            f"PreparedSamplingParams.{name} has {value.shape[0]} rows; expected batch_size "
            f"{instance.batch_size}"
        )


@attrs.frozen(kw_only=True)
class PreparedSamplingParams:
    """Sampling parameters normalised for the device sampler: one entry per physical row.

    Greedy rows carry k=1, p=0, inverse temperature 1; stochastic rows carry `1 / temperature`
    (field `inverse_temperature`) and a top_k in `[1, max_device_top_k]`; inactive rows are
    neutral (k=1, p=0, inverse temperature 1, no seed, no log-probs, neutral penalties, path
    "inactive"). History tensors are int64 `[batch_size, length]`, `-1` meaning "no token".
    `slot_remap[i]` is the slot whose request-owned state moves into slot `i` (`-1`: none).
    """

    batch_size: int
    active_rows: int
    max_device_top_k: int
    sampling_path: PreparedPath
    top_k: tuple[int, ...]
    top_p: tuple[float, ...]
    inverse_temperature: tuple[float, ...]
    presence_penalty: tuple[float, ...]
    frequency_penalty: tuple[float, ...]
    repetition_penalty: tuple[float, ...]
    seeds: tuple[int | None, ...]
    enable_log_probs: tuple[bool, ...]
    num_logprobs: tuple[int, ...]
    logprob_modes: tuple[LogProbMode, ...]
    greedy_mask: tuple[bool, ...]
    row_paths: tuple[RowPath, ...]
    active_mask: tuple[bool, ...]
    prompt_tokens: torch.Tensor | None = attrs.field(default=None, eq=False)
    output_tokens: torch.Tensor | None = attrs.field(default=None, eq=False)
    slot_remap: tuple[int, ...] | None = None

    def __attrs_post_init__(self) -> None:
        """Invariants, so a hand-built or sliced value can never reach a device half-formed."""
        n = self.batch_size
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {n!r}")
        for name in (
            "top_k",
            "top_p",
            "inverse_temperature",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "seeds",
            "enable_log_probs",
            "num_logprobs",
            "logprob_modes",
            "greedy_mask",
            "row_paths",
            "active_mask",
        ):
            length = len(getattr(self, name))
            if length != n:
                raise ValueError(
                    f"PreparedSamplingParams.{name} has {length} entries; expected batch_size {n}"
                )
        if not 1 <= self.active_rows <= n:
            raise ValueError(f"active_rows must be in [1, {n}], got {self.active_rows}")
        if sum(self.active_mask) != self.active_rows:
            raise ValueError(
                f"active_mask marks {sum(self.active_mask)} rows but active_rows is "
                f"{self.active_rows}"
            )
        for row in range(n):
            active = self.active_mask[row]
            path = self.row_paths[row]
            if (path == "inactive") == active:
                raise ValueError(f"row {row}: path {path!r} disagrees with active={active}")
            if self.greedy_mask[row] and (
                self.top_k[row] != GREEDY_TOP_K
                or self.top_p[row] != GREEDY_TOP_P
                or self.inverse_temperature[row] != GREEDY_INVERSE_TEMPERATURE
            ):
                raise ValueError(f"row {row}: a greedy row must be k=1, p=0, inverse temp 1")
            if active and not 1 <= self.top_k[row] <= self.max_device_top_k:
                raise ValueError(
                    f"row {row}: top_k={self.top_k[row]} is outside the device-supported range "
                    f"[1, {self.max_device_top_k}]"
                )
        expected: PreparedPath = "argmax" if self.all_active_rows_argmax else "topk"
        if self.sampling_path != expected:
            raise ValueError(
                f"sampling_path {self.sampling_path!r} disagrees with the row paths "
                f"(expected {expected!r})"
            )
        _check_history(self, "prompt_tokens", self.prompt_tokens)
        _check_history(self, "output_tokens", self.output_tokens)
        if self.slot_remap is not None and len(self.slot_remap) != n:
            raise ValueError(
                f"slot_remap has {len(self.slot_remap)} entries; expected batch_size {n}"
            )

    def _active(self) -> list[int]:
        return [row for row, active in enumerate(self.active_mask) if active]

    @property
    def active_row_indices(self) -> tuple[int, ...]:
        """Physical rows that carry a request, in order."""
        return tuple(self._active())

    @property
    def penalties_enabled(self) -> bool:
        """Any active row with a non-neutral presence, frequency or repetition penalty."""
        return any(
            self.presence_penalty[r] != 0.0
            or self.frequency_penalty[r] != 0.0
            or self.repetition_penalty[r] != 1.0
            for r in self._active()
        )

    @property
    def log_probs_enabled(self) -> bool:
        """Any active row that asked for log-probabilities."""
        return any(self.logprob_modes[r] != "none" for r in self._active())

    @property
    def all_active_rows_greedy(self) -> bool:
        return all(self.greedy_mask[r] for r in self._active())

    @property
    def all_active_rows_argmax(self) -> bool:
        return all(self.row_paths[r] == "argmax" for r in self._active())

    @property
    def seeded(self) -> bool:
        """Any active row with an explicit seed (the sampler then needs positions)."""
        return any(self.seeds[r] is not None for r in self._active())

    @property
    def max_num_logprobs(self) -> int:
        """Widest top-n log-prob request over the active rows (0 when none)."""
        return max((self.num_logprobs[r] for r in self._active()), default=0)

    def kpt_values(self) -> tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]:
        """(top_k, top_p, inverse temperature) per row: the K/P/T device inputs."""
        return self.top_k, self.top_p, self.inverse_temperature

    def _rows(self) -> list[_Row]:
        return [
            _Row(
                active=self.active_mask[r],
                greedy=self.greedy_mask[r],
                path=self.row_paths[r],
                top_k=self.top_k[r],
                top_p=self.top_p[r],
                inverse_temperature=self.inverse_temperature[r],
                presence_penalty=self.presence_penalty[r],
                frequency_penalty=self.frequency_penalty[r],
                repetition_penalty=self.repetition_penalty[r],
                seed=self.seeds[r],
                enable_log_probs=self.enable_log_probs[r],
                num_logprobs=self.num_logprobs[r],
                logprob_mode=self.logprob_modes[r],
            )
            for r in range(self.batch_size)
        ]


def _assemble(
    rows: Sequence[_Row],
    *,
    max_device_top_k: int,
    prompt_tokens: torch.Tensor | None,
    output_tokens: torch.Tensor | None,
    slot_remap: tuple[int, ...] | None,
) -> PreparedSamplingParams:
    argmax = all(row.path == "argmax" for row in rows if row.active)
    return PreparedSamplingParams(
        batch_size=len(rows),
        active_rows=sum(row.active for row in rows),
        max_device_top_k=max_device_top_k,
        sampling_path="argmax" if argmax else "topk",
        top_k=tuple(row.top_k for row in rows),
        top_p=tuple(row.top_p for row in rows),
        inverse_temperature=tuple(row.inverse_temperature for row in rows),
        presence_penalty=tuple(row.presence_penalty for row in rows),
        frequency_penalty=tuple(row.frequency_penalty for row in rows),
        repetition_penalty=tuple(row.repetition_penalty for row in rows),
        seeds=tuple(row.seed for row in rows),
        enable_log_probs=tuple(row.enable_log_probs for row in rows),
        num_logprobs=tuple(row.num_logprobs for row in rows),
        logprob_modes=tuple(row.logprob_mode for row in rows),
        greedy_mask=tuple(row.greedy for row in rows),
        row_paths=tuple(row.path for row in rows),
        active_mask=tuple(row.active for row in rows),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        slot_remap=slot_remap,
    )


# --------------------------------------------------------------------------------------------
# prepare_sampling_params
# --------------------------------------------------------------------------------------------


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _resolve_active_mask(
    sp: SamplingParams, batch_size: int, active_mask: Sequence[bool] | torch.Tensor | None
) -> list[bool]:
    if active_mask is None:
        rows = sp.num_rows
        if rows > batch_size:
            raise ValueError(
                f"SamplingParams has {rows} rows (the length of temperature) but the sampling "
                f"batch has {batch_size} rows"
            )
        return [row < rows for row in range(batch_size)]
    values: list[object]
    if isinstance(active_mask, torch.Tensor):
        values = list(active_mask.detach().reshape(-1).tolist())
    elif isinstance(active_mask, Sequence) and not isinstance(active_mask, str | bytes):
        values = list(active_mask)
    else:
        raise TypeError(f"active_mask must be a sequence of bool, got {type(active_mask).__name__}")
    if len(values) != batch_size:
        raise ValueError(f"active_mask has {len(values)} entries; expected batch_size {batch_size}")
    mask: list[bool] = []
    for row, value in enumerate(values):
        if not isinstance(value, bool):
            raise TypeError(f"active_mask row {row} must be a bool, got {value!r}")
        mask.append(value)
    if not any(mask):
        raise ValueError("active_mask marks no active row; at least one row must be active")
    return mask


def _per_row(field: str, value: T | tuple[T, ...], batch_size: int, cover: int, pad: T) -> list[T]:
    """Broadcast a scalar or length-1 sequence; otherwise per row, padded with `pad`."""
    if not isinstance(value, tuple):
        return [value] * batch_size
    if len(value) == 1:
        return [value[0]] * batch_size
    if len(value) > batch_size:
        raise ValueError(
            f"SamplingParams.{field} has {len(value)} values but the sampling batch has "
            f"{batch_size} rows"
        )
    if len(value) < cover:
        raise ValueError(
            f"SamplingParams.{field} has {len(value)} values but active row {cover - 1} needs "
            f"one; give one value, or one per row up to row {cover - 1}"
        )
    return list(value) + [pad] * (batch_size - len(value))


def _per_row_seeds(seed: int | tuple[int | None, ...] | None, batch_size: int) -> list[int | None]:
    """A scalar seed is request-owned by row 0 and never broadcast."""
    if seed is None:
        return [None] * batch_size
    if isinstance(seed, int):
        return [seed] + [None] * (batch_size - 1)
    if len(seed) > batch_size:
        raise ValueError(
            f"SamplingParams.seed has {len(seed)} values but the sampling batch has "
            f"{batch_size} rows"
        )
    return list(seed) + [None] * (batch_size - len(seed))


def _history(
    name: str, value: torch.Tensor | None, batch_size: int, mask: Sequence[bool]
) -> torch.Tensor | None:
    """Copy request-owned token history to `[batch_size, length]` int64; inactive rows -> -1."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
    if value.dim() != 2:
        raise ValueError(f"{name} must be [rows, length], got shape {tuple(value.shape)}")
    rows = value.shape[0]
    if rows not in (1, batch_size):
        raise ValueError(
            f"{name} has {rows} rows; expected 1 (broadcast) or batch_size {batch_size}"
        )
    out = value.to(torch.int64).expand(batch_size, value.shape[1]).clone()
    inactive = torch.tensor([not active for active in mask], device=out.device)
    out[inactive] = -1
    bad = (out < -1).any(dim=1).nonzero().reshape(-1).tolist()
    if bad:
        raise ValueError(f"{name} row {bad[0]} holds a token id < -1; use -1 for 'no token'")
    return out


def _slot_remap(
    value: Sequence[int] | torch.Tensor | None, batch_size: int
) -> tuple[int, ...] | None:
    if value is None:
        return None
    items: list[object]
    if isinstance(value, torch.Tensor):
        items = list(value.detach().reshape(-1).tolist())
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        items = list(value)
    else:
        raise TypeError(f"slot_remap must be a sequence of ints, got {type(value).__name__}")
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


def prepare_sampling_params(
    sp: SamplingParams,
    batch_size: int,
    *,
    max_device_top_k: int,
    allow_force_argmax: bool,
    prompt_tokens: torch.Tensor | None = None,
    output_tokens: torch.Tensor | None = None,
    slot_remap: Sequence[int] | torch.Tensor | None = None,
    active_mask: Sequence[bool] | torch.Tensor | None = None,
) -> PreparedSamplingParams:
    """Normalise request parameters to `batch_size` device rows (reference §2.7).

    Without `active_mask` the first `sp.num_rows` rows are active and sequences are request
    rows; with it (decode: a slot is active iff its position >= 0) sequences are slot-indexed.
    Stochastic rows need an int top_k in `[1, max_device_top_k]` and are rejected, never
    clamped, otherwise. Greedy rows are normalised before that check, so any top_k is fine
    with temperature 0.
    """
    if not isinstance(sp, SamplingParams):
        raise TypeError(f"sp must be SamplingParams, got {type(sp).__name__}")
    _positive_int("batch_size", batch_size)
    _positive_int("max_device_top_k", max_device_top_k)
    if not isinstance(allow_force_argmax, bool):
        raise TypeError(f"allow_force_argmax must be bool, got {allow_force_argmax!r}")
    mask = _resolve_active_mask(sp, batch_size, active_mask)
    cover = max(row for row, active in enumerate(mask) if active) + 1

    temperatures = _per_row("temperature", sp.temperature, batch_size, cover, DEFAULT_TEMPERATURE)
    top_ks = _per_row("top_k", sp.top_k, batch_size, cover, GREEDY_TOP_K)
    top_ps = _per_row("top_p", sp.top_p, batch_size, cover, DEFAULT_TOP_P)
    presences = _per_row(
        "presence_penalty", sp.presence_penalty, batch_size, cover, DEFAULT_PRESENCE_PENALTY
    )
    frequencies = _per_row(
        "frequency_penalty", sp.frequency_penalty, batch_size, cover, DEFAULT_FREQUENCY_PENALTY
    )
    repetitions = _per_row(
        "repetition_penalty", sp.repetition_penalty, batch_size, cover, DEFAULT_REPETITION_PENALTY
    )
    enables = _per_row("enable_log_probs", sp.enable_log_probs, batch_size, cover, False)
    counts = _per_row("num_logprobs", sp.num_logprobs, batch_size, cover, 0)
    seeds = _per_row_seeds(sp.seed, batch_size)

    rows: list[_Row] = []
    for row in range(batch_size):
        if not mask[row]:
            rows.append(_NEUTRAL_ROW)
            continue
        temperature = temperatures[row]
        greedy = temperature == 0.0
        if greedy:
            top_k, top_p, inverse = GREEDY_TOP_K, GREEDY_TOP_P, GREEDY_INVERSE_TEMPERATURE
        else:
            top_k, top_p, inverse = top_ks[row], top_ps[row], 1.0 / temperature
            if not 1 <= top_k <= max_device_top_k:
                meaning = " (top_k=0 means no top-k limit)" if top_k == 0 else ""
                raise ValueError(
                    f"row {row}: top_k={top_k}{meaning} is outside the device-supported range "
                    f"[1, {max_device_top_k}] for a stochastic row (temperature={temperature}); "
                    "it is never clamped; route this request to host sampling"
                )
            if inverse > _FLOAT32_MAX:
                raise ValueError(
                    f"row {row}: temperature={temperature} is too small for a stochastic row "
                    "(its inverse overflows float32); use temperature 0 for greedy"
                )
        enabled = enables[row]
        count = counts[row] if enabled else 0
        mode: LogProbMode = "none" if not enabled else ("top_n" if count > 0 else "sampled_token")
        path: RowPath = "argmax" if greedy and allow_force_argmax and mode == "none" else "topk"
        rows.append(
            _Row(
                active=True,
                greedy=greedy,
                path=path,
                top_k=top_k,
                top_p=top_p,
                inverse_temperature=inverse,
                presence_penalty=presences[row],
                frequency_penalty=frequencies[row],
                repetition_penalty=repetitions[row],
                seed=seeds[row],
                enable_log_probs=enabled,
                num_logprobs=count,
                logprob_mode=mode,
            )
        )
    return _assemble(
        rows,
        max_device_top_k=max_device_top_k,
        prompt_tokens=_history("prompt_tokens", prompt_tokens, batch_size, mask),
        output_tokens=_history("output_tokens", output_tokens, batch_size, mask),
        slot_remap=_slot_remap(slot_remap, batch_size),
    )


def _select_history(value: torch.Tensor | None, rows: Sequence[int]) -> torch.Tensor | None:
    if value is None:
        return None
    index = torch.tensor(list(rows), dtype=torch.int64, device=value.device)
    return value.index_select(0, index)


def slice_prepared_sampling_params(
    prepared: PreparedSamplingParams, rows: Sequence[int] | torch.Tensor
) -> PreparedSamplingParams:
    """The prepared rows `rows` (in that order) as a smaller batch; needs one active row.

    `slot_remap` is dropped: its slot numbers belong to the original batch.
    """
    if not isinstance(prepared, PreparedSamplingParams):
        raise TypeError(f"prepared must be PreparedSamplingParams, got {type(prepared).__name__}")
    selected = _row_indices("rows", rows)
    if not selected:
        raise ValueError("slice_prepared_sampling_params needs at least one row")
    for row in selected:
        if row >= prepared.batch_size:
            raise ValueError(f"row {row} is outside the prepared batch of {prepared.batch_size}")
    source = prepared._rows()
    picked = [source[row] for row in selected]
    if not any(row.active for row in picked):
        raise ValueError(f"rows {selected} hold no active row; a slice needs at least one")
    return _assemble(
        picked,
        max_device_top_k=prepared.max_device_top_k,
        prompt_tokens=_select_history(prepared.prompt_tokens, selected),
        output_tokens=_select_history(prepared.output_tokens, selected),
        slot_remap=None,
    )


def _place_history(
    value: torch.Tensor | None, sources: Sequence[int], slots: Sequence[int], batch_size: int
) -> torch.Tensor | None:
    if value is None:
        return None
    out = torch.full((batch_size, value.shape[1]), -1, dtype=value.dtype, device=value.device)
    if slots:
        src = torch.tensor(list(sources), dtype=torch.int64, device=value.device)
        dst = torch.tensor(list(slots), dtype=torch.int64, device=value.device)
        out[dst] = value.index_select(0, src)
    return out


def place_prepared_sampling_params(
    prepared: PreparedSamplingParams,
    slots: Sequence[int] | torch.Tensor,
    *,
    batch_size: int | None = None,
    slot_remap: Sequence[int] | torch.Tensor | None = None,
) -> PreparedSamplingParams:
    """Move the active rows, in order, into `slots` of a (lane-local) batch; the rest neutral.

    `batch_size` defaults to the prepared batch size; history rows outside `slots` become -1.
    The old `slot_remap` is dropped (its slot numbers belong to the old batch); pass a new one.
    """
    if not isinstance(prepared, PreparedSamplingParams):
        raise TypeError(f"prepared must be PreparedSamplingParams, got {type(prepared).__name__}")
    target = prepared.batch_size if batch_size is None else _positive_int("batch_size", batch_size)
    placed = _row_indices("slots", slots)
    active = prepared._active()
    if len(placed) != len(active):
        raise ValueError(
            f"{len(placed)} slots given for {len(active)} active rows; give one slot per active row"
        )
    for slot in placed:
        if slot >= target:
            raise ValueError(f"slot {slot} is outside the target batch of {target}")
    source = prepared._rows()
    rows = [_NEUTRAL_ROW] * target
    for row, slot in zip(active, placed, strict=True):
        rows[slot] = source[row]
    return _assemble(
        rows,
        max_device_top_k=prepared.max_device_top_k,
        prompt_tokens=_place_history(prepared.prompt_tokens, active, placed, target),
        output_tokens=_place_history(prepared.output_tokens, active, placed, target),
        slot_remap=_slot_remap(slot_remap, target),
    )


# --------------------------------------------------------------------------------------------
# Log-probability payloads (reference §2.7 helpers and §3)
# --------------------------------------------------------------------------------------------


LogProbRowPayload: TypeAlias = tuple[Sequence[int], object]
"""(source rows of one request, that request's sampled-token log-prob payload or None)."""


def sampled_log_probs_for_rows(value: object, rows: int) -> torch.Tensor:
    """A request's log-prob payload as float32 `[rows]` on the host.

    Accepts a tensor (any shape, flattened), a number, or a sequence of numbers. One value
    broadcasts to every row; more values than rows keep the first `rows`; fewer -> ValueError.
    """
    _positive_int("rows", rows)
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
    _positive_int("batch_size", batch_size)
    merged: torch.Tensor | None = None
    for rows, value in row_payloads:
        if value is None:
            continue
        indices = _row_indices("payload rows", rows)
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
