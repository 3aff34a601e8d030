"""The Qwen3-MoE family's registration: Qwen3 attention with routed experts in every layer."""

from __future__ import annotations

from models.decoder.weight_names import GGUF_LAYER_NAMES, GGUF_QK_NORM_NAMES
from models.families import Family
from models.qwen3_moe.args import Qwen3MoeArgs

FAMILY = Family(
    name="qwen3_moe",
    config_class=Qwen3MoeArgs,
    description=(
        "Qwen3-MoE decoders: Qwen3's attention (per-head q/k RMSNorm) with top-k routed "
        "SwiGLU experts in place of the dense MLP"
    ),
    model="models.qwen3_moe.model:Qwen3MoeModel",
    # Recognised so a qwen3moe GGUF is refused by name (`Qwen3MoeArgs.from_gguf_metadata`).
    gguf_layer_names={**GGUF_LAYER_NAMES, **GGUF_QK_NORM_NAMES},
    gguf_rope_permuted=False,
    fused_decode_unsupported=(
        "the native fused decode stack runs dense SwiGLU layers, not routed experts; decode "
        "runs the per-op path"
    ),
)
