"""Properties of prefill through the runtime over random batches.

Random prompt lengths, block-aligned cached prefixes (sometimes the whole prompt) and lane
slots: every planned row equals the model's own single-row full prefill of its prompt, fully
cached rows are zero, and results come back in source-row order whatever the plan looked like
(waves, chunked rows, cached rows).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.prefill.result_collector import InvocationResult
from runtime.sampling import SamplingParams
from tests.runtime.prefill_setup import BLOCK, LANES, PrefillHarness, make_harness, prompt

ATOL = 1e-4


@attrs.frozen
class Batch:
    prompts: tuple[tuple[int, ...], ...]
    cached: tuple[int, ...]
    slots: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.prompts)


@st.composite
def batches(draw: st.DrawFn, max_rows: int = 4, max_length: int = 80) -> Batch:
    rows = draw(st.integers(1, max_rows))
    lengths: list[int] = []
    cached: list[int] = []
    for _ in range(rows):
        length = draw(st.integers(1, max_length))
        # Uncached rows (so batched waves happen), cached prefixes, and fully cached rows.
        kind = draw(st.sampled_from(("fresh", "fresh", "cached", "full")))
        if kind == "full":
            length = max(BLOCK, length // BLOCK * BLOCK)
        lengths.append(length)
        prefix = {"fresh": 0, "full": length}.get(kind)
        cached.append(
            prefix if prefix is not None else draw(st.integers(0, length // BLOCK)) * BLOCK
        )
    slots = tuple(draw(st.permutations(range(LANES)))[:rows])
    seeds = draw(st.lists(st.integers(0, 2**20), min_size=rows, max_size=rows))
    prompts = tuple(
        tuple(prompt(length, seed)) for length, seed in zip(lengths, seeds, strict=True)
    )
    return Batch(prompts, tuple(cached), slots)


@functools.cache
def _harness(sampling: bool) -> PrefillHarness:
    return make_harness(sampling=sampling)


def _stage(h: PrefillHarness, batch: Batch) -> torch.Tensor:
    table = h.page_table(batch.prompts)
    for row, (tokens, cached) in enumerate(zip(batch.prompts, batch.cached, strict=True)):
        if cached < len(tokens):
            h.write_prefix(tokens, table[row], cached)
    return table


@given(batches())
def test_runtime_prefill_equals_per_prompt_full_prefill(batch: Batch) -> None:
    h = _harness(False)
    table = _stage(h, batch)
    before = h.device.live_allocations
    logits = h.run(batch.prompts, table, start_pos=batch.cached, empty_slots=batch.slots)
    assert h.device.live_allocations == before
    assert isinstance(logits, torch.Tensor) and logits.shape == (batch.size, 1, h.vocab)
    for row, (tokens, cached) in enumerate(zip(batch.prompts, batch.cached, strict=True)):
        if cached == len(tokens):
            assert torch.count_nonzero(logits[row]) == 0
        else:
            torch.testing.assert_close(
                logits[row, 0], h.reference_logits(tokens), atol=ATOL, rtol=0
            )


@given(batches(), st.data())
def test_greedy_tokens_and_log_probs_follow_source_rows(batch: Batch, data: st.DataObject) -> None:
    h = _harness(True)
    table = _stage(h, batch)
    logits = h.run(batch.prompts, table, start_pos=batch.cached, empty_slots=batch.slots)
    wanted = data.draw(st.lists(st.booleans(), min_size=batch.size, max_size=batch.size))
    params = SamplingParams(temperature=0.0, enable_log_probs=wanted)
    tokens, log_probs = h.run(
        batch.prompts,
        table,
        start_pos=batch.cached,
        empty_slots=batch.slots,
        sampling_params=params,
    )
    planned = [cached < len(p) for p, cached in zip(batch.prompts, batch.cached, strict=True)]
    expected = torch.where(
        torch.tensor(planned), logits[:, 0].argmax(dim=-1), torch.zeros(batch.size).long()
    )
    assert tokens.tolist() == expected.tolist()
    if not any(w and p for w, p in zip(wanted, planned, strict=True)):
        assert log_probs is None
        return
    assert log_probs is not None
    reference = torch.log_softmax(logits[:, 0], dim=-1)
    for row in range(batch.size):
        if wanted[row] and planned[row]:
            value = reference[row, int(tokens[row])].item()
            assert abs(log_probs[row].item() - value) <= ATOL
        else:
            assert log_probs[row].item() == 1.0


@given(batches(max_rows=8, max_length=120))
def test_assemble_restores_source_order(batch: Batch) -> None:
    h = _harness(False)
    table = h.page_table(batch.prompts)
    prepared = h.runtime.prepare(
        tokens=torch.tensor([list(p) + [0] * (120 - len(p)) for p in batch.prompts]),
        page_table=table,
        prompt_lens=[len(p) for p in batch.prompts],
        start_pos=batch.cached,
        empty_slots=batch.slots,
    )
    planned_rows = sorted(row for item in prepared for row in item.request.source_rows)
    assert planned_rows == [
        row for row in range(batch.size) if batch.cached[row] < len(batch.prompts[row])
    ]

    def result(item: Any) -> InvocationResult:
        rows = item.request.padded_batch_size
        value = torch.full((rows, h.vocab), -1.0)
        for local, source in enumerate(item.request.source_rows):
            value[local] = float(source + 1)
        return InvocationResult(value)

    logits = h.runtime.assemble(
        ((item, result(item)) for item in reversed(prepared)), batch_size=batch.size
    )
    assert isinstance(logits, torch.Tensor)
    for row in range(batch.size):
        expected = float(row + 1) if row in planned_rows else 0.0
        assert (logits[row] == expected).all()
