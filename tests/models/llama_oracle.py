"""Test helpers: transformers oracles built from the same weights as our model."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import torch

from models.decoder import (
    DecoderModel,
    allocate_kv_cache,
    greedy_generate,
    random_state_dict,
)
from models.llama import LlamaArgs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def hf_llama(args: LlamaArgs, state_dict: Mapping[str, torch.Tensor]) -> Any:
    """A transformers `LlamaForCausalLM` with `state_dict` loaded (float32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**args.to_hf_config())
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    result = model.load_state_dict(dict(state_dict), strict=False)
    allowed_missing = {"lm_head.weight"} if args.tie_word_embeddings else set()
    assert set(result.missing_keys) <= allowed_missing, result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    if args.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@cache
def tiny_pair(preset: str, seed: int = 0) -> tuple[DecoderModel, Any]:
    """Our tiny-random model and the transformers oracle with the same weights."""
    args = LlamaArgs.tiny_random(preset)
    state = random_state_dict(args, seed=seed)
    return DecoderModel.from_state_dict(args, state), hf_llama(args, state)


def hf_last_logits(hf_model: Any, prompt: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = hf_model(torch.tensor([list(prompt)], dtype=torch.long))
    return out.logits[0, -1].float()


def hf_greedy(
    hf_model: Any, prompt: Sequence[int], max_new_tokens: int, eos: Sequence[int]
) -> list[int]:
    """transformers' own greedy `generate` for one prompt (stops at `eos`, like ours)."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.inference_mode():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos) if eos else None,
            pad_token_id=eos[0] if eos else 0,
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    if eos:  # generate pads finished rows with pad_token_id after the stop token
        for index, token in enumerate(tokens):
            if token in eos:
                return tokens[: index + 1]
    return tokens


def full_prefill_logits(model: DecoderModel, prompt: Sequence[int], block_size: int = 8) -> Any:
    """Last-token logits of one unchunked prefill into a fresh contiguous cache."""
    blocks = (len(prompt) + block_size - 1) // block_size
    model.set_kv_cache(None)
    model.configure_paged_attention(block_size=block_size, max_num_blocks=max(blocks, 1))
    model.set_kv_cache(allocate_kv_cache(model, max(blocks, 1)))
    table = torch.arange(max(blocks, 1), dtype=torch.int32).unsqueeze(0)
    logits = model.prefill(
        torch.tensor([list(prompt)], dtype=torch.long),
        page_table=table,
        prompt_lens=torch.tensor([len(prompt)]),
        chunk_start=torch.tensor([0]),
    )
    model.set_kv_cache(None)
    return logits[0]


def assert_four_rows_greedy_match_transformers(model: DecoderModel, hf: Any, preset: str) -> None:
    """Four prompts of 1-40 tokens decoded together, 24 greedy tokens each, against
    transformers' own `generate` per prompt."""
    generator = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(3, model.vocab_size, (n,), generator=generator).tolist()
        for n in (1, 9, 17, 40)
    ]
    ours = greedy_generate(model, prompts, 24, block_size=8)
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 24, ()), (preset, len(prompt))
