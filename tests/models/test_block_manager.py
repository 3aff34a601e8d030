"""Prefix-caching block manager: sharing, reference counts, LRU reuse, token checks."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
from hypothesis import given
from hypothesis import strategies as st

from models.generation.block_manager import BlockManager, NoFreeBlocksError


def test_prefix_blocks_are_shared_and_block_aligned() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    first = manager.allocate(list(range(10)))
    assert first.cached_tokens == 0 and len(first.block_ids) == 3
    second = manager.allocate([*range(8), 99, 98, 97])
    assert second.cached_tokens == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    assert manager.ref_count(first.block_ids[0]) == 2
    assert manager.cache_hit_tokens == 8


def test_last_token_is_never_cached() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.allocate(list(range(8)))
    again = manager.allocate(list(range(8)))
    assert again.cached_tokens == 4  # the final block is recomputed


def test_freed_cached_blocks_are_reused_lru_after_never_used() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a = manager.allocate([1, 2, 3])
    first_block = a.block_ids[0]
    manager.free(a)
    assert a.block_ids == [] and manager.free_blocks == 4
    hit = manager.allocate([1, 2, 5])
    assert hit.cached_tokens == 2 and hit.block_ids[0] == first_block
    manager.free(hit)
    # Fill the pool with other prompts: never-used blocks go first, then LRU cached ones.
    b = manager.allocate([7, 8, 9, 10, 11, 12, 13])
    assert len(b.block_ids) == 4
    with pytest.raises(NoFreeBlocksError):
        manager.allocate([1, 2, 3])
    manager.free(b)
    miss = manager.allocate([1, 2, 3])
    assert miss.cached_tokens == 0  # the old [1, 2] block was evicted


def test_hash_hit_requires_equal_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    import models.generation.block_manager as module

    monkeypatch.setattr(module, "chain_hash", lambda previous, tokens: b"same" * 4)
    manager = BlockManager(num_blocks=8, block_size=2)
    manager.allocate([1, 2, 3])
    other = manager.allocate([5, 6, 7])
    assert other.cached_tokens == 0


def test_append_slot_grows_and_publishes() -> None:
    manager = BlockManager(num_blocks=3, block_size=2)
    table = manager.allocate([1, 2, 3])
    seq = [1, 2, 3, 4]
    assert manager.append_slot(table, seq)
    assert len(table.block_ids) == 2 and table.hashes[1] is not None
    seq.append(5)
    assert manager.append_slot(table, seq)
    assert len(table.block_ids) == 3
    seq.append(6)
    assert manager.append_slot(table, seq)
    seq.append(7)
    assert not manager.append_slot(table, seq)  # pool exhausted
    manager.free(table)
    sharing = manager.allocate([1, 2, 3, 4, 5])
    assert sharing.cached_tokens == 4


def test_disabled_prefix_cache_never_shares() -> None:
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_cache=False)
    a = manager.allocate([1, 2, 3])
    b = manager.allocate([1, 2, 3])
    assert b.cached_tokens == 0 and set(a.block_ids).isdisjoint(b.block_ids)


def test_validation() -> None:
    with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
        BlockManager(num_blocks=0, block_size=2)
    with pytest.raises(ValueError, match="empty prompt"):
        BlockManager(num_blocks=1, block_size=2).allocate([])


@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), max_size=12),
    frees=st.lists(st.booleans(), max_size=12),
)
def test_reference_counts_balance(prompts: list[list[int]], frees: list[bool]) -> None:
    manager = BlockManager(num_blocks=16, block_size=2)
    live = []
    for index, prompt in enumerate(prompts):
        if not manager.can_allocate(prompt):
            continue
        table = manager.allocate(prompt)
        assert table.cached_tokens % 2 == 0 and table.cached_tokens < len(prompt)
        live.append(table)
        if index < len(frees) and frees[index]:
            manager.free(live.pop(0))
    held = {b for table in live for b in table.block_ids}
    assert manager.free_blocks == 16 - len(held)
    for table in live:
        manager.free(table)
    assert manager.free_blocks == 16
    assert all(manager.ref_count(b) == 0 for b in range(16))


class _Interrupting(BlockManager):
    """A Ctrl-C instead of its `interrupt_at`-th reference drop (0: never)."""

    interrupt_at = 0
    drops = 0

    def _drop_reference(self, block_id: int) -> None:
        self.drops += 1
        if self.drops == self.interrupt_at:
            raise KeyboardInterrupt
        super()._drop_reference(block_id)


@given(
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=14),
    shared=st.booleans(),
    cut=st.integers(0, 7),
)
def test_a_free_cut_short_and_run_again_drops_each_reference_once(
    prompt: list[int], shared: bool, cut: int
) -> None:
    """Ctrl-C can land inside `free`; the cleanup that follows frees the same table again.
    That must not fail with "freed more often than allocated" (the CLI exited 1 instead of
    130) nor drop a reference twice: at worst the block being dropped at the interrupt keeps
    its reference."""
    manager = _Interrupting(num_blocks=16, block_size=2)
    other = manager.allocate(prompt) if shared else None
    table = manager.allocate(prompt)
    ids = list(table.block_ids)
    leaked = ids[-(cut + 1)] if cut < len(ids) else None  # free walks the table backwards
    manager.interrupt_at = cut + 1
    with pytest.raises(KeyboardInterrupt) if leaked is not None else nullcontext():
        manager.free(table)
    manager.interrupt_at = 0
    manager.free(table)  # the cleanup after the interrupt
    assert table.block_ids == [] and table.hashes == []
    held = other.block_ids if other is not None else []
    for block in range(16):
        assert manager.ref_count(block) == held.count(block) + (block == leaked)
