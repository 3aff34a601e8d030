"""A tiny random Qwen3-MoE checkpoint built offline with transformers' own Qwen3-MoE classes.

`write_tiny_qwen3_moe` builds `transformers.Qwen3MoeForCausalLM` from
`transformers.Qwen3MoeConfig`, gives it seeded weights whose greedy continuations vary
(`random_state_dict` of the runtime's preset, per-expert names, stacked into transformers'
in-memory `mlp.experts.gate_up_proj` / `down_proj` with `stack_hf_experts`), saves it with
`save_pretrained` (safetensors: transformers writes the per-expert names real checkpoints
hold) and adds the byte-level tokenizer of the Qwen3 helper. The HF model returned is the
oracle.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import torch

from models.decoder import random_state_dict
from models.qwen3_moe import TINY_PRESETS, Qwen3MoeArgs, stack_hf_experts
from tests.models.qwen3_checkpoint import EOS_ID, VOCAB, write_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def tiny_qwen3_moe_args(preset: str = "qwen3-moe") -> Qwen3MoeArgs:
    """The preset with a byte vocabulary plus Qwen3's two special tokens (eos `<|im_end|>`)."""
    return attrs.evolve(
        TINY_PRESETS[preset], vocab_size=VOCAB, bos_token_id=None, eos_token_ids=(EOS_ID,)
    )


def stacked_state(args: Qwen3MoeArgs, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (per-expert names) with each layer's experts stacked as transformers holds them
    in memory."""
    out = {name: t for name, t in state.items() if ".mlp." not in name}
    for layer in range(args.n_layers):
        prefix = f"model.layers.{layer}."
        for suffix, tensor in stack_hf_experts(state, layer, args.moe.shapes).items():
            out[prefix + suffix] = tensor
    return out


def hf_qwen3_moe(args: Qwen3MoeArgs, state: dict[str, torch.Tensor]) -> Any:
    """transformers' `Qwen3MoeForCausalLM` from its own `Qwen3MoeConfig`, holding `state`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**args.to_hf_config())
    config._attn_implementation = "eager"
    model = Qwen3MoeForCausalLM(config).eval()
    result = model.load_state_dict(stacked_state(args, state), strict=False)
    allowed_missing = {"lm_head.weight"} if args.tie_word_embeddings else set()
    assert set(result.missing_keys) <= allowed_missing, result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    if args.tie_word_embeddings:
        model.tie_weights()
    block = model.model.layers[0].mlp
    assert block.experts.gate_up_proj.shape == args.moe.shapes.gate_up
    assert block.gate.top_k == args.top_k and block.gate.norm_topk_prob == args.norm_topk_prob
    return model


def write_tiny_qwen3_moe(
    folder: Path, preset: str = "qwen3-moe", seed: int = 0
) -> tuple[Path, Any]:
    """Save a tiny random Qwen3-MoE (safetensors + tokenizer) in `folder`; the HF oracle."""
    args = tiny_qwen3_moe_args(preset)
    state = random_state_dict(args, seed=seed)
    model = hf_qwen3_moe(args, state)
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer(folder)
    return folder, model
