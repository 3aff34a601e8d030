"""The Llama family's arguments: `LlamaArgs` (recognised checkpoints) and its tiny presets.

Everything a Llama-architecture decoder computes is the shared decoder (`models.decoder`);
this value only names what the family recognises (HF `model_type` `llama`,
`LlamaForCausalLM`, GGUF `llama`) and its small random shapes for tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import attrs

from models.decoder.config import DecoderArgs, RopeScaling, tiny_random_name


@attrs.frozen
class LlamaArgs(DecoderArgs):
    """A Llama-architecture decoder (Llama, SmolLM, Mistral-style dense models)."""

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("llama",)
    HF_ARCHITECTURES: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)
    GGUF_ARCHITECTURES: ClassVar[tuple[str, ...]] = ("llama",)
    PRESETS: ClassVar[Mapping[str, DecoderArgs]] = {}


_TINY_GQA = LlamaArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    ffn_dim=128,
    head_dim=16,
    max_seq_len=512,
    norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
    name=tiny_random_name("gqa"),
)

TINY_PRESETS: dict[str, LlamaArgs] = {
    # grouped-query attention, untied head
    "gqa": _TINY_GQA,
    # multi-head attention with a tied head
    "mha-tied": attrs.evolve(
        _TINY_GQA, name=tiny_random_name("mha-tied"), n_kv_heads=4, tie_word_embeddings=True
    ),
    # one KV head, head_dim different from dim / n_heads, three layers
    "mqa": attrs.evolve(
        _TINY_GQA,
        name=tiny_random_name("mqa"),
        n_heads=4,
        n_kv_heads=1,
        head_dim=24,
        n_layers=3,
        ffn_dim=96,
    ),
    # llama3-style rope scaling; original context small so all three bands are used
    "llama3-rope": attrs.evolve(
        _TINY_GQA,
        name=tiny_random_name("llama3-rope"),
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            kind="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        tie_word_embeddings=True,
    ),
    # linear position interpolation
    "linear-rope": attrs.evolve(
        _TINY_GQA,
        name=tiny_random_name("linear-rope"),
        rope_scaling=RopeScaling(kind="linear", factor=2.0),
    ),
    # every matrix row (dim, ffn_dim) a multiple of 256, for GGUF K-quant super-blocks; with
    # 8 heads of 32 the seeded weights' greedy continuations run past 48 tokens without eos
    "q256": attrs.evolve(
        _TINY_GQA,
        name=tiny_random_name("q256"),
        dim=256,
        ffn_dim=512,
        n_heads=8,
        head_dim=32,
    ),
}

LlamaArgs.PRESETS = TINY_PRESETS
