"""The Llama family's registration: Llama-architecture checkpoints on the shared decoder."""

from __future__ import annotations

from models.families import Family
from models.llama.config import LlamaArgs

FAMILY = Family(
    name="llama",
    config_class=LlamaArgs,
    description="Llama-architecture decoders (Llama, SmolLM): RMSNorm, rotary, GQA, SwiGLU",
)
