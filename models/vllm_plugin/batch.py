"""The worker's view of vLLM's requests, and one scheduler step turned into facade inputs.

vLLM's scheduler owns admission, chunking, prefix caching and preemption; each step it sends
how many tokens of which request to compute. This module keeps what the worker must remember
between steps (tokens, block ids, computed offsets, a decode slot per running request) and
turns one step into at most one `prefill_forward` batch and one `decode_forward` lane. It
imports neither vLLM nor torch device APIs, so it is tested without vLLM installed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch


@attrs.define
class RequestState:
    """One request as the worker knows it: its tokens so far and where its KV lives."""

    req_id: str
    prompt: list[int]
    block_ids: list[int]
    num_computed: int
    payload: Any = None
    output: list[int] = attrs.field(factory=list)
    slot: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_at(self, position: int) -> int:
        split = len(self.prompt)
        return self.prompt[position] if position < split else self.output[position - split]

    def token_ids(self, end: int) -> list[int]:
        """The first `end` tokens (prompt, then sampled output)."""
        if end <= len(self.prompt):
            return self.prompt[:end]
        return self.prompt + self.output[: end - len(self.prompt)]


@attrs.frozen
class PrefillBatch:
    """One `prefill_forward` call: whole prompts from position 0, cached prefixes skipped."""

    req_ids: tuple[str, ...]
    tokens: torch.Tensor  # int32 [B, max_end], zero padded
    page_table: torch.Tensor  # int32 [B, W]: W blocks reach max_model_len, zero padded
    prompt_lens: np.ndarray  # int64 [B]: where each row's chunk ends
    start_pos: np.ndarray  # int32 [B]: block-aligned first position to compute
    empty_slots: tuple[int, ...]
    sample: tuple[bool, ...]  # False for a chunk that ends before the request's last token


@attrs.frozen
class DecodeBatch:
    """One lane-wide `decode_forward` call: row = slot, inactive rows at position -1."""

    req_ids: tuple[str, ...]
    slots: tuple[int, ...]
    tokens: torch.Tensor  # int32 [B_pad, 1]
    start_pos: torch.Tensor  # int32 [B_pad], -1 on inactive rows
    page_table: torch.Tensor  # int32 [B_pad, W], zero rows on inactive rows


@attrs.frozen
class StepPlan:
    prefill: PrefillBatch | None
    decode: DecodeBatch | None


class RequestTable:
    """Requests by id, their decode slots, and the step planner."""

    def __init__(self, *, max_slots: int, block_size: int, decode_width: int) -> None:
        self.max_slots = max_slots
        self.block_size = block_size
        self.decode_width = decode_width
        self.requests: dict[str, RequestState] = {}
        self._free_slots = list(range(max_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, req_id: str) -> RequestState:
        return self.requests[req_id]

    # -- state updates from the scheduler's output ---------------------------------------------

    def add(
        self,
        req_id: str,
        prompt: Sequence[int],
        block_ids: Sequence[int],
        num_computed: int,
        payload: Any = None,
    ) -> RequestState:
        """A newly scheduled request (a prefix-cache hit arrives as `num_computed > 0`)."""
        if req_id in self.requests:  # an aborted request resubmitted under the same id
            self.finish(req_id)
        state = RequestState(
            req_id=req_id,
            prompt=list(prompt),
            block_ids=list(block_ids),
            num_computed=num_computed,
            payload=payload,
        )
        self.requests[req_id] = state
        return state

    def update(
        self,
        req_id: str,
        *,
        num_computed: int,
        new_block_ids: Sequence[int] | None,
        resumed: bool,
        num_output_tokens: int | None = None,
        all_token_ids: Sequence[int] | None = None,
    ) -> None:
        """A running or resumed request: new offset, appended (or, resumed, replaced) blocks."""
        state = self.requests[req_id]
        state.num_computed = num_computed
        if resumed:
            self.release_slot(req_id)
            state.block_ids = list(new_block_ids or ())
        elif new_block_ids:
            state.block_ids.extend(new_block_ids)
        if num_output_tokens is not None and num_output_tokens < len(state.output):
            del state.output[num_output_tokens:]
        if all_token_ids is not None and num_output_tokens:
            state.output = list(all_token_ids[len(all_token_ids) - num_output_tokens :])

    def release_slot(self, req_id: str) -> None:
        """A preempted request keeps its tokens but gives its decode slot back."""
        state = self.requests.get(req_id)
        if state is not None and state.slot is not None:
            self._free_slots.append(state.slot)
            state.slot = None

    def finish(self, req_id: str) -> None:
        self.release_slot(req_id)
        self.requests.pop(req_id, None)

    def append_token(self, req_id: str, token: int) -> None:
        self.requests[req_id].output.append(int(token))

    # -- one step --------------------------------------------------------------------------------

    def _assign_slots(self, scheduled: Sequence[str]) -> None:
        wanted = set(scheduled)
        missing = [r for r in scheduled if self.requests[r].slot is None]
        if len(missing) > len(self._free_slots):  # reclaim slots of requests not running now
            for req_id, state in self.requests.items():
                if req_id not in wanted and state.slot is not None:
                    self.release_slot(req_id)
        if len(missing) > len(self._free_slots):
            raise RuntimeError(
                f"{len(scheduled)} scheduled requests exceed the {self.max_slots} decode slots "
                "(max_num_seqs); the engine scheduled more requests than the worker was built for"
            )
        for req_id in missing:
            self.requests[req_id].slot = self._free_slots.pop()

    def is_decode(self, state: RequestState, num_scheduled: int) -> bool:
        """One token right after everything computed so far: a decode row."""
        return num_scheduled == 1 and 0 < state.num_computed == state.num_tokens - 1

    def plan(self, num_scheduled: Mapping[str, int]) -> StepPlan:
        """Split the step's scheduled requests into a prefill batch and a decode lane."""
        scheduled = list(num_scheduled)
        for req_id in scheduled:
            state = self.requests.get(req_id)
            if state is None:
                raise RuntimeError(f"request {req_id!r} was scheduled but never added")
            count = num_scheduled[req_id]
            if count < 1 or state.num_computed + count > state.num_tokens:
                raise RuntimeError(
                    f"request {req_id!r}: {count} scheduled tokens after {state.num_computed} "
                    f"computed exceed its {state.num_tokens} tokens (speculative decoding is "
                    "not supported by this worker)"
                )
        self._assign_slots(scheduled)
        decode = [r for r in scheduled if self.is_decode(self.requests[r], num_scheduled[r])]
        prefill = [r for r in scheduled if r not in set(decode)]
        return StepPlan(
            prefill=self._prefill_batch(prefill, num_scheduled) if prefill else None,
            decode=self._decode_batch(decode) if decode else None,
        )

    def _blocks_for(self, state: RequestState, end: int) -> list[int]:
        needed = -(-end // self.block_size)
        if len(state.block_ids) < needed:
            raise RuntimeError(
                f"request {state.req_id!r} needs {needed} KV blocks for {end} tokens but the "
                f"engine gave it {len(state.block_ids)}"
            )
        return state.block_ids[:needed]

    def _prefill_batch(self, req_ids: list[str], num_scheduled: Mapping[str, int]) -> PrefillBatch:
        rows = [self.requests[r] for r in req_ids]
        ends = [s.num_computed + num_scheduled[s.req_id] for s in rows]
        tables = [self._blocks_for(s, end) for s, end in zip(rows, ends, strict=True)]
        tokens = torch.zeros((len(rows), max(ends)), dtype=torch.int32)
        page_table = torch.zeros((len(rows), self.decode_width), dtype=torch.int32)
        for row, (state, end, table) in enumerate(zip(rows, ends, tables, strict=True)):
            tokens[row, :end] = torch.tensor(state.token_ids(end), dtype=torch.int32)
            page_table[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        # A chunk may start mid-block; recomputing from the block start rewrites identical K/V.
        starts = [s.num_computed - s.num_computed % self.block_size for s in rows]
        slots = tuple(s.slot for s in rows if s.slot is not None)
        assert len(slots) == len(rows)
        return PrefillBatch(
            req_ids=tuple(req_ids),
            tokens=tokens,
            page_table=page_table,
            prompt_lens=np.asarray(ends, dtype=np.int64),
            start_pos=np.asarray(starts, dtype=np.int32),
            empty_slots=slots,
            sample=tuple(end == s.num_tokens for s, end in zip(rows, ends, strict=True)),
        )

    def _decode_batch(self, req_ids: list[str]) -> DecodeBatch:
        lane = self.max_slots
        tokens = torch.zeros((lane, 1), dtype=torch.int32)
        start_pos = torch.full((lane,), -1, dtype=torch.int32)
        page_table = torch.zeros((lane, self.decode_width), dtype=torch.int32)
        slots: list[int] = []
        for req_id in req_ids:
            state = self.requests[req_id]
            assert state.slot is not None
            position = state.num_computed
            table = self._blocks_for(state, position + 1)
            if len(table) > self.decode_width:
                raise RuntimeError(
                    f"request {req_id!r} at position {position} needs {len(table)} KV blocks; "
                    f"the decode page table holds {self.decode_width}"
                )
            tokens[state.slot, 0] = state.token_at(position)
            start_pos[state.slot] = position
            page_table[state.slot, : len(table)] = torch.tensor(table, dtype=torch.int32)
            slots.append(state.slot)
        return DecodeBatch(
            req_ids=tuple(req_ids),
            slots=tuple(slots),
            tokens=tokens,
            start_pos=start_pos,
            page_table=page_table,
        )
