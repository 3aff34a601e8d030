"""Continuous-batching scheduler: which requests prefill, which decode, which yield their blocks.

Pure host logic over a `BlockManager`, so it is testable without a device. One step is:

1. `admit()`: move waiting requests (FIFO, head of line first) into free lane slots while the
   KV pool can hold them; their block tables say how many leading tokens are already cached.
2. `reserve_decode()`: make sure every running request has a block for the token it feeds
   next; when the pool is short, preempt the NEWEST running request by recompute (its blocks
   are freed, it goes back to the front of the waiting queue with its generated tokens, and
   a later admission prefills prompt + generated tokens, so it continues where it was).
3. `finish()`: release a finished request's slot and blocks (waiting or running).

A request is never dropped: it is always in exactly one of waiting, running or finished.

The block manager publishes a full block's hash when it allocates the block, before the
prefill that writes it has run. So a request whose cached prefix would come from blocks
allocated in the same admission round waits for the next round, when those blocks are written.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Literal

import attrs

from models.generation.block_manager import BlockManager, BlockTable, chain_hash

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "eos"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "eos")


@attrs.define(eq=False)
class SequenceState:
    """One request as the scheduler sees it: tokens so far, lane slot and block table."""

    index: int
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    output_token_ids: list[int] = attrs.field(factory=list)
    slot: int | None = None
    table: BlockTable | None = None
    admitted_order: int = -1
    finish_reason: FinishReason | None = None
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def all_token_ids(self) -> list[int]:
        """What a (re)admission prefills: the prompt and every token generated so far."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def next_position(self) -> int:
        """Absolute position of the token decode feeds next (the last generated one)."""
        return self.num_tokens - 1


@attrs.define(eq=False)
class Admission:
    """One admitted request: its slot, its tokens to prefill and its cached prefix length."""

    sequence: SequenceState
    slot: int
    token_ids: list[int]
    cached_tokens: int


class Scheduler:
    """Admission, decode reservation, preemption and release over a lane's (or lanes') slots.

    With several block managers (data-parallel lanes), slot `s` belongs to lane
    `s // (num_slots // lanes)` and takes its blocks from that lane's manager; admission
    fills the lane with the fewest running requests first.
    """

    def __init__(
        self, block_manager: BlockManager | Sequence[BlockManager], num_slots: int
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        managers = (
            (block_manager,) if isinstance(block_manager, BlockManager) else tuple(block_manager)
        )
        if not managers or num_slots % len(managers):
            raise ValueError(
                f"num_slots ({num_slots}) must split evenly over {len(managers)} lane block "
                "managers"
            )
        self.block_managers = managers
        self.block_manager = managers[0]
        self.slots_per_lane = num_slots // len(managers)
        self.num_slots = num_slots
        self.waiting: deque[SequenceState] = deque()
        self.running: dict[int, SequenceState] = {}
        self._admissions = 0
        self.preemptions = 0

    # -- queue ---------------------------------------------------------------------------------

    def add(self, sequence: SequenceState) -> None:
        """Queue a new request at the back."""
        if sequence.finished or sequence.slot is not None or sequence.table is not None:
            raise ValueError(f"request {sequence.index} is not a fresh request")
        self.waiting.append(sequence)

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def running_in_admission_order(self) -> list[SequenceState]:
        """Running requests, oldest admission first."""
        return sorted(self.running.values(), key=lambda s: s.admitted_order)

    def free_slots(self) -> list[int]:
        """Lane slots with no running request, lowest first."""
        return [slot for slot in range(self.num_slots) if slot not in self.running]

    def lane_of(self, slot: int) -> int:
        """The lane (block manager) a slot belongs to."""
        return slot // self.slots_per_lane

    def _running_in(self, lane: int) -> list[SequenceState]:
        return [s for slot, s in self.running.items() if self.lane_of(slot) == lane]

    def _lane_slots(self) -> list[tuple[int, int]]:
        """(lane, its lowest free slot), least busy lane first."""
        best: dict[int, int] = {}
        for slot in self.free_slots():
            best.setdefault(self.lane_of(slot), slot)
        return sorted(best.items(), key=lambda item: (len(self._running_in(item[0])), item[0]))

    # -- admission ------------------------------------------------------------------------------

    def _needs_block(self, sequence: SequenceState) -> bool:
        assert sequence.table is not None
        bs = self.block_manager.block_size
        return sequence.num_tokens > len(sequence.table.block_ids) * bs

    def _growth_reserve(self, lane: int = 0) -> int:
        """Blocks the lane's running requests need for their next decode step."""
        return sum(1 for s in self._running_in(lane) if self._needs_block(s))

    def _fits(self, lane: int, tokens: Sequence[int]) -> bool:
        manager = self.block_managers[lane]
        if not manager.can_allocate(tokens):
            return False
        if self._running_in(lane):
            upper_bound = manager.blocks_needed(len(tokens))
            new_grows = 1 if len(tokens) % manager.block_size == 0 else 0
            if manager.free_blocks - upper_bound < self._growth_reserve(lane) + new_grows:
                return False
        return True

    def _prefix_hashes(self, tokens: Sequence[int]) -> list[bytes]:
        bs = self.block_manager.block_size
        hashes: list[bytes] = []
        previous: bytes | None = None
        for index in range((len(tokens) - 1) // bs):
            previous = chain_hash(previous, tokens[index * bs : (index + 1) * bs])
            hashes.append(previous)
        return hashes

    def admit(self) -> list[Admission]:
        """Admit waiting requests in order while a slot and the KV pool allow.

        Admission stops at the first request that does not fit (no overtaking). Unless nothing
        runs, a request is admitted only if the blocks its prompt needs (counted without
        prefix hits) leave one block for every running request that grows next step, so a
        fresh admission is not preempted right away.
        """
        admitted: list[Admission] = []
        fresh_hashes: set[bytes] = set()
        while self.waiting:
            sequence = self.waiting[0]
            tokens = sequence.all_token_ids()
            fitting = [
                (lane, slot) for lane, slot in self._lane_slots() if self._fits(lane, tokens)
            ]
            if not fitting:
                break
            lane, slot = fitting[0]
            manager = self.block_managers[lane]
            if fresh_hashes and any(h in fresh_hashes for h in self._prefix_hashes(tokens)):
                break  # its prefix is being written by this round's prefill; next round
            self.waiting.popleft()
            table = manager.allocate(tokens)
            cached = table.cached_tokens
            fresh_hashes.update(
                h for h in table.hashes[cached // manager.block_size :] if h is not None
            )
            sequence.slot = slot
            sequence.table = table
            sequence.admitted_order = self._admissions
            self._admissions += 1
            self.running[slot] = sequence
            admitted.append(Admission(sequence, slot, tokens, cached))
            logger.debug(
                "admitted request %d into slot %d: %d tokens, %d cached",
                sequence.index,
                slot,
                len(tokens),
                cached,
            )
        return admitted

    # -- decode ---------------------------------------------------------------------------------

    def reserve_decode(self) -> list[SequenceState]:
        """Give every running request a block for its next fed token; returns the preempted.

        Needs are counted first and victims chosen before any block is appended, so a
        preempted request never leaves a published block whose KV was not written.
        """
        preempted: list[SequenceState] = []
        for lane, manager in enumerate(self.block_managers):
            while self._running_in(lane) and self._growth_reserve(lane) > manager.free_blocks:
                victim = max(self._running_in(lane), key=lambda s: s.admitted_order)
                self._preempt(victim)
                preempted.append(victim)
        for sequence in self.running_in_admission_order():
            assert sequence.table is not None and sequence.slot is not None
            manager = self.block_managers[self.lane_of(sequence.slot)]
            if not manager.append_slot(sequence.table, sequence.all_token_ids()):
                raise RuntimeError(
                    f"request {sequence.index}: no KV block for position "
                    f"{sequence.next_position} after reservation (scheduler bug)"
                )
        return preempted

    def _release(self, sequence: SequenceState) -> None:
        if sequence.table is not None:
            assert sequence.slot is not None
            self.block_managers[self.lane_of(sequence.slot)].free(sequence.table)
            sequence.table = None
        if sequence.slot is not None:
            self.running.pop(sequence.slot, None)  # a release cut short may have done this
            sequence.slot = None

    def _preempt(self, sequence: SequenceState) -> None:
        logger.info(
            "preempting request %d (slot %s, %d tokens) by recompute: KV pool is full",
            sequence.index,
            sequence.slot,
            sequence.num_tokens,
        )
        self._release(sequence)
        sequence.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(sequence)

    def preempt(self, sequence: SequenceState) -> None:
        """Preempt one running request by recompute (front of the waiting queue)."""
        if sequence.slot is None or self.running.get(sequence.slot) is not sequence:
            raise ValueError(f"request {sequence.index} is not running")
        self._preempt(sequence)

    # -- completion ------------------------------------------------------------------------------

    def finish(self, sequence: SequenceState, reason: FinishReason) -> None:
        """Mark a request finished and release its slot and blocks (idempotent for the slot)."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason {reason!r} is not one of {FINISH_REASONS}")
        sequence.finish_reason = reason
        self._release(sequence)
        if sequence in self.waiting:
            self.waiting.remove(sequence)

    def abort_all(self) -> list[SequenceState]:
        """Drop every waiting and running request (after a device failure); returns them."""
        dropped = [*self.running.values(), *self.waiting]
        for sequence in list(self.running.values()):
            self._release(sequence)
        self.waiting.clear()
        return dropped

    def extend(self, sequences: Iterable[SequenceState]) -> None:
        """Queue several new requests in order."""
        for sequence in sequences:
            self.add(sequence)
