"""A tiny random Qwen3 checkpoint built offline with transformers' own Qwen3 classes.

`write_tiny_qwen3` builds `transformers.Qwen3ForCausalLM` from `transformers.Qwen3Config`,
gives it seeded weights whose greedy continuations vary (`random_state_dict` of the
runtime's `Qwen3Args` preset: transformers' own init is std 0.02, whose near-flat logits
make greedy ties), saves it with `save_pretrained` (safetensors) and adds a byte-level BPE
tokenizer (`tokenizer.json`, `tokenizer_config.json`). The HF model returned is the oracle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from models.decoder import random_state_dict
from models.qwen3 import TINY_PRESETS, Qwen3Args

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

BYTES = 256
EOS_TOKEN = "<|im_end|>"
SPECIALS = ("<|endoftext|>", EOS_TOKEN)
VOCAB = BYTES + len(SPECIALS)
EOS_ID = BYTES + 1


def tiny_qwen3_args(preset: str = "qwen3") -> Qwen3Args:
    """The preset with a byte vocabulary plus Qwen3's two special tokens (eos `<|im_end|>`)."""
    return attrs.evolve(
        TINY_PRESETS[preset], vocab_size=VOCAB, bos_token_id=None, eos_token_ids=(EOS_ID,)
    )


def hf_qwen3(args: Qwen3Args, state: dict[str, torch.Tensor]) -> Any:
    """transformers' `Qwen3ForCausalLM` from its own `Qwen3Config`, holding `state`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**args.to_hf_config())
    config._attn_implementation = "eager"
    model = Qwen3ForCausalLM(config).eval()
    result = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if args.tie_word_embeddings else set()
    assert set(result.missing_keys) <= allowed_missing, result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    if args.tie_word_embeddings:
        model.tie_weights()
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (args.head_dim,)
    return model


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE without merges: ids 0..255 the bytes, then Qwen3's special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from models.decoder.tokenizer import byte_alphabet

    alphabet = byte_alphabet()
    vocab = {alphabet[b]: b for b in range(BYTES)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True) for token in SPECIALS])
    assert backend.token_to_id(EOS_TOKEN) == EOS_ID
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": SPECIALS[0],
        "model_max_length": 512,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_tiny_qwen3(folder: Path, preset: str = "qwen3", seed: int = 0) -> tuple[Path, Any]:
    """Save a tiny random Qwen3 (safetensors + tokenizer) in `folder`; the HF oracle model."""
    args = tiny_qwen3_args(preset)
    state = random_state_dict(args, seed=seed)
    model = hf_qwen3(args, state)
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer(folder)
    return folder, model


def hf_greedy_batch(
    hf_model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' own greedy `generate`, one prompt at a time, stopping at the eos."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        with torch.inference_mode():
            generated = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=[EOS_ID],
                pad_token_id=EOS_ID,
            )
        tokens: list[int] = generated[0, len(prompt) :].tolist()
        if EOS_ID in tokens:
            tokens = tokens[: tokens.index(EOS_ID) + 1]
        out.append(tokens)
    return out
