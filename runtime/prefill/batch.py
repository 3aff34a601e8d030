"""One prefill call's caller input, checked once at the public boundary.

`PrefillArguments` is the prefill keyword list, declared once: every public prefill call
(`ModelExecutor`, the executors, `PrefillRuntime`) takes it as `**arguments`. `PlanLimits` is
the lane geometry a call is checked against. `check_batch` turns the arguments into a frozen
`PrefillBatch` (or raises the caller-facing error naming the argument); the planner, the
sampler and the executors below trust that value and only assert its invariants.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NotRequired, TypedDict

import attrs
import torch

from runtime.config import RuntimePolicy
from runtime.sampling import SamplingParams
from runtime.validation import check_block_ids, is_int, plain_bool, positive_int

IntVector = torch.Tensor | Sequence[int] | None
"""A per-row int vector as callers pass it: a rank-1 integer tensor, a sequence, or None."""


class PrefillRowArguments(TypedDict):
    """The keywords that decide a prefill plan (what `PrefillRuntime.plan` takes)."""

    tokens: torch.Tensor
    page_table: torch.Tensor
    prompt_lens: NotRequired[IntVector]
    start_pos: NotRequired[IntVector]
    empty_slots: NotRequired[IntVector]


class SamplingArguments(TypedDict, total=False):
    """The keywords of device sampling (used only with `sampling_params`)."""

    sampling_params: SamplingParams | None
    prompt_tokens: torch.Tensor | None
    output_tokens: torch.Tensor | None
    slot_remap: IntVector


class PrefillArguments(PrefillRowArguments, SamplingArguments):
    """Every keyword of a public prefill call: the plan's rows plus device sampling."""


PREFILL_KEYWORDS = frozenset(PrefillArguments.__required_keys__) | frozenset(
    PrefillArguments.__optional_keys__
)


def check_prefill_keywords(operation: str, arguments: Mapping[str, object]) -> None:
    """Refuse what Python would for an explicit keyword list (plus the borrowed-cache hint)."""
    if "kv_cache" in arguments:
        raise TypeError(
            f"{operation}() got an unexpected keyword argument 'kv_cache': executors use the "
            "manager-owned cache; validate the borrowed handle at the model executor"
        )
    for name in arguments:
        if name not in PREFILL_KEYWORDS:
            raise TypeError(f"{operation}() got an unexpected keyword argument {name!r}")
    missing = [name for name in ("tokens", "page_table") if name not in arguments]
    if missing:
        listed = " and ".join(repr(name) for name in missing)
        raise TypeError(
            f"{operation}() missing {len(missing)} required keyword-only argument"
            f"{'s' if len(missing) > 1 else ''}: {listed}"
        )


@attrs.frozen
class PlanLimits:
    """The lane geometry one planning call is checked and planned against.

    `supports_batched_prefill=None` selects the reference's legacy batching rule. The two
    widths are given together or not at all (`max_actual_width` bounds a prompt's blocks,
    `canonical_width` is the padded table width every request uses).
    """

    block_size: int
    max_batch_size: int
    max_prefill_chunk_size: int
    max_prefill_batch_size: int
    supports_batched_prefill: bool | None
    disable_batched_prefill: bool
    max_actual_width: int | None
    canonical_width: int | None
    policy: RuntimePolicy
    num_blocks: int | None = None

    @classmethod
    def checked(
        cls,
        *,
        block_size: object,
        max_batch_size: object,
        max_prefill_chunk_size: object,
        max_prefill_batch_size: object,
        supports_batched_prefill: object,
        disable_batched_prefill: object,
        max_actual_width: object,
        canonical_width: object,
        policy: object,
    ) -> PlanLimits:
        """Limits from the planner's own caller (`plan_prefill_requests`), every value checked."""
        if not isinstance(policy, RuntimePolicy):
            raise TypeError(f"policy must be a RuntimePolicy, got {type(policy).__name__}")
        block = positive_int("block_size", block_size)
        lane = positive_int("max_batch_size", max_batch_size)
        chunk = positive_int("max_prefill_chunk_size", max_prefill_chunk_size)
        wave = positive_int("max_prefill_batch_size", max_prefill_batch_size)
        supports = (
            None
            if supports_batched_prefill is None
            else plain_bool("supports_batched_prefill", supports_batched_prefill)
        )
        disable = plain_bool("disable_batched_prefill", disable_batched_prefill)
        actual, canonical = _widths(max_actual_width, canonical_width, policy)
        return cls(block, lane, chunk, wave, supports, disable, actual, canonical, policy)


def _widths(
    max_actual: object, canonical: object, policy: RuntimePolicy
) -> tuple[int | None, int | None]:
    if (max_actual is None) != (canonical is None):
        raise ValueError(
            f"max_actual_page_table_width and canonical_page_table_width must be given "
            f"together, got {max_actual!r} and {canonical!r}"
        )
    if max_actual is None:
        return None, None
    actual = positive_int("max_actual_page_table_width", max_actual)
    width = positive_int("canonical_page_table_width", canonical)
    align = policy.page_table_width_alignment
    if width < actual or width % align:
        raise ValueError(
            f"canonical_page_table_width must be >= max_actual_page_table_width "
            f"({actual}) and a multiple of {align} (policy page_table_width_alignment), "
            f"got {width}"
        )
    return actual, width


@attrs.frozen(eq=False)
class PrefillBatch:
    """A checked prefill call: rows, their cached prefixes and lane slots, and sampling.

    Invariants (`check_batch` establishes them): `tokens` and `page_table` are rank-2
    integer tensors with the same non-zero row count; per row `0 <= cached <= prompt <=
    tokens width`, `cached` is block aligned, and a row with uncached tokens fits the page
    table and the lane's paged-KV capacity; `slots` are unique and inside the lane. With
    `sampling_params`, each history is a rank-2 integer tensor of 1, batch or lane rows;
    `slot_remap` is checked against each request's sampler rows when it is prepared.
    """

    tokens: torch.Tensor
    page_table: torch.Tensor
    prompt_lens: tuple[int, ...]
    cached_tokens: tuple[int, ...]
    slots: tuple[int, ...]
    sampling_params: SamplingParams | None = None
    prompt_tokens: torch.Tensor | None = None
    output_tokens: torch.Tensor | None = None
    slot_remap: IntVector = None

    @property
    def batch_size(self) -> int:
        """Caller rows (fully cached rows included)."""
        return len(self.prompt_lens)

    def blocks_read(self, block_size: int) -> torch.Tensor:
        """Leading page-table entries each row's plan copies (int64 `[rows]`): the prompt's
        blocks for a row with uncached tokens, none for a fully cached row (it does not run)."""
        return torch.tensor(
            [
                0 if cached == prompt else -(-prompt // block_size)
                for prompt, cached in zip(self.prompt_lens, self.cached_tokens, strict=True)
            ],
            dtype=torch.int64,
        )


def check_batch(
    arguments: PrefillRowArguments, limits: PlanLimits, sampling: SamplingArguments | None = None
) -> PrefillBatch:
    """The arguments as a `PrefillBatch`, or the error naming the offending argument.

    `sampling` (usually `arguments` itself) adds the sampling keywords; its history tensors
    are checked only when `sampling_params` is given (without it they are not read).
    """
    tokens = _integer_matrix("tokens", arguments["tokens"])
    page_table = _integer_matrix("page_table", arguments["page_table"])
    batch, width = int(tokens.shape[0]), int(tokens.shape[1])
    if page_table.shape[0] != batch:
        raise ValueError(
            f"tokens and page_table must have the same batch, got {batch} and {page_table.shape[0]}"
        )
    if batch == 0:
        raise ValueError("tokens must have at least one row, got batch 0")
    prompts = _vector("prompt_lens", arguments.get("prompt_lens"), batch, (width,) * batch)
    cached = _vector("start_pos", arguments.get("start_pos"), batch, (0,) * batch)
    slots = _vector("empty_slots", arguments.get("empty_slots"), batch, tuple(range(batch)))
    lane = limits.max_batch_size
    if len(set(slots)) != batch or not all(0 <= slot < lane for slot in slots):
        raise ValueError(
            f"empty_slots must contain unique lane-local slots in [0, {lane}) "
            f"(max_batch_size), got {slots}"
        )
    _check_positions(prompts, cached, width, limits.block_size)
    _check_capacity(prompts, cached, int(page_table.shape[1]), limits)
    rows = PrefillBatch(tokens, page_table, prompts, cached, slots)
    if limits.num_blocks is not None:
        check_block_ids(page_table, limits.num_blocks, read=rows.blocks_read(limits.block_size))
    if sampling is None or sampling.get("sampling_params") is None:
        return rows
    return _with_sampling(rows, sampling, lane)


def _with_sampling(rows: PrefillBatch, sampling: SamplingArguments, lane: int) -> PrefillBatch:
    histories = {
        name: _history(name, sampling.get(name), rows.batch_size, lane)
        for name in ("prompt_tokens", "output_tokens")
    }
    return attrs.evolve(
        rows,
        sampling_params=sampling.get("sampling_params"),
        prompt_tokens=histories["prompt_tokens"],
        output_tokens=histories["output_tokens"],
        slot_remap=sampling.get("slot_remap"),
    )


def _history(name: str, value: object, batch: int, lane: int) -> torch.Tensor | None:
    """A sampling history: a rank-2 integer tensor of 1, `batch` or `lane` rows (or None)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        raise ValueError(f"{name} must be a rank-2 [rows, length] tensor, got {value!r:.80}")
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
    if int(value.shape[0]) not in (1, batch, lane):
        raise ValueError(
            f"prefill sampling state {name} has {int(value.shape[0])} rows, expected 1, "
            f"request batch {batch}, or lane capacity {lane}"
        )
    return value


def _integer_matrix(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        raise ValueError(f"{name} must be a rank-2 torch tensor, got {value!r:.80}")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {value.dtype}")
    return value


def _vector(name: str, value: object, batch: int, default: tuple[int, ...]) -> tuple[int, ...]:
    if value is None:
        return default
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex():
            raise ValueError(
                f"{name} must be a rank-1 integer tensor, got shape {tuple(value.shape)} "
                f"dtype {value.dtype}"
            )
        # An integer tensor lists Python ints already; only bool elements need converting.
        listed: list[int] = value.tolist()
        ints = [int(v) for v in listed] if value.dtype == torch.bool else listed
    elif isinstance(value, Sequence) and not isinstance(value, str):
        items = tuple(value)
        ints = [item for item in items if is_int(item)]
        if len(ints) != len(items):
            raise ValueError(f"{name} must contain only ints, got {items!r}")
    else:
        raise ValueError(f"{name} must be a rank-1 tensor or a sequence of ints, got {value!r}")
    if len(ints) != batch:
        raise ValueError(f"{name} has {len(ints)} entries, the batch has {batch} rows")
    return tuple(ints)


def _check_positions(
    prompts: tuple[int, ...], cached: tuple[int, ...], width: int, block_size: int
) -> None:
    for row, (prompt, start) in enumerate(zip(prompts, cached, strict=True)):
        if not 0 <= start <= prompt <= width:
            raise ValueError(
                f"row {row} must satisfy 0 <= start_pos <= prompt_len <= token width {width}, "
                f"got start_pos {start} and prompt_len {prompt}"
            )
        if start % block_size:
            raise ValueError(
                f"cached prefill start for row {row} must be block aligned: start_pos "
                f"{start} is not a multiple of block_size {block_size}"
            )


def _check_capacity(
    prompts: tuple[int, ...], cached: tuple[int, ...], columns: int, limits: PlanLimits
) -> None:
    """Every row the plan runs (one with uncached tokens) fits the KV capacity and the table."""
    block, capacity = limits.block_size, limits.max_actual_width
    for row, (prompt, start) in enumerate(zip(prompts, cached, strict=True)):
        needed = -(-prompt // block)
        if start == prompt or (needed <= columns and (capacity is None or needed <= capacity)):
            continue
        if capacity is not None and needed > capacity:
            raise ValueError(
                f"row {row} with prompt length {prompt} needs {needed} blocks "
                f"of {block} tokens, which exceeds the configured paged-KV capacity "
                f"of {capacity} blocks (max_actual_page_table_width)"
            )
        raise ValueError(
            f"page table is too narrow for row {row}: prompt length "
            f"{prompt} needs {needed} blocks of {block} tokens, "
            f"the page table has {columns} columns"
        )
