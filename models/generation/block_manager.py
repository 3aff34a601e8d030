"""Block tables with prefix caching: which physical KV blocks each sequence uses.

Full blocks are identified by a chained hash (the previous block's hash plus this block's
tokens), so two sequences with the same prefix share the same physical blocks. Shared blocks
are reference counted; a block whose count drops to zero keeps its cached contents and is
reused in least-recently-freed order only when no never-used block is left. A hash hit is
confirmed by comparing tokens, so a collision can never serve another prompt's KV. Cached
prefixes are always whole blocks.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence

import attrs

logger = logging.getLogger(__name__)


def _check_positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def chain_hash(previous: bytes | None, tokens: Sequence[int]) -> bytes:
    """Hash of one full block, chained to the hash of the block before it."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(previous or b"\0" * 16)
    digest.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return digest.digest()


@attrs.define(eq=False)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    tokens: tuple[int, ...] = ()


@attrs.define(eq=False)
class BlockTable:
    """One sequence's blocks: physical ids in order and how many leading tokens were cached."""

    block_ids: list[int]
    cached_tokens: int
    hashes: list[bytes | None]


class NoFreeBlocksError(RuntimeError):
    """The pool cannot hold the request right now (the scheduler preempts or waits)."""


@attrs.define
class BlockManager:
    """Allocates, shares, and frees the physical blocks of a paged KV pool."""

    num_blocks: int = attrs.field(validator=_check_positive)
    block_size: int = attrs.field(validator=_check_positive)
    enable_prefix_cache: bool = True
    _blocks: list[_Block] = attrs.field(init=False)
    _never_used: list[int] = attrs.field(init=False)
    _cached_free: OrderedDict[int, None] = attrs.field(init=False)
    _by_hash: dict[bytes, int] = attrs.field(init=False)
    cache_hit_tokens: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._blocks = [_Block(i) for i in range(self.num_blocks)]
        self._never_used = list(range(self.num_blocks - 1, -1, -1))
        self._cached_free = OrderedDict()
        self._by_hash = {}

    # -- accounting -------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks that can be handed out now (never used plus cached but unreferenced)."""
        return len(self._never_used) + len(self._cached_free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that `num_tokens` tokens occupy."""
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        """How many sequences use `block_id`."""
        return self._blocks[block_id].ref_count

    # -- allocation -------------------------------------------------------------------------

    def can_allocate(self, tokens: Sequence[int]) -> bool:
        """Whether `allocate(tokens)` would succeed now."""
        hits = self._match_prefix(tokens)
        reused_free = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(tokens)) - len(hits)
        return needed <= self.free_blocks - reused_free

    def allocate(self, tokens: Sequence[int]) -> BlockTable:
        """Blocks for a prompt, sharing cached full blocks of its prefix.

        At least one token is always left uncached (the last prompt token must be computed
        to produce logits), so a fully cached prompt recomputes its final block.
        """
        if not tokens:
            raise ValueError("cannot allocate blocks for an empty prompt")
        if not self.can_allocate(tokens):
            raise NoFreeBlocksError(
                f"need {self.blocks_needed(len(tokens))} blocks for {len(tokens)} tokens, "
                f"{self.free_blocks} free"
            )
        hits = self._match_prefix(tokens)
        table = BlockTable(block_ids=[], cached_tokens=0, hashes=[])
        previous: bytes | None = None
        for index, block_id in enumerate(hits):
            block = self._blocks[block_id]
            if block.ref_count == 0:
                self._cached_free.pop(block_id, None)
            block.ref_count += 1
            table.block_ids.append(block_id)
            table.hashes.append(block.block_hash)
            previous = block.block_hash
            table.cached_tokens = (index + 1) * self.block_size
        self.cache_hit_tokens += table.cached_tokens
        start = len(hits) * self.block_size
        for offset in range(start, len(tokens), self.block_size):
            chunk = tuple(int(t) for t in tokens[offset : offset + self.block_size])
            block_id = self._take_free()
            block = self._blocks[block_id]
            block.ref_count = 1
            table.block_ids.append(block_id)
            if len(chunk) == self.block_size and self.enable_prefix_cache:
                previous = chain_hash(previous, chunk)
                self._publish(block, previous, chunk)
                table.hashes.append(previous)
            else:
                table.hashes.append(None)
        return table

    def append_slot(self, table: BlockTable, tokens: Sequence[int]) -> bool:
        """Make room for one more token of a running sequence; False when the pool is full.

        `tokens` is the sequence after appending. When a block just became full it is
        published for prefix sharing.
        """
        length = len(tokens)
        if length > len(table.block_ids) * self.block_size:
            if self.free_blocks == 0:
                return False
            block_id = self._take_free()
            self._blocks[block_id].ref_count = 1
            table.block_ids.append(block_id)
            table.hashes.append(None)
        if self.enable_prefix_cache and length % self.block_size == 0:
            index = length // self.block_size - 1
            if table.hashes[index] is None:
                previous = table.hashes[index - 1] if index > 0 else None
                chunk = tuple(int(t) for t in tokens[index * self.block_size : length])
                block_hash = chain_hash(previous, chunk)
                self._publish(self._blocks[table.block_ids[index]], block_hash, chunk)
                table.hashes[index] = block_hash
        return True

    def free(self, table: BlockTable) -> None:
        """Drop a sequence's references; cached blocks stay reusable until evicted.

        Each block leaves the table before its reference is dropped, so a free cut short (a
        Ctrl-C lands between any two bytecodes) and run again drops each reference once: at
        worst one block is never returned, never one returned twice."""
        while table.block_ids:
            block_id = table.block_ids.pop()
            if table.hashes:
                table.hashes.pop()
            self._drop_reference(block_id)
        table.hashes.clear()

    def _drop_reference(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._cached_free[block_id] = None
            else:
                self._never_used.append(block_id)

    # -- internals ------------------------------------------------------------------------------

    def _match_prefix(self, tokens: Sequence[int]) -> list[int]:
        if not self.enable_prefix_cache:
            return []
        hits: list[int] = []
        previous: bytes | None = None
        full_blocks = (len(tokens) - 1) // self.block_size  # keep >= 1 token uncached
        for index in range(full_blocks):
            chunk = tuple(
                int(t) for t in tokens[index * self.block_size : (index + 1) * self.block_size]
            )
            previous = chain_hash(previous, chunk)
            block_id = self._by_hash.get(previous)
            if block_id is None or self._blocks[block_id].tokens != chunk:
                break
            hits.append(block_id)
        return hits

    def _take_free(self) -> int:
        if self._never_used:
            return self._never_used.pop()
        if self._cached_free:
            block_id, _ = self._cached_free.popitem(last=False)
            block = self._blocks[block_id]
            if block.block_hash is not None and self._by_hash.get(block.block_hash) == block_id:
                del self._by_hash[block.block_hash]
            block.block_hash = None
            block.tokens = ()
            return block_id
        raise NoFreeBlocksError("no free KV blocks")

    def _publish(self, block: _Block, block_hash: bytes, tokens: tuple[int, ...]) -> None:
        block.block_hash = block_hash
        block.tokens = tokens
        self._by_hash.setdefault(block_hash, block.block_id)
