"""Scheduler: admission by slots and blocks, prefix hits, preemption by recompute, no lost request.

Pure host logic over a real `BlockManager`; no executor involved.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.generation.block_manager import BlockManager
from models.generation.scheduler import Scheduler, SequenceState


def seq(index: int, prompt: list[int], max_new: int = 8) -> SequenceState:
    return SequenceState(index=index, prompt_token_ids=tuple(prompt), max_new_tokens=max_new)


def make(num_blocks: int = 16, block_size: int = 4, slots: int = 2) -> Scheduler:
    return Scheduler(BlockManager(num_blocks=num_blocks, block_size=block_size), slots)


def test_admission_is_fifo_and_bounded_by_slots() -> None:
    scheduler = make(slots=2)
    requests = [seq(i, [10 + i] * 3) for i in range(3)]
    scheduler.extend(requests)
    admitted = scheduler.admit()
    assert [a.sequence.index for a in admitted] == [0, 1]
    assert [a.slot for a in admitted] == [0, 1]
    assert list(scheduler.waiting) == [requests[2]]
    assert scheduler.admit() == []  # no free slot
    scheduler.finish(requests[0], "length")
    again = scheduler.admit()
    assert [(a.sequence.index, a.slot) for a in again] == [(2, 0)]


def test_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    scheduler = make(num_blocks=4, block_size=4, slots=3)
    big, small = seq(0, list(range(20))), seq(1, [1])
    scheduler.extend([big, small])
    assert scheduler.admit() == []  # 5 blocks needed; the small one does not overtake
    assert list(scheduler.waiting) == [big, small]


def test_cached_prefix_is_reported_and_block_aligned() -> None:
    scheduler = make(num_blocks=16, block_size=4, slots=4)
    first = seq(0, list(range(10)))
    scheduler.add(first)
    (admission,) = scheduler.admit()
    assert admission.cached_tokens == 0
    second = seq(1, [*range(8), 50, 51])
    scheduler.add(second)
    (hit,) = scheduler.admit()
    assert hit.cached_tokens == 8
    assert hit.sequence.table is not None and first.table is not None
    assert hit.sequence.table.block_ids[:2] == first.table.block_ids[:2]


def test_a_prefix_written_in_the_same_round_waits_for_the_next_round() -> None:
    """The block manager publishes hashes at allocation, before prefill writes the blocks."""
    scheduler = make(num_blocks=16, block_size=4, slots=4)
    shared = list(range(8))
    a, b = seq(0, [*shared, 1, 2]), seq(1, [*shared, 3, 4])
    scheduler.extend([a, b])
    assert [x.sequence.index for x in scheduler.admit()] == [0]
    (later,) = scheduler.admit()
    assert later.sequence is b and later.cached_tokens == 8


def test_reserve_decode_preempts_the_newest_and_keeps_its_tokens() -> None:
    scheduler = make(num_blocks=4, block_size=4, slots=2)
    old, new = seq(0, [1, 2, 3]), seq(1, [5, 6, 7])
    scheduler.add(old)
    scheduler.admit()
    scheduler.add(new)
    scheduler.admit()
    for sequence in (old, new):
        sequence.output_token_ids.extend([9, 9])  # 5 tokens each: both need a second block
    scheduler.reserve_decode()
    assert scheduler.block_manager.free_blocks == 0
    for sequence in (old, new):
        sequence.output_token_ids.extend([9, 9, 9, 9])  # 9 tokens: both need a third block
    preempted = scheduler.reserve_decode()
    assert preempted == [new]
    assert new.slot is None and new.table is None and new.preemptions == 1
    assert list(scheduler.waiting) == [new]
    assert new.output_token_ids == [9, 9, 9, 9, 9, 9]  # kept: it continues where it was
    assert old.table is not None and len(old.table.block_ids) == 3


def test_preempted_request_is_readmitted_with_prompt_and_generated_tokens() -> None:
    scheduler = make(num_blocks=8, block_size=4, slots=2)
    request = seq(0, [1, 2, 3, 4, 5])
    scheduler.add(request)
    scheduler.admit()
    request.output_token_ids.extend([7, 8, 9, 10])
    scheduler.preempt(request)
    (admission,) = scheduler.admit()
    assert admission.token_ids == [1, 2, 3, 4, 5, 7, 8, 9, 10]
    assert admission.cached_tokens == 4  # its own first block is still cached
    assert request.next_position == 8


def test_admission_keeps_a_block_for_running_requests_that_grow() -> None:
    scheduler = make(num_blocks=2, block_size=4, slots=2)
    running = seq(0, [1, 2, 3, 4])
    scheduler.add(running)
    scheduler.admit()
    running.output_token_ids.append(5)  # its next fed token needs a second block
    scheduler.add(seq(1, [6, 7, 8]))
    assert scheduler.admit() == []  # it would take the block the running request needs
    assert scheduler.reserve_decode() == []
    assert running.table is not None and len(running.table.block_ids) == 2
    scheduler.finish(running, "length")
    assert [a.sequence.index for a in scheduler.admit()] == [1]


def test_finish_releases_blocks_and_rejects_unknown_reasons() -> None:
    scheduler = make(num_blocks=4, block_size=4, slots=1)
    request = seq(0, [1, 2, 3])
    scheduler.add(request)
    scheduler.admit()
    assert scheduler.block_manager.free_blocks == 3
    with pytest.raises(ValueError, match="finish reason 'done'"):
        scheduler.finish(request, "done")  # type: ignore[arg-type]
    scheduler.finish(request, "eos")
    assert scheduler.block_manager.free_blocks == 4
    assert not scheduler.has_work and request.finish_reason == "eos"


def test_a_waiting_request_can_finish() -> None:
    """A stop string found after preemption ends a request that is back in the queue."""
    scheduler = make(slots=1)
    request = seq(0, [1, 2])
    scheduler.add(request)
    scheduler.admit()
    scheduler.preempt(request)
    scheduler.finish(request, "stop")
    assert not scheduler.waiting and not scheduler.has_work


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="num_slots must be a positive integer, got 0"):
        make(slots=0)
    scheduler = make()
    request = seq(0, [1])
    scheduler.add(request)
    scheduler.admit()
    with pytest.raises(ValueError, match="request 0 is not a fresh request"):
        scheduler.add(request)
    with pytest.raises(ValueError, match="request 1 is not running"):
        scheduler.preempt(seq(1, [2]))


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([2, 4]),
    slots=st.integers(1, 4),
    count=st.integers(1, 8),
)
def test_every_request_finishes_with_exactly_its_tokens(
    seed: int, block_size: int, slots: int, count: int
) -> None:
    """Simulated generation: requests always live in one place, blocks balance, all finish."""
    rng = random.Random(seed)
    shared = [rng.randrange(100) for _ in range(rng.randrange(0, 9))]
    requests = [
        seq(i, shared + [rng.randrange(100) for _ in range(rng.randrange(1, 7))], rng.randint(1, 9))
        for i in range(count)
    ]
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
    num_blocks = -(-longest // block_size) + rng.randrange(0, 6)
    scheduler = Scheduler(BlockManager(num_blocks=num_blocks, block_size=block_size), slots)
    scheduler.extend(requests)
    finished: list[SequenceState] = []
    for _step in range(2000):
        if not scheduler.has_work:
            break
        for admission in scheduler.admit():
            assert admission.cached_tokens % block_size == 0
            assert admission.cached_tokens < len(admission.token_ids)
            admission.sequence.output_token_ids.append(rng.randrange(100))
        for sequence in list(scheduler.running.values()):
            if len(sequence.output_token_ids) >= sequence.max_new_tokens:
                scheduler.finish(sequence, "length")
                finished.append(sequence)
        if scheduler.running:
            scheduler.reserve_decode()
            for sequence in scheduler.running.values():
                assert sequence.table is not None
                assert len(sequence.table.block_ids) * block_size >= sequence.num_tokens
                sequence.output_token_ids.append(rng.randrange(100))
        places = [
            (r in scheduler.waiting) + (r in scheduler.running.values()) + (r in finished)
            for r in requests
        ]
        assert places == [1] * count
        used = sum(len(s.table.block_ids) for s in scheduler.running.values() if s.table)
        assert scheduler.block_manager.free_blocks + used >= num_blocks
    assert not scheduler.has_work
    assert sorted(r.index for r in finished) == list(range(count))
    assert all(len(r.output_token_ids) == r.max_new_tokens for r in requests)
    assert scheduler.block_manager.free_blocks == num_blocks
