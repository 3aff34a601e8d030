"""Shared test setup: a tiny-random Llama model bound to a paged KV cache on a torch device.

`build_tiny_setup()` returns everything a runtime test composes: the model (configured for
paged attention), a `TorchDevice`, a `PagedKVCacheManager` with the cache allocated and bound,
the `PageTableLayout` for that capacity, a `RuntimePolicy` and an `OutputReader` on the same
device. `TinySetup.close()` releases the cache. Helpers build per-row page tables, prefill
prompts through the model's own `prefill`, and make a device sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from models.decoder.model import DecoderModel
from models.decoder.sampling import DecoderSampler, SamplerConfig
from models.decoder.sources import load_model
from runtime.backends.torch_device import TorchDevice
from runtime.config import PagedKVCacheConfig, PageTableLayout, RuntimePolicy
from runtime.decode_config import DecodeRuntimeConfig
from runtime.output_reader import OutputReader
from runtime.paged_kv_cache import PagedKVCacheManager


def tiny_model(
    preset: str = "tiny-random",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> DecoderModel:
    """A fresh tiny-random model (weights are seeded, so equal arguments give equal models)."""
    return load_model(preset, seed=seed, dtype=dtype, device=device, with_tokenizer=False).model


@attrs.define(eq=False)
class TinySetup:
    """A model with a bound paged KV cache and the runtime collaborators around it."""

    model: DecoderModel
    device: TorchDevice
    kv_manager: PagedKVCacheManager
    kv_cache: list[list[torch.Tensor]]
    layout: PageTableLayout
    policy: RuntimePolicy
    reader: OutputReader

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        """Physical blocks allocated per layer."""
        num_blocks = self.kv_manager.config.num_blocks
        assert num_blocks is not None
        return num_blocks

    @property
    def resident_allocations(self) -> int:
        """Live device allocations that outlive a request: the KV cache (K and V per layer)
        and, once the decode runtime materialised it, the device sampler's buffers."""
        sampler = getattr(self.model, "sampling", None)
        buffers = len(sampler.buffers) if sampler is not None else 0
        return 2 * self.model.n_layers + buffers

    def decode_config(
        self, *, lane_capacity: int, device_sampling_enabled: bool = False, **overrides: Any
    ) -> DecodeRuntimeConfig:
        """The decode runtime's configuration over this setup's model, cache and reader."""
        options: dict[str, Any] = {
            "model": self.model,
            "device": self.device,
            "output_reader": self.reader,
            "lane_capacity": lane_capacity,
            "page_table_layout": self.layout,
            "device_sampling_enabled": device_sampling_enabled,
            "policy": self.policy,
            **overrides,
        }
        return DecodeRuntimeConfig.resolve(**options)

    def close(self) -> None:
        """Release the sampler buffers and the KV cache (idempotent)."""
        sampler = getattr(self.model, "sampling", None)
        if sampler is not None:
            sampler.release()
        self.kv_manager.release()


def build_tiny_setup(
    *,
    preset: str = "tiny-random",
    block_size: int = 4,
    num_blocks: int = 32,
    max_num_blocks: int | None = None,
    max_prefill_chunk_size: int = 32,
    decode_lane_capacity_limit: int = 64,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> TinySetup:
    """Build and bind a tiny model's paged KV cache; see `TinySetup`."""
    model = tiny_model(preset, seed=seed, dtype=dtype, device=device)
    ceiling = num_blocks if max_num_blocks is None else max_num_blocks
    model.configure_paged_attention(block_size=block_size, max_num_blocks=ceiling)
    torch_device = TorchDevice(device)
    manager = PagedKVCacheManager(
        model,
        PagedKVCacheConfig(
            block_size=block_size, max_num_blocks=ceiling, dtype=dtype, num_blocks=num_blocks
        ),
        device=torch_device,
    )
    cache = manager.allocate()
    layout = PageTableLayout.resolve(
        block_size=block_size,
        model_max_sequence_length=model.max_seq_len,
        physical_num_blocks=num_blocks,
        max_prefill_chunk_size=max_prefill_chunk_size,
    )
    # Unchecked against the pool: these unit tests prepare tables of distinct blocks per row,
    # wider than this small pool, without running them; the pool rule is tested on executors
    # (`test_single_lane_refusal_machine`) and on the model.
    layout = attrs.evolve(layout, num_blocks=None)
    policy = RuntimePolicy.torch_default(decode_lane_capacity_limit=decode_lane_capacity_limit)
    return TinySetup(
        model=model,
        device=torch_device,
        kv_manager=manager,
        kv_cache=cache,
        layout=layout,
        policy=policy,
        reader=OutputReader(torch_device),
    )


def tiny_sampler(
    model: DecoderModel,
    *,
    max_batch_size: int,
    max_top_k: int = 32,
    allow_force_argmax: bool = True,
) -> DecoderSampler:
    """A device sampler for `model` (not materialised; the runtime materialises it)."""
    return DecoderSampler(
        SamplerConfig(
            max_batch_size=max_batch_size,
            max_top_k=max_top_k,
            vocab_size=model.vocab_size,
            allow_force_argmax=allow_force_argmax,
        )
    )


def block_page_table(
    rows: int, blocks_per_row: int, *, width: int | None = None, first_block: int = 0
) -> torch.Tensor:
    """int32 `[rows, width]`: row r owns blocks `first + r*blocks_per_row ...`; rest -1."""
    total = blocks_per_row if width is None else width
    table = torch.full((rows, total), -1, dtype=torch.int32)
    for row in range(rows):
        start = first_block + row * blocks_per_row
        table[row, :blocks_per_row] = torch.arange(start, start + blocks_per_row)
    return table


def prefill_prompts(
    setup: TinySetup, prompts: Sequence[Sequence[int] | None], page_table: torch.Tensor
) -> torch.Tensor:
    """Write each row's prompt K/V with the model's own `prefill` (None rows are padding).

    Returns the last-token logits `[rows, vocab]` (padding rows zero).
    """
    rows = len(prompts)
    length = max((len(prompt) for prompt in prompts if prompt is not None), default=1)
    tokens = torch.zeros((rows, length), dtype=torch.int64)
    lens = torch.zeros(rows, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        if prompt is None:
            continue
        tokens[row, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.int64)
        lens[row] = len(prompt)
    return setup.model.prefill(
        tokens,
        page_table=page_table,
        prompt_lens=lens,
        chunk_start=torch.zeros(rows, dtype=torch.int64),
    )
