"""The decode batch: one lane step's caller input, checked once and frozen (reference §2.15).

`DecodeRuntime.prepare` is the decode boundary: it turns the caller's tensors and sampling
arguments into a `PreparedDecode` with the checks here, raising every caller error before
anything is staged. Code below the boundary (staging, invocation, trace refresh, the
executors) trusts the value; `assert_lane_batch` states what it guarantees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Required, TypeAlias, TypedDict

import attrs
import torch

from runtime.config import PageTableLayout
from runtime.decode_config import DecodeRuntimeConfig
from runtime.decode_signatures import DecodeSignature
from runtime.sampling import (
    PreparedSamplingParams,
    SamplingParams,
    SamplingPath,
    prepare_sampling_params,
    slice_prepared_sampling_params,
)

__all__ = [
    "DECODE_OPTIONS",
    "DecodeArguments",
    "DecodeOptions",
    "LaneInputs",
    "LaneSamplingMemo",
    "PreparedDecode",
    "SlotRemap",
    "assert_lane_batch",
    "check_decode_options",
    "check_lane_inputs",
    "check_sampling_arguments",
    "check_token_ids",
    "page_table_copy_counts",
    "prepare_lane_sampling",
    "require_prepared",
]

SlotRemap: TypeAlias = Sequence[int] | torch.Tensor
"""`slot_remap[i]`: the slot whose request-owned sampling state moves into slot `i`."""


class DecodeOptions(TypedDict, total=False):
    """The optional keywords of one decode step, after the lane's three tensors."""

    sampling_params: SamplingParams | None
    prompt_tokens: torch.Tensor | None
    output_tokens: torch.Tensor | None
    slot_remap: SlotRemap | None
    reset_batch: bool


class DecodeArguments(DecodeOptions):
    """Every keyword of a public decode step: what every layer above `DecodeRuntime.prepare`
    passes through unchanged (the one declaration of the decode keyword list)."""

    tokens: Required[torch.Tensor]
    start_pos: Required[torch.Tensor]
    page_table: Required[torch.Tensor]


DECODE_OPTIONS = frozenset(DecodeOptions.__optional_keys__)


def check_decode_options(operation: str, options: Mapping[str, object]) -> None:
    """Refuse an unknown keyword as Python would for an explicit keyword list."""
    for name in options:
        if name not in DECODE_OPTIONS:
            raise TypeError(f"{operation}() got an unexpected keyword argument {name!r}")


@attrs.frozen(eq=False)
class PreparedDecode:
    """One validated decode step of a whole lane, ready to stage (host tensors only).

    `tokens`/`start_pos` are int64 `[lane]` private copies; `page_table` is the normalised
    int32 `[lane, decode_width]` table (possibly the cached object of the previous step);
    `prepared_sampling` is slot-indexed over the lane with inactive rows neutral. `signature`
    is the step's program and trace identity, built once by the boundary: the dispatcher's
    key, never rebuilt below it.
    """

    tokens: torch.Tensor
    start_pos: torch.Tensor
    page_table: torch.Tensor
    sampling_params: SamplingParams | None
    prepared_sampling: PreparedSamplingParams | None
    sampling_path: SamplingPath
    reset_batch: bool
    device_feedback: bool
    page_table_changed: bool
    signature: DecodeSignature

    @property
    def lane_capacity(self) -> int:
        """Rows of the lane (the decode batch)."""
        return int(self.tokens.shape[0])

    @property
    def active_mask(self) -> torch.Tensor:
        """bool `[lane]`: a row is active iff its start position is >= 0."""
        return self.start_pos >= 0

    @property
    def active_rows(self) -> int:
        """How many rows of the lane are active."""
        return int(self.active_mask.sum())

    @property
    def penalties_enabled(self) -> bool:
        """Whether any active row asked for a presence/frequency/repetition penalty."""
        return self.prepared_sampling is not None and self.prepared_sampling.penalties_enabled

    @property
    def logprobs_enabled(self) -> bool:
        """Whether any active row asked for log-probabilities."""
        return self.prepared_sampling is not None and self.prepared_sampling.log_probs_enabled


def require_prepared(value: object) -> PreparedDecode:
    """`value` if it came from `DecodeRuntime.prepare` (a public call handed a foreign value)."""
    if not isinstance(value, PreparedDecode):
        raise TypeError(f"prepared must be a PreparedDecode, got {type(value).__name__}")
    return value


def assert_lane_batch(prepared: PreparedDecode, lane_capacity: int, decode_width: int) -> None:
    """What the boundary guaranteed, stated where a step is staged (no caller error here)."""
    assert prepared.tokens.shape == (lane_capacity,) and prepared.tokens.dtype == torch.int64
    assert prepared.start_pos.shape == (lane_capacity,)
    assert prepared.page_table.shape == (lane_capacity, decode_width)
    assert prepared.page_table.dtype == torch.int32
    assert (prepared.prepared_sampling is None) == (prepared.sampling_path == "logits")
    assert prepared.signature.sampling_path == prepared.sampling_path


# --------------------------------------------------------------------------------------------
# Boundary checks (each raises the caller's error, naming the argument)
# --------------------------------------------------------------------------------------------


def _host_tensor(name: str, value: object, rank: int, shape_text: str) -> torch.Tensor:
    """`value` is an integer torch tensor of `rank` (TypeError / ValueError naming it)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_text}, got {type(value).__name__}")
    if value.dim() != rank:
        raise ValueError(
            f"{name} must be a rank-{rank} tensor {shape_text}, got shape {tuple(value.shape)}"
        )
    dtype = value.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {dtype}")
    return value


@attrs.frozen(eq=False)
class LaneInputs:
    """The lane tensors after their shape checks: private int64 host copies of tokens and
    positions, and the caller's page table (normalised later, against the copy counts)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    page_table: torch.Tensor

    @property
    def active(self) -> torch.Tensor:
        """bool `[lane]`: rows with a position >= 0 (computed when a check needs it)."""
        return self.positions >= 0


def check_lane_inputs(
    lane_capacity: int, tokens: object, start_pos: object, page_table: object
) -> LaneInputs:
    """Ranks, integer dtypes and one batch of `lane_capacity` rows for the three tensors."""
    host_tokens = _host_tensor("tokens", tokens, 1, "[lane]")
    positions = _host_tensor("start_pos", start_pos, 1, "[lane]")
    table = _host_tensor("page_table", page_table, 2, "[lane, width]")
    batch = int(host_tokens.shape[0])
    if batch != lane_capacity:
        raise ValueError(f"decode batch {batch} must equal lane capacity {lane_capacity}")
    if int(positions.shape[0]) != batch or int(table.shape[0]) != batch:
        raise ValueError(
            f"decode tokens, start_pos and page_table batches must match: tokens {batch}, "
            f"start_pos {int(positions.shape[0])}, page_table {int(table.shape[0])}"
        )
    # Integer tensors never require grad: a copy needs no detach.
    return LaneInputs(
        tokens=host_tokens.to(device="cpu", dtype=torch.int64, copy=True),
        positions=positions.to(device="cpu", dtype=torch.int64, copy=True),
        page_table=table,
    )


def check_token_ids(lane: LaneInputs, vocab_size: int) -> None:
    """Every active row's token is a vocabulary id (inactive rows may carry anything)."""
    tokens = lane.tokens
    if not tokens.numel():
        return
    low, high = torch.aminmax(tokens)
    if int(low) >= 0 and int(high) < vocab_size:
        return  # every row holds an id: one reduction; active rows are looked at otherwise
    bad = (lane.active & ((tokens < 0) | (tokens >= vocab_size))).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        raise ValueError(
            f"tokens row {row} is {int(tokens[row])}; allowed token ids of an active row "
            f"are [0, {vocab_size})"
        )


def check_sampling_arguments(
    device_sampling_enabled: bool,
    sampling_params: object,
    *,
    prompt_tokens: object,
    output_tokens: object,
    slot_remap: object,
) -> SamplingParams | None:
    """`sampling_params` as SamplingParams (device sampling on) or None with no sampling state."""
    if sampling_params is None:
        for name, value in (
            ("prompt_tokens", prompt_tokens),
            ("output_tokens", output_tokens),
            ("slot_remap", slot_remap),
        ):
            if value is not None:
                raise ValueError(
                    f"{name} is request-owned sampling state and needs sampling_params; "
                    "pass sampling_params or leave it None"
                )
        return None
    if not device_sampling_enabled:
        raise ValueError(
            "sampling_params were supplied but device sampling is disabled; resolve "
            "DecodeRuntimeConfig with device_sampling_enabled=True"
        )
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(
            f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}"
        )
    return sampling_params


def page_table_copy_counts(
    page_table: torch.Tensor,
    start_pos: torch.Tensor,
    *,
    layout: PageTableLayout,
    device_feedback: bool,
) -> torch.Tensor:
    """Blocks to copy per row: `ceil((pos+1)/block)`, plus a look-ahead block with feedback.

    Raises when a position is beyond the paged-KV capacity or the caller's table is too
    narrow for it (rule 20). The look-ahead block is added only when device feedback will
    advance the position past a block boundary (`(pos+1) % block == 0`), capped by the raw
    capacity and the caller width. Negative positions (inactive rows) copy nothing.
    """
    block = layout.block_size
    raw = layout.raw_capacity_width
    width = int(page_table.shape[1])
    pos = start_pos.to(torch.int64)
    # ceil((pos + 1) / block) == floor((pos + block) / block) for pos >= -1; below, 0 blocks.
    used = (pos + block).div_(block, rounding_mode="floor")
    if pos.numel():
        low, high = torch.aminmax(pos)
        if int(low) < -1:
            used.clamp_(min=0)
        if int(high) >= min(raw, width) * block:  # the blocks needed grow with the position
            _refuse_positions(pos, used, block=block, raw=raw, width=width)
    if not device_feedback:
        return used
    at_boundary = (pos >= 0) & ((pos + 1) % block == 0)
    look_ahead = (used + 1).clamp(max=min(raw, width))
    return torch.where(at_boundary, torch.maximum(look_ahead, used), used)


def _refuse_positions(
    pos: torch.Tensor, used: torch.Tensor, *, block: int, raw: int, width: int
) -> None:
    """The first row whose position the layout or the caller's table cannot hold."""
    over = (used > raw).nonzero()
    if over.numel():
        row = int(over[0, 0])
        raise ValueError(
            f"decode position {int(pos[row])} of row {row} exceeds the configured paged-KV "
            f"capacity: it needs {int(used[row])} block(s) of {block} tokens, the layout holds "
            f"{raw} (raw_capacity_width); allowed positions are < {raw * block}"
        )
    narrow = (used > width).nonzero()
    if narrow.numel():
        row = int(narrow[0, 0])
        raise ValueError(
            f"page table is too narrow for decode row {row}: position {int(pos[row])} needs "
            f"{int(used[row])} block(s) of {block} tokens, the page table has {width} column(s)"
        )


# --------------------------------------------------------------------------------------------
# Sampling over the lane
# --------------------------------------------------------------------------------------------


def _pad_history(value: torch.Tensor | None, lane: int, rows: int) -> torch.Tensor | None:
    """Lane-row history extended with empty (-1) rows to the sampler batch."""
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != lane:
        return value  # broadcast, full-width or malformed: the sampler validates it
    if rows == lane:
        return value
    filler = torch.full((rows - lane, value.shape[1]), -1, dtype=value.dtype, device=value.device)
    return torch.cat([value, filler])


def _pad_slot_remap(value: SlotRemap | None, lane: int, rows: int) -> SlotRemap | None:
    """A lane-wide slot remap extended with "no source" (-1) entries to the sampler batch."""
    if value is None or rows == lane:
        return value
    items = value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else list(value)
    return items + [-1] * (rows - lane) if len(items) == lane else value


def prepare_lane_sampling(
    config: DecodeRuntimeConfig,
    sampling_params: SamplingParams,
    lane: LaneInputs,
    *,
    prompt_tokens: torch.Tensor | None,
    output_tokens: torch.Tensor | None,
    slot_remap: SlotRemap | None,
) -> PreparedSamplingParams:
    """Normalise over the sampler batch (reference 2.15), then keep the lane's rows.

    Slot-indexed values may cover the whole sampler batch (e.g. 32 rows for a lane of 1);
    rows past the lane are inactive, hence neutral, and never change the sampling path.
    """
    active = [bool(flag) for flag in lane.active.tolist()]
    if not any(active):
        raise ValueError(
            "sampling_params need at least one active decode row (start_pos >= 0); "
            "every row is inactive"
        )
    width = config.lane_capacity
    rows = config.sampling_batch_size or width
    assert config.max_device_top_k is not None  # device sampling is on (checked above)
    full = prepare_sampling_params(
        sampling_params,
        rows,
        max_device_top_k=config.max_device_top_k,
        allow_force_argmax=config.allow_force_argmax and not config.force_greedy_top_k,
        prompt_tokens=_pad_history(prompt_tokens, width, rows),
        output_tokens=_pad_history(output_tokens, width, rows),
        slot_remap=_pad_slot_remap(slot_remap, width, rows),
        active_mask=active + [False] * (rows - width),
    )
    if rows == width:
        return full
    lane_rows = slice_prepared_sampling_params(full, range(width))
    remap = None if full.slot_remap is None else full.slot_remap[:width]
    return attrs.evolve(lane_rows, slot_remap=remap)


class LaneSamplingMemo:
    """The last `prepare_lane_sampling` result, reused while a lane's requests stay put.

    A generator hands the same (frozen) `SamplingParams` object step after step, a serving
    engine equal ones; normalising them over the sampler batch again each step cost more host
    time than the argmax it feeds. Reused only for equal parameters (the same object is
    checked first), the same active rows and no history or slot remap (those change every
    step); anything else is prepared afresh and remembered.
    """

    def __init__(self) -> None:
        self._last: tuple[SamplingParams, tuple[bool, ...], PreparedSamplingParams] | None = None

    def prepare(
        self,
        config: DecodeRuntimeConfig,
        sampling_params: SamplingParams,
        lane: LaneInputs,
        *,
        prompt_tokens: torch.Tensor | None,
        output_tokens: torch.Tensor | None,
        slot_remap: SlotRemap | None,
    ) -> PreparedSamplingParams:
        """`prepare_lane_sampling`, or the remembered result of an identical call."""
        stateless = prompt_tokens is None and output_tokens is None and slot_remap is None
        active = tuple(bool(flag) for flag in lane.active.tolist())
        last = self._last
        if (
            stateless
            and last is not None
            and last[1] == active
            and (last[0] is sampling_params or last[0] == sampling_params)
        ):
            return last[2]
        prepared = prepare_lane_sampling(
            config,
            sampling_params,
            lane,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            slot_remap=slot_remap,
        )
        self._last = (sampling_params, active, prepared) if stateless else None
        return prepared
