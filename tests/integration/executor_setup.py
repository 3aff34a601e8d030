"""Helpers that build tiny `DecoderExecutor`s and drive them the way a server would."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from models.decoder.executor import DecoderExecutor, load_executor
from runtime.config import WarmupConfig

BLOCK = 4
CHUNK = 32


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models are dominated by thread synchronisation; one thread is faster and steadier
    (a module imports this fixture to use it)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_executor(
    *,
    trace_mode: str = "none",
    max_batch_size: int = 4,
    num_blocks: int | None = 48,
    faults: str | None = None,
    warmup: WarmupConfig | None = None,
    device_sampling: bool = True,
    max_seq_len: int = 64,
    seed: int = 0,
) -> DecoderExecutor:
    """A tiny-random executor in CONSTRUCTED (same seed -> same weights)."""
    return load_executor(
        "tiny-random",
        trace_mode=trace_mode,
        block_size=BLOCK,
        num_blocks=num_blocks,
        max_batch_size=max_batch_size,
        max_prefill_chunk_size=CHUNK,
        max_seq_len=max_seq_len,
        faults=faults,
        warmup=warmup or WarmupConfig(prefill_batch_sizes=(1, 2, 4)),
        device_sampling=device_sampling,
        seed=seed,
    )


def contiguous_tables(lengths: list[int], *, width: int, first_block: int = 0) -> torch.Tensor:
    """Row r owns a contiguous run of blocks big enough for `lengths[r]` tokens."""
    table = torch.full((len(lengths), width), -1, dtype=torch.int32)
    block = first_block
    for row, length in enumerate(lengths):
        needed = -(-length // BLOCK)
        table[row, :needed] = torch.arange(block, block + needed, dtype=torch.int32)
        block += needed
    return table


def prompts_batch(lengths: list[int], *, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    """Random prompts padded to the longest, as a `[B, L]` int64 tensor."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=generator)
    for row, length in enumerate(lengths):
        tokens[row, length:] = 0
    return tokens


def kv_snapshot(executor: DecoderExecutor) -> list[torch.Tensor]:
    """Copies of every K and V tensor."""
    assert executor.kv_cache is not None
    return [tensor.clone() for pair in executor.kv_cache for tensor in pair]


def run_prefill(executor: DecoderExecutor, lengths: list[int], **extra: Any) -> Any:
    """Prefill prompts of `lengths` into contiguous blocks."""
    tokens = prompts_batch(lengths)
    width = executor.page_table_layout.prefill_width
    return executor.prefill_forward(
        tokens=tokens,
        page_table=contiguous_tables(lengths, width=width),
        prompt_lens=torch.tensor(lengths),
        empty_slots=list(range(len(lengths))),
        **extra,
    )
