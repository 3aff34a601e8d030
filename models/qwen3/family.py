"""The Qwen3 family's registration: Qwen3 dense checkpoints on the shared decoder."""

from __future__ import annotations

from models.decoder.weight_names import GGUF_LAYER_NAMES, GGUF_QK_NORM_NAMES
from models.families import Family
from models.qwen3.config import Qwen3Args

FAMILY = Family(
    name="qwen3",
    config_class=Qwen3Args,
    description="Qwen3 dense decoders: Llama's blocks with per-head q/k RMSNorm before rotary",
    gguf_layer_names={**GGUF_LAYER_NAMES, **GGUF_QK_NORM_NAMES},
    # llama.cpp converts Qwen3 for NeoX rotary: its Q/K rows are stored as in HF.
    gguf_rope_permuted=False,
    fused_decode_unsupported=(
        "the native fused decode stack has no per-head q/k RMSNorm; decode runs the per-op path"
    ),
)
