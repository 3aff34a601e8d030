"""Prefill test harness: a tiny model, its bound paged KV cache and a `PrefillRuntime`.

Geometry is small so every planner path happens with short prompts: blocks of 8 tokens,
chunks of at most 32 tokens (padded lengths 32, 64, 128: anything over 32 uncached tokens is
chunked), waves of up to 8 rows. The model's own single-row full prefill (`reference_logits`,
which writes nothing to the cache) is the oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from runtime.backends.base import Device
from runtime.config import RuntimePolicy
from runtime.output_reader import OutputReader
from runtime.prefill.config import PrefillRuntimeConfig
from runtime.prefill.runtime import PrefillRuntime
from runtime.sampling import SamplingParams
from tests.runtime.tiny_setup import TinySetup, build_tiny_setup, tiny_sampler

BLOCK = 8
CHUNK = 32
NUM_BLOCKS = 160
LANES = 8
POLICY = RuntimePolicy.torch_default(chunk_size_multiple=16)
STALE_BLOCK = NUM_BLOCKS - 1
"""Written into page-table tails beyond each row's prompt: the runtime must never use it."""


def _never(length: int, cached: int) -> bool:
    return False


class FailingPrefillModel:
    """Delegates to a real model; its `fail_on`-th prefill call raises."""

    def __init__(self, inner: Any, *, fail_on: int) -> None:
        self.inner = inner
        self.fail_on = fail_on
        self.calls = 0

    @property
    def vocab_size(self) -> int:
        return int(self.inner.vocab_size)

    @property
    def device(self) -> torch.device:
        return torch.device(self.inner.device)

    def prefill(self, tokens: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError(f"injected prefill failure on call {self.calls}")
        return self.inner.prefill(tokens, **kwargs)


@attrs.define(eq=False)
class PrefillHarness:
    """Everything a prefill test composes, plus prompt/page-table helpers."""

    setup: TinySetup
    device: Device
    reader: OutputReader
    config: PrefillRuntimeConfig
    runtime: PrefillRuntime
    next_block: int = 0

    @property
    def model(self) -> Any:
        return self.setup.model

    @property
    def vocab(self) -> int:
        return int(self.setup.model.vocab_size)

    def blocks_for(self, length: int) -> list[int]:
        """Fresh blocks for a prompt of `length` tokens (wraps around the cache)."""
        count = -(-length // BLOCK)
        if self.next_block + count >= STALE_BLOCK:
            self.next_block = 0
        out = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return out

    def page_table(
        self, prompts: Sequence[Sequence[int]], width: int | None = None
    ) -> torch.Tensor:
        """One row per prompt with fresh blocks; tails hold a stale (but valid) block id."""
        columns = width or self.config.page_table_layout.raw_capacity_width
        table = torch.full((len(prompts), columns), STALE_BLOCK, dtype=torch.int32)
        for row, prompt in enumerate(prompts):
            blocks = self.blocks_for(len(prompt))
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table

    def write_prefix(self, prompt: Sequence[int], table_row: torch.Tensor, cached: int) -> None:
        """Put the first `cached` tokens of `prompt` into the cache (the model's own prefill)."""
        if cached == 0:
            return
        self.model.prefill(
            torch.tensor([list(prompt[:cached])], dtype=torch.int64),
            page_table=table_row.reshape(1, -1),
            prompt_lens=torch.tensor([cached]),
            chunk_start=torch.tensor([0]),
        )

    def reference_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """The model's single-row full prefill of `prompt` (no cache reads or writes)."""
        width = -(-len(prompt) // BLOCK)
        logits = self.model.prefill(
            torch.tensor([list(prompt)], dtype=torch.int64),
            page_table=torch.full((1, width), -1, dtype=torch.int32),
            prompt_lens=torch.tensor([len(prompt)]),
            chunk_start=torch.tensor([0]),
        )
        return logits[0].float()

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        page_table: torch.Tensor,
        *,
        start_pos: Sequence[int] | None = None,
        empty_slots: Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
    ) -> Any:
        """prepare -> invoke each -> assemble, as an eager executor does."""
        tokens = token_matrix(prompts)
        prepared = self.runtime.prepare(
            tokens=tokens,
            page_table=page_table,
            prompt_lens=[len(p) for p in prompts],
            start_pos=start_pos,
            empty_slots=empty_slots,
            sampling_params=sampling_params,
        )
        results = [(item, self.runtime.invoke(item)) for item in prepared]
        return self.runtime.assemble(
            results, batch_size=len(prompts), sampling_params=sampling_params
        )


def token_matrix(prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Prompts as a zero-padded int64 `[rows, longest]` matrix."""
    width = max(len(p) for p in prompts)
    tokens = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.int64)
    return tokens


def prompt(length: int, seed: int) -> list[int]:
    """A reproducible prompt of `length` token ids in [3, 256)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=generator).tolist()


def make_harness(
    *,
    sampling: bool = False,
    sampler_rows: int = LANES,
    can_enable_trace: Callable[[int, int], bool] = _never,
    wrap_device: Callable[[Device], Device] | None = None,
    wrap_model: Callable[[Any], Any] | None = None,
    **config: Any,
) -> PrefillHarness:
    """A harness over a fresh tiny model and cache; `config` overrides `resolve` arguments."""
    setup = build_tiny_setup(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_prefill_chunk_size=CHUNK)
    if sampling:
        sampler = tiny_sampler(setup.model, max_batch_size=sampler_rows, max_top_k=8)
        setup.model.sampling = sampler
    device: Device = setup.device if wrap_device is None else wrap_device(setup.device)
    reader = setup.reader if device is setup.device else OutputReader(device)
    model = setup.model if wrap_model is None else wrap_model(setup.model)
    arguments: dict[str, Any] = {
        "model": model,
        "device": device,
        "output_reader": reader,
        "page_table_layout": setup.layout,
        "max_batch_size": LANES,
        "max_prefill_chunk_size": CHUNK,
        "policy": POLICY,
        "device_sampling_enabled": sampling,
        "can_enable_trace": can_enable_trace,
    }
    arguments.update(config)
    resolved = PrefillRuntimeConfig.resolve(**arguments)
    return PrefillHarness(
        setup=setup,
        device=device,
        reader=reader,
        config=resolved,
        runtime=PrefillRuntime(resolved),
    )
