"""`prepare_sampling_params`: a request's `SamplingParams` in the device sampler's form.

It normalises to one entry per physical row of the sampler batch (reference §2.7): greedy rows
become the device representation (k=1, p=0, inverse temperature 1), stochastic rows carry the
inverse temperature, inactive rows are neutral, and the value records the sampling path the
program identity needs. Everything here is host-side and pure, so it is all checked before any
device work; a stochastic row whose top_k the device cannot honour is refused, never clamped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import attrs
import torch

from runtime.sampling.checks import checked_slot_remap, listed
from runtime.sampling.params import (
    DEFAULT_FREQUENCY_PENALTY,
    DEFAULT_PRESENCE_PENALTY,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    SamplingParams,
)
from runtime.sampling.prepared import (
    GREEDY_INVERSE_TEMPERATURE,
    GREEDY_TOP_K,
    GREEDY_TOP_P,
    NEUTRAL_ROW,
    LogProbMode,
    PreparedRow,
    PreparedSamplingParams,
    RowPath,
    assemble_prepared,
)
from runtime.validation import integer_tensor, plain_bool, positive_int

_FLOAT32_MAX = 3.4028234663852886e38

T = TypeVar("T")


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
    values = listed("active_mask", active_mask, "bool")
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
    integer_tensor(name, value)
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


@attrs.frozen
class _RowValues:
    """The request's values spread to one list per field, each `batch_size` long."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    presence_penalty: list[float]
    frequency_penalty: list[float]
    repetition_penalty: list[float]
    enable_log_probs: list[bool]
    num_logprobs: list[int]
    seeds: list[int | None]

    @classmethod
    def spread(cls, sp: SamplingParams, batch_size: int, cover: int) -> _RowValues:
        """Scalars broadcast; sequences must reach active row `cover - 1` and are padded."""

        def per_row(field: str, pad: T) -> list[T]:
            value: T | tuple[T, ...] = getattr(sp, field)
            return _per_row(field, value, batch_size, cover, pad)

        return cls(
            temperature=per_row("temperature", DEFAULT_TEMPERATURE),
            top_k=per_row("top_k", GREEDY_TOP_K),
            top_p=per_row("top_p", DEFAULT_TOP_P),
            presence_penalty=per_row("presence_penalty", DEFAULT_PRESENCE_PENALTY),
            frequency_penalty=per_row("frequency_penalty", DEFAULT_FREQUENCY_PENALTY),
            repetition_penalty=per_row("repetition_penalty", DEFAULT_REPETITION_PENALTY),
            enable_log_probs=per_row("enable_log_probs", False),
            num_logprobs=per_row("num_logprobs", 0),
            seeds=_per_row_seeds(sp.seed, batch_size),
        )


def _device_kpt(
    row: int, temperature: float, top_k: int, top_p: float, max_device_top_k: int
) -> tuple[int, float, float]:
    """(top_k, top_p, inverse temperature) of an active row in the device representation."""
    if temperature == 0.0:
        return GREEDY_TOP_K, GREEDY_TOP_P, GREEDY_INVERSE_TEMPERATURE
    inverse = 1.0 / temperature
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
    return top_k, top_p, inverse


def _prepare_row(
    row: int, values: _RowValues, *, max_device_top_k: int, allow_force_argmax: bool
) -> PreparedRow:
    """One active row: greedy rows normalised first, so any top_k is fine with temperature 0."""
    temperature = values.temperature[row]
    greedy = temperature == 0.0
    top_k, top_p, inverse = _device_kpt(
        row, temperature, values.top_k[row], values.top_p[row], max_device_top_k
    )
    enabled = values.enable_log_probs[row]
    count = values.num_logprobs[row] if enabled else 0
    mode: LogProbMode = "none" if not enabled else ("top_n" if count > 0 else "sampled_token")
    path: RowPath = "argmax" if greedy and allow_force_argmax and mode == "none" else "topk"
    return PreparedRow(
        active=True,
        greedy=greedy,
        path=path,
        top_k=top_k,
        top_p=top_p,
        inverse_temperature=inverse,
        presence_penalty=values.presence_penalty[row],
        frequency_penalty=values.frequency_penalty[row],
        repetition_penalty=values.repetition_penalty[row],
        seed=values.seeds[row],
        enable_log_probs=enabled,
        num_logprobs=count,
        logprob_mode=mode,
    )


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
    positive_int("batch_size", batch_size)
    positive_int("max_device_top_k", max_device_top_k)
    plain_bool("allow_force_argmax", allow_force_argmax)
    mask = _resolve_active_mask(sp, batch_size, active_mask)
    cover = max(row for row, active in enumerate(mask) if active) + 1
    values = _RowValues.spread(sp, batch_size, cover)
    rows = [
        _prepare_row(
            row, values, max_device_top_k=max_device_top_k, allow_force_argmax=allow_force_argmax
        )
        if mask[row]
        else NEUTRAL_ROW
        for row in range(batch_size)
    ]
    return assemble_prepared(
        rows,
        max_device_top_k=max_device_top_k,
        prompt_tokens=_history("prompt_tokens", prompt_tokens, batch_size, mask),
        output_tokens=_history("output_tokens", output_tokens, batch_size, mask),
        slot_remap=checked_slot_remap(slot_remap, batch_size),
    )
