"""Canonical (Hugging Face) weight names of the decoder, and llama.cpp's GGUF names for them.

Kept apart from the loaders (and free of torch) so the family registry can name a family's
weight-name map without importing the tensor code.
"""

from __future__ import annotations

from collections.abc import Mapping

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
LAYER_PREFIX = "model.layers."

GGUF_GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd.weight": EMBED,
    "output_norm.weight": FINAL_NORM,
    "output.weight": LM_HEAD,
}
"""GGUF names of the tensors outside the layers -> canonical names."""

GGUF_LAYER_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}
"""A dense decoder layer's GGUF tensor names (`blk.N.<name>.weight`) -> canonical suffixes
within the layer (`model.layers.N.<suffix>`)."""

GGUF_QK_NORM_NAMES: Mapping[str, str] = {
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
}
"""The per-head query/key norms of a `qk_norm` layer (Qwen3), GGUF -> canonical suffix."""


def layer_name(index: int, suffix: str) -> str:
    """The canonical name of layer `index`'s tensor `suffix`."""
    return f"{LAYER_PREFIX}{index}.{suffix}"
