"""Properties of paged prefill/decode: chunking, cached prefixes and block placement are invisible.

For random prompt lengths, block sizes, chunk sizes and block-aligned cached prefixes, the
last-token logits must equal one full prefill of the same prompt, and a page table with
shuffled physical blocks must give the result of a contiguous one.
"""

from __future__ import annotations

from functools import cache

import attrs
import torch
from hypothesis import given
from hypothesis import strategies as st

from models.decoder import DecoderModel, allocate_kv_cache, random_state_dict
from models.decoder.reference import prefill_prompts
from models.llama import TINY_PRESETS, LlamaArgs
from tests.models.llama_oracle import full_prefill_logits

ATOL = 1e-4


@cache
def _model(preset: str) -> DecoderModel:
    args = LlamaArgs.tiny_random(preset)
    return DecoderModel.from_state_dict(args, random_state_dict(args, seed=11))


@attrs.frozen
class Scenario:
    preset: str
    block_size: int
    prompts: tuple[tuple[int, ...], ...]
    cached: tuple[int, ...]  # block-aligned cached prefix per row
    chunk: int
    permutation: tuple[int, ...]  # physical block of each logical block, all rows in order

    def counts(self) -> list[int]:
        """Blocks per row: the prompt plus one decode token."""
        return [(len(p) + 1 + self.block_size - 1) // self.block_size for p in self.prompts]

    def page_table(self, *, shuffled: bool) -> torch.Tensor:
        counts = self.counts()
        table = torch.full((len(counts), max(counts) + 1), -1, dtype=torch.int32)
        start = 0
        for row, count in enumerate(counts):
            ids = range(start, start + count)
            physical = [self.permutation[i] if shuffled else i for i in ids]
            table[row, :count] = torch.tensor(physical, dtype=torch.int32)
            start += count
        return table


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    preset = draw(st.sampled_from(sorted(TINY_PRESETS)))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    rows = draw(st.integers(1, 3))
    lengths = [draw(st.integers(1, 40)) for _ in range(rows)]
    prompts = tuple(
        tuple(draw(st.lists(st.integers(3, 255), min_size=n, max_size=n))) for n in lengths
    )
    cached = tuple(draw(st.integers(0, (n - 1) // block_size)) * block_size for n in lengths)
    chunk = draw(st.integers(1, max(n - c for n, c in zip(lengths, cached, strict=True))))
    total = sum((n + 1 + block_size - 1) // block_size for n in lengths)
    permutation = tuple(draw(st.permutations(range(total))))
    return Scenario(preset, block_size, prompts, cached, chunk, permutation)


def _fill_cached_prefixes(model: DecoderModel, scenario: Scenario, table: torch.Tensor) -> None:
    """Write each row's cached prefix as an earlier request would have (padding rows: len 0)."""
    longest = max(scenario.cached)
    if longest == 0:
        return
    tokens = torch.zeros(len(scenario.prompts), longest, dtype=torch.long)
    for row, (prompt, cached) in enumerate(zip(scenario.prompts, scenario.cached, strict=True)):
        tokens[row, :cached] = torch.tensor(prompt[:cached])
    model.prefill(
        tokens,
        page_table=table,
        prompt_lens=torch.tensor(scenario.cached),
        chunk_start=torch.zeros(len(scenario.prompts), dtype=torch.long),
    )


def _run(scenario: Scenario, *, shuffled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill over cached prefixes, then one decode step; both logits `[B, V]`."""
    model = _model(scenario.preset)
    table = scenario.page_table(shuffled=shuffled)
    blocks = len(scenario.permutation)
    model.set_kv_cache(None)
    model.configure_paged_attention(block_size=scenario.block_size, max_num_blocks=blocks)
    model.set_kv_cache(allocate_kv_cache(model, blocks))
    try:
        _fill_cached_prefixes(model, scenario, table)
        logits = prefill_prompts(
            model,
            scenario.prompts,
            table,
            chunk_size=scenario.chunk,
            cached_tokens=scenario.cached,
        )
        positions = torch.tensor([len(p) for p in scenario.prompts])
        decoded = model.decode(logits.argmax(-1), positions=positions, page_table=table)
    finally:
        model.set_kv_cache(None)
    return logits, decoded


@given(scenarios())
def test_chunked_cached_prefill_and_decode_equal_full_prefill(scenario: Scenario) -> None:
    model = _model(scenario.preset)
    expected = [full_prefill_logits(model, p) for p in scenario.prompts]
    logits, decoded = _run(scenario, shuffled=True)
    for row, prompt in enumerate(scenario.prompts):
        assert (logits[row] - expected[row]).abs().max().item() < ATOL, row
        following = int(logits[row].argmax())
        after = full_prefill_logits(model, (*prompt, following))
        assert (decoded[row] - after).abs().max().item() < ATOL, row


@given(scenarios())
def test_shuffled_physical_blocks_equal_contiguous(scenario: Scenario) -> None:
    contiguous = _run(scenario, shuffled=False)
    shuffled = _run(scenario, shuffled=True)
    for a, b in zip(contiguous, shuffled, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
