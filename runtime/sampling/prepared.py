"""`PreparedSamplingParams`: sampling parameters in the device sampler's form, one entry per row.

Greedy rows are in the device representation (k=1, p=0, inverse temperature 1), stochastic rows
carry the inverse temperature, inactive rows are neutral, and the value knows the sampling path
the program identity needs. The class checks its own invariants, so a hand-built, sliced or
placed value can never reach a device half-formed. Besides the class this module holds the
row moves a prepared batch goes through: slicing rows out, placing them into a lane's slots,
and broadcasting a single active row. `runtime.sampling.prepare` builds the values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, NamedTuple, TypeAlias

import attrs
import torch

from runtime.sampling.checks import checked_slot_remap, row_indices
from runtime.sampling.params import (
    DEFAULT_FREQUENCY_PENALTY,
    DEFAULT_PRESENCE_PENALTY,
    DEFAULT_REPETITION_PENALTY,
)
from runtime.validation import positive_int

SamplingPath: TypeAlias = Literal["logits", "argmax", "topk"]
PreparedPath: TypeAlias = Literal["argmax", "topk"]
RowPath: TypeAlias = Literal["argmax", "topk", "inactive"]
LogProbMode: TypeAlias = Literal["none", "sampled_token", "top_n"]

# Device representation of a greedy row, and the neutral values of an inactive row.
GREEDY_TOP_K = 1
GREEDY_TOP_P = 0.0
GREEDY_INVERSE_TEMPERATURE = 1.0


class PreparedRow(NamedTuple):
    """One physical row of a prepared batch: what prepare builds and slices/places move."""

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


NEUTRAL_ROW = PreparedRow(
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


_PER_ROW_FIELDS = (
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
)
"""The fields of `PreparedSamplingParams` that hold one entry per physical row."""


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
        self._check_lengths()
        for row in range(self.batch_size):
            self._check_row(row)
        expected: PreparedPath = "argmax" if self.all_active_rows_argmax else "topk"
        if self.sampling_path != expected:
            raise ValueError(
                f"sampling_path {self.sampling_path!r} disagrees with the row paths "
                f"(expected {expected!r})"
            )
        _check_history(self, "prompt_tokens", self.prompt_tokens)
        _check_history(self, "output_tokens", self.output_tokens)
        if self.slot_remap is not None and len(self.slot_remap) != self.batch_size:
            raise ValueError(
                f"slot_remap has {len(self.slot_remap)} entries; expected batch_size "
                f"{self.batch_size}"
            )

    def _check_lengths(self) -> None:
        """One entry per row in every per-row field, and a consistent active-row count."""
        n = positive_int("batch_size", self.batch_size)
        for name in _PER_ROW_FIELDS:
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

    def _check_row(self, row: int) -> None:
        """A row's path matches its activity; greedy rows and top_k are in device form."""
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

    def _active(self) -> tuple[int, ...]:
        return self.active_row_indices

    @functools.cached_property
    def active_row_indices(self) -> tuple[int, ...]:
        """Physical rows that carry a request, in order (computed once: the value is frozen,
        and a lane of many slots asks for it per property, per planned request)."""
        return tuple(row for row, active in enumerate(self.active_mask) if active)

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

    def _rows(self) -> list[PreparedRow]:
        return [
            PreparedRow(
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


def assemble_prepared(
    rows: Sequence[PreparedRow],
    *,
    max_device_top_k: int,
    prompt_tokens: torch.Tensor | None,
    output_tokens: torch.Tensor | None,
    slot_remap: tuple[int, ...] | None,
) -> PreparedSamplingParams:
    """The prepared value holding `rows`; its sampling path follows the active rows."""
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
    selected = row_indices("rows", rows)
    if not selected:
        raise ValueError("slice_prepared_sampling_params needs at least one row")
    for row in selected:
        if row >= prepared.batch_size:
            raise ValueError(f"row {row} is outside the prepared batch of {prepared.batch_size}")
    source = prepared._rows()
    picked = [source[row] for row in selected]
    if not any(row.active for row in picked):
        raise ValueError(f"rows {selected} hold no active row; a slice needs at least one")
    return assemble_prepared(
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
    target = prepared.batch_size if batch_size is None else positive_int("batch_size", batch_size)
    placed = row_indices("slots", slots)
    active = prepared._active()
    if len(placed) != len(active):
        raise ValueError(
            f"{len(placed)} slots given for {len(active)} active rows; give one slot per active row"
        )
    for slot in placed:
        if slot >= target:
            raise ValueError(f"slot {slot} is outside the target batch of {target}")
    source = prepared._rows()
    rows = [NEUTRAL_ROW] * target
    for row, slot in zip(active, placed, strict=True):
        rows[slot] = source[row]
    return assemble_prepared(
        rows,
        max_device_top_k=prepared.max_device_top_k,
        prompt_tokens=_place_history(prepared.prompt_tokens, active, placed, target),
        output_tokens=_place_history(prepared.output_tokens, active, placed, target),
        slot_remap=checked_slot_remap(slot_remap, target),
    )


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
    return assemble_prepared(
        [prepared._rows()[row]] * rows,
        max_device_top_k=prepared.max_device_top_k,
        prompt_tokens=_broadcast_history(prepared.prompt_tokens, row, rows),
        output_tokens=_broadcast_history(prepared.output_tokens, row, rows),
        slot_remap=prepared.slot_remap,
    )
