"""Checks every new family's end-to-end tests share (Qwen3, Qwen3-MoE): the prompts, the
lane they run on, logits against transformers at every step, and the vLLM engine contract.

A family test module builds its own checkpoint (with transformers' classes) and calls these,
so what "equals transformers" means is written once.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from models import load_executor
from models.decoder.reference import allocate_kv_cache
from models.decoder.sources import load_model
from models.generation import GenerationParams, Generator

BLOCK = 8
CHUNK = 32
NEW_TOKENS = 12
# float32 on both sides; our fused projections and transformers' sum in different orders, so
# logits differ by rounding only.
LOGIT_ATOL = 1e-4


def prompts() -> list[list[int]]:
    """Eight prompts of 1-70 tokens; most share a two-block prefix (prefix-cache hits), and
    three are longer than the prefill chunk."""
    rng = random.Random(5)
    prefix = [rng.randrange(0, 256) for _ in range(2 * BLOCK)]
    out = []
    for i, n in enumerate((1, 6, 13, 24, 37, 45, 58, 70)):
        tail = [rng.randrange(0, 256) for _ in range(n)]
        out.append((prefix + tail)[: max(n, 1) + (0 if i % 2 == 0 else 2 * BLOCK)])
    return out


def lane(folder: Path, trace_mode: str, **kwargs: Any) -> Any:
    """A 4-slot lane over `folder` whose default warmup covers every request it admits."""
    return load_executor(
        folder,
        trace_mode=trace_mode,
        block_size=BLOCK,
        max_batch_size=4,
        max_prefill_chunk_size=CHUNK,
        max_seq_len=128,
        **kwargs,
    )


def assert_logits_match_at_every_step(folder: Path, hf: Any) -> None:
    """Prefill one prompt, then decode 8 fed tokens; every step's logits within `LOGIT_ATOL`
    of transformers' full forward over the same tokens, with the same argmax."""
    model = load_model(folder, with_tokenizer=False).model
    prompt = prompts()[5]
    feed = [7, 200, 31, 31, 250, 1, 96, 128]
    blocks = -(-(len(prompt) + len(feed)) // BLOCK)
    model.configure_paged_attention(block_size=BLOCK, max_num_blocks=blocks)
    model.set_kv_cache(allocate_kv_cache(model, blocks))
    table = torch.arange(blocks, dtype=torch.int32).unsqueeze(0)
    ours = [
        model.prefill(
            torch.tensor([prompt]),
            page_table=table,
            prompt_lens=torch.tensor([len(prompt)]),
            chunk_start=torch.tensor([0]),
        )[0]
    ]
    for step, token in enumerate(feed):
        position = torch.tensor([len(prompt) + step])
        ours.append(model.decode(torch.tensor([token]), positions=position, page_table=table)[0])
    model.set_kv_cache(None)
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt + feed])).logits[0].float()
    for step, logits in enumerate(ours):
        reference = theirs[len(prompt) - 1 + step]
        difference = float((logits - reference).abs().max())
        assert difference <= LOGIT_ATOL, f"step {step}: max |diff| {difference}"
        assert int(logits.argmax()) == int(reference.argmax())


def assert_engine_contract_gives_generator_tokens(folder: Path, architecture: str) -> None:
    """The plugin's lookup of `architecture` gives the generic facade, and the engine's call
    sequence over it (trace decode_only, sampling on device, prefix hits) yields the
    runtime's own Generator tokens."""
    from transformers import AutoConfig

    from models.vllm_facade.facade import DecoderVLLMModel
    from models.vllm_plugin.facades import facade_class
    from tests.integration.vllm_engine import EngineDriver

    config = AutoConfig.from_pretrained(str(folder))
    config._name_or_path = str(folder)
    assert config.architectures == [architecture]
    facade = facade_class(config)
    assert facade is DecoderVLLMModel
    rng = random.Random(9)
    base = [rng.randrange(0, 256) for _ in range(13)]
    waves = [[base, base[:6]], [[*base[:8], 5, 6, 7], [rng.randrange(0, 256) for _ in range(9)]]]
    executor = lane(folder, "none")
    try:
        executor.start()
        completions = Generator(executor).generate(
            [p for wave in waves for p in wave],
            GenerationParams(max_new_tokens=6, ignore_eos=True),
        )
    finally:
        executor.close()
    driver = EngineDriver(
        facade,
        config,
        max_batch_size=4,
        max_model_len=64,
        block_size=4,
        trace_mode="decode_only",
        sample_on_device=True,
        async_decode=True,
        facade_options={"block_size": 8, "max_prefill_chunk_size": CHUNK},
    )
    driver.start()
    outputs = driver.generate(waves, max_new_tokens=6)
    assert outputs == [list(c.token_ids) for c in completions]
    assert driver.stats.prefix_hit_tokens > 0
