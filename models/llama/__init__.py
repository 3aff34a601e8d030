"""The Llama family: Llama-architecture decoders (Llama, SmolLM) on the shared decoder.

The tensor model, loaders, tokenizer and executor are the shared `models.decoder`; this
package holds only what is Llama's: the config class that recognises its checkpoints
(`LlamaArgs`), its tiny presets and its registration (`family.FAMILY`).
"""

from __future__ import annotations

from models.llama.config import TINY_PRESETS, LlamaArgs

__all__ = ["TINY_PRESETS", "LlamaArgs"]
